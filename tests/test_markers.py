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


def test_a_second_pass_leaves_out_what_the_first_passed(tmp_path):
    """CI's two passes (.ci/run): JAXKV_RECORD_PASSED=FILE writes the node ids that passed, JAXKV_SKIP_RECORDED=FILE
    deselects them, in one process or on pytest-xdist's workers."""
    import os
    import subprocess
    import sys

    first = "tests/test_markers.py::test_every_acceptance_test_is_also_slow"
    second = "tests/test_markers.py::test_the_gpu_kernel_module_is_marked_gpu"
    passed = tmp_path / "passed.txt"
    passed.write_text("stale line from an earlier run\n")

    def run(env: dict, *args):
        env = {**os.environ, "JAXKV_RECORD_PASSED": "", "JAXKV_SKIP_RECORDED": "", **env}
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args]
        return subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True)

    one = run({"JAXKV_RECORD_PASSED": str(passed)}, "-n", "2", first)
    assert one.returncode == 0, one.stdout + one.stderr
    assert passed.read_text().splitlines() == [first]

    two = run({"JAXKV_SKIP_RECORDED": str(passed)}, "-n", "2", first, second)
    assert two.returncode == 0, two.stdout + two.stderr
    assert f"PASSED {second}" in two.stdout and f"PASSED {first}" not in two.stdout
    assert " 1 passed" in two.stdout.splitlines()[-1]  # (xdist's controller does not count workers' deselections)

    missing = run({"JAXKV_SKIP_RECORDED": str(tmp_path / "absent.txt")}, second)
    assert missing.returncode == 4 and "JAXKV_SKIP_RECORDED: no such file" in missing.stderr
