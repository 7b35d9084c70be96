"""Dense masked attention: the reference every other attention path is tested against."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, visible
from jaxkv.attention.rope import rope_ranks


def dense_attention(
    q,
    k,
    v,
    q_positions,
    kv_positions,
    *,
    mask: MaskSpec | None = None,
    causal=False,
    chunk=None,
    window=None,
    sink=0,
    scale=None,
    rope=None,
    return_lse=False,
):
    """Softmax attention with a position mask, float32 accumulation.

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0 (GQA/MQA: query head h uses kv head
        h // (q_heads // kv_heads), i.e. consecutive query heads share a kv head).
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty: whatever bytes an
        empty slot holds, NaN included, it cannot change the output).
      mask: a `jaxkv.attention.MaskSpec`, or its fields as keywords (causal, chunk, window, sink).
      rope: optional `CacheRope`: rotate k by its rank in the cache and q by its rank among the cached positions.
      return_lse: also return the log-sum-exp of the scaled logits, float32 [batch, q_len, q_heads] (-inf where a
        query sees no key).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype (and the lse). Queries that see no key get zeros.
    """
    b, lq, hq, _, hk, d = check_inputs(q, k, v, q_positions, kv_positions)
    groups = hq // hk
    scale = check_scale(scale, d)
    mask = visible(q_positions, kv_positions, as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink))
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    # Masked logits are selected away, but a zero probability times a NaN/Inf value is NaN in p @ v: zero the
    # values of empty slots (fused into the float32 cast, no extra pass).
    vf = jnp.where((kv_positions >= 0)[:, :, None, None], v.astype(jnp.float32), 0.0)
    if rope is not None:
        q_ranks, k_ranks = rope_ranks(q_positions, kv_positions)
        qf, kf = rope.rotate(qf, q_ranks), rope.rotate(kf, k_ranks)
    qf = qf.reshape(b, lq, hk, groups, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, vf)
    out = out.reshape(b, lq, hq, d).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)[..., 0]  # [b, hk, g, q]
    return out, jnp.moveaxis(lse.reshape(b, hq, lq), 1, 2)
