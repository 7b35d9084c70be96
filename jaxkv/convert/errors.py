"""The one exception type of the converters."""

from __future__ import annotations


class ConversionError(ValueError):
    """A checkpoint cannot be converted. The message names the file or key, what was expected and what was found;
    `jaxkv convert` prints it as is (no traceback) and exits non-zero."""


def listing(items, limit: int = 12) -> str:
    """`a, b, c ... and 40 more` — keeps error messages one readable paragraph."""
    items = list(items)
    shown = ", ".join(str(i) for i in items[:limit])
    if len(items) > limit:
        shown += f" ... and {len(items) - limit} more"
    return shown
