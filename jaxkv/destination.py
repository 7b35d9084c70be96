"""Where an output directory may go: the rules that refuse a destination whose writing would destroy something
that is not a previous jaxkv output (`check_destination`), and the test of whether a directory is one of ours
(`directory_problem`). Checks only; nothing here touches the file system. How the directory is then written is
`jaxkv.files`.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Collection, Iterable


class DestinationError(ValueError):
    """The output path cannot be written without destroying something that is not ours."""


def _inside(child: str, parent: str) -> bool:
    return os.path.commonpath([child, parent]) == parent and child != parent


def directory_problem(
    path: str,
    *,
    required: Collection[str],
    optional: Collection[str] = (),
    formats: Collection[str] | None = None,
    marker_file: str = "config.json",
) -> str | None:
    """Why ``path`` is not a directory that a jaxkv writer made, or None if it is one.

    One of ours is a real directory (not a symlink) whose entries are all regular files, that holds every name in
    ``required``, nothing outside ``required`` and ``optional``, and whose ``marker_file`` (JSON) has a ``"format"``
    in ``formats`` (None: any format starting with ``"jaxkv-"``).
    """
    if os.path.islink(path):
        return f"{path} is a symbolic link"
    if not os.path.isdir(path):
        return f"{path} is not a directory" if os.path.lexists(path) else f"{path} does not exist"
    entries = sorted(os.listdir(path))
    missing = sorted(set(required) - set(entries))
    foreign = [
        e
        for e in entries
        if e not in required
        and e not in optional
        or not os.path.isfile(os.path.join(path, e))
        or os.path.islink(os.path.join(path, e))
    ]
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" ... and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        return f"{path} holds entries a jaxkv writer does not make ({shown})"
    if missing:
        return f"{path} lacks {', '.join(missing)}"
    try:
        with open(os.path.join(path, marker_file)) as f:
            found = json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        found = None
    ok = found in formats if formats is not None else isinstance(found, str) and found.startswith("jaxkv-")
    if not ok:
        want = f"one of {sorted(formats)}" if formats is not None else "'jaxkv-...'"
        return f'{os.path.join(path, marker_file)} has no jaxkv format marker ("format": {want}; found {found!r})'
    return None


def replace_problem(path: str, replaceable: Callable[[str], str | None] | None) -> str | None:
    """An empty real directory may always be replaced (nothing is lost); anything else only if ``replaceable``
    recognises it."""
    if not os.path.islink(path) and os.path.isdir(path) and not os.listdir(path):
        return None
    if replaceable is None:
        return f"{path} is not known to be a jaxkv output"
    return replaceable(path)


def check_destination(
    dst: str,
    *,
    sources: Iterable[str] = (),
    force: bool = False,
    replaceable: Callable[[str], str | None] | None = None,
    flag: str = "--force",
) -> None:
    """Raises DestinationError unless writing the directory ``dst`` destroys nothing but a previous output.

    Always refused: ``dst`` equal to, inside, or containing any of ``sources`` (compared both as given and with
    symlinks resolved, so a source file's own directory counts as containing it), and an existing ``dst`` that is
    the current directory or contains it. An existing ``dst`` needs ``force``, and is then replaced only if
    ``replaceable(dst)`` (e.g. a `functools.partial` of `directory_problem`) returns None, or if it is an empty
    directory; the reason is reported otherwise. ``flag`` is the option that sets ``force``, for the messages.
    Checks only; touches nothing.
    """
    targets = {os.path.abspath(dst), os.path.realpath(dst)}
    for src in sources:
        for s in {os.path.abspath(src), os.path.realpath(src)}:
            for d in targets:
                if d == s:
                    raise DestinationError(f"the output {dst} is the source {src}; choose another output path")
                if _inside(d, s):
                    raise DestinationError(f"the output {dst} lies inside the source {src}; choose a path outside it")
                if _inside(s, d):
                    raise DestinationError(
                        f"the output {dst} contains the source {src}; replacing it would delete "
                        f"the source; choose another output path"
                    )
    if not os.path.lexists(dst):
        return
    if not force:
        raise DestinationError(
            f"{dst} already exists; pass {flag} to replace it (only a previous jaxkv output directory is replaced)"
        )
    cwd = os.path.realpath(os.getcwd())
    if any(d == cwd or _inside(cwd, d) for d in targets):
        raise DestinationError(f"refusing to replace {dst}: it is (or contains) the current directory")
    problem = replace_problem(dst, replaceable)
    if problem is not None:
        raise DestinationError(
            f"refusing to replace {dst} even with {flag}: {problem}; {flag} only replaces a "
            f"directory that jaxkv wrote (remove it yourself or choose another output path)"
        )
