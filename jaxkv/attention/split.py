"""Split-KV attention: the keys cut into equal static parts, attended as extra batch rows of one kernel call that
returns (out, float32 log-sum-exp), the parts merged by their LSE.

Why split a call that a flash kernel could do whole: a kernel that gives each thread block one query tile runs
``ceil(q_len / tile) * heads * batch`` blocks; when that is a few waves of the GPU's SMs plus a fraction (a Wan
1.3B chunk: 37 tiles x 12 heads = 444 blocks on an H200's 132 SMs, 3.4 waves), the last wave leaves most SMs idle.
Splitting the keys in ``parts`` runs ``parts`` times the blocks over ``1/parts`` of the keys each, and the merge is
one cheap pass over the outputs. Whether it wins is a measured property of (keys, queries) on a given GPU
(`jaxkv.attention.cudnn.SPLIT_KV`); the arithmetic here is exact either way.

No key or value is copied: ``[batch, kv_len, heads, head_dim]`` reshaped to ``[batch * parts, kv_len / parts,
heads, head_dim]`` is the same buffer (the slot axis is contiguous within a session), so part p of session b is
batch row ``b * parts + p``; only the queries are repeated per part. The parts are therefore equal: ``parts`` must
divide kv_len.

The merge (`merge_by_lse`) is pure JAX, so the XLA paths, which return an LSE on any backend, test it against one
call and the dense reference on CPU.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jaxkv.validate import check_int


def check_parts(kv_len: int, parts: int) -> int:
    """``parts`` checked: a positive int dividing kv_len (the parts are equal views of one buffer)."""
    parts = check_int("parts", parts, minimum=1)
    if kv_len % parts:
        raise ValueError(f"split-KV needs parts dividing the keys: {kv_len} keys are not {parts} equal parts")
    return parts


def merge_by_lse(outs, lses, axis: int):
    """Merges attention over disjoint key sets laid along ``axis``.

    Args:
      outs: [..., parts (at axis), ..., head_dim]: each part's output, normalised over its own keys (any float
        dtype), e.g. [batch, parts, q_len, heads, head_dim] with axis=1.
      lses: float32, the shape of outs without head_dim: the natural-log log-sum-exp of each part's scaled
        logits (-inf where a query sees no key of the part: weight 0; a query that sees no key of any part gets
        zeros and lse -inf).
      axis: the parts axis (non-negative, < lses.ndim).
    Returns:
      (out float32 without the parts axis, lse float32 without it).
    """
    lses = jnp.asarray(lses, jnp.float32)
    if outs.shape[:-1] != lses.shape or not 0 <= axis < lses.ndim:
        raise ValueError(
            f"merge_by_lse: lses must be outs' shape without head_dim and axis within it; got outs "
            f"{list(outs.shape)}, lses {list(lses.shape)}, axis {axis}"
        )
    m = jnp.max(lses, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m_safe)  # 0 for parts a query does not see
    total = jnp.sum(w, axis=axis)
    acc = jnp.sum(w[..., None] * outs.astype(jnp.float32), axis=axis)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, jnp.squeeze(m_safe, axis) + jnp.log(safe), -jnp.inf)
    return out, lse


def split_attention(kernel: Callable, q, k, v, parts: int):
    """Attention of q to all of k, v as ``parts`` equal key parts in one ``kernel`` call, merged by LSE.

    Args:
      kernel: ``kernel(q, k, v) -> (out [rows, q_len, q_heads, head_dim], lse float32 [rows, q_len, q_heads])``,
        attending every key of its row (no mask: split only keys that every query sees).
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim].
      parts: how many parts (divides kv_len); 1 is one plain call.
    Returns:
      (out [batch, q_len, q_heads, head_dim] in q's dtype, lse float32 [batch, q_len, q_heads]).
    """
    b, lk = k.shape[:2]
    parts = check_parts(lk, parts)
    if parts == 1:
        out, lse = kernel(q, k, v)
        return out.astype(q.dtype), lse.astype(jnp.float32)
    view = lambda x: x.reshape(b * parts, lk // parts, *x.shape[2:])  # same buffer: row b*parts + p
    out, lse = kernel(jnp.repeat(q, parts, axis=0), view(k), view(v))
    out = out.reshape(b, parts, *out.shape[1:])
    lse = lse.reshape(b, parts, *lse.shape[1:])
    out, lse = merge_by_lse(out, lse, axis=1)
    return out.astype(q.dtype), lse
