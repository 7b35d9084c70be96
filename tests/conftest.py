"""Suite-wide rules: tests marked ``torch`` skip cleanly where torch / diffusers / transformers are absent, tests
marked ``gpu`` skip where JAX has no GPU, and each module's compiled programs are dropped when the module ends.

On a GPU, float32 matmuls default to TF32 (~1e-3 relative), while the reference comparisons are written for float32
as CPUs compute it (tolerances down to ~1e-6): the whole session runs at the highest matmul precision there, so the
same tolerances hold on every platform. Nothing changes on CPU, which computes float32 matmuls exactly already.

The marker is the declaration; a test still calls ``pytest.importorskip`` before importing, but a forgotten guard
can no longer turn a missing optional dependency into a failure of the README's test command.
"""

from __future__ import annotations

import importlib.util

import pytest

_OPTIONAL = ("torch", "diffusers", "transformers")


def pytest_configure(config):
    import jax

    if jax.default_backend() == "gpu":
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    import jax

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


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """``jax.clear_caches()`` after each module: the full run (~780 tests) compiles thousands of programs in one
    process and would otherwise hold them all. A full run once died of a segfault inside XLA's CPU compiler at
    ~87 % (in test_wan_streaming, which passes on its own); bounding what the process holds is the cheap guard."""
    yield
    import jax

    jax.clear_caches()
