"""`attend`: one entry point over the dense XLA reference, the blockwise XLA path and the Pallas GPU kernel."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv.attention import cudnn, pallas_gpu
from jaxkv.attention.blockwise import blockwise_attention
from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec
from jaxkv.attention.reference import dense_attention
from jaxkv.attention.rope import CacheRope
from jaxkv.attention.xla_cpu import xla_cpu_attention

BACKENDS = ("auto", "xla", "xla_dense", "xla_blockwise", "xla_cpu", "pallas", "cudnn")

# "xla" runs the dense path while its float32 logits fit in this many elements (16 MiB), blockwise beyond: on
# XLA:CPU the blockwise path was already faster at 5M logits (benchmarks/attention.py --quick: 31 vs 47 ms).
DENSE_MAX_LOGITS = 1 << 22


@dataclasses.dataclass(frozen=True)
class _Config:
    spec: MaskSpec
    scale: float
    rope: CacheRope | None
    block_k: int
    segments: tuple[int, ...] | None
    block_sizes: pallas_gpu.BlockSizes | None
    interpret: bool

    def mask_kwargs(self):
        return dict(causal=self.spec.causal, chunk=self.spec.chunk, window=self.spec.window, sink=self.spec.sink)


def resolve_backend(backend: str, *, head_dim: int, dtypes, rope, logits: int, platform: str | None = None) -> str:
    """The concrete path ("xla_dense", "xla_blockwise", "xla_cpu", "pallas" or "cudnn") that `attend` runs for
    `backend`. "cudnn" still falls back at run time (see `jaxkv.attention.cudnn`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        platform = platform or jax.default_backend()
        kernel_ok = (pallas_gpu.supported(head_dim) and len(set(dtypes)) == 1
                     and (rope is None or head_dim >= 32))
        if platform == "cpu":
            # Faster than dense and blockwise at every measured shape on XLA:CPU (jaxkv/attention/xla_cpu.py).
            return "xla_cpu"
        if platform == "gpu" and cudnn.static_ok(head_dim, dtypes, rope):
            return "cudnn"
        backend = "pallas" if platform == "gpu" and kernel_ok else "xla"
    if backend == "cudnn" and not cudnn.static_ok(head_dim, dtypes, rope):
        raise ValueError(f"backend 'cudnn' needs float16/bfloat16 q, k, v of one dtype, head_dim % 8 == 0 and "
                         f"<= 256, and no cache-relative rope; got dtypes {tuple(map(str, dtypes))}, head_dim "
                         f"{head_dim}, rope {rope!r}")
    if backend == "xla":
        backend = "xla_dense" if logits <= DENSE_MAX_LOGITS else "xla_blockwise"
    return backend


def attend(q, k, v, q_positions, kv_positions, *, causal=False, chunk=None, window=None, sink=0, scale=None,
           backend="auto", rope: CacheRope | None = None, block_k: int = 512, segments=None,
           block_sizes: pallas_gpu.BlockSizes | None = None, interpret: bool = False):
    """Attention of queries at absolute positions to keys/values at absolute positions, in any physical order.

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k, v: [batch, kv_len, kv_heads, head_dim], e.g. a ring cache's buffers as they lie; q_heads must be a
        multiple of kv_heads (GQA/MQA).
      q_positions: int [batch, q_len] absolute token positions of the queries.
      kv_positions: int [batch, kv_len] absolute token positions of the keys; negative = empty slot.
      causal, chunk, window, sink: the position mask, see `jaxkv.attention.masks.MaskSpec`.
      scale: softmax scale, default head_dim ** -0.5.
      backend: "auto" (on GPU: "cudnn" for half-precision q/k/v without rope, else Pallas when the kernel
        supports the shapes; "xla_cpu" on CPU; "xla" elsewhere), "cudnn" (cuDNN flash attention with per-session
        valid lengths when the mask reduces to them at run time, else the Pallas kernel or blockwise XLA),
        "xla" (dense while the logits are small, else blockwise), "xla_dense", "xla_blockwise", "xla_cpu" (the
        CPU-tuned layout, `jaxkv.attention.xla_cpu`) or "pallas".
      rope: optional `CacheRope`: cache-relative RoPE — keys (cached unrotated) rotated by their rank among the
        cached positions, queries by the number of cached positions below them.
      block_k: key block size of the blockwise XLA path (see `blockwise_attention`).
      segments: static slot split points for the blockwise path, merged by log-sum-exp (e.g. `(spec.sink,)`).
      block_sizes: `pallas_gpu.BlockSizes` tunables of the kernel.
      interpret: run the Pallas kernel in the interpreter (to use backend="pallas" on CPU, in tests).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype, float32 softmax and accumulation. A query that sees no key
      gets zeros. The XLA paths are differentiable in forward and reverse mode; the Pallas path in reverse mode
      only (`jax.grad`/`jax.vjp`: a `custom_vjp` whose gradient is the blockwise path's) — `jax.jvp`/`jax.jacfwd`
      raise on it, so use backend="xla_blockwise" for forward-mode.
    """
    b, lq, hq, lk, _, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = MaskSpec(causal=causal, chunk=chunk, window=window, sink=sink)
    if rope is not None and not isinstance(rope, CacheRope):
        raise ValueError(f"rope must be None or a CacheRope, got {rope!r}")
    if rope is not None and d % 2:
        raise ValueError(f"cache-relative RoPE needs an even head_dim, got {d}")
    cfg = _Config(spec=spec, scale=check_scale(scale, d), rope=rope, block_k=block_k,
                  segments=None if segments is None else tuple(segments), block_sizes=block_sizes,
                  interpret=bool(interpret))
    path = resolve_backend(backend, head_dim=d, dtypes=(q.dtype, k.dtype, v.dtype), rope=rope,
                           logits=b * hq * lq * lk)
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    if path == "xla_dense":
        return dense_attention(q, k, v, q_positions, kv_positions, scale=cfg.scale, rope=rope, **cfg.mask_kwargs())
    if path == "xla_blockwise":
        return _blockwise(q, k, v, q_positions, kv_positions, cfg)
    if path == "xla_cpu":
        return xla_cpu_attention(q, k, v, q_positions, kv_positions, scale=cfg.scale, rope=rope, **cfg.mask_kwargs())
    if path == "cudnn":
        inner = _pallas if pallas_gpu.supported(d) else _blockwise
        fallback = lambda q_, k_, v_, qp_, kp_: inner(q_, k_, v_, qp_, kp_, cfg)
        return cudnn.cudnn_attention(q, k, v, q_positions, kv_positions, fallback=fallback, scale=cfg.scale,
                                     **cfg.mask_kwargs())
    return _pallas(q, k, v, q_positions, kv_positions, cfg)


def _blockwise(q, k, v, q_positions, kv_positions, cfg: _Config):
    return blockwise_attention(q, k, v, q_positions, kv_positions, scale=cfg.scale, rope=cfg.rope,
                               block_k=cfg.block_k, segments=cfg.segments, **cfg.mask_kwargs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _pallas(q, k, v, q_positions, kv_positions, cfg: _Config):
    return pallas_gpu.pallas_attention(q, k, v, q_positions, kv_positions, scale=cfg.scale, rope=cfg.rope,
                                       block_sizes=cfg.block_sizes, interpret=cfg.interpret, **cfg.mask_kwargs())


def _pallas_fwd(q, k, v, q_positions, kv_positions, cfg):
    return _pallas(q, k, v, q_positions, kv_positions, cfg), (q, k, v, q_positions, kv_positions)


def _pallas_bwd(cfg, residuals, g):
    # Forward-only kernel: the gradient is the blockwise XLA path's (same function, recomputed block by block).
    q, k, v, q_positions, kv_positions = residuals
    _, vjp = jax.vjp(lambda q_, k_, v_: _blockwise(q_, k_, v_, q_positions, kv_positions, cfg), q, k, v)
    return (*vjp(g), None, None)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)
