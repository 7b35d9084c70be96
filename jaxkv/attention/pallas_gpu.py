"""Flash-attention forward for GPUs (Triton-backed Pallas) that reads a ring cache in place.

Algorithm. The grid is (batch, q_head, q_block): one program owns a tile of `block_q` queries of one head and keeps
its running max `m`, sum `l` and unnormalised output `acc` (FlashAttention-2) in registers. The loop over key
blocks runs *inside* the program (`lax.fori_loop`), so the key order is data, not grid structure: before the
kernel, XLA computes for every query tile a **visit list** — the key blocks that some query of the tile may see,
in chronological order (sorted by their oldest position, which for a wrapped ring is its two runs) — and its length.
Empty blocks and blocks that the causal / chunk-causal / window mask hides from the whole tile are not in the list,
so they cost nothing. Inside a visited block every (query, key) pair is masked exactly from positions loaded beside
the keys. K/V are read from the cache where they lie: no gather, no concatenation. Lengths that are not multiples
of the block sizes (Wan: 4,680-token chunks, 1,560-token frames) are handled with masked loads and stores.

Wrapped and unwrapped rings. The visit order depends only on positions, so a ring that has wrapped and one that has
not give **bit-identical** results on the same logical content exactly when each key block holds one piece of one
chunk, i.e. `block_k` divides the chunk (a ring puts chunks at multiples of the chunk size). Block sizes are powers
of two (>= 16), so that can only hold for chunks that are multiples of 16; Wan's 4,680-token chunk (8 x 585) is
not, its blocks straddle chunks differently in the two layouts, and the results are equal to float tolerance.

Cache-relative RoPE: queries are rotated by rank in XLA (one chunk); keys are rotated inside the kernel by their
rank, loaded per block like the positions, so the cache is never rewritten rotated.

The pure-jnp reference is `jaxkv.attention.reference.dense_attention`; tests run this kernel with
`interpret=True` on CPU against it and check that it lowers for CUDA. Backend selection: the Triton compiler
parameters are passed explicitly (without them JAX may lower a Pallas GPU call with Mosaic GPU instead). The
Triton path is the one JAX 0.10 and 0.11 both provide.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, pair_visible
from jaxkv.attention.rope import rope_ranks
from jaxkv.attention.tiles import visit_lists
from jaxkv.validate import is_int

_NEG = -1e30  # finite "minus infinity": keeps exp2 and max free of inf - inf
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of the kernel. Block sizes must be powers of two >= 16 (Triton tiles).

    Attributes:
      block_q: queries per program.
      block_k: keys per loop step (also the granularity at which empty/masked key blocks are skipped).
      num_warps: warps per program (default 4 for head_dim <= 64, else 8).
      num_stages: software pipelining stages of the Triton compiler.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not is_int(size) or size < 16 or size & (size - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {size!r}")


def default_block_sizes(head_dim: int) -> BlockSizes:
    """Starting points from FlashAttention-2 practice on Hopper-class GPUs (untuned here: no GPU was at hand; the
    benchmark's GPU part sweeps a few alternatives)."""
    if head_dim <= 64:
        return BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2)
    return BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3)


def supported(head_dim: int) -> bool:
    """Head dims the kernel handles: powers of two from 16 to 256 (Wan uses 128; 64 is common)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _pair_view(x, style):
    """[..., head_dim] -> a free reshape exposing the two rotary halves on one axis: [..., 2, d/2] for "half"
    (contiguous halves), [..., d/2, 2] for "interleaved" (even/odd lanes)."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], *((2, d // 2) if style == "half" else (d // 2, 2)))


def _split(ref, rows, style):
    """The two rotary halves, each [rows, head_dim / 2], of a block ref in `_pair_view` layout."""
    first, second = jnp.int32(0), jnp.int32(1)  # array indices: plain ints are not accepted by every lowering
    if style == "half":
        return ref.at[rows, first, :], ref.at[rows, second, :]
    return ref.at[rows, :, first], ref.at[rows, :, second]


def _kernel(
    visits_ref, qpos_ref, kvpos_ref, q_ref, k_ref, v_ref, *rest, spec, scale, block_q, block_k, q_len, kv_len, rope
):
    if rope is None:
        (o_ref,) = rest
    else:
        krank_ref, o_ref = rest
    head_dim = v_ref.shape[-1]
    q_rows = pl.program_id(2) * block_q + jnp.arange(block_q)
    q_valid = q_rows < q_len
    q_pos = plgpu.load(qpos_ref, mask=q_valid, other=0)
    all_rows = pl.ds(0, block_q)
    if rope is None:
        q = plgpu.load(q_ref, mask=q_valid[:, None], other=0.0)
    else:
        q1_ref, q2_ref = _split(q_ref, all_rows, rope.style)
        q1 = plgpu.load(q1_ref, mask=q_valid[:, None], other=0.0)
        q2 = plgpu.load(q2_ref, mask=q_valid[:, None], other=0.0)
        lanes = jnp.arange(head_dim // 2).astype(jnp.float32)
        inv_freq = jnp.exp2(lanes * (-2.0 * math.log2(rope.theta) / head_dim))  # theta ** (-2i / head_dim)
    qk_scale = scale * _LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))

    def body(j, carry):
        acc, m, l = carry
        start = visits_ref[1 + j] * block_k
        k_valid = start + jnp.arange(block_k) < kv_len
        rows = pl.ds(start, block_k)
        k_pos = plgpu.load(kvpos_ref.at[rows], mask=k_valid, other=-1)
        if rope is None:
            k = plgpu.load(k_ref.at[rows, :], mask=k_valid[:, None], other=0.0)
            s = plgpu.dot(q, k, trans_b=True)
        else:
            k1_ref, k2_ref = _split(k_ref, rows, rope.style)
            k1 = plgpu.load(k1_ref, mask=k_valid[:, None], other=0.0).astype(jnp.float32)
            k2 = plgpu.load(k2_ref, mask=k_valid[:, None], other=0.0).astype(jnp.float32)
            rank = plgpu.load(krank_ref.at[rows], mask=k_valid, other=0)
            angle = rank.astype(jnp.float32)[:, None] * inv_freq[None, :]
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            r1 = (k1 * cos - k2 * sin).astype(q1.dtype)
            r2 = (k2 * cos + k1 * sin).astype(q2.dtype)
            s = plgpu.dot(q1, r1, trans_b=True) + plgpu.dot(q2, r2, trans_b=True)
        s = s.astype(jnp.float32) * qk_scale
        mask = pair_visible(q_pos[:, None], k_pos[None, :], spec)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        alpha = jnp.exp2(m - m_new)
        # Empty slots load as zero values: p is 0 there, but 0 x NaN would still be NaN in p @ v.
        v = plgpu.load(v_ref.at[rows, :], mask=(k_valid & (k_pos >= 0))[:, None], other=0.0)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), _NEG, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, _, l = lax.fori_loop(0, visits_ref[0], body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # no visible key -> zeros, as in the reference
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=q_valid[:, None])


def pallas_attention(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
):
    """Position-masked flash attention over K/V in any slot order (forward only).

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim], bf16/f16/f32;
        head_dim a power of two in [16, 256]; q_heads % kv_heads == 0.
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty slot; its bytes are
        never read into the result).
      mask: a `jaxkv.attention.MaskSpec`, or its fields as keywords (causal, chunk, window, sink).
      scale: softmax scale (default head_dim ** -0.5).
      rope: optional `CacheRope` (keys rotated by cache rank inside the kernel).
      block_sizes: `BlockSizes` tunables (default `default_block_sizes(head_dim)`).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype; float32 softmax and accumulation.
    """
    b, lq, hq, lk, hk, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, d)
    if not supported(d):
        raise ValueError(f"the Pallas kernel needs head_dim a power of two in [16, 256], got {d}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype for the Pallas kernel, got {q.dtype}, {k.dtype}, {v.dtype}")
    if rope is not None and d < 32 and not interpret:
        raise ValueError(
            f"cache-relative RoPE in the Pallas kernel needs head_dim >= 32 (two dots of head_dim / 2 >= 16), got {d}"
        )
    bs = block_sizes or default_block_sizes(d)
    return _pallas_forward(
        q,
        k,
        v,
        q_positions.astype(jnp.int32),
        kv_positions.astype(jnp.int32),
        spec=spec,
        scale=scale,
        rope=rope,
        bs=bs,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("spec", "scale", "rope", "bs", "interpret"))
def _pallas_forward(q, k, v, q_positions, kv_positions, *, spec, scale, rope, bs, interpret):
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    groups = hq // hk
    block_q = min(bs.block_q, max(16, pl.next_power_of_2(lq)))
    visits = visit_lists(q_positions, kv_positions, spec, block_q, bs.block_k)
    nq = visits.shape[1]
    operands = [visits, q_positions, kv_positions]
    in_specs = [
        pl.BlockSpec((None, None, visits.shape[2]), lambda bi, h, i: (bi, i, 0)),
        pl.BlockSpec((None, block_q), lambda bi, h, i: (bi, i)),
        pl.BlockSpec((None, lk), lambda bi, h, i: (bi, 0)),
        pl.BlockSpec((None, block_q, None, d), lambda bi, h, i: (bi, i, h, 0)),
        pl.BlockSpec((None, lk, None, d), lambda bi, h, i: (bi, 0, h // groups, 0)),
        pl.BlockSpec((None, lk, None, d), lambda bi, h, i: (bi, 0, h // groups, 0)),
    ]
    if rope is not None:
        # q and k enter as [..., 2, d/2] or [..., d/2, 2] (a bitcast) so the kernel can load each rotary half.
        q_ranks, k_ranks = rope_ranks(q_positions, kv_positions)
        q = _pair_view(rope.rotate(q, q_ranks).astype(k.dtype), rope.style)
        k = _pair_view(k, rope.style)
        pair = q.shape[-2:]
        in_specs[3] = pl.BlockSpec((None, block_q, None, *pair), lambda bi, h, i: (bi, i, h, 0, 0))
        in_specs[4] = pl.BlockSpec((None, lk, None, *pair), lambda bi, h, i: (bi, 0, h // groups, 0, 0))
        in_specs.append(pl.BlockSpec((None, lk), lambda bi, h, i: (bi, 0)))
        operands += [q, k, v, k_ranks]
    else:
        operands += [q, k, v]
    kernel = functools.partial(
        _kernel, spec=spec, scale=scale, block_q=block_q, block_k=bs.block_k, q_len=lq, kv_len=lk, rope=rope
    )
    num_warps = bs.num_warps or (4 if d <= 64 else 8)
    return pl.pallas_call(
        kernel,
        grid=(b, hq, nq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda bi, h, i: (bi, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((b, lq, hq, d), v.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="jaxkv_ring_attention",
    )(*operands)
