"""Compile counting for jitted functions: one helper for tests, benchmarks and `jaxkv generate`.

A streaming step must compile once however many chunks it runs (slots and positions are traced); these helpers say
how many programs a jitted function holds, so callers can assert or report it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


def compile_count(jitted: Callable) -> int:
    """How many compiled programs the ``jax.jit``-wrapped function holds (one per distinct input signature)."""
    size = getattr(jitted, "_cache_size", None)
    if size is None:
        raise TypeError(f"{jitted!r} is not a jax.jit-wrapped function (no compilation cache to count)")
    return int(size())


@contextlib.contextmanager
def count_compiles(jitted: Callable) -> Iterator[Callable[[], int]]:
    """``with count_compiles(f) as new: ...; new()`` is the number of programs ``f`` compiled inside the block."""
    before = compile_count(jitted)
    yield lambda: compile_count(jitted) - before
