"""Streaming generation with causal Wan 2.1 on jaxkv caches: Self-Forcing's chunk-by-chunk sampler.

Every chunk of ``chunk_frames`` latent frames is produced by the same compiled program:

1. ``cache.begin_chunk()`` reserves the chunk's slot (on a full ring: the oldest non-sink chunk's slot);
2. denoising passes at the schedule's timesteps (`jaxkv.schedule.Schedule`): each predicts the flow v, takes
   ``x0 = x - sigma * v`` and re-noises to the next step's sigma; each pass writes the chunk's K/V into the reserved
   slot, overwriting the previous pass;
3. one more pass at ``context_noise`` on the clean x0 commits the chunk's final K/V at the same positions.

The passes are a ``lax.scan`` over (timestep, sigma, next sigma, noise), so a chunk is one model body in the
compiled program. Cross-attention K/V are computed once per rollout (`jaxkv.models.wan.cross_kv`).

Two forms, each compiling once per shape:
  * `rollout`: the whole rollout as a ``lax.scan`` over chunks (jit it with `jit_rollout`); differentiable.
  * `stream_step`: one chunk, jitted, the cache donated (updated in place); `jaxkv.stream.Stream` drives it as an
    iterator that yields each chunk's latents as soon as they are ready.

Noise: pass it explicitly (``noise [num_chunks, steps, batch, chunk_frames, height, width, in_dim]``; ``noise[n, 0]``
is chunk n's initial x, ``noise[n, i]`` the eps mixed in before step i) to compare runs step for step with another
implementation; otherwise it is drawn from a key, ``jax.random.normal(fold_in(key, n), ...)`` for chunk n, in the
same way by both forms, so `rollout` and `jaxkv.stream.Stream` agree given the same key.

Classifier-free guidance runs the negative context as a second session (cache rows [batch:2*batch]) next to the
conditional one: ``v = v_neg + scale * (v_cond - v_neg)``; both sessions commit their own K/V.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cache import WRAPPING_POLICIES as WRAPPING_POLICIES  # re-exported: read as jaxkv.rollout.WRAPPING_POLICIES
from jaxkv.cache import ChunkCache, MixedCache, RingSpec
from jaxkv.cache.clock import check_chunk_room, wrap_clock
from jaxkv.cache.clock import wrap_period as wrap_period  # re-exported: callers read it as jaxkv.rollout.wrap_period
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.inputs import check_context
from jaxkv.models.wan.params import is_per_layer
from jaxkv.rollout_config import RolloutConfig as RolloutConfig  # re-exported: jaxkv.rollout.RolloutConfig
from jaxkv.validate import check_int, is_concrete


class RolloutState(NamedTuple):
    """What carries from chunk to chunk: the stacked cache (sessions = batch, or 2*batch with guidance) and the
    hoisted cross-attention K/V. Both are held per layer (tuples of per-layer buffers, for the unrolled layer loop)
    when the state was made from per-layer params (`jaxkv.models.wan.params.per_layer_params`) for a ring or
    rolling cache; `stacked_state` / `per_layer_state` convert (a copy)."""

    cache: ChunkCache | MixedCache
    cross: M.CrossKV


def stacked_state(state: RolloutState) -> RolloutState:
    """``state`` with its cache and cross K/V stacked (as sessions, pools and meshes hold them); ``state`` itself
    when it is stacked already."""
    per_layer_cache = getattr(state.cache, "is_per_layer", False)
    if not per_layer_cache and not state.cross.is_per_layer:
        return state
    return RolloutState(state.cache.stacked() if per_layer_cache else state.cache, state.cross.stacked())


def per_layer_state(state: RolloutState) -> RolloutState:
    """``state`` with its ring/rolling cache and its cross K/V per layer (what per-layer params run fastest on; a
    dilated or mixed cache stays stacked)."""
    cache = state.cache
    if not isinstance(cache, MixedCache) and isinstance(cache.spec, RingSpec):
        cache = cache.per_layer()
    return RolloutState(cache, state.cross.per_layer())


# ------------------------------------------------------------------------------------------------ setup


def _check_context(config: WanConfig, rc: RolloutConfig, context, negative_context):
    """The sessions' text context: [batch, text_len, text_dim], or [2*batch, text_len, text_dim] with guidance
    (conditional rows first), zero-padded as `jaxkv.models.wan.cross_kv` pads."""
    context = check_context(config, context)
    if rc.guidance_scale is None:
        if negative_context is not None:
            raise ValueError(
                "negative_context was given but guidance_scale is None; set "
                "RolloutConfig(guidance_scale=...) to use classifier-free guidance"
            )
        return context
    if negative_context is None:
        raise ValueError(f"guidance_scale={rc.guidance_scale} needs a negative_context [batch, tokens, text_dim]")
    negative_context = check_context(config, negative_context, context.shape[0], name="negative_context")
    return jnp.concatenate([context, negative_context], axis=0)


def _check_model(config: WanConfig) -> None:
    if config.in_dim != config.out_dim:
        raise ValueError(
            f"a rollout denoises latents with the model's own prediction, so it needs in_dim == out_dim; "
            f"this model has in_dim={config.in_dim}, out_dim={config.out_dim}"
        )
    if config.patch_size[0] != 1:
        raise ValueError(
            f"a rollout counts chunk tokens per latent frame, so it needs a temporal patch of 1 (Wan 2.1 "
            f"uses patch_size (1, 2, 2)); this model has patch_size {config.patch_size}"
        )


def init_state(params, config: WanConfig, rc: RolloutConfig, context, negative_context=None) -> RolloutState:
    """Empty cache and the cross-attention K/V of the (conditional and negative) text context.

    Args:
      context: [batch, text_tokens, text_dim]; negative_context: same, required iff guidance_scale is set.
    """
    _check_model(config)
    sessions = _check_context(config, rc, context, negative_context)
    per_layer = is_per_layer(params)
    cross = M.cross_kv(params, config, sessions, run=rc.run)  # per layer iff the params are
    return RolloutState(empty_cache(config, rc, sessions.shape[0], per_layer=per_layer), cross)


def empty_cache(config: WanConfig, rc: RolloutConfig, sessions: int, per_layer: bool = False):
    """The empty stacked cache of ``sessions`` sessions that a rollout under ``rc`` holds: ring / rolling layers, all
    dilated (dilated_every=1) or a `MixedCache`, in the precision's cache dtype. ``per_layer``: a ring / rolling
    cache is held per layer (`jaxkv.cache.ChunkCache`); dilated and mixed caches stay stacked."""
    policy = "dilated" if rc.dilated_every == 1 else rc.policy
    per_layer = per_layer and rc.dilated_every == 0
    return M.init_cache(
        config,
        rc.cache_spec(config),
        sessions,
        policy=policy,
        dtype=jnp.dtype(rc.precision.cache_dtype),
        fp8=rc.precision.fp8_kv,
        per_layer=per_layer,
    )


def chunk_noise(key, config: WanConfig, rc: RolloutConfig, batch: int, chunk_index):
    """The noise of chunk ``chunk_index`` drawn from ``key``: float32 [steps, batch, chunk_frames, h, w, in_dim]."""
    return jax.random.normal(jax.random.fold_in(key, chunk_index), (rc.steps, *rc.chunk_shape(config, batch)))


def check_position_room(config: WanConfig, rc: RolloutConfig, num_chunks: int, cache: ChunkCache | None = None):
    """ValueError when generating ``num_chunks`` more chunks would pass the int32 token positions (absolute RoPE
    only: with ``rope="cache-relative"`` the clock wraps (`wrap_clock`) and any number of chunks fits).

    A stream holds `RingSpec.max_chunks` chunks (Wan 2.1 at 480p, 4,680-token chunks: 458,864, about 95 hours of
    16 fps video); past it positions would wrap and, under jit, the writes be dropped without an error. The chunks
    already in ``cache`` count when its positions are concrete (under `jit_rollout` a passed state is traced and
    only ``num_chunks`` itself is checked; the cache's own `begin_chunk` check covers eager steps). The rule is the
    cache's (`jaxkv.cache.clock.check_chunk_room`); this applies it to the stream ``rc`` configures.
    """
    if rc.bounded:
        check_chunk_room(rc.spec(config), num_chunks, cache)


# ------------------------------------------------------------------------------------------------ one chunk


def generate_chunk(params, config: WanConfig, rc: RolloutConfig, state: RolloutState, noise, active=None):
    """Generates the next chunk of every session: (clean latents float32 [batch, chunk_frames, h, w, in_dim], state).

    Args:
      noise: float [steps, batch, chunk_frames, h, w, in_dim]: noise[0] is the initial x, noise[i] the eps mixed in
        before step i.
      active: optional bool [batch]: only these rows generate a chunk (`jaxkv.pool`). The others run through the
        model (a fixed-shape batch) but reserve nothing, write nothing and keep their clock: their cache rows come
        back bit for bit, chunks held or not; their output is meaningless. With guidance the mask covers both
        sessions of a row.
    """
    _check_model(config)
    batch = noise.shape[1]
    if tuple(noise.shape) != (rc.steps, *rc.chunk_shape(config, batch)):
        raise ValueError(
            f"chunk noise must be [steps, batch, chunk_frames, h, w, in_dim] = "
            f"{[rc.steps, *rc.chunk_shape(config, batch)]}, got {list(noise.shape)}"
        )
    guided = rc.guidance_scale is not None
    sessions = 2 * batch if guided else batch
    if state.cache.batch != sessions:
        raise ValueError(
            f"the state has {state.cache.batch} sessions but {batch} noise rows need {sessions}"
            f"{' (guidance doubles them)' if guided else ''}"
        )
    t, sigma, next_sigma = (jnp.asarray(a, jnp.float32) for a in rc.schedule.passes())
    noise = noise.astype(jnp.float32)
    # eps mixed in after pass i is noise[i + 1]; after the last step and the context pass nothing is mixed in
    next_noise = jnp.concatenate([noise[1:], jnp.zeros((2, *noise.shape[1:]), jnp.float32)], axis=0)

    def one_pass(carry, xs):
        x, cache = carry
        t_i, sigma_i, next_sigma_i, eps = xs
        x_in = jnp.concatenate([x, x], axis=0) if guided else x
        flow, cache = M.forward_chunk(
            params,
            config,
            cache,
            state.cross,
            x_in,
            jnp.full((sessions,), t_i),
            rope=rc.rope,
            run=rc.run,
            remat=rc.remat,
        )
        if guided:
            cond, neg = flow[:batch], flow[batch:]
            flow = neg + rc.guidance_scale * (cond - neg)
        x0 = x - sigma_i * flow
        if rc.schedule.sampler == "euler":  # the noise this prediction implies: an Euler step of the flow
            eps = x + (1.0 - sigma_i) * flow
        return ((1.0 - next_sigma_i) * x0 + next_sigma_i * eps, cache), None

    if active is not None:
        active = jnp.asarray(active)
        if active.shape != (batch,) or active.dtype != jnp.bool_:
            raise ValueError(f"active must be bool [{batch}], got {active.dtype}{list(active.shape)}")
        active = jnp.concatenate([active, active]) if guided else active
    cache = state.cache if rc.bounded else wrap_clock(state.cache, active)
    cache = cache.begin_chunk(active)
    if active is not None:  # the waiting rows' writes are no-ops (they may hold chunks: a pool's rows step apart)
        cache = cache.only_writing(active)
    (x, cache), _ = lax.scan(one_pass, (noise[0], cache), (t, sigma, next_sigma, next_noise))
    if active is not None:
        cache = cache.only_writing(None)  # the state leaves as it came in: no mask
    return x, RolloutState(cache, state.cross)


def commit(params, config: WanConfig, rc: RolloutConfig, state: RolloutState, latents) -> RolloutState:
    """Commits given clean latents [batch, n * chunk_frames, h, w, in_dim] to the cache, chunk by chunk, as a
    stream commits the chunks it generates (the pass at ``rc.schedule.context_noise``): a stream that continues
    from known frames, e.g. a video's first chunks or a world's true frames. With guidance each row's frames go to
    both its sessions (the conditional and the negative one), as `generate_chunk` commits a guided chunk."""
    _check_model(config)
    latents = jnp.asarray(latents, jnp.float32)
    batch, cf = latents.shape[0], rc.chunk_frames
    if (
        latents.ndim != 5
        or latents.shape[1] % cf
        or latents.shape[1] == 0
        or tuple(latents.shape[2:]) != tuple(rc.chunk_shape(config, batch)[2:])
    ):
        frame = ", ".join(map(str, rc.chunk_shape(config, 1)[2:]))
        raise ValueError(f"commit needs latents [batch, n * {cf}, {frame}] (whole chunks), got {list(latents.shape)}")
    guided = rc.guidance_scale is not None
    sessions = 2 * batch if guided else batch
    if state.cache.batch != sessions:
        raise ValueError(
            f"the state has {state.cache.batch} sessions, the latents {batch} rows"
            f"{' (guidance doubles them)' if guided else ''}"
        )
    if guided:
        latents = jnp.concatenate([latents, latents], axis=0)
    cache = state.cache
    for c in range(latents.shape[1] // cf):
        cache = cache.begin_chunk() if rc.bounded else wrap_clock(cache).begin_chunk()
        _, cache = M.forward_chunk(
            params,
            config,
            cache,
            state.cross,
            latents[:, c * cf : (c + 1) * cf],
            jnp.full((sessions,), rc.schedule.context_noise),
            rope=rc.rope,
            run=rc.run,
            remat=rc.remat,
        )
    return RolloutState(cache, state.cross)


jit_commit = jax.jit(commit, static_argnums=(1, 2))
jit_commit.__doc__ = "`commit` under jax.jit (config and rc static)."

# One chunk at a time, the cache donated: `jaxkv.stream.Stream.commit` runs one program however many chunks it is given.
commit_step = jax.jit(commit, static_argnums=(1, 2), donate_argnames=("state",))


# ------------------------------------------------------------------------------------------------ whole rollout


class Rollout(NamedTuple):
    latents: jax.Array  # float32 [batch, num_chunks * chunk_frames, h, w, in_dim]
    state: RolloutState  # the state after the last chunk (continue with `generate_chunk` or `jaxkv.stream.Stream`)


def rollout(
    params,
    config: WanConfig,
    rc: RolloutConfig,
    context,
    *,
    num_chunks: int,
    key=None,
    noise=None,
    negative_context=None,
    state: RolloutState | None = None,
    first_chunk: int = 0,
) -> Rollout:
    """The whole rollout as one ``lax.scan`` over chunks; pure and differentiable in params, context and noise.

    Args:
      params: Wan params; config: its WanConfig; rc: RolloutConfig.
      context: [batch, text_tokens, text_dim]; negative_context: same, iff rc.guidance_scale is set. May be None
        when continuing a ``state`` (its cross-attention K/V are the context's).
      num_chunks: chunks to generate (any number: the cache wraps).
      key: PRNG key for the noise (chunk n uses ``fold_in(key, first_chunk + n)``), or
      noise: explicit noise [num_chunks, steps, batch, chunk_frames, h, w, in_dim].
      state: continue from a previous rollout's state (default: a fresh one).
      first_chunk: int >= 0 or int32 scalar [] (traced under `jit_rollout`: any offset runs the same program):
        index of the first chunk for the key's noise, e.g. the chunks already generated when continuing a state.
    Returns:
      Rollout(latents [batch, num_chunks * chunk_frames, h, w, in_dim], final state).
    """
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)
    if context is None and state is None:
        raise ValueError("rollout needs a context (or a state to continue, which holds the cross-attention K/V)")
    batch = (
        jnp.shape(context)[0]
        if context is not None
        else state.cache.batch // (2 if rc.guidance_scale is not None else 1)
    )
    if (key is None) == (noise is None):
        raise ValueError("pass exactly one of key= (noise drawn per chunk) or noise= (explicit noise)")
    if isinstance(first_chunk, (bool, np.bool_)):
        raise ValueError(f"first_chunk must be an int >= 0, got {first_chunk!r}")
    first_chunk = jnp.asarray(first_chunk)
    if first_chunk.shape != () or not jnp.issubdtype(first_chunk.dtype, jnp.integer):
        raise ValueError(
            f"first_chunk must be an int >= 0 or an int32 scalar, got {first_chunk.dtype}{list(first_chunk.shape)}"
        )
    if is_concrete(first_chunk) and int(first_chunk) < 0:
        raise ValueError(f"first_chunk must be >= 0, got {int(first_chunk)}")
    check_position_room(config, rc, num_chunks, None if state is None else state.cache)
    if noise is not None:
        noise = jnp.asarray(noise)
        expected = rc.noise_shape(config, batch, num_chunks)
        if tuple(noise.shape) != expected:
            raise ValueError(
                f"noise must be [num_chunks, steps, batch, chunk_frames, h, w, in_dim] = "
                f"{list(expected)}, got {list(noise.shape)}"
            )
    if state is None:
        state = init_state(params, config, rc, context, negative_context)

    def body(state, xs):
        eps = xs if noise is not None else chunk_noise(key, config, rc, batch, xs)
        x, state = generate_chunk(params, config, rc, state, eps)
        return state, x

    xs = noise if noise is not None else first_chunk.astype(jnp.int32) + jnp.arange(num_chunks, dtype=jnp.int32)
    state, chunks = lax.scan(body, state, xs)
    # [num_chunks, batch, chunk_frames, ...] -> [batch, num_chunks * chunk_frames, ...]
    latents = jnp.moveaxis(chunks, 0, 1).reshape(batch, num_chunks * rc.chunk_frames, *chunks.shape[3:])
    return Rollout(latents, state)


jit_rollout = jax.jit(rollout, static_argnums=(1, 2), static_argnames=("num_chunks",))
jit_rollout.__doc__ = (
    "`rollout` under jax.jit (config, rc and num_chunks static; first_chunk traced, so continuing "
    "at any offset reuses one program)."
)


# ------------------------------------------------------------------------------------------------ streaming


def _stream_step(config, rc, params, state, key, index, noise):
    if noise is None:
        batch = state.cache.batch // (2 if rc.guidance_scale is not None else 1)
        noise = chunk_noise(key, config, rc, batch, index)
    return generate_chunk(params, config, rc, state, noise)


_init_state_jit = jax.jit(init_state, static_argnums=(1, 2))

# The cache is donated: XLA writes the chunk into the caller's buffers instead of copying the cache per chunk.
stream_step = jax.jit(_stream_step, static_argnums=(0, 1), donate_argnames=("state",))
