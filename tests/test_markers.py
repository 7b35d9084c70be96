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
    """CI's two passes (.ci/run): --record-passed writes the node ids that passed, --skip-recorded deselects them."""
    import subprocess
    import sys

    first = "tests/test_markers.py::test_every_acceptance_test_is_also_slow"
    second = "tests/test_markers.py::test_the_gpu_kernel_module_is_marked_gpu"
    passed = tmp_path / "passed.txt"
    passed.write_text("stale line from an earlier run\n")
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
    )
    one = run("--record-passed", str(passed), first)
    assert one.returncode == 0, one.stdout + one.stderr
    assert passed.read_text().splitlines() == [first]

    two = run("--skip-recorded", str(passed), first, second)
    assert two.returncode == 0, two.stdout + two.stderr
    assert f"{second} PASSED" in two.stdout and f"{first} PASSED" not in two.stdout
    assert "1 passed, 1 deselected" in two.stdout

    missing = run("--skip-recorded", str(tmp_path / "absent.txt"), second)
    assert missing.returncode == 4 and "--skip-recorded: no such file" in missing.stderr
