"""FP8 (e4m3) quantization: the scale convention every FP8 path of jaxkv shares.

A float tensor ``x`` is held as ``x8 = float8_e4m3fn(x / s)`` with a float32 scale ``s = amax / 448`` taken over some
group of its elements (448 is e4m3's largest finite value), and read back as ``x8 * s``. e4m3 keeps 3 mantissa bits:
a value within a group's range is rounded to a relative error of at most 2**-4 (half a unit in the last place),
values below ``s * 2**-6`` lose precision as subnormals, and nothing overflows because the scale comes from the
group's own amax. ``float8_e4m3fn`` has no infinity: a value past 448 would become NaN, so `quantize` clips to the
finite range first (only rounding of the scale itself can push a value a hair past it). An all-zero group gets scale
1 (its zeros stay zeros); a group holding a NaN or an infinity gets a NaN or infinite scale, so the damage stays
visible rather than being clipped into plausible numbers.
"""

from __future__ import annotations

import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


def scale_of(x, axis=None):
    """float32 scale ``amax(|x|) / 448`` over ``axis`` (None: the whole tensor; kept dims are squeezed), 1 where the
    amax is 0."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis)
    return jnp.where(amax == 0, 1.0, amax / E4M3_MAX).astype(jnp.float32)


def quantize(x, scale):
    """``float8_e4m3fn(x / scale)``, clipped to e4m3's finite range; ``scale`` broadcasts against x."""
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(FP8)


def dequantize(x8, scale, dtype=jnp.float32):
    """``x8 * scale`` (computed in float32) in ``dtype``; ``scale`` broadcasts against x8."""
    return (x8.astype(jnp.float32) * scale).astype(dtype)


def round_trip(x, axis=None):
    """x quantized to FP8 with its own amax scale over ``axis`` and read back, in x's dtype: what an FP8 store
    does to it (the emulation path of jaxkv's FP8 attention)."""
    s = scale_of(x, axis)
    if axis is not None:
        s = jnp.expand_dims(s, axis)
    return dequantize(quantize(x, s), s, x.dtype)
