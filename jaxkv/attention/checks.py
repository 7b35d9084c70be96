"""Trace-time checks of attention inputs: shapes, head counts, dtypes. Raise ValueError naming what came."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.validate import is_concrete, is_int, is_real


def check_inputs(q, k, v, q_positions, kv_positions):
    """Validate q [batch, q_len, q_heads, head_dim], k/v [batch, kv_len, kv_heads, head_dim] and int positions
    q_positions [batch, q_len], kv_positions [batch, kv_len]. Returns (batch, q_len, q_heads, kv_len, kv_heads,
    head_dim)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be [batch, tokens, heads, head_dim], got shape {getattr(x, 'shape', x)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    b, lq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    kb, lk, hk, kd = k.shape
    if kb != b:
        raise ValueError(f"q and k/v batch sizes differ: q {q.shape}, k {k.shape}")
    if kd != d:
        raise ValueError(f"q and k/v head_dim differ: q {q.shape}, k {k.shape}")
    if d == 0:
        raise ValueError(f"head_dim must be >= 1, got q {q.shape}")
    if lq == 0 or lk == 0:
        raise ValueError(
            f"attention needs at least one query and one key slot, got q {q.shape} (q_len {lq}) and "
            f"k/v {k.shape} (kv_len {lk}); represent an empty cache by negative kv_positions"
        )
    if hk == 0 or hq % hk:
        raise ValueError(f"q_heads ({hq}) must be a positive multiple of kv_heads ({hk}) for GQA/MQA")
    for name, pos, want in (("q_positions", q_positions, (b, lq)), ("kv_positions", kv_positions, (b, lk))):
        if getattr(pos, "shape", None) != want:
            raise ValueError(f"{name} must have shape {want} ([batch, tokens]), got {getattr(pos, 'shape', pos)}")
        if not jnp.issubdtype(pos.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (absolute token positions), got dtype {pos.dtype}")
    return b, lq, hq, lk, hk, d


def check_scale(scale, head_dim):
    """The softmax scale: head_dim ** -0.5 by default, else a finite positive Python number (static)."""
    if scale is None:
        return head_dim**-0.5
    if not is_real(scale):
        raise ValueError(f"scale must be None or a Python float, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    return float(scale)


def check_layer(k, v, layer):
    """Checks ``layer=`` against k, v: a stacked cache [layers, batch, slots, kv_heads, head_dim] needs a layer (a
    Python int in range, or an integer scalar that may be traced: keep it in range, ``dynamic_slice`` clamps) and
    4-D k/v must not have one. Returns (k_view, v_view): the [batch, slots, kv_heads, head_dim] shapes one layer
    has (`jax.ShapeDtypeStruct`, for `check_inputs`), or k, v themselves without a layer."""
    stacked = getattr(k, "ndim", None) == 5
    if stacked != (layer is not None):
        raise ValueError(
            f"a stacked cache [layers, batch, slots, heads, head_dim] needs layer= and a [batch, slots, heads, "
            f"head_dim] k/v must not have one; got k shape {getattr(k, 'shape', k)} and layer {layer!r}"
        )
    if not stacked:
        return k, v
    if getattr(v, "shape", None) != k.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {getattr(v, 'shape', v)}")
    if not is_int(layer) and not (hasattr(layer, "dtype") and jnp.issubdtype(layer.dtype, jnp.integer)):
        raise ValueError(f"layer must be an int or an integer scalar, got {layer!r}")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    if is_concrete(layer) and not 0 <= int(layer) < k.shape[0]:
        raise ValueError(f"layer {int(layer)} is out of range for a cache of {k.shape[0]} layers")
    return jax.ShapeDtypeStruct(k.shape[1:], k.dtype), jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
