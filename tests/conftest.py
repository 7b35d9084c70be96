"""Suite-wide rules: tests marked ``torch`` skip cleanly where torch / diffusers / transformers are absent, tests
marked ``gpu`` skip where JAX has no GPU, and each module's compiled programs are dropped when the module ends.

On a GPU, float32 matmuls default to TF32 (~1e-3 relative), while the reference comparisons are written for float32
as CPUs compute it (tolerances down to ~1e-6): the whole session runs at the highest matmul precision there, so the
same tolerances hold on every platform. Nothing changes on CPU, which computes float32 matmuls exactly already.

The marker is the declaration; a test still calls ``pytest.importorskip`` before importing, but a forgotten guard
can no longer turn a missing optional dependency into a failure of the README's test command.

CI runs the suite in two environments (``.ci/run``): the first pass records the node ids of the tests that passed
(``JAXKV_RECORD_PASSED=FILE``) and the second, with torch and the browser, leaves those out
(``JAXKV_SKIP_RECORDED=FILE``), so each test runs once, in the first environment that can run it. (Environment
variables rather than options: pytest-xdist's workers do not see options added by a conftest below the root.)
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

_OPTIONAL = ("torch", "diffusers", "transformers")
_record_passed_to: str | None = None  # JAXKV_RECORD_PASSED, in the controller only (see pytest_configure)


def pytest_configure(config):
    import jax

    global _record_passed_to
    # under pytest-xdist the controller sees every worker's reports: it alone writes
    _record_passed_to = None if hasattr(config, "workerinput") else os.environ.get("JAXKV_RECORD_PASSED")
    if _record_passed_to:
        pathlib.Path(_record_passed_to).write_text("")  # this run's passes only, however often FILE is reused

    if jax.default_backend() == "gpu":
        jax.config.update("jax_default_matmul_precision", "highest")


# With -n 2 (pytest-xdist, --dist loadfile) whole modules are handed to the workers in collection order: the
# heaviest start first, so the two workers finish together rather than one running a heavy module alone at the end.
# Measured with a serial `python -m pytest -m "slow or torch" --durations=0` on 2 cores (4,087 s in all): these took
# 433, 340, 330, 223, 189, 157, 153 and 144 s. Every other module keeps its place.
_HEAVY_FIRST = (
    "test_parallel.py",
    "test_toyworld_quality.py",
    "test_toyworld_model.py",
    "test_train_step_benchmark.py",
    "test_rollout.py",
    "test_gpu_check.py",
    "test_toyworld_scenes.py",
    "test_finetune_scenes_benchmark.py",
)


def pytest_collection_modifyitems(config, items):
    import jax

    first = {name: rank for rank, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: order within a module is kept

    recorded = os.environ.get("JAXKV_SKIP_RECORDED")
    if recorded:
        try:
            passed = set(pathlib.Path(recorded).read_text().splitlines())
        except FileNotFoundError:
            raise pytest.UsageError(f"JAXKV_SKIP_RECORDED: no such file {recorded!r}") from None
        kept = [item for item in items if item.nodeid not in passed]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in passed])
            items[:] = kept

    if jax.default_backend() != "gpu":
        skip_gpu = pytest.mark.skip(reason="needs a GPU (run with a CUDA jaxlib: python -m pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    missing = [name for name in _OPTIONAL if importlib.util.find_spec(name) is None]
    if "torch" in missing:
        skip = pytest.mark.skip(reason="needs torch (pip install torch==2.13.0, then the 'parity' extra)")
        for item in items:
            if "torch" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    # an xfail that passes unexpectedly is not a pass to leave out of the next run
    if _record_passed_to and report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
        with open(_record_passed_to, "a") as f:
            f.write(report.nodeid + "\n")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """``jax.clear_caches()`` after each module: the full run (~780 tests) compiles thousands of programs in one
    process and would otherwise hold them all. A full run once died of a segfault inside XLA's CPU compiler at
    ~87 % (in test_wan_streaming, which passes on its own); bounding what the process holds is the cheap guard."""
    yield
    import jax

    jax.clear_caches()
