"""Every Python block of the README and of the docs runs on its own, as written, and the docs site builds with
warnings as errors: documentation that cannot silently rot.

A block fenced ```` ```python notest ```` is shown but not run: only for code that needs what a test machine
cannot have (real checkpoints, several GPUs); the page says so beside it.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.S | re.M)


def blocks():
    """(id, code, runs) of every ```python block in README.md and docs/*.md."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            runs = m.group(1).strip() != "notest"
            out.append(pytest.param(m.group(2), runs, id=f"{page.relative_to(ROOT)}:{line}"))
    return out


def test_there_are_blocks_to_run():
    assert sum(1 for p in blocks() if p.values[1]) >= 8


@pytest.mark.parametrize("code, runs", blocks())
def test_block_runs_on_its_own(code, runs, tmp_path, monkeypatch):
    if not runs:
        pytest.skip("fenced ```python notest")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    scope: dict = {"__name__": "__docs__"}
    exec(compile(code, "<docs block>", "exec"), scope)


def test_notest_blocks_are_few_and_explained():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).strip() == "notest":
                before = text[max(0, m.start() - 400) : m.start()]
                assert "not run" in before or "needs" in before, f"{page.name}: say why a notest block is not run"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed (the 'docs' extra)")
def test_docs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_changelogs_latest_release_is_the_package_version():
    import jaxkv

    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, flags=re.M)
    assert releases, "CHANGELOG.md lists no release"
    assert releases[0] == jaxkv.__version__
    assert "## [Unreleased]" in text and text.index("## [Unreleased]") < text.index(f"## [{releases[0]}]")


def test_the_version_has_one_source():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    with open(ROOT / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jaxkv.__version__"}
