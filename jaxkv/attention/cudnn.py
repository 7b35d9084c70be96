"""cuDNN flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) where a position mask reduces to
per-session valid key counts.

cuDNN takes no per-key positions: besides causal/local masks by *index* (wrong on a ring), its only mask is
``key_value_seq_lengths`` — session b attends slots [0, length_b). That equals the position mask exactly when

1. the valid slots (position >= 0) of every session form a prefix of physical slot order, and
2. every valid key is visible to every query of its session.

Both hold in a streaming Wan step (`jaxkv.models.wan.forward_chunk`): a ring or rolling cache fills its slots in
order and never holds a key later than the chunk being denoised, RoPE is applied before the write, and the mask is
chunk-causal only — so attention reads every cached key (tests/test_cudnn.py proves the invariant on the real
caches through fill, wrap and reset). They are *checked* at run time too: `cudnn_attention` computes
`lengths_if_exact` and runs the fallback (the Pallas ring kernel, or XLA) under ``lax.cond`` whenever they fail, so
the result never depends on the caller having got the invariant right.

cuDNN needs float16/bfloat16 q, k, v of one dtype and head_dim a multiple of 8 up to 256 (`static_ok`); on a CPU-only
jaxlib the call refuses to trace ("cuDNN is not detected"), so this path is selected only on GPU.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, block_all_visible
from jaxkv.attention.xla_cpu import _INT_MAX

DTYPES = (jnp.float16, jnp.bfloat16)


def static_ok(head_dim: int, dtypes, rope) -> bool:
    """What cuDNN's fused attention accepts, known at trace time: one half dtype, head_dim % 8 == 0 and <= 256, and
    no cache-relative RoPE (keys would need rotating at read)."""
    dtypes = {jnp.dtype(d) for d in dtypes}
    return (
        rope is None
        and len(dtypes) == 1
        and dtypes.pop() in {jnp.dtype(d) for d in DTYPES}
        and head_dim % 8 == 0
        and 8 <= head_dim <= 256
    )


def lengths_if_exact(q_positions, kv_positions, spec: MaskSpec):
    """(lengths int32 [batch], exact bool []): valid keys per session, and whether attending slots [0, length) of
    every session is exactly the position mask (conditions 1 and 2 above, and at least one key per session: cuDNN's
    result for an empty session is not the zeros jaxkv promises).

    q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
    """
    valid = kv_positions >= 0
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    prefix = jnp.all(valid == (jnp.arange(kv_positions.shape[1])[None, :] < lengths[:, None]))
    q_lo, q_hi = jnp.min(q_positions, axis=1), jnp.max(q_positions, axis=1)
    # The window clause needs only the oldest key outside the sink (sink keys are never hidden by the window).
    k_lo = jnp.min(jnp.where(valid & (kv_positions >= spec.sink), kv_positions, _INT_MAX), axis=1)
    k_hi = jnp.max(jnp.where(valid, kv_positions, -1), axis=1)
    # k_min = 0: empty slots are excluded by the lengths, so only the valid keys must all be visible.
    every = jnp.all(block_all_visible(q_lo, q_hi, jnp.zeros_like(k_lo), k_lo, k_hi, spec))
    return lengths, prefix & every & jnp.all(lengths > 0)


def cudnn_call(q, k, v, lengths, scale: float):
    """The fused kernel: [batch, q_len, q_heads, head_dim] out, attending slots [0, lengths[b]) of each session."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn")


def cudnn_attention(
    q,
    k,
    v,
    q_positions,
    kv_positions,
    *,
    fallback: Callable,
    mask: MaskSpec | None = None,
    causal=False,
    chunk=None,
    window=None,
    sink=0,
    scale=None,
    kernel: Callable = cudnn_call,
):
    """Position-masked attention on cuDNN when the mask is a valid-prefix mask, else ``fallback``.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] (float16/bfloat16).
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
      fallback: ``fallback(q, k, v, q_positions, kv_positions) -> out`` computing the same mask any other way (the
        Pallas ring kernel on GPU); run under ``lax.cond`` when `lengths_if_exact` says cuDNN would be wrong.
      mask: the position mask, a `MaskSpec` (or its fields as the keywords causal, chunk, window, sink).
      kernel: the cuDNN call (a parameter so tests on CPU can stand in for it).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype.
    """
    _, _, _, _, _, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, d)
    if not static_ok(d, (q.dtype, k.dtype, v.dtype), None):
        raise ValueError(
            f"cuDNN attention needs float16/bfloat16 q, k, v of one dtype and head_dim % 8 == 0, "
            f"<= 256; got {q.dtype}/{k.dtype}/{v.dtype}, head_dim {d}"
        )
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    lengths, exact = lengths_if_exact(q_positions, kv_positions, spec)
    return lax.cond(
        exact,
        lambda: kernel(q, k, v, lengths, scale).astype(q.dtype),
        lambda: fallback(q, k, v, q_positions, kv_positions).astype(q.dtype),
    )
