"""Attention laid out for XLA:CPU: head-major matmuls, unrolled key blocks, and a mask pass only where one is needed.

What makes XLA:CPU's attention slow is not the arithmetic but the passes around it (measured on jax 0.10.2, see
DESIGN.md "Making XLA do what the design promises"):

* with ``[batch, tokens, heads, head_dim]`` operands XLA copies K and the probabilities into transposed buffers on
  every call; here q, k, v are moved to ``[batch, kv_heads, tokens, head_dim]`` once (GQA groups folded into the
  query rows), so both matmuls are plain batched matmuls on contiguous operands;
* the softmax is normalised *after* the PV matmul (``o / l`` on ``[q, d]``, not ``p / l`` on ``[q, k]``);
* keys are cut into a few static blocks (unrolled, each ~`block_k` keys, on chunk boundaries when the mask has a
  chunk) merged by log-sum-exp, so each block's logits stay in cache;
* each block decides at run time, from the smallest/largest positions it holds, whether it is fully visible to
  every query (no mask pass at all: the steady state of a streaming model, where the cache only holds keys the
  chunk may see), fully hidden (skipped), or mixed (masked with `pair_visible`, the rule every path shares).

Exact against `dense_attention` up to float summation order. Differentiable (``lax.switch`` and plain jnp ops).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxkv.attention.blockwise import _finish, _merge_states
from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, block_all_visible, block_may_be_visible, pair_visible
from jaxkv.attention.rope import rope_ranks
from jaxkv.validate import check_int

_INT_MAX = jnp.iinfo(jnp.int32).max

# Keys per block. Measured on 2 cores (390 queries, 2 x 128 heads, f32): 1,170-1,560 beat 390, 780 and one block
# at 2,730-5,460 keys (e.g. 41 vs 44-49 ms at 2,730; 80 vs 86-107 ms at 5,460), and tie at 780.
DEFAULT_BLOCK_K = 1560


def key_blocks(kv_len: int, block_k: int, unit: int = 1) -> list[tuple[int, int]]:
    """Static [start, stop) key ranges of about `block_k` keys, each a whole number of `unit`s (the last may be
    shorter)."""
    size = max(unit, (block_k // unit) * unit)
    return [(s, min(s + size, kv_len)) for s in range(0, kv_len, size)]


HIDDEN, MASKED, OPEN = 0, 1, 2


def block_branch(q_positions, kv_positions, spec: MaskSpec):
    """How a key block is computed for all sessions: int32 [] HIDDEN (no query of any session sees a key: skipped),
    OPEN (every query of every session sees every key: no mask pass) or MASKED (anything else).

    q_positions: int [batch, q_len]; kv_positions: int [batch, block] (negative = empty).
    """
    q_lo, q_hi = jnp.min(q_positions, axis=1), jnp.max(q_positions, axis=1)
    valid = kv_positions >= 0
    k_min = jnp.min(kv_positions, axis=1)
    k_lo = jnp.min(jnp.where(valid, kv_positions, _INT_MAX), axis=1)
    k_hi = jnp.max(jnp.where(valid, kv_positions, -1), axis=1)
    every = jnp.all(block_all_visible(q_lo, q_hi, k_min, k_lo, k_hi, spec))
    some = jnp.any(block_may_be_visible(q_lo, q_hi, k_lo, k_hi, spec))
    return jnp.where(every, OPEN, jnp.where(some, MASKED, HIDDEN)).astype(jnp.int32)


def _block_state(qs, kb, vb, mask):
    """Flash state of head-major queries qs [b, h, m, d] over one key block kb, vb [b, h, n, d].

    mask: None (every pair visible) or bool [b, 1, m, n]. Returns o [b, h, m, d] (unnormalised), m and l [b, h, m].
    """
    s = jnp.einsum("bhqd,bhkd->bhqk", qs, kb)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0) if mask is not None else m
    p = jnp.exp(s - m_safe[..., None])
    return jnp.einsum("bhqk,bhkd->bhqd", p, vb), m, jnp.sum(p, axis=-1)


def xla_cpu_attention(
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
    block_k: int = DEFAULT_BLOCK_K,
    return_lse=False,
):
    """Softmax attention by position, in the layout XLA:CPU runs fastest; equals `dense_attention`.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] in any slot order.
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
      mask: the `MaskSpec` (or its fields as the keywords causal, chunk, window, sink).
      scale: softmax scale (default head_dim ** -0.5).
      rope: optional `CacheRope` (cache-relative RoPE: keys rotated by rank).
      block_k: target keys per unrolled block (blocks are whole chunks when `chunk` divides kv_len).
      return_lse: also return float32 lse [batch, q_len, q_heads] (-inf where a query sees no key).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype (and lse); float32 softmax and accumulation. Queries that see
      no key get zeros.
    """
    b, lq, hq, lk, hk, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, d)
    block_k = check_int("block_k", block_k, minimum=1)
    g = hq // hk
    q_positions = q_positions.astype(jnp.int32)
    kv_positions = kv_positions.astype(jnp.int32)
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    if rope is not None:
        q_ranks, k_ranks = rope_ranks(q_positions, kv_positions)
        qf, kf = rope.rotate(qf, q_ranks), rope.rotate(kf, k_ranks)
    # [b, lq, hk*g, d] -> [b, hk, g*lq, d]: GQA groups become extra query rows of one matmul per kv head.
    qs = jnp.transpose((qf * scale).reshape(b, lq, hk, g, d), (0, 2, 3, 1, 4)).reshape(b, hk, g * lq, d)
    kh = jnp.transpose(kf, (0, 2, 1, 3))
    vh = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))
    q_rows = jnp.tile(q_positions, (1, g))  # [b, g*lq]: the position of each folded query row

    unit = spec.chunk if spec.chunk is not None and lk % spec.chunk == 0 else 1
    state = None
    for start, stop in key_blocks(lk, block_k, unit):
        kb, vb = kh[:, :, start:stop], vh[:, :, start:stop]
        pos = kv_positions[:, start:stop]

        def hidden(kb, vb, pos):
            return (
                jnp.zeros((b, hk, g * lq, d), jnp.float32),
                jnp.full((b, hk, g * lq), -jnp.inf, jnp.float32),
                jnp.zeros((b, hk, g * lq), jnp.float32),
            )

        def masked(kb, vb, pos):
            # Only a mixed block can hold empty slots: zero their values (0 x NaN would be NaN in p @ v).
            vb = jnp.where((pos >= 0)[:, None, :, None], vb, 0.0)
            return _block_state(qs, kb, vb, pair_visible(q_rows[:, :, None], pos[:, None, :], spec)[:, None])

        def open_(kb, vb, pos):
            return _block_state(qs, kb, vb, None)

        part = lax.switch(block_branch(q_positions, pos, spec), (hidden, masked, open_), kb, vb, pos)
        state = part if state is None else _merge_states(state, part)
    out, lse = _finish(state)  # [b, hk, g*lq, d], [b, hk, g*lq]
    out = jnp.transpose(out.reshape(b, hk, g, lq, d), (0, 3, 1, 2, 4)).reshape(b, lq, hq, d).astype(q.dtype)
    if not return_lse:
        return out
    return out, jnp.transpose(lse.reshape(b, hk, g, lq), (0, 3, 1, 2)).reshape(b, lq, hq)


def blocks_for(kv_len: int, chunk: int | None, block_k: int = DEFAULT_BLOCK_K) -> int:
    """How many unrolled key blocks `xla_cpu_attention` uses for kv_len keys (for tests and benchmarks)."""
    unit = chunk if chunk is not None and kv_len % chunk == 0 else 1
    return math.ceil(kv_len / max(unit, (block_k // unit) * unit))
