"""`cached_attention`: one layer's attention step on a chunk cache — write, read the layer, attend.

The one place where a model's layer meets a `jaxkv.cache` cache: `CachedSelfAttention` and the Wan streaming
forward both call it, so they cast, write and mask the same way.
"""

from __future__ import annotations

from jaxkv.attention import CacheRope, MaskSpec, Plan, attend
from jaxkv.cache.base import ChunkCache
from jaxkv.run_options import RunOptions


def cached_attention(
    cache,
    q,
    k,
    v,
    *,
    layer=None,
    mask: MaskSpec | None = None,
    rope: CacheRope | None = None,
    run: RunOptions | None = None,
    plan: Plan | None = None,
):
    """Writes the reserved chunk's k, v into ``cache`` and attends the chunk's queries to the whole cache.

    Args:
      cache: a `RingCache`/`RollingCache` with a reserved chunk (``begin_chunk()`` called for this chunk).
      q: [batch, chunk, q_heads, head_dim] at the reserved chunk's positions (``cache.chunk_positions()``).
      k, v: [batch, chunk, kv_heads, head_dim], kv_heads = cache.heads.
      layer: the layer of a stacked cache (an int or a traced int32 scalar; a Python int for a per-layer cache,
        whose layer is then read where it lies, with no copy), None for a single-layer cache. A stacked
        `ChunkCache` (ring, rolling, dilated) is handed to `jaxkv.attend` whole with ``layer=``: backend "mosaic"
        reads the layer in place, the others slice it as ``cache.layer_kv`` does; an FP8 cache is read through its
        ``layer_kv`` (dequantized).
      mask: the position mask; default ``cache.spec.mask()`` (what a sink + window cache holds).
      rope: optional `CacheRope` (keys cached unrotated, rotated at read by rank).
      run: how the model runs (`jaxkv.run_options.RunOptions`, default ``RunOptions()``): ``run.backend`` is
        `jaxkv.attend`'s backend; the dtypes follow the cache (q, k, v are cast to it), whatever ``run.precision``
        says.
      plan: optional `jaxkv.attention.plan_attention` of ``cache.chunk_positions()``, ``cache.read_positions()``
        and the mask, made once for all layers of a chunk (see `jaxkv.attend`).
    Returns:
      (out [batch, chunk, q_heads, head_dim] in q's dtype, the cache with k, v written).

    q, k and v are cast to the cache's dtype: the kernels take one dtype for all three (a float32 q beside a bf16
    cache would send "auto" to the XLA path); softmax and accumulation stay float32 on every path.
    """
    run = RunOptions() if run is None else run
    dtype = cache.dtype
    cache = cache.write(k.astype(dtype), v.astype(dtype), layer=layer)
    if layer is None or (isinstance(cache, ChunkCache) and not cache.is_per_layer):
        kc, vc = cache.k, cache.v  # one layer, or the stack handed whole: read in place where a backend can
    else:
        kc, vc, layer = *cache.layer_kv(layer), None  # an FP8 cache dequantizes; a per-layer one has no stack
    out = attend(
        q.astype(dtype),
        kc,
        vc,
        cache.chunk_positions(),
        cache.positions,
        mask=cache.spec.mask() if mask is None else mask,
        rope=rope,
        backend=run.backend,
        interpret=run.interpret,
        plan=plan,
        layer=layer,
    )
    return out.astype(q.dtype), cache
