"""The marker rules of pyproject.toml hold in the test files: acceptance checks are also slow (the quick set leaves
them out, CI's "slow or not slow" runs them), and the GPU-kernel module is marked gpu as a whole."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _marks(node) -> set[str]:
    return {ast.unparse(d).removeprefix("pytest.mark.").split("(")[0] for d in node.decorator_list}


def test_every_acceptance_test_is_also_slow():
    found = 0
    for path in TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "acceptance" in _marks(node):
                found += 1
                assert "slow" in _marks(node), f"{path.name}::{node.name} is acceptance but not slow"
    assert found >= 5


def test_the_gpu_kernel_module_is_marked_gpu():
    tree = ast.parse((TESTS / "test_gpu_kernels.py").read_text())
    assigned = [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "pytestmark"]
    assert assigned and ast.unparse(assigned[0].value) == "pytest.mark.gpu"
