"""The Wan model on a KV cache: `init_cache` (stacked, per layer, mixed, FP8), `forward_chunk` (one chunk of a
stream: its K/V written into the reserved slot, attention over the whole cache) and `recompute_cache` (every slot's
K/V again, in one forward, under new text)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention import attend, plan_attention
from jaxkv.attention.fp8 import fp8_attend
from jaxkv.cache import MixedCache, MixedSpec, RingSpec, policy_class
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.models.wan.attention import CrossKV, _relative_attend
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.dtypes import _run_of
from jaxkv.models.wan.inputs import _check_latents, check_rope_mode
from jaxkv.nn.cached import cached_attention
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions
from jaxkv.validate import is_concrete


def init_cache(
    config: WanConfig,
    spec,
    batch: int,
    *,
    policy: str = "ring",
    dtype=jnp.float32,
    fp8: bool = False,
    per_layer: bool = False,
):
    """An empty stacked cache for all layers: k, v [layers, batch, capacity, heads, head_dim] (with ``per_layer``:
    tuples of ``layers`` buffers [batch, capacity, heads, head_dim], for the unrolled layer loop; ring and rolling
    only).

    fp8: store K/V in FP8 e4m3 with per-(chunk, head) float32 scales (`jaxkv.cache.fp8.Fp8Cache`, read and written
    in ``dtype``; a `RingSpec` with policy "ring" only; per layer too), as `jaxkv.precision.Precision.fp8_kv` asks.

    spec and policy:
      * a `RingSpec` with policy "ring" (`jaxkv.RingCache`, O(chunk) per chunk) or "rolling"
        (`jaxkv.RollingCache`, shift-by-copy): every layer keeps the same sink + window;
      * a `jaxkv.cache.DilatedSpec` with policy "dilated": every layer keeps dilated frames;
      * a `jaxkv.cache.MixedSpec`: a `jaxkv.cache.MixedCache`, every ``spec.period``-th layer dilated and the others
        dense under ``policy`` ("ring" or "rolling"); num_layers must be a multiple of the period.
    """
    if fp8:
        if policy != "ring" or type(spec) is not RingSpec:
            raise ValueError(
                f"an FP8 cache is a ring cache: pass a RingSpec with policy 'ring', got {type(spec).__name__} with "
                f"policy {policy!r}"
            )
        return Fp8Cache.init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, per_layer=per_layer
        )
    if per_layer and (isinstance(spec, MixedSpec) or policy == "dilated"):
        raise ValueError(f"per_layer caches are ring or rolling sink + window caches, not {policy!r} / {spec!r}")
    if per_layer:
        return policy_class(policy, spec).init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, per_layer=True
        )
    if isinstance(spec, MixedSpec):
        dense = policy_class(policy, spec.dense)
        return MixedCache.init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, dense_policy=dense
        )
    return policy_class(policy, spec).init(
        spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers
    )


def _describe_layers(cache) -> str:
    if isinstance(cache, MixedCache):
        return f"dense k {list(cache.dense.k.shape)} + dilated k {list(cache.dilated.k.shape)}"
    if getattr(cache, "is_per_layer", False):
        return f"{len(cache.k)} per-layer k {list(cache.k[0].shape)}"
    return f"k {list(cache.k.shape)}"


def forward_chunk(
    params,
    config: WanConfig,
    cache,
    cross: CrossKV,
    latents,
    timesteps,
    *,
    rope: str = "absolute",
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
    remat: bool = False,
):
    """One chunk of a stream: the flow prediction of the cache's reserved chunk, and the cache with its K/V written.

    The caller reserves the chunk (``cache = cache.begin_chunk()``) once, then may call this any number of times for
    that chunk (each denoising step overwrites the chunk's slot; the last write wins).

    Args:
      cache: stacked `RingCache`/`RollingCache`/`DilatedCache` [layers=num_layers, batch, capacity, heads,
        head_dim], or a `MixedCache` of num_layers layers (`init_cache`), whose spec's chunk equals this chunk's
        tokens (frames/pt * height/ph * width/pw).
      cross: `cross_kv` of the text context, k and v [layers, batch, text_tokens, heads, head_dim] with batch rows
        matching the cache's sessions (any text_tokens >= 1: padded to text_len or not).
      latents: [batch, chunk_frames, height, width, in_dim].
      timesteps: float [batch] or [batch, chunk_frames // pt].
      rope: "absolute" (keys rotated at their positions before the write) or "cache-relative" (keys cached
        unrotated; q and the cached keys rotated by rank at read, `cache_relative_rope`). A cache must be used in
        one mode throughout.
      backend: the attention backend (`jaxkv.attend`'s names; default "auto").
      precision: the dtype policy (`jaxkv.precision.Precision` or a preset name; default float32): params in its
        param_dtype, the cache and the cross K/V in its cache_dtype (`init_cache(..., dtype=precision.cache_dtype)`,
        `cross_kv(..., precision=precision)`).
      run: a `jaxkv.run_options.RunOptions` holding both instead (``run=rc.run``; TypeError if given with either).
      remat: each block under `jax.checkpoint`, for a gradient through the chunk (as `forward_teacher_forcing`).
    Returns:
      (flow float32 [batch, chunk_frames, height, width, out_dim], updated cache).
    """
    check_rope_mode(rope)
    run = _run_of(params, run, backend, precision, "forward_chunk")
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    b = latents.shape[0]
    n = gf * gh * gw
    if cache.layers != config.num_layers or cache.heads != config.num_heads or cache.head_dim != config.head_dim:
        raise ValueError(
            f"cache must be stacked as [layers={config.num_layers}, batch, capacity, "
            f"heads={config.num_heads}, head_dim={config.head_dim}], got "
            f"{_describe_layers(cache)}"
        )
    if cache.batch != b:
        raise ValueError(f"cache has {cache.batch} sessions but latents have batch {b}")
    if cache.spec.chunk != n:
        raise ValueError(
            f"cache chunk is {cache.spec.chunk} tokens but the latents chunk has {n} ({gf} frames x {gh}x{gw} patches)"
        )
    _check_cross(config, cross, b)
    _check_cache_dtypes(cache, cross, run)
    # The cache's own check sits inside the layer scan, where chunk_start is a tracer: check here, before the scan.
    if is_concrete(cache.chunk_start) and bool(jnp.all(cache.chunk_start < 0)):
        raise ValueError(
            "forward_chunk: no session has a reserved chunk (chunk_start < 0 for every session); call "
            "cache = cache.begin_chunk() before the chunk's first forward"
        )

    # One attention plan for every layer and pass: positions are shared by all layers, and every write leaves the
    # same read positions (`ChunkCache.read_positions`). A MixedCache has two sets of positions: planned per call.
    # FP8 attention (`fp8_attend`) decides its own path per call: no plan.
    plan = None
    if not isinstance(cache, MixedCache) and not run.precision.fp8_attention:
        plan = plan_attention(cache.chunk_positions(), cache.read_positions(), cache.spec.mask())

    if rope == "absolute" and not run.precision.fp8_attention:

        def self_attention(q, k, v, cache, layer):
            return cached_attention(cache, q, k, v, layer=layer, run=run, plan=plan)  # cache.spec.mask()
    elif rope == "absolute":  # FP8 attention: the same write and read, attended by `fp8_attend`

        def self_attention(q, k, v, cache, layer):
            dtype = cache.dtype
            cache = cache.write(k.astype(dtype), v.astype(dtype), layer=layer)
            kc, vc = cache.layer_kv(layer)
            out = fp8_attend(
                q.astype(dtype),
                kc,
                vc,
                cache.chunk_positions(),
                cache.positions,
                mask=cache.spec.mask(),
                backend=run.backend,
            )
            return out.astype(q.dtype), cache
    else:
        attend_fn = fp8_attend if run.precision.fp8_attention else attend

        def self_attention(q, k, v, cache, layer):
            dtype = cache.dtype
            cache = cache.write(k.astype(dtype), v.astype(dtype), layer=layer)
            kc, vc = cache.layer_kv(layer)
            return _relative_attend(
                q,
                kc,
                vc,
                cache.chunk_positions(),
                cache.positions,
                cache.spec.mask(),
                (gh, gw),
                config,
                run,
                attend_fn,
                plan=plan,
            ), cache

    return dit(
        params,
        config,
        latents,
        timesteps,
        cache.chunk_positions(),
        cross,
        self_attention,
        cache,
        run,
        rotate=rope == "absolute",
        remat=remat,
    )


def _check_cross(config: WanConfig, cross: CrossKV, batch: int) -> None:
    expected = [config.num_layers, batch, "text_tokens", config.num_heads, config.head_dim]
    if cross.is_per_layer:
        shapes = {tuple(x.shape) for x in (*cross.k, *cross.v)}
        if len(cross.k) != config.num_layers or len(cross.v) != config.num_layers or len(shapes) != 1:
            raise ValueError(
                f"per-layer cross K/V must be {config.num_layers} k and v arrays of one shape [batch, text_tokens, "
                f"heads, head_dim]; got {len(cross.k)} k and {len(cross.v)} v of shapes {sorted(shapes)}"
            )
        k_shape = v_shape = (config.num_layers, *shapes.pop())
    else:
        k_shape, v_shape = tuple(cross.k.shape), tuple(cross.v.shape)
    if (
        len(k_shape) != 5
        or k_shape != v_shape
        or k_shape[2] < 1
        or (k_shape[0], k_shape[1], k_shape[3], k_shape[4])
        != (config.num_layers, batch, config.num_heads, config.head_dim)
    ):
        raise ValueError(
            f"cross K/V must both be [layers, batch, text_tokens, heads, head_dim] = {expected}, "
            f"got k {list(k_shape)}, v {list(v_shape)}"
        )


def _check_cache_dtypes(cache, cross: CrossKV, run: RunOptions) -> None:
    precision = run.precision
    if isinstance(cache, Fp8Cache) != precision.fp8_kv:
        raise ValueError(
            f"the cache is {'an FP8' if isinstance(cache, Fp8Cache) else 'a ' + jnp.dtype(cache.dtype).name} cache "
            f"but the precision's fp8_kv is {precision.fp8_kv}; build the cache with init_cache(..., "
            f"fp8=precision.fp8_kv) or pass the matching precision"
        )
    # Every layer's text K/V (one stack, or a tuple per layer; arrays or abstract ShapeDtypeStructs).
    text = [("cross K", a.dtype) for a in jax.tree.leaves(cross.k)] + [
        ("cross V", a.dtype) for a in jax.tree.leaves(cross.v)
    ]
    for name, dtype in (("cache", cache.dtype), *text):
        if jnp.dtype(dtype) != jnp.dtype(precision.cache_dtype):
            raise ValueError(
                f"the {name} is {jnp.dtype(dtype).name} but the precision's cache_dtype is "
                f"{precision.cache_dtype}; build both with it (init_cache(..., dtype="
                f"precision.cache_dtype), cross_kv(..., precision=precision)) or pass that precision"
            )


def recompute_cache(
    params,
    config: WanConfig,
    cache,
    cross: CrossKV,
    latents,
    timesteps,
    *,
    keep=None,
    rope: str = "absolute",
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """Recomputes every slot's K/V from the latents the cache's slots hold, in one forward (KV re-cache).

    The slots are run as one sequence in the cache's physical order, each token at its stored position, under the
    cache's own mask (`RingSpec.mask`: chunk-causal, the window, the sink), so every retained chunk sees exactly
    the retained chunks a stream showed it (the block-causal training mask over what is held) and nothing is
    gathered. Each layer's new K/V replace that layer's whole buffer (one update in the scan carry); positions and
    the reserved chunk are unchanged.

    Args:
      cache: stacked cache [layers, batch, capacity, heads, head_dim] whose slots all hold whole chunks.
      cross: cross K/V [layers, batch, text_tokens, heads, head_dim] of the context to recompute under.
      latents: [batch, num_slots * chunk_frames, height, width, in_dim]: slot j's chunk at frames
        [j * chunk_frames, (j + 1) * chunk_frames) (anything finite for empty slots: they stay invisible).
      timesteps: float [batch] or [batch, frames], e.g. the context-pass timestep.
      keep: optional bool [batch, capacity]: slots whose cached K/V stay as they are (and are what the others
        attend to), e.g. the sink.
      rope: the cache's RoPE mode (see `forward_chunk`).
      backend, precision, run: how the model runs (see `forward_chunk`).
    Returns:
      the cache with recomputed K/V.
    """
    check_rope_mode(rope)
    run = _run_of(params, run, backend, precision, "recompute_cache")
    if isinstance(cache, Fp8Cache):
        raise ValueError(
            "recompute_cache does not rebuild an FP8 cache (fp8_kv) itself: `jaxkv.recache.recompute` re-caches it "
            "(dequantized, re-computed, re-quantized by the write's own rule)"
        )
    if isinstance(cache, MixedCache) or not isinstance(cache.spec, RingSpec):
        raise ValueError(
            f"recompute_cache rebuilds a sink + window cache (ring or rolling, a RingSpec); a "
            f"{type(cache).__name__} (dilated layers) is re-cached by replay: jaxkv.recache.switch_prompt"
        )
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    b = latents.shape[0]
    if cache.layers != config.num_layers or cache.heads != config.num_heads or cache.head_dim != config.head_dim:
        raise ValueError(
            f"cache must be stacked as [layers={config.num_layers}, batch, capacity, "
            f"heads={config.num_heads}, head_dim={config.head_dim}], got {_describe_layers(cache)}"
        )
    if cache.batch != b or gf * gh * gw != cache.spec.capacity:
        raise ValueError(
            f"latents must fill the cache's slots: [batch={cache.batch}, frames, h, w, in_dim] with "
            f"frames * h * w / patch = capacity {cache.spec.capacity} tokens, got {list(latents.shape)} "
            f"({gf * gh * gw} tokens)"
        )
    if keep is not None:
        keep = jnp.asarray(keep)
        if keep.shape != cache.positions.shape or keep.dtype != jnp.bool_:
            raise ValueError(f"keep must be bool {list(cache.positions.shape)}, got {keep.dtype}{list(keep.shape)}")
    _check_cross(config, cross, b)
    _check_cache_dtypes(cache, cross, run)
    positions, mask = cache.positions, cache.spec.mask()

    def self_attention(q, k, v, cache, layer):
        dtype = cache.dtype
        old_k, old_v = cache.layer_kv(layer)
        k, v = k.astype(dtype), v.astype(dtype)
        if keep is not None:
            sel = keep[:, :, None, None]
            k, v = jnp.where(sel, old_k, k), jnp.where(sel, old_v, v)
        cache = cache.replace_layer(layer, k, v)
        if rope == "absolute":
            out = attend(
                q.astype(dtype), k, v, positions, positions, mask=mask, backend=run.backend, interpret=run.interpret
            ).astype(q.dtype)
        else:
            out = _relative_attend(q, k, v, positions, positions, mask, (gh, gw), config, run)
        return out, cache

    return dit(
        params,
        config,
        latents,
        timesteps,
        positions,
        cross,
        self_attention,
        cache,
        run,
        rotate=rope == "absolute",
    )[1]
