"""The Wan 2.1 VAE's building blocks as pure functions on channels-last video ``[B, T, H, W, C]``.

Every block is per frame except the causal 3-D convolutions, whose temporal kernel 3 looks at the 2 frames before
each output frame. Those 2 frames come from a *feature cache* (the previous chunk's last 2 conv inputs, zeros at the
start of a stream); zero padding at the front is the same thing as an all-zero cache, which is why a fixed-shape
zero state decodes a stream's first chunk exactly as the reference does.

Precision: activations in the params' dtype; RMS norms and the attention softmax in float32; convolutions
accumulate in float32 (``preferred_element_type``) whatever the storage dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CACHE_FRAMES = 2  # temporal kernel 3 - 1: the history a causal conv needs

_DN3 = ("NDHWC", "DHWIO", "NDHWC")
_DN2 = ("NHWC", "HWIO", "NHWC")


def _cast(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def dense(p: dict, x: jax.Array) -> jax.Array:
    """A 1x1(x1) conv: ``x [..., in] @ kernel [in, out] + bias``."""
    k = p["kernel"]
    y = jnp.einsum("...i,io->...o", _cast(x, k.dtype), k, preferred_element_type=jnp.float32)
    return (y + p["bias"].astype(jnp.float32)).astype(k.dtype)


def rms_norm(p: dict, x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """``x / max(|x|, eps) * sqrt(C) * scale`` over the channel axis (torch ``F.normalize``), in float32."""
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
    y = xf / jnp.maximum(norm, eps) * (x.shape[-1] ** 0.5) * p["scale"].astype(jnp.float32)
    return y.astype(x.dtype)


def conv3d_causal(p: dict, x: jax.Array, cache: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Causal 3-D conv over ``cache [B, 2, H, W, Cin]`` followed by ``x [B, T, H, W, Cin]``.

    Time is padded at the front only (by the cache; by zeros when ``cache`` is None, the start of a stream);
    height and width by ``k // 2`` on both sides. Returns (``[B, T, H, W, Cout]``, the new cache: the last 2
    frames of cache + x).
    """
    k = p["kernel"]
    kt, kh, kw = k.shape[:3]
    if kt != CACHE_FRAMES + 1:
        raise ValueError(f"conv3d_causal expects a temporal kernel of {CACHE_FRAMES + 1}, got {k.shape}")
    if cache is None:
        # A pad, not a concatenated zero constant: XLA would constant-fold convolutions of the latter (minutes).
        full = jnp.pad(x, [(0, 0), (CACHE_FRAMES, 0), (0, 0), (0, 0), (0, 0)])
    else:
        full = jnp.concatenate([_cast(cache, x.dtype), x], axis=1)
    y = lax.conv_general_dilated(
        _cast(full, k.dtype),
        k,
        (1, 1, 1),
        [(0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)],
        dimension_numbers=_DN3,
        preferred_element_type=jnp.float32,
    )
    return (y + p["bias"].astype(jnp.float32)).astype(k.dtype), full[:, -CACHE_FRAMES:]


def conv_time_stride2(p: dict, x: jax.Array) -> jax.Array:
    """The encoder's temporal downsampling conv: kernel (3, 1, 1), stride 2 in time, no padding.
    ``x [B, T, H, W, C]`` -> ``[B, (T - 1) // 2, H, W, C]``."""
    k = p["kernel"]
    y = lax.conv_general_dilated(
        _cast(x, k.dtype),
        k,
        (2, 1, 1),
        [(0, 0), (0, 0), (0, 0)],
        dimension_numbers=_DN3,
        preferred_element_type=jnp.float32,
    )
    return (y + p["bias"].astype(jnp.float32)).astype(k.dtype)


def conv2d(p: dict, x: jax.Array, *, stride: int = 1, padding) -> jax.Array:
    """Per-frame 2-D conv: ``x [B, T, H, W, Cin]`` -> ``[B, T, H', W', Cout]``."""
    k = p["kernel"]
    b, t, h, w, c = x.shape
    y = lax.conv_general_dilated(
        _cast(x.reshape(b * t, h, w, c), k.dtype),
        k,
        (stride, stride),
        padding,
        dimension_numbers=_DN2,
        preferred_element_type=jnp.float32,
    )
    y = (y + p["bias"].astype(jnp.float32)).astype(k.dtype)
    return y.reshape(b, t, *y.shape[1:])


def upsample2d(p: dict, x: jax.Array) -> jax.Array:
    """Nearest 2x (torch 'nearest-exact' at scale 2 repeats each pixel) then a 3x3 conv: ``[B, T, 2H, 2W, C']``."""
    x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
    return conv2d(p, x, padding=[(1, 1), (1, 1)])


def downsample2d(p: dict, x: jax.Array) -> jax.Array:
    """Zero-pad one row/column at the bottom/right, then a 3x3 conv of stride 2: ``[B, T, H/2, W/2, C]``."""
    return conv2d(p, x, stride=2, padding=[(0, 1), (0, 1)])


def attention(p: dict, x: jax.Array) -> jax.Array:
    """Single-head self-attention over the pixels of each frame (frames never see each other), plus the input.
    ``x [B, T, H, W, C]`` -> same shape."""
    b, t, h, w, c = x.shape
    qkv = dense(p["qkv"], rms_norm(p["norm"], x)).reshape(b * t, h * w, 3 * c)
    q, k, v = (qkv[..., i * c : (i + 1) * c] for i in range(3))
    logits = jnp.einsum("nqc,nkc->nqk", q, k, preferred_element_type=jnp.float32) / (c**0.5)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("nqk,nkc->nqc", probs, v.astype(jnp.float32)).astype(x.dtype)
    return x + dense(p["proj"], out).reshape(b, t, h, w, c)
