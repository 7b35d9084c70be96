"""Ring attention on Hopper as a Pallas Mosaic GPU kernel (`jax.experimental.pallas.mosaic_gpu`), forward only.

What it computes is specified, step for step, by `jaxkv.attention.mosaic_emulation` (tested on CPU against the
dense reference); this module is the same loop on the hardware:

* grid (batch, q_heads, query tiles of ``2 * block_q`` rows); three warpgroups per program: two consumers of
  ``block_q`` rows each and one producer (a FlashAttention-3 layout, without its ping-pong scheduling barrier: the
  simplest structure the primitives of jax 0.10 and 0.11 both provide);
* the producer reads the tile's visit list (`jaxkv.attention.tiles.tile_plan`, computed by XLA from positions) and
  TMA-loads each listed K and V block into a ring of ``stages`` shared-memory buffers, straight from the caller's
  buffer — a cache ``[batch, slots, heads, dim]`` or a stacked ``[layers, batch, slots, heads, dim]`` at a layer
  index (no copy of the layer) — in chronological order; out-of-bounds rows of a ragged last block load as zeros;
* each consumer: ``s = q @ k^T`` by wgmma into float32, scaled by ``scale * log2(e)``; FULL blocks go straight to
  the online softmax (exp2), PARTIAL blocks first apply the `MaskSpec` pair rule from the query and key positions,
  PARTIAL_EMPTY blocks also copy V into the warpgroup's own buffer with empty slots zeroed (NaN in an empty slot
  must not reach ``p @ v``); ``p`` is rounded to bf16/fp16 for the ``p @ v`` wgmma; the result is normalised
  (rows that see nothing: exact zeros), TMA-stored (a ragged last tile's extra rows are clipped by the TMA store),
  and the log-sum-exp written for merging.

It runs only on a CUDA jaxlib on sm_90 (no interpreter): tests lower it for CUDA on any machine
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``) and compare it with the emulation and the dense
reference on a GPU (tests marked ``gpu``).
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.attention.checks import check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, pair_visible
from jaxkv.attention.mosaic_emulation import HEAD_DIMS, KERNEL_DTYPES, MosaicBlockSizes, check_mosaic_inputs
from jaxkv.attention.tiles import FULL, PARTIAL_EMPTY, tile_plan

_NEG = -1e30
_LOG2E = math.log2(math.e)
_CONSUMERS = 2
# jax 0.10's plgpu.load takes the index as a required argument, 0.11 deprecates passing it: pass () only where needed.
_LOAD_NEEDS_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def _load(ref, layout, optimized=True):
    """The whole of ``ref`` as an array in register layout ``layout`` (``optimized=False``: a plain load, which is
    what a small vector of positions in global memory needs)."""
    index = ((),) if _LOAD_NEEDS_INDEX else ()
    return plgpu.load(ref, *index, layout=layout, optimized=optimized)


def _kernel(
    layer_ref, count_ref, order_ref, kind_ref, qpos_ref, kpos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, cfg
):
    spec, scale, bq, bk, stages, groups = cfg
    (q_smem2, k_smem, v_smem, vz_smem2, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free) = scoped
    bi, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("tiles")
    wg = lax.axis_index("wg")
    count = count_ref[bi, t]
    head_dim = q_ref.shape[-1]
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_smem, vz_smem, lse_smem = q_smem2.at[wg], vz_smem2.at[wg], lse_smem2.at[wg]
        row0 = t * (_CONSUMERS * bq) + wg * bq
        plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(row0, bq), h], q_smem, q_ready.at[wg])
        q_pos = _load(qpos_ref.at[bi, pl.ds(row0, bq)], row_layout, optimized=False)
        plgpu.barrier_wait(q_ready.at[wg])

        def step(j, carry):
            acc, m, rowsum = carry
            slot = lax.rem(j, jnp.int32(stages))
            kind = kind_ref[bi, t, j]
            start = order_ref[bi, t, j] * bk
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * (scale * _LOG2E)

            def seen_pairs():
                k_pos = _load(kpos_ref.at[bi, pl.ds(start, bk)], col_layout, optimized=False)
                qb = lax.broadcast_in_dim(q_pos, (bq, bk), [0])
                kb = lax.broadcast_in_dim(k_pos, (bq, bk), [1])
                return pair_visible(qb, kb, spec)

            def full_block(s):
                m_new = jnp.maximum(m, s.max(axis=1))
                return m_new, jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bk), [0]))

            def partial_block(s):
                seen = seen_pairs()
                s = jnp.where(seen, s, _NEG)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bk), [0]))
                return m_new, jnp.where(seen, p, 0.0)  # a row with nothing seen yet: exp2(0) = 1 without this

            m_new, p = lax.cond(kind == FULL, full_block, partial_block, s)
            alpha = jnp.exp2(m - m_new)
            rowsum = rowsum * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, (bq, head_dim), [0])
            p16 = p.astype(q_ref.dtype)
            plgpu.barrier_wait(v_ready.at[slot])

            def pv_from(v_tile):
                def body(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)

                return pl.run_state(body)(plgpu.ACC.init(acc))

            def pv_zeroed():
                # Empty slots of this block may hold anything (NaN): copy V with their rows zeroed, then multiply.
                valid = _load(kpos_ref.at[bi, pl.ds(start, bk)], row_layout, optimized=False) >= 0
                tile = _load(v_smem.at[slot], plgpu.Layout.WGMMA)
                keep = lax.broadcast_in_dim(valid, (bk, head_dim), [0])
                vz_smem[...] = jnp.where(keep, tile, jnp.zeros_like(tile))
                plgpu.commit_smem()
                return pv_from(vz_smem)

            acc = lax.cond(kind == PARTIAL_EMPTY, pv_zeroed, lambda: pv_from(v_smem.at[slot]))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, rowsum

        init = (
            plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((bq,), _NEG, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout),
        )
        acc, m, rowsum = lax.fori_loop(0, count, step, init)
        seen = rowsum > 0
        safe_l = jnp.where(seen, rowsum, 1.0)
        acc = acc / lax.broadcast_in_dim(safe_l, (bq, head_dim), [0])  # nothing seen: acc is 0, stays 0
        q_smem[...] = acc.astype(q_smem.dtype)
        lse_smem[...] = jnp.where(seen, (m + jnp.log2(safe_l)) * (1.0 / _LOG2E), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, pl.ds(row0, bq), h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, h, pl.ds(row0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(h, jnp.int32(groups))
        layer = layer_ref[0]

        def load(j, slot):
            rows = pl.ds(order_ref[bi, t, j] * bk, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, bi, rows, kv_head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, bi, rows, kv_head], v_smem.at[slot], v_ready.at[slot])

        for j in range(stages):  # fill the ring
            pl.when(j < count)(functools.partial(load, j, j))

        @pl.loop(stages, jnp.maximum(count, stages))
        def _(j):
            slot = lax.rem(j, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])  # both consumers are done with step j - stages
            plgpu.barrier_wait(v_free.at[slot])
            load(j, slot)


def mosaic_attention(
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
    """Position-masked flash attention on Hopper over K/V in any slot order (forward only).

    Args:
      q: [batch, q_len, q_heads, head_dim] bfloat16 or float16, head_dim 64 or 128.
      k, v: [batch, slots, kv_heads, head_dim] in q's dtype, or a layer-stacked cache [layers, batch, slots,
        kv_heads, head_dim] read at ``layer`` (an int or a traced int32 scalar in range) without a copy.
      q_positions: int [batch, q_len]; kv_positions: int [batch, slots] (negative = empty slot).
      mask: a `MaskSpec`, or its fields as keywords (causal, chunk, window, sink); scale: default head_dim**-0.5.
      block_sizes: `MosaicBlockSizes`.
    Returns:
      (out [batch, q_len, q_heads, head_dim] in q's dtype, lse float32 [batch, q_len, q_heads], natural log, -inf
      where a query sees no key) — equal to `jaxkv.attention.mosaic_emulation.emulate_mosaic` up to float rounding.
    """
    check_mosaic_inputs(q, k, v, q_positions, kv_positions, layer, kernel=True)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, q.shape[-1])
    if layer is None:  # one layer: a free reshape to the stacked form
        k, v, layer = k[None], v[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return _mosaic_forward(
        q, k, v, q_positions, kv_positions, layer, spec=spec, scale=scale, bs=block_sizes or MosaicBlockSizes()
    )


@functools.partial(jax.jit, static_argnames=("spec", "scale", "bs"))
def _mosaic_forward(q, k, v, q_positions, kv_positions, layer, *, spec, scale, bs):
    b, lq, hq, d = q.shape
    hk = k.shape[3]
    bq, bk, tq = bs.block_q, bs.block_k, bs.tile_q
    plan = tile_plan(q_positions, kv_positions, spec, tq, bk)
    nt = plan.order.shape[1]
    stages = max(2, min(bs.stages, plan.order.shape[2]))
    cfg = (spec, scale, bq, bk, stages, hq // hk)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, cfg=cfg),
            (
                plgpu.SMEM((_CONSUMERS, bq, d), q.dtype, transforms=tiles),
                plgpu.SMEM((stages, bk, d), k.dtype, transforms=tiles),
                plgpu.SMEM((stages, bk, d), v.dtype, transforms=tiles),
                plgpu.SMEM((_CONSUMERS, bk, d), v.dtype, transforms=tiles),
                plgpu.SMEM((_CONSUMERS, bq), jnp.float32),
            ),
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=_CONSUMERS),
            ),
            (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2,
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, lq, hq, d), q.dtype),
            jax.ShapeDtypeStruct((b, hq, nt * tq), jnp.float32),  # padded: rows of the last tile past q_len
        ),
        grid=(b, hq, nt),
        grid_names=("batch", "heads", "tiles"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(layer, plan.count, plan.order, plan.kind, plan.q_positions, plan.kv_positions, q, k, v)
    return out, jnp.swapaxes(lse[:, :, :lq], 1, 2)


# ------------------------------------------------------------------------------------------------ when `auto` uses it

# Measured on Hopper, keyed (kv_len, q_len, head_dim) of a bf16/fp16 call without rope (heads, batch and GPU as the
# entry was measured at). Both are empty until a GPU session measures (benchmarks/gpu_check.py's ``mosaic`` part
# prints the entries its timings support), so `attend(backend="auto")` behaves as before the kernel existed:
#   MOSAIC_OVER_CUDNN: shapes where the kernel beat cuDNN on a mask cuDNN can run (a full or filling ring, every key
#     visible): `auto` runs the kernel for the whole call instead of the cuDNN path.
#   MOSAIC_OVER_TRITON: shapes where the kernel beat the Triton kernel on a mask cuDNN cannot run (a filling ring
#     with a sink, dilated layers, chunk-causal, stale slots): the cuDNN path's fallback is the kernel, not Triton.
# Add an entry in place (``MOSAIC_OVER_CUDNN.add((32760, 4680, 128))``) before tracing to try it; record measured
# ones here with the GPU, date and TFLOP/s as a comment (as `jaxkv.attention.cudnn.SPLIT_KV` does).
MOSAIC_OVER_CUDNN: set[tuple[int, int, int]] = set()
MOSAIC_OVER_TRITON: set[tuple[int, int, int]] = set()


def static_ok(head_dim: int, dtypes, rope) -> bool:
    """Whether the kernel takes a call of these static properties: one bf16/fp16 dtype, head_dim 64 or 128, no
    cache-relative RoPE (apply RoPE before the cache write, as Wan does)."""
    return rope is None and len(set(dtypes)) == 1 and dtypes[0] in KERNEL_DTYPES and head_dim in HEAD_DIMS


def is_hopper(device=None) -> bool:
    """Whether ``device`` (default: the first JAX device) is an sm_90 GPU, the one the kernel is written for."""
    device = device or jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"
