"""Argument validators shared by every layer: one home for "a positive int, not a bool" and "is this concrete".

Each raises ``ValueError`` naming the argument, what was expected and what came, before any state is touched.
"""

from __future__ import annotations

import numbers

import jax

# Sizes no model has, refused when a model config is built (converted, loaded or passed): a larger value is a typo
# (``--text-len 100000000000``) that would otherwise fail only when the arrays are allocated, after minutes of
# tracing. Far above every released model, far below what an int32 index or any memory could hold.
MAX_TEXT_LEN = 2**16  # tokens per prompt (Wan 2.1 / umT5: 512); the encoder attends text_len x text_len
MAX_WIDTH = 2**20  # any model width or channel count (Wan 2.1 14B: dim 5120, ffn_dim 13824)
MAX_LAYERS = 2**12  # transformer blocks (Wan 2.1 14B: 40; umT5-xxl: 24)
MAX_INDEX = 2**31 - 1  # anything indexed with int32 (a vocabulary)


def is_int(value) -> bool:
    """True for Python / NumPy integers (not bools, which are ints to Python)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int, or ValueError if it is not an integer in ``[minimum, maximum]``."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def is_concrete(x) -> bool:
    """True when ``x`` has a value now (not a tracer inside jit/grad/vmap), so it can be checked eagerly."""
    return not isinstance(x, jax.core.Tracer)


def is_real(value) -> bool:
    """True for Python / NumPy real numbers, integers included (not bools); finiteness is the caller's check."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def shorten(text: str, limit: int = 80) -> str:
    """``repr`` of ``text`` for a message: whole up to ``limit`` characters, else its first ``limit`` characters and
    its length (a 10,000-character prompt must not become a 20 KB error line)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def utf8_problem(text: str) -> str | None:
    """None if ``text`` encodes as UTF-8; else where it does not. Python decodes command-line bytes that are not
    UTF-8 into lone surrogates (U+DC80..U+DCFF for byte 0x80..0xFF), which no file or JSON can hold."""
    for i, ch in enumerate(text):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            byte = ord(ch) - 0xDC00
            what = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else f"a lone surrogate U+{ord(ch):04X}"
            return f"{what} at character {i} is not valid UTF-8"
    return None
