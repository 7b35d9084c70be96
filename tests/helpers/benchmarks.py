"""Loading a script of benchmarks/ as a module (the directory is not a package), for the tests of the benchmarks."""

from __future__ import annotations

import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """The module benchmarks/<name>.py, executed afresh (its own module object, named ``bench_<name>``)."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
