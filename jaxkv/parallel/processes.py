"""One directory written by every process of a multi-process JAX job, complete or not at all.

`write_directory(path, write=..., finish=...)`: process 0 opens a `jaxkv.files.atomic_directory` (a hidden marked
temporary sibling of ``path``) and tells every process its name; each process writes its own files into it
(``write(tmp)`` returns a small JSON-able description of what it wrote); after a barrier process 0 gets every
process's description and writes what needs them all (``finish(tmp, parts)``: a manifest); then process 0 renames
the temporary into place and every process waits for that rename before returning. The temporary must be on a
file system every process sees (a process that cannot see it fails, naming the path).

Failure anywhere leaves no directory that looks complete: each step ends in an exchange of every process's status
(`exchange`), so when one process fails every process raises (that process its own exception, the others
`ProcessFailed` naming it and its message), and process 0 removes the temporary instead of renaming it. A process
that dies without raising leaves the others waiting in JAX's collective until the job's coordination service gives
up; its temporary keeps its marker and is removed by the next write of the same ``path`` (`jaxkv.files.remove_stale`).

The exchanges are ``jax.experimental.multihost_utils.process_allgather`` of small uint8 buffers (any backend with
cross-process collectives, CPU with gloo included); with one process they are plain function calls, so the
single-process path writes the same files in the same order as before.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxkv import files


class ProcessFailed(RuntimeError):
    """Another process of the job failed at a step every process takes together (the message names it)."""


def gather_text(text: str) -> list[str]:
    """Every process's ``text``, in process order. A collective: every process calls it, at the same point."""
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    width = 1 << max(int(sizes.max()) - 1, 0).bit_length()  # a power of two: few distinct exchange programs
    buffer = np.zeros(width, np.uint8)
    buffer[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(sizes), width)
    return [bytes(row[:size]).decode() for row, size in zip(rows, sizes)]


def exchange(value: Any, error: BaseException | None, step: str) -> list[Any]:
    """Every process's JSON-able ``value`` in process order, after every process reached this point. If any
    process passes an ``error``, every process raises: that process its own ``error``, the others `ProcessFailed`
    naming the first failed process and its message."""
    mine = {"value": value} if error is None else {"error": f"{type(error).__name__}: {error}"}
    everyone = [json.loads(t) for t in gather_text(json.dumps(mine))]
    if error is not None:
        raise error
    failed = [(i, e["error"]) for i, e in enumerate(everyone) if "error" in e]
    if failed:
        i, message = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise ProcessFailed(f"{step} failed in process {i} of {len(everyone)}{more}: {message}")
    return [e["value"] for e in everyone]


def write_directory(
    path: str,
    *,
    write: Callable[[str], Any],
    finish: Callable[[str, list[Any]], None],
    replace: Callable[[str], str | None] | None = None,
) -> str:
    """Writes the directory ``path`` from every process (see the module docstring); returns its absolute path.

    ``write(tmp)``: run by every process, writes its own files into ``tmp``, returns a JSON-able part; ``finish(tmp,
    parts)``: run by process 0 with every process's part (process order) once all are written. ``replace``: as
    `jaxkv.files.atomic_directory` (checked by process 0 before anything is created)."""
    path = os.path.abspath(path)
    lead = jax.process_index() == 0
    stack = contextlib.ExitStack()
    tmp, error = "", None
    if lead:
        try:
            tmp = stack.enter_context(files.atomic_directory(path, replace=replace))
        except Exception as e:  # noqa: BLE001 - every process must hear of it before any raises
            error = e
    agreed = True  # an exception raised while True was raised by every process alike
    failure = None
    try:
        with stack:  # process 0: leaving it renames the temporary into place, or removes it on an exception
            tmp = exchange(tmp, error, f"creating {path}'s temporary directory")[0]
            part, error = None, None
            try:
                if not os.path.isdir(tmp):
                    raise FileNotFoundError(
                        f"{tmp} (made by process 0) is not visible here: save to a file system every process shares"
                    )
                part = write(tmp)
            except Exception as e:  # noqa: BLE001
                error = e
            parts = exchange(part, error, f"writing {path}")
            agreed = False
            if lead:
                finish(tmp, parts)
    except BaseException as e:
        if agreed:
            raise
        failure = e  # process 0's finish or rename: the others must hear of it
    exchange(None, failure, f"finishing {path}")
    return path
