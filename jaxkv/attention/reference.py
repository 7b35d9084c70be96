"""Dense masked attention: the reference every other attention path is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.masks import visible


def dense_attention(q, k, v, q_positions, kv_positions, *, causal=False, chunk=None, window=None, sink=0,
                    scale=None):
    """Softmax attention with a position mask, float32 accumulation.

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0 (GQA/MQA).
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
      Mask arguments: see `jaxkv.attention.masks.visible`.
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype. Queries that see no key get zeros.
    """
    b, lq, hq, d = q.shape
    hk = k.shape[2]
    groups = hq // hk
    scale = d ** -0.5 if scale is None else scale
    mask = visible(q_positions, kv_positions, causal=causal, chunk=chunk, window=window, sink=sink)
    qf = q.astype(jnp.float32).reshape(b, lq, hk, groups, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, lq, hq, d).astype(q.dtype)
