"""Windowed generation driven by a `jaxkv.cache.WindowSchedule`: the stream is produced window by window, each
window conditioned on the previous window's committed K/V, and what the schedule releases is evicted between windows.

Semantics (pinned from the seed's windowed-generation PR, its KV-context mode, and tested against a cache-free
reference in tests/test_windowed.py). Units are latent frames; every count of the schedule is a whole number of
chunks (``rc.chunk_frames``), so a window is a run of whole chunks.

* Window i spans [i*stride, i*stride + window) with stride = window - overlap. Its first ``overlap`` frames are the
  previous window's last ones: they are **conditioned on, not generated again** — their committed K/V is already in
  the cache. So window i generates exactly its commit span, [end(i-1), end(i)) clipped to the total (window 0:
  [0, window)), chunk by chunk with the rollout's own step (`jaxkv.rollout.generate_chunk`: denoising passes, then
  the context pass that commits the chunk's K/V). Commit spans tile [0, total): every frame is generated and
  committed exactly once.
* Within a window, chunks are chunk-causal as in the plain rollout: a chunk sees itself and every committed chunk of
  the window before it.
* After window i the schedule releases [prefix, released_end(i)), released_end(i) = end(i) - context (nothing when
  ``context_units`` is 0): those frames are evicted (`jaxkv.cache.release`) before window i+1 starts. The
  protected prefix (the first ``prefix_units`` frames, the cache's sink) is never released. Since context >=
  overlap (the schedule refuses less), window i+1 always still sees the overlap it conditions on.
* Hence a chunk of window j sees: the prefix, and every committed frame from released_end(j-1) (0 for j = 0) up to
  itself. With ``context_units = 0`` nothing is released and this is the plain rollout with an unbounded window.
* A padded last window (its span runs past the total) commits only up to the total, and its padding is not
  generated: in a causal model frames after the total cannot change committed ones.

The cache is the rollout's `RingCache` (or `RollingCache`) with sink = prefix frames and a window large enough that
the ring itself never evicts a frame the schedule still keeps (`windowed_config` sets both): context + stride
frames, or the whole stream when context is 0. Releases then do all the evicting. With dilated layers
(``rc.dilated_every``: a `MixedCache`, or all dilated with no prefix) a dilated layer keeps its own rule (kept
frames within its horizon) and a release frees the same span from it too: its chunk sees what its rule shows of
what the schedule keeps. Each chunk runs the donated,
jitted `jaxkv.rollout.stream_step` (one compilation for the whole stream) and each release one small jitted
program; noise is drawn as in `jaxkv.rollout.rollout` (``fold_in(key, chunk)``) or given explicitly.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp

from jaxkv import rollout as R
from jaxkv.cache import DilatedCache, MixedCache, WindowSchedule, release
from jaxkv.cache.window_schedule import Window
from jaxkv.models.wan.config import WanConfig


def chunk_schedule(rc: R.RolloutConfig, schedule: WindowSchedule) -> WindowSchedule:
    """The schedule in chunk units (every frame count divided by rc.chunk_frames); ValueError naming the first count
    that is not a whole number of chunks."""
    if not isinstance(schedule, WindowSchedule):
        raise ValueError(f"schedule must be a jaxkv.cache.WindowSchedule (units: latent frames), got {schedule!r}")
    c = rc.chunk_frames
    fields = ("total_units", "window_units", "overlap_units", "context_units", "prefix_units")
    for name in fields:
        if getattr(schedule, name) % c:
            raise ValueError(
                f"windowed generation runs whole chunks: schedule.{name} ({getattr(schedule, name)} "
                f"frames) must be a multiple of chunk_frames ({c})"
            )
    return WindowSchedule(*(getattr(schedule, name) // c for name in fields))


def window_frames_needed(rc: R.RolloutConfig, schedule: WindowSchedule) -> int:
    """Frames the cache's rolling window must hold so that the ring never evicts what the schedule keeps: (context
    + stride) frames, or every frame after the prefix when context is 0 (nothing is released)."""
    s = chunk_schedule(rc, schedule)
    chunks = s.context_units + s.stride if s.context_units else max(s.total_units - s.prefix_units, 1)
    return chunks * rc.chunk_frames


def windowed_config(rc: R.RolloutConfig, schedule: WindowSchedule) -> R.RolloutConfig:
    """``rc`` with the cache a windowed generation under ``schedule`` needs: sink = the schedule's prefix frames,
    window = `window_frames_needed`."""
    return dataclasses.replace(rc, sink_frames=schedule.prefix_units, window_frames=window_frames_needed(rc, schedule))


def _check(config: WanConfig, rc: R.RolloutConfig, schedule: WindowSchedule) -> WindowSchedule:
    s = chunk_schedule(rc, schedule)
    need = window_frames_needed(rc, schedule)
    if rc.sink_frames != schedule.prefix_units or rc.window_frames < need:
        raise ValueError(
            f"the schedule needs sink_frames = prefix_units = {schedule.prefix_units} and window_frames "
            f">= {need} (context + stride, or the whole stream when context is 0); got sink_frames="
            f"{rc.sink_frames}, window_frames={rc.window_frames}; use windowed_config(rc, schedule)"
        )
    R.check_position_room(config, rc, s.total_units)
    return s


def release_frames(cache, stop):
    """Evicts the held tokens at positions [sink, stop) of every layer: `jaxkv.cache.release` for a sink + window
    cache; a dilated stack (`DilatedCache.release`) frees the same span of what its own rule holds (the dense
    layers' sink, the schedule's prefix, is protected in every layer)."""
    if isinstance(cache, MixedCache):
        dense = release(cache.dense, stop)
        return cache.replace(dense=dense, dilated=cache.dilated.release(cache.spec.dense.sink, stop))
    if isinstance(cache, DilatedCache):
        return cache.release(0, stop)  # (all-dilated: no sink, so no prefix)
    return release(cache, stop)


_release_step = jax.jit(
    lambda state, stop: R.RolloutState(release_frames(state.cache, stop), state.cross), donate_argnums=0
)


def windows(
    params,
    config: WanConfig,
    rc: R.RolloutConfig,
    schedule: WindowSchedule,
    context,
    *,
    key=None,
    noise=None,
    negative_context=None,
) -> Iterator[tuple[Window, jax.Array, R.RolloutState]]:
    """Generates window by window; yields (window in frame units, its committed latents float32 [batch,
    commit_stop - commit_start, h, w, in_dim], the state after it) as soon as each window is done (e.g. to decode
    it while the next one denoises). See the module docstring for what each window sees. The yielded state is
    valid until the iteration resumes: the next chunk's step donates its buffers (the cache is updated in place).

    Args:
      rc: a RolloutConfig whose cache fits the schedule (`windowed_config`).
      schedule: `WindowSchedule` in latent frames, every count a multiple of rc.chunk_frames.
      context, negative_context: as `jaxkv.rollout.rollout`.
      key: PRNG key (chunk n's noise from ``fold_in(key, n)``, as the rollout), or
      noise: explicit noise [total_units // chunk_frames, steps, batch, chunk_frames, h, w, in_dim].
    """
    s = _check(config, rc, schedule)
    if (key is None) == (noise is None):
        raise ValueError("pass exactly one of key= (noise drawn per chunk) or noise= (explicit noise)")
    batch = jnp.shape(context)[0]
    if noise is not None:
        noise = jnp.asarray(noise)
        expected = rc.noise_shape(config, batch, s.total_units)
        if tuple(noise.shape) != expected:
            raise ValueError(
                f"noise must be [chunks = total_units // chunk_frames, steps, batch, chunk_frames, h, w, "
                f"in_dim] = {list(expected)}, got {list(noise.shape)}"
            )
    state = R._init_state_jit(params, config, rc, context, negative_context)
    return _generate(params, config, rc, s, state, key, noise)  # checked above, eagerly; generated lazily


def _generate(params, config, rc, s: WindowSchedule, state, key, noise):
    c, tokens = rc.chunk_frames, rc.spec(config).chunk
    for w in s.windows():
        chunks = []
        for n in range(w.commit_start, w.commit_stop):
            if noise is not None:
                x, state = R.stream_step(config, rc, params, state, None, None, noise[n])
            else:
                x, state = R.stream_step(config, rc, params, state, key, jnp.asarray(n, jnp.int32), None)
            chunks.append(x)
        lo, hi = s.released_span(w.index)
        if hi > lo and w.index + 1 < s.num_windows:
            state = _release_step(state, jnp.asarray(hi * tokens, jnp.int32))
        frames = Window(*(u * c for u in w))
        yield frames, jnp.concatenate(chunks, axis=1), state


def windowed_rollout(
    params,
    config: WanConfig,
    rc: R.RolloutConfig,
    schedule: WindowSchedule,
    context,
    *,
    key=None,
    noise=None,
    negative_context=None,
) -> R.Rollout:
    """The whole windowed generation: Rollout(latents float32 [batch, total_units, h, w, in_dim], final state).
    Arguments as `windows`."""
    parts, state = [], None
    for _, latents, state in windows(  # noqa: B007 - the last state is returned
        params, config, rc, schedule, context, key=key, noise=noise, negative_context=negative_context
    ):
        parts.append(latents)
    return R.Rollout(jnp.concatenate(parts, axis=1), state)
