"""The Mosaic GPU ring kernel's specification: its tiles, checks and loop, written in plain JAX.

`jaxkv.attention.mosaic_gpu` runs on Hopper only and cannot be interpreted on a CPU, so this module states what it
computes in a form every CPU test can run, and the GPU tests compare the kernel with it:

* tiles: one program owns ``2 * block_q`` queries of one head (two consumer warpgroups of ``block_q`` rows each)
  and walks the key blocks of ``block_k`` slots that `jaxkv.attention.tiles.tile_plan` lists for that tile, in
  chronological order; FULL blocks run unmasked, PARTIAL blocks apply the pair rule of the `MaskSpec`,
  PARTIAL_EMPTY blocks also zero the values of their empty slots (the kernel's TMA loads cannot be masked, and
  ``0 * NaN`` would reach the output);
* ragged edges: a tile or block that runs past the end of q / k / v reads zeros there (what a TMA load returns
  out of bounds) and its positions are padded as `tile_plan` pads them, so those keys are masked and those rows
  never stored;
* arithmetic: logits in float32 scaled by ``scale * log2(e)``, online softmax in base 2 (running max ``m``, sum
  ``rowsum``, accumulator ``acc`` in float32), ``p`` rounded to the input dtype before ``p @ v`` (a bf16/fp16 wgmma with
  float32 accumulation); a row that sees no key returns exact zeros and log-sum-exp -inf;
* the log-sum-exp (natural log, float32 [batch, q_len, q_heads]) for merging partial results
  (`jaxkv.attention.split.merge_by_lse`).

K/V may be a layer-stacked cache ``[layers, batch, slots, kv_heads, head_dim]`` read at ``layer`` (the kernel's TMA
descriptors address the stacked buffer directly: no copy of the layer).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.checks import check_inputs, check_layer, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, pair_visible
from jaxkv.attention.tiles import FULL, PARTIAL_EMPTY, tile_plan
from jaxkv.validate import is_int

_NEG = -1e30  # finite "minus infinity", as in the kernel: exp2 and max stay free of inf - inf
_LOG2E = math.log2(math.e)
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tunables of the Mosaic GPU kernel (untuned: no GPU has run it yet; the GPU check sweeps alternatives).

    Attributes:
      block_q: query rows per consumer warpgroup (multiple of 64: a wgmma tile); a program owns 2 * block_q rows.
      block_k: keys per loop step (multiple of 64), also the granularity of skip / full / partial.
      stages: K/V tiles in flight (shared-memory ring buffer of the producer warpgroup), >= 2.

    Shared memory: (2 * block_q + 2 * stages * block_k + 2 * block_k) * head_dim * 2 bytes (q tiles, K/V stages,
    each consumer's zeroed-V tile) must stay under Hopper's 227 KiB; at head_dim 128 the default (64, 64, 4) takes
    192 KiB, (128, 64, 3) 192 KiB, and block_k 128 does not fit with two stages. Lowering the kernel refuses a
    size that does not fit ("exceeds available shared memory"), before it runs.
    """

    block_q: int = 64
    block_k: int = 64
    stages: int = 4

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not is_int(size) or size < 64 or size % 64:
                raise ValueError(f"MosaicBlockSizes.{name} must be a positive multiple of 64, got {size!r}")
        if not is_int(self.stages) or self.stages < 2:
            raise ValueError(f"MosaicBlockSizes.stages must be an int >= 2, got {self.stages!r}")

    @property
    def tile_q(self) -> int:
        """Queries per program: two consumer warpgroups."""
        return 2 * self.block_q


def check_mosaic_inputs(q, k, v, q_positions, kv_positions, layer, *, kernel: bool):
    """Checks the kernel's inputs; k, v are [batch, slots, kv_heads, head_dim] or a stacked cache [layers, batch,
    slots, kv_heads, head_dim] with ``layer`` (an int, or a traced int32 scalar that must be in range). ``kernel``:
    also the compiled kernel's limits (bf16/fp16, head_dim 64 or 128, q_len and kv_len below 8 or multiples of 8).
    Returns (batch, q_len, q_heads, kv_len, kv_heads, head_dim)."""
    k_view, v_view = check_layer(k, v, layer)
    dims = check_inputs(q, k_view, v_view, q_positions, kv_positions)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype for the Mosaic GPU kernel, got {q.dtype}, {k.dtype}, {v.dtype}")
    if kernel and (q.dtype not in KERNEL_DTYPES or dims[-1] not in HEAD_DIMS):
        raise ValueError(
            f"the Mosaic GPU kernel takes bfloat16/float16 and head_dim in {HEAD_DIMS}; got {q.dtype}, head_dim "
            f"{dims[-1]}"
        )
    # The TMA descriptors tile the token axis by 8 rows: lowering refuses another length with an opaque message.
    ragged = [f"{name} {n}" for name, n in (("q_len", dims[1]), ("kv_len", dims[3])) if n >= 8 and n % 8]
    if kernel and ragged:
        raise ValueError(
            f"the Mosaic GPU kernel's TMA loads need q_len and kv_len below 8 or multiples of 8; got "
            f"{', '.join(ragged)} (the emulation and the other backends take any length)"
        )
    return dims


def emulate_mosaic(
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
    layer=None,
    block_sizes: MosaicBlockSizes | None = None,
):
    """What the Mosaic GPU kernel computes, step by step, in XLA (any backend; float32 inputs allowed here).

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, slots, kv_heads, head_dim], or [layers, batch, slots,
        kv_heads, head_dim] with ``layer``; q_heads % kv_heads == 0.
      q_positions: int [batch, q_len]; kv_positions: int [batch, slots] (negative = empty: its bytes, NaN
        included, never reach the output).
      mask: a `MaskSpec`, or its fields as keywords; scale: default head_dim ** -0.5.
      block_sizes: `MosaicBlockSizes` (the tiles and the visit order depend on them).
    Returns:
      (out [batch, q_len, q_heads, head_dim] in q's dtype, lse float32 [batch, q_len, q_heads], natural log,
      -inf for rows that see no key).
    """
    check_mosaic_inputs(q, k, v, q_positions, kv_positions, layer, kernel=False)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, q.shape[-1])
    if layer is not None:
        k, v = k[layer], v[layer]
    return _emulate(q, k, v, q_positions, kv_positions, spec=spec, scale=scale, bs=block_sizes or MosaicBlockSizes())


@functools.partial(jax.jit, static_argnames=("spec", "scale", "bs"))
def _emulate(q, k, v, q_positions, kv_positions, *, spec, scale, bs):
    b, lq, hq, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    g, tq, bk = hq // hk, bs.tile_q, bs.block_k
    plan = tile_plan(q_positions, kv_positions, spec, tq, bk)
    nt, nk = plan.order.shape[1:]
    # Out-of-bounds rows read as zeros, like the kernel's TMA loads (the caller's arrays are not padded there).
    qt = jnp.pad(q, ((0, 0), (0, nt * tq - lq), (0, 0), (0, 0))).reshape(b, nt, tq, hk, g, d)
    pad_k = ((0, 0), (0, nk * bk - lk), (0, 0), (0, 0))
    kt = jnp.pad(k, pad_k).reshape(b, nk, bk, hk, d)
    vt = jnp.pad(v, pad_k).reshape(b, nk, bk, hk, d)
    qpos = plan.q_positions.reshape(b, nt, 1, 1, tq, 1)
    kpos = plan.kv_positions.reshape(b, nk, bk)
    qs = qt.astype(jnp.float32)

    def step(j, carry):
        acc, m, rowsum = carry  # [b, nt, hk, g, tq, d], [b, nt, hk, g, tq] x2
        blk = plan.order[:, :, j]  # [b, nt]
        kind = plan.kind[:, :, j][:, :, None, None, None, None]
        take = lambda x: jnp.take_along_axis(x, blk.reshape(b, nt, *([1] * (x.ndim - 2))), axis=1)
        kj, vj, pj = take(kt), take(vt), take(kpos)  # [b, nt, bk, hk, d], ..., [b, nt, bk]
        s = jnp.einsum("btqhgd,btkhd->bthgqk", qs, kj.astype(jnp.float32)) * (scale * _LOG2E)
        seen = (kind == FULL) | pair_visible(qpos, pj[:, :, None, None, None, :], spec)
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(seen, jnp.exp2(s - m_new[..., None]), 0.0)
        alpha = jnp.exp2(m - m_new)
        zero_v = (plan.kind[:, :, j] == PARTIAL_EMPTY)[:, :, None, None, None] & (pj < 0)[..., None, None]
        vj = jnp.where(zero_v, jnp.zeros((), v.dtype), vj)
        pv = jnp.einsum("bthgqk,btkhd->bthgqd", p.astype(v.dtype).astype(jnp.float32), vj.astype(jnp.float32))
        new = (acc * alpha[..., None] + pv, m_new, rowsum * alpha + jnp.sum(p, axis=-1))
        active = (j < plan.count)[:, :, None, None, None]
        return tuple(jnp.where(active[..., None] if n.ndim == 6 else active, n, o) for n, o in zip(new, carry))

    init = (
        jnp.zeros((b, nt, hk, g, tq, d), jnp.float32),
        jnp.full((b, nt, hk, g, tq), _NEG, jnp.float32),
        jnp.zeros((b, nt, hk, g, tq), jnp.float32),
    )
    acc, m, rowsum = lax.fori_loop(0, nk, step, init)
    seen = rowsum > 0
    out = acc / jnp.where(seen, rowsum, 1.0)[..., None]  # no visible key -> exact zeros
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, rowsum, 1.0))) / _LOG2E, -jnp.inf)
    out = jnp.moveaxis(out, 4, 2).reshape(b, nt * tq, hq, d)[:, :lq].astype(q.dtype)
    lse = jnp.moveaxis(lse, 4, 2).reshape(b, nt * tq, hq)[:, :lq]
    return out, lse
