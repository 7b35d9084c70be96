"""The "Module sizes" list at the end of docs/stream-state.md stays true: every jaxkv module over 400 lines is on it
(with why it is one concept), and every module on it is still over 400 lines (issue 38: modules stay small unless
one concept needs the length). Lines are counted as ``wc -l`` counts them (newline characters)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "stream-state.md"
LIMIT = 400
ENTRY = re.compile(r"^- `(jaxkv/[\w/]+\.py)`", flags=re.M)


def line_count(path: pathlib.Path) -> int:
    """``wc -l``: the number of newline characters."""
    return path.read_bytes().count(b"\n")


def listed(doc_text: str) -> set[str]:
    """The module paths listed (``- `jaxkv/...py` ...``) under the "## Module sizes" heading, up to the next one."""
    parts = re.split(r"^## Module sizes\s*$", doc_text, flags=re.M)
    assert len(parts) == 2, 'the page needs exactly one "## Module sizes" section'
    section = re.split(r"^## ", parts[1], flags=re.M)[0]
    return set(ENTRY.findall(section))


def problems(root: pathlib.Path, doc_text: str) -> list[str]:
    """What makes the list untrue for the package under ``root`` (a directory holding ``jaxkv/``)."""
    sizes = {p.relative_to(root).as_posix(): line_count(p) for p in sorted((root / "jaxkv").rglob("*.py"))}
    over = {name for name, n in sizes.items() if n > LIMIT}
    names = listed(doc_text)
    out = [f"{name} has {sizes[name]} lines but is not listed" for name in sorted(over - names)]
    for name in sorted(names - over):
        out.append(f"{name} is listed but has {sizes[name]} lines" if name in sizes else f"{name} does not exist")
    return out


def test_the_module_sizes_list_is_true():
    assert problems(ROOT, DOC.read_text()) == []


def test_the_check_catches_a_missing_and_a_stale_entry(tmp_path):
    (tmp_path / "jaxkv" / "sub").mkdir(parents=True)
    (tmp_path / "jaxkv" / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "jaxkv" / "sub" / "edge.py").write_text("x = 1\n" * LIMIT)  # exactly 400: not over
    doc = "# Page\n\n## Module sizes\n\n- `jaxkv/big.py`: one concept.\n\n## Later\n\n- `jaxkv/sub/edge.py`: not here\n"
    assert problems(tmp_path, doc) == []
    assert problems(tmp_path, doc.replace("big.py", "sub/edge.py")) == [
        "jaxkv/big.py has 401 lines but is not listed",
        "jaxkv/sub/edge.py is listed but has 400 lines",
    ]
    assert problems(tmp_path, doc.replace("`jaxkv/big.py`", "`jaxkv/big.py`\n- `jaxkv/gone.py`")) == [
        "jaxkv/gone.py does not exist"
    ]
    (tmp_path / "jaxkv" / "big.py").write_text("x = 1\n" * (LIMIT + 1) + "no newline at the end")  # wc -l: 401
    assert problems(tmp_path, doc) == []
