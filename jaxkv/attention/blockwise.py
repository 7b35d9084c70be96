"""Blockwise online-softmax attention in XLA (the flash recurrence), visiting a ring in chronological order.

The keys are cut into *segments* (static slot ranges, e.g. the sink slots and the rolling window of a ring cache)
and each segment into blocks of `block_k` slots. Within a segment the blocks are visited in **chronological
order** — sorted by the smallest valid position each holds, empty blocks last — which for a wrapped ring window is
exactly its two runs: from the oldest chunk's slot to the end, then from the start. Each block is read in place
with a dynamic slice (no gather of the cache into order), its mask computed from positions, and folded into a
running (max, sum, output) state; a block that no query can see (empty, or outside every query's causal/chunk/
window range) is skipped with `lax.cond`. Segments are merged by log-sum-exp.

Because the visit order depends only on positions, a ring that has wrapped and one that has not give
**bit-identical** results on the same logical content exactly when every block holds one piece of one chunk: the
mask's `chunk` is set, the segments start at chunk boundaries (as a ring's sink/window split does) and the block
size used divides `chunk`. With `chunk` set the block size is the largest divisor <= block_k of gcd(segment
length, chunk) when that divisor is >= 8 — e.g. chunk 4,680 and block_k 512 give blocks of 468. Otherwise (no
`chunk`, or a gcd without such a divisor, e.g. chunk 7) the block size comes from the segment length alone and the
two layouts agree to float tolerance only (the same keys, summed in a different order).

Differentiable (forward-mode and reverse-mode): the loop is a `lax.scan` with a static trip count and the block
body is rematerialised in the backward pass, so memory stays O(q_len * block_k) per head.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, block_may_be_visible, pair_visible
from jaxkv.attention.rope import rope_ranks
from jaxkv.validate import check_int

_INT_MAX = jnp.iinfo(jnp.int32).max


def choose_block(n: int, target: int, minimum: int = 8) -> int:
    """Largest block size <= target that divides n (n itself when n <= target); 0 if none is >= minimum."""
    if n <= target:
        return n
    for size in range(target, minimum - 1, -1):
        if n % size == 0:
            return size
    return 0


def segment_bounds(kv_len: int, segments) -> list[tuple[int, int]]:
    """[(start, stop), ...] slot ranges from sorted interior split points, e.g. (sink_slots,)."""
    cuts = [int(c) for c in (segments or ())]
    if any(c <= 0 or c >= kv_len for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"segments must be strictly increasing split points inside (0, {kv_len}), got {segments!r}")
    edges = [0, *cuts, kv_len]
    return list(zip(edges[:-1], edges[1:]))


def merge_partials(parts):
    """Merge attention results over disjoint key sets by log-sum-exp.

    Args:
      parts: sequence of (out, lse): out [batch, q_len, heads, head_dim] (normalised over its own keys), lse
        float32 [batch, q_len, heads] (-inf where that part had no visible key).
    Returns:
      (out float32, lse): attention over the union of the key sets; zeros where no part saw a key.
    """
    # A normalised part is the flash state (o = out, m = lse, l = 1) — or l = 0 where it saw no key.
    states = [
        (o.astype(jnp.float32), lse, jnp.where(jnp.isfinite(lse), 1.0, 0.0).astype(jnp.float32)) for o, lse in parts
    ]
    return _finish(functools.reduce(_merge_states, states))


def _block_ranges(kv_pos_blocks):
    """Smallest and largest valid position per block ([..., n_blocks, block] -> [..., n_blocks])."""
    valid = kv_pos_blocks >= 0
    lo = jnp.min(jnp.where(valid, kv_pos_blocks, _INT_MAX), axis=-1)
    hi = jnp.max(jnp.where(valid, kv_pos_blocks, -1), axis=-1)
    return lo, hi


def _segment_state(qs, q_positions, k, v, kv_positions, k_ranks, spec, rope, start, stop, block_k):
    """Flash state (o, m, l) of queries over slots [start, stop) of k/v.

    qs: float32 [batch, kv_heads, groups, q_len, head_dim], already scaled (and rotated).
    Returns o [b, h, g, q, d] (unnormalised), m and l [b, h, g, q].
    """
    b, hk, g, lq, d = qs.shape
    n = stop - start
    nb = n // block_k
    seg_pos = lax.slice_in_dim(kv_positions, start, start + nb * block_k, axis=1).reshape(b, nb, block_k)
    blk_lo, blk_hi = _block_ranges(seg_pos)
    # Chronological visit order: by oldest valid position, empty blocks (lo = INT_MAX) last.
    order = jnp.argsort(blk_lo, axis=1, stable=True).astype(jnp.int32)
    q_lo, q_hi = jnp.min(q_positions, axis=1), jnp.max(q_positions, axis=1)

    def read(x, offsets):
        return jax.vmap(lambda row, o: lax.dynamic_slice_in_dim(row, o, block_k, axis=0))(x, offsets)

    @jax.checkpoint
    def visit(state, offsets):
        o, m, l = state
        pb = read(kv_positions, offsets)  # [b, bk]
        kb = read(k, offsets).astype(jnp.float32)  # [b, bk, hk, d]
        # Empty slots' values are zeroed: their probabilities are 0, but 0 x NaN would still be NaN in p @ v.
        vb = jnp.where((pb >= 0)[:, :, None, None], read(v, offsets).astype(jnp.float32), 0.0)
        if rope is not None:
            kb = rope.rotate(kb, read(k_ranks, offsets))
        s = jnp.einsum("bhgqd,bkhd->bhgqk", qs, kb)
        mask = pair_visible(q_positions[:, :, None], pb[:, None, :], spec)[:, None, None]  # [b, 1, 1, q, bk]
        s = jnp.where(mask, s, -jnp.inf)
        # m only shifts the exponent; it cancels in the result, so it carries no gradient.
        m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=-1)
        o = alpha[..., None] * o + jnp.einsum("bhgqk,bkhd->bhgqd", p, vb)
        return o, m_new, l

    def step(state, j):
        idx = order[:, j]
        lo = jnp.take_along_axis(blk_lo, idx[:, None], axis=1)[:, 0]
        hi = jnp.take_along_axis(blk_hi, idx[:, None], axis=1)[:, 0]
        needed = jnp.any(block_may_be_visible(q_lo, q_hi, lo, hi, spec))
        offsets = start + idx * block_k
        state = lax.cond(needed, visit, lambda s, _: s, state, offsets)
        return state, None

    state = (
        jnp.zeros((b, hk, g, lq, d), jnp.float32),
        jnp.full((b, hk, g, lq), -jnp.inf, jnp.float32),
        jnp.zeros((b, hk, g, lq), jnp.float32),
    )
    state, _ = lax.scan(step, state, jnp.arange(nb))
    return state


def _merge_states(a, b):
    """Flash states (o [..., d] unnormalised, m [...] running max, l [...] sum of exp(s - m)) of disjoint key
    sets -> the state of their union."""
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(ma - m_safe), jnp.exp(mb - m_safe)
    return wa[..., None] * oa + wb[..., None] * ob, m, wa * la + wb * lb


def _finish(state):
    """Flash state -> (normalised out float32, lse): zeros and -inf where no key was seen (l = 0)."""
    o, m, l = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    return o / l_safe[..., None], jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def blockwise_attention(
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
    block_k=512,
    segments=None,
    return_lse=False,
):
    """Online-softmax attention over key blocks visited in chronological order; equals `dense_attention`.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] in any slot order.
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty; its bytes are ignored).
      mask: a `jaxkv.attention.MaskSpec`, or its fields as keywords (causal, chunk, window, sink).
      scale: softmax scale (default head_dim ** -0.5).
      rope: optional `CacheRope` (cache-relative RoPE, keys rotated by rank as each block is read).
      block_k: target key block size. Each segment uses the largest divisor <= block_k of gcd(its length, chunk)
        when `chunk` is set and that divisor is >= 8 (wrap-invariant: bit-identical results for any rotation of
        whole chunks); otherwise the largest divisor <= block_k of its length (to float tolerance across
        rotations), or blocks of block_k plus a ragged tail segment when no divisor >= 8 exists.
      segments: static slot split points, e.g. `(sink_slots,)` for a ring cache with a sink: each segment runs its
        own recurrence and the results are merged by log-sum-exp.
      return_lse: also return float32 lse [batch, q_len, q_heads].
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype (and lse). Queries that see no key get zeros.
    """
    b, lq, hq, lk, hk, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, d)
    block_k = check_int("block_k", block_k, minimum=1)
    g = hq // hk
    q_positions = q_positions.astype(jnp.int32)
    kv_positions = kv_positions.astype(jnp.int32)
    qf = q.astype(jnp.float32)
    k_ranks = None
    if rope is not None:
        q_ranks, k_ranks = rope_ranks(q_positions, kv_positions)
        qf = rope.rotate(qf, q_ranks)
    qs = jnp.moveaxis((qf * scale).reshape(b, lq, hk, g, d), 1, 3)  # [b, hk, g, q, d]

    state = None
    for start, stop in segment_bounds(lk, segments):
        n = stop - start
        # Prefer blocks that tile the mask's chunk: then every block holds one piece of one chunk wherever the ring
        # put it, and wrapped/unwrapped layouts run bit-identical arithmetic. Not below 8 keys a block, though: a
        # tiny gcd (chunk 7) would turn the scan into thousands of steps; the segment's own divisors are used then.
        size = choose_block(math.gcd(n, spec.chunk), block_k) if spec.chunk else 0
        if size < 8:
            size = choose_block(n, block_k)
        pieces = (
            [(start, stop, size)]
            if size
            else [(start, start + n - n % block_k, block_k), (start + n - n % block_k, stop, n % block_k)]
        )
        for lo, hi, bk in pieces:
            if hi > lo:
                part = _segment_state(qs, q_positions, k, v, kv_positions, k_ranks, spec, rope, lo, hi, bk)
                state = part if state is None else _merge_states(state, part)
    out, lse = _finish(state)  # [b, hk, g, q, d], [b, hk, g, q]
    out = jnp.moveaxis(out, 3, 1).reshape(b, lq, hq, d).astype(q.dtype)
    if not return_lse:
        return out
    return out, jnp.moveaxis(lse.reshape(b, hq, lq), 1, 2)
