"""`attend`: one entry point over the attention paths, chosen by backend name.

A path is a function ``(q, k, v, q_positions, kv_positions, cfg: AttendConfig) -> out`` registered in `PATHS`;
"auto" and "xla" are policies that resolve to one of them (`resolve_backend`). A new path (another kernel) is one
entry in `PATHS` and, if "auto" should pick it, one clause in `resolve_backend`.

On Hopper, "auto" prefers the Mosaic GPU kernel ("mosaic") over cuDNN, and over the Triton kernel as cuDNN's
fallback, only for the shapes its measured tables list (`jaxkv.attention.mosaic_gpu.MOSAIC_OVER_CUDNN`,
``MOSAIC_OVER_TRITON``; empty until a GPU session measures), so until then "auto" runs what it ran before.

A layer-stacked cache [layers, batch, slots, heads, head_dim] can be handed whole with ``layer=``: the paths in
`STACK_READERS` ("mosaic") read it at the layer in place, every other path gets the layer sliced out first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention import cudnn, mosaic_gpu, pallas_gpu
from jaxkv.attention.blockwise import blockwise_attention
from jaxkv.attention.checks import check_inputs, check_layer, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask
from jaxkv.attention.mosaic_emulation import MosaicBlockSizes, emulate_mosaic
from jaxkv.attention.reference import dense_attention
from jaxkv.attention.rope import CacheRope
from jaxkv.attention.xla_cpu import xla_cpu_attention

# "xla" runs the dense path while its float32 logits fit in this many elements (16 MiB), blockwise beyond: on
# XLA:CPU the blockwise path was already faster at 5M logits (benchmarks/attention.py --quick: 31 vs 47 ms).
DENSE_MAX_LOGITS = 1 << 22


@dataclasses.dataclass(frozen=True)
class AttendConfig:
    """The static options of one `attend` call, as every path receives them (hashable: a custom_vjp static arg)."""

    mask: MaskSpec
    scale: float
    rope: CacheRope | None
    block_k: int
    segments: tuple[int, ...] | None
    block_sizes: pallas_gpu.BlockSizes | MosaicBlockSizes | None
    interpret: bool


def _dense(q, k, v, q_positions, kv_positions, cfg: AttendConfig):
    return dense_attention(q, k, v, q_positions, kv_positions, mask=cfg.mask, scale=cfg.scale, rope=cfg.rope)


def _blockwise(q, k, v, q_positions, kv_positions, cfg: AttendConfig):
    return blockwise_attention(
        q,
        k,
        v,
        q_positions,
        kv_positions,
        mask=cfg.mask,
        scale=cfg.scale,
        rope=cfg.rope,
        block_k=cfg.block_k,
        segments=cfg.segments,
    )


def at_layer(x, layer):
    """Layer ``layer`` of a stacked cache buffer x [layers, batch, slots, heads, head_dim] (x itself when layer is
    None): the dynamic slice `ChunkCache.layer_kv` takes, a copy of the layer on GPU."""
    return x if layer is None else lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)


def _blockwise_vjp(forward):
    """``forward(q, k, v, q_positions, kv_positions, layer, cfg)`` (layer None, or k, v stacked and read at it)
    with the blockwise XLA path's gradient (the kernels are forward-only)."""
    forward = jax.custom_vjp(forward, nondiff_argnums=(6,))

    def fwd(q, k, v, q_positions, kv_positions, layer, cfg):
        return forward(q, k, v, q_positions, kv_positions, layer, cfg), (q, k, v, q_positions, kv_positions, layer)

    def bwd(cfg, residuals, g):
        q, k, v, q_positions, kv_positions, layer = residuals
        blockwise = lambda q_, k_, v_: _blockwise(
            q_, at_layer(k_, layer), at_layer(v_, layer), q_positions, kv_positions, cfg
        )
        _, vjp = jax.vjp(blockwise, q, k, v)
        return (*vjp(g), None, None, None)

    forward.defvjp(fwd, bwd)
    return forward


@_blockwise_vjp
def _pallas_at(q, k, v, q_positions, kv_positions, layer, cfg: AttendConfig):
    # The Triton kernel reads one layer (`attend` slices a stack before calling: layer is None).
    sizes = cfg.block_sizes if isinstance(cfg.block_sizes, pallas_gpu.BlockSizes) else None
    return pallas_gpu.pallas_attention(
        q,
        at_layer(k, layer),
        at_layer(v, layer),
        q_positions,
        kv_positions,
        mask=cfg.mask,
        scale=cfg.scale,
        rope=cfg.rope,
        block_sizes=sizes,
        interpret=cfg.interpret,
    )


@_blockwise_vjp
def _mosaic_at(q, k, v, q_positions, kv_positions, layer, cfg: AttendConfig):
    # Reads a stacked cache at `layer` in place (TMA descriptors of the whole stack). interpret=True runs the
    # kernel's pure-JAX emulation (the Mosaic GPU kernel has no interpreter on CPU).
    sizes = cfg.block_sizes if isinstance(cfg.block_sizes, MosaicBlockSizes) else None
    if cfg.rope is not None:
        raise ValueError("backend 'mosaic' takes no cache-relative rope: rotate keys before the cache write")
    run = emulate_mosaic if cfg.interpret else mosaic_gpu.mosaic_attention
    out, _ = run(q, k, v, q_positions, kv_positions, mask=cfg.mask, scale=cfg.scale, layer=layer, block_sizes=sizes)
    return out


def _pallas(q, k, v, q_positions, kv_positions, cfg: AttendConfig):
    return _pallas_at(q, k, v, q_positions, kv_positions, None, cfg)


def _mosaic(q, k, v, q_positions, kv_positions, cfg: AttendConfig):
    return _mosaic_at(q, k, v, q_positions, kv_positions, None, cfg)


# The paths that read a stacked cache [layers, batch, slots, heads, head_dim] at a layer index in place (`attend`'s
# ``layer=``); every other path gets the layer sliced out first.
STACK_READERS = {"mosaic": _mosaic_at}


def _xla_cpu(q, k, v, q_positions, kv_positions, cfg: AttendConfig):
    return xla_cpu_attention(q, k, v, q_positions, kv_positions, mask=cfg.mask, scale=cfg.scale, rope=cfg.rope)


def _cudnn(q, k, v, q_positions, kv_positions, cfg: AttendConfig, plan: cudnn.Plan | None = None):
    # cuDNN where the mask reduces to no mask or valid lengths at run time, else a ring kernel (or blockwise XLA):
    # the Mosaic GPU one where it was measured faster than Triton on this shape on Hopper, else the Triton one.
    shape = (k.shape[1], q.shape[1], q.shape[-1])
    mosaic_ok = mosaic_gpu.static_ok(q.shape[-1], (q.dtype, k.dtype, v.dtype), cfg.rope)
    if mosaic_ok and shape in mosaic_gpu.MOSAIC_OVER_TRITON and mosaic_gpu.is_hopper():
        inner = _mosaic
    else:
        inner = _pallas if pallas_gpu.supported(q.shape[-1]) else _blockwise
    fallback = lambda q_, k_, v_, qp_, kp_: inner(q_, k_, v_, qp_, kp_, cfg)
    return cudnn.cudnn_attention(
        q, k, v, q_positions, kv_positions, fallback=fallback, mask=cfg.mask, scale=cfg.scale, plan=plan
    )


# Concrete paths by backend name.
PATHS: dict[str, Callable] = {
    "xla_dense": _dense,
    "xla_blockwise": _blockwise,
    "xla_cpu": _xla_cpu,
    "pallas": _pallas,
    "mosaic": _mosaic,
    "cudnn": _cudnn,
}
BACKENDS = ("auto", "xla", *PATHS)


def resolve_backend(
    backend: str,
    *,
    head_dim: int,
    dtypes,
    rope,
    logits: int,
    platform: str | None = None,
    shape: tuple[int, int] | None = None,
    hopper: bool | None = None,
) -> str:
    """The concrete path (a key of `PATHS`) that `attend` runs for `backend`.

    shape: (kv_len, q_len) of the call, for the measured Hopper table (`mosaic_gpu.MOSAIC_OVER_CUDNN`); hopper:
    whether the GPU is sm_90 (default: asked of the first device when the table has the shape)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        platform = platform or jax.default_backend()
        if platform == "cpu":
            # Faster than dense and blockwise at every measured shape on XLA:CPU (jaxkv/attention/xla_cpu.py).
            return "xla_cpu"
        measured = shape is not None and (*shape, head_dim) in mosaic_gpu.MOSAIC_OVER_CUDNN
        if platform == "gpu" and measured and mosaic_gpu.static_ok(head_dim, tuple(dtypes), rope):
            if hopper if hopper is not None else mosaic_gpu.is_hopper():
                return "mosaic"
        if platform == "gpu" and cudnn.static_ok(head_dim, dtypes, rope):
            return "cudnn"
        kernel_ok = pallas_gpu.supported(head_dim) and len(set(dtypes)) == 1 and (rope is None or head_dim >= 32)
        backend = "pallas" if platform == "gpu" and kernel_ok else "xla"
    if backend == "cudnn" and not cudnn.static_ok(head_dim, dtypes, rope):
        raise ValueError(
            f"backend 'cudnn' needs float16/bfloat16 q, k, v of one dtype, head_dim % 8 == 0 and "
            f"<= 256, and no cache-relative rope; got dtypes {tuple(map(str, dtypes))}, head_dim "
            f"{head_dim}, rope {rope!r}"
        )
    if backend == "xla":
        backend = "xla_dense" if logits <= DENSE_MAX_LOGITS else "xla_blockwise"
    return backend


def attend(
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
    backend="auto",
    rope: CacheRope | None = None,
    block_k: int = 512,
    segments=None,
    block_sizes: pallas_gpu.BlockSizes | None = None,
    interpret: bool = False,
    plan: cudnn.Plan | None = None,
    layer=None,
):
    """Attention of queries at absolute positions to keys/values at absolute positions, in any physical order.

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim], e.g. a ring cache's buffers as they lie; q_heads must be a
        multiple of kv_heads (GQA/MQA): query head h uses kv head h // (q_heads // kv_heads), so each run of
        q_heads // kv_heads consecutive query heads shares one kv head.
      q_positions: int [batch, q_len] absolute token positions of the queries.
      kv_positions: int [batch, kv_len] absolute token positions of the keys; negative = empty slot. Whatever an
        empty slot holds (stale keys, NaN, Inf) cannot reach the output on any path.
      mask: the position mask, a `jaxkv.attention.MaskSpec` (e.g. a cache's ``spec.mask()``); or give its fields
        as the keywords causal, chunk, window, sink (not both).
      scale: softmax scale, default head_dim ** -0.5.
      backend: "auto" ("xla_cpu" on CPU; on GPU "cudnn" for half-precision q/k/v without rope, else "pallas" when
        the kernel supports the shapes; "xla" elsewhere; on Hopper "mosaic" where its measured table says so, see
        the module docstring), "xla" (dense while the logits are small, else blockwise), or a path of `PATHS`:
        "xla_dense", "xla_blockwise", "xla_cpu" (the CPU-tuned layout, `jaxkv.attention.xla_cpu`), "pallas" (the
        Triton ring kernel), "mosaic" (the Mosaic GPU ring kernel for Hopper, `jaxkv.attention.mosaic_gpu`;
        bf16/fp16, head_dim 64 or 128, no rope), "cudnn" (cuDNN flash attention with per-session valid lengths when
        the mask reduces to them at run time, else a ring kernel or blockwise XLA).
      rope: optional `CacheRope`: cache-relative RoPE — keys (cached unrotated) rotated by their rank among the
        cached positions, queries by the number of cached positions below them.
      block_k: key block size of the blockwise XLA path (see `blockwise_attention`).
      segments: static slot split points for the blockwise path, merged by log-sum-exp (e.g. `(spec.sink,)`).
      block_sizes: `pallas_gpu.BlockSizes` tunables of the Triton kernel (or, for backend="mosaic",
        `jaxkv.attention.mosaic_emulation.MosaicBlockSizes`; a kernel ignores the other kernel's sizes).
      interpret: run the Pallas kernel in the interpreter, and backend="mosaic" as its pure-JAX emulation
        (`jaxkv.attention.mosaic_emulation`), to use them on CPU, in tests.
      plan: optional `jaxkv.attention.cudnn.Plan` of exactly these positions and mask
        (`jaxkv.attention.cudnn.plan_attention`), made once and shared by the calls that share the positions (every
        layer of a chunk); the cuDNN path then only branches on it instead of checking the positions per call.
        ``cudnn.ALL_VISIBLE_PLAN`` says every key is visible (static: no check at all). Other paths ignore it.
      layer: with k, v a layer-stacked cache [layers, batch, kv_len, kv_heads, head_dim], the layer to read (a
        Python int, or an integer scalar that may be traced, e.g. a layer scan's index: keep it in range, a traced
        index is clamped like ``cache.layer_kv``'s). Only "mosaic" (`STACK_READERS`) reads the stack in place;
        every other path gets the layer sliced out first (the copy `ChunkCache.layer_kv` makes), so every backend
        takes the call and returns what it returns for ``k[layer], v[layer]``.
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype, float32 softmax and accumulation. A query that sees no key
      gets zeros. The XLA paths are differentiable in forward and reverse mode; the kernel paths in reverse mode
      only (`jax.grad`/`jax.vjp`: a `custom_vjp` whose gradient is the blockwise path's) — `jax.jvp`/`jax.jacfwd`
      raise on it, so use backend="xla_blockwise" for forward-mode.
    """
    k_view, v_view = check_layer(k, v, layer)
    b, lq, hq, lk, _, d = check_inputs(q, k_view, v_view, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    if rope is not None and not isinstance(rope, CacheRope):
        raise ValueError(f"rope must be None or a CacheRope, got {rope!r}")
    if rope is not None and d % 2:
        raise ValueError(f"cache-relative RoPE needs an even head_dim, got {d}")
    cfg = AttendConfig(
        mask=spec,
        scale=check_scale(scale, d),
        rope=rope,
        block_k=block_k,
        segments=None if segments is None else tuple(segments),
        block_sizes=block_sizes,
        interpret=bool(interpret),
    )
    path = resolve_backend(
        backend, head_dim=d, dtypes=(q.dtype, k.dtype, v.dtype), rope=rope, logits=b * hq * lq * lk, shape=(lk, lq)
    )
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    if layer is not None and path in STACK_READERS:
        return STACK_READERS[path](q, k, v, q_positions, kv_positions, layer, cfg)
    k, v = at_layer(k, layer), at_layer(v, layer)
    if path == "cudnn":
        return _cudnn(q, k, v, q_positions, kv_positions, cfg, plan)
    return PATHS[path](q, k, v, q_positions, kv_positions, cfg)
