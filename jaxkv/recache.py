"""Prompt switching mid-stream with KV re-cache (LongLive's interactive switch), on jaxkv's caches.

A stream's self-attention cache holds K/V computed under the prompt they were generated with. Switching the prompt
at chunk n only in the cross-attention would leave the retained frames' K/V speaking of the old prompt; LongLive
re-caches instead. Semantics pinned here (read from LongLive's ``_recache_after_switch`` and its causal model):

1. the cross-attention K/V are recomputed from the new context (the old ones are dropped);
2. the frames the cache retains (its sink chunks and its window) are re-run, from their **clean** latents, at the
   **context-pass timestep** (``Schedule.context_noise``, the timestep that committed them), at their **own
   positions**, under the **block-causal mask** of the cache (chunk-causal, the window, the sink), in one forward
   (`jaxkv.models.wan.recompute_cache`); their new K/V replace the old in place. Positions, the clock and the
   slots do not change, so the next chunk is generated exactly as a stream that had held these K/V would;
3. the sink: ``keep_sink=True`` (LongLive's ``global_sink``) keeps the sink chunks' K/V as they were, and the
   re-run window attends to those kept K/V; ``keep_sink=False`` recomputes the sink chunks under the new prompt
   too, from their own clean latents. (One difference, as read in LongLive's code: without ``global_sink`` it
   re-runs its last ``local_attn_size`` frames into the zeroed cache, which on a full cache fills it from the
   first slot, so its sink slots then hold the oldest re-run frames; here the sink always holds the stream's
   first chunks.)

The clean latents come from a `LatentRing` (a `jaxkv.stream.Stream` keeps one, ``stream.ring``, and switches with
``stream.switch_prompt``): the last window's (and the sink's) clean chunks, a small pytree of its own laid out by
the ring rule (sink chunk n in slot n, later chunks in ``sink + (n - sink) % window``) and written with
``lax.dynamic_update_slice`` at traced slots, like the cache. It is matched to the cache's slots by chunk index
(modulo `jaxkv.rollout.wrap_period` on the cache-relative wrapped clock), so the ring and rolling policies both work
(`RECACHE_POLICIES`). Caches with dilated layers (`DilatedCache`, `MixedCache`) are re-cached by
replaying their held chunks instead (`jaxkv.recache_dilated`), from a ring that also reaches their horizon. An FP8
cache (`Fp8Cache`, a ring) is re-computed as the read-dtype ring it reads as, and each re-run chunk re-quantized
with its own per-(chunk, head) scales by the rule its step's write uses (`recompute`).

Costs: a switch is one forward over the cache's capacity (the window's frames at once) plus the new cross K/V,
compiled once per shape (`jit_switch_prompt`); the step is not recompiled. The ring adds
``(sink + window) frames x latent size`` per stream (a few MiB at 480p), tiny next to the K/V.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxkv import recache_dilated as D
from jaxkv import rollout as R
from jaxkv.cache import RECACHE_POLICIES, ChunkCache, Fp8Cache, RingSpec
from jaxkv.cache.clock import ring_slot
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.validate import is_concrete

EMPTY = -1
RING_EXTRA = "latent_ring"  # the session extras entry of a saved `LatentRing` (`jaxkv.stream.Stream.session`)


@struct.dataclass
class LatentRing:
    """The clean latents of the chunks a cache retains, one slot per chunk.

    latents: float32 [batch, num_slots, chunk_frames, height, width, channels]
    chunks:  int32 [batch, num_slots]   chunk index held by each slot, -1 when empty
    """

    latents: jax.Array
    chunks: jax.Array
    sink_chunks: int = struct.field(pytree_node=False)
    window_chunks: int = struct.field(pytree_node=False)

    @classmethod
    def init(cls, spec: RingSpec, chunk_shape) -> "LatentRing":
        """An empty ring for chunks of ``chunk_shape`` [batch, chunk_frames, height, width, channels] and the slots
        of ``spec`` (sink_chunks + window_chunks)."""
        if not isinstance(spec, RingSpec):
            raise TypeError(f"spec must be a RingSpec, got {type(spec).__name__}")
        chunk_shape = tuple(int(d) for d in chunk_shape)
        if len(chunk_shape) != 5 or min(chunk_shape) < 1:
            raise ValueError(
                f"chunk_shape must be [batch, chunk_frames, height, width, channels], got {list(chunk_shape)}"
            )
        batch = chunk_shape[0]
        return cls(
            latents=jnp.zeros((batch, spec.num_slots, *chunk_shape[1:]), jnp.float32),
            chunks=jnp.full((batch, spec.num_slots), EMPTY, jnp.int32),
            sink_chunks=spec.sink_chunks,
            window_chunks=spec.window_chunks,
        )

    @property
    def batch(self) -> int:
        return self.chunks.shape[0]

    @property
    def num_slots(self) -> int:
        return self.chunks.shape[1]

    def slot_of_chunk(self, chunk_index):
        """int32 [...]: the slot of chunk ``chunk_index`` (the `jaxkv.RingCache` rule)."""
        return ring_slot(chunk_index, self.sink_chunks, self.window_chunks)

    def push(self, latents, chunk_index) -> "LatentRing":
        """Stores each row's clean chunk ``latents`` [batch, chunk_frames, h, w, c] as chunk ``chunk_index`` int32
        [batch] (traced); rows with a negative index are left untouched. O(chunk) per row."""
        latents = jnp.asarray(latents)
        if tuple(latents.shape) != (self.batch, *self.latents.shape[2:]):
            raise ValueError(
                f"push: latents must be [batch, chunk_frames, h, w, c] = "
                f"{[self.batch, *self.latents.shape[2:]]}, got {list(latents.shape)}"
            )
        chunk_index = jnp.asarray(chunk_index)
        if chunk_index.shape != (self.batch,) or not jnp.issubdtype(chunk_index.dtype, jnp.integer):
            raise ValueError(
                f"push: chunk_index must be int [{self.batch}], got {chunk_index.dtype}{list(chunk_index.shape)}"
            )
        chunk_index = chunk_index.astype(jnp.int32)
        slots = self.slot_of_chunk(jnp.maximum(chunk_index, 0))
        lat, chunks = self.latents, self.chunks
        for b in range(self.batch):
            old = lax.dynamic_index_in_dim(lat[b], slots[b], 0, keepdims=False)
            row = jnp.where(chunk_index[b] >= 0, latents[b].astype(jnp.float32), old)
            lat = lax.dynamic_update_slice(lat, row[None, None], (b, slots[b], 0, 0, 0, 0))
            old_c = lax.dynamic_index_in_dim(chunks[b], slots[b], 0, keepdims=True)
            chunks = lax.dynamic_update_slice(
                chunks, jnp.where(chunk_index[b] >= 0, chunk_index[b : b + 1], old_c)[None], (b, slots[b])
            )
        return self.replace(latents=lat, chunks=chunks)

    def for_cache(self, cache: ChunkCache, period: int | None = None):
        """The latents of what ``cache``'s slots hold, in the cache's physical slot order.

        Args:
          cache: a cache whose first ``batch`` sessions hold this ring's streams (with guidance the negative rows
            that follow share their positions); its slots must hold whole chunks.
          period: chunks by which the cache's clock may have wrapped (`jaxkv.rollout.wrap_period`), None for none.
        Returns:
          (latents float32 [batch, num_slots * chunk_frames, h, w, c], found bool [batch, num_slots]: a cache slot
          holding a chunk that this ring holds; False for empty slots and for chunks the ring lacks).
        """
        spec = cache.spec
        if spec.num_slots != self.num_slots or cache.batch < self.batch:
            raise ValueError(
                f"the ring has {self.num_slots} slots for {self.batch} rows; the cache has "
                f"{spec.num_slots} slots for {cache.batch} sessions"
            )
        first = cache.positions[: self.batch, :: spec.chunk]  # [batch, num_slots]
        wanted = jnp.where(first >= 0, first // spec.chunk, EMPTY)
        ring_slot = self.slot_of_chunk(jnp.maximum(wanted, 0))
        held = jnp.take_along_axis(self.chunks, ring_slot, axis=1)
        diff = held - wanted
        same = diff == 0 if period is None else jnp.mod(diff, period) == 0
        found = (wanted >= 0) & (held >= 0) & same
        lat = jnp.take_along_axis(self.latents, ring_slot[:, :, None, None, None, None], axis=1)
        lat = jnp.where(found[:, :, None, None, None, None], lat, 0.0)
        b, n, f = lat.shape[:3]
        return lat.reshape(b, n * f, *lat.shape[3:]), found


def _period(rc: R.RolloutConfig, spec: RingSpec) -> int | None:
    return None if rc.bounded else R.wrap_period(spec)


def _host(x) -> np.ndarray:
    """``x`` whole on the host; gathered from every process where a multi-process mesh spreads it (a collective:
    every process checks alike)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def check_ring(config: WanConfig, rc: R.RolloutConfig, state: R.RolloutState, ring: LatentRing) -> None:
    """ValueError (eager, concrete arrays) when the cache holds a chunk whose clean latents the ring lacks: a
    re-cache would otherwise run those slots on zeros. Traced arguments are not checked."""
    if D.has_dilated_layers(state.cache):
        D.check_history(state.cache, ring.chunks, D.period_of(rc, state.cache))
        return
    if not (is_concrete(state.cache.positions) and is_concrete(ring.chunks)):
        return
    spec = state.cache.spec
    _, found = ring.for_cache(state.cache, _period(rc, spec))
    positions = _host(state.cache.positions[: ring.batch])
    held = positions[:, :: spec.chunk] >= 0
    missing = held & ~_host(found)
    if missing.any():
        row, slot = np.argwhere(missing)[0]
        chunk = int(positions[row, slot * spec.chunk]) // spec.chunk
        raise ValueError(
            f"the latent ring lacks chunk {chunk} (row {row}) that the cache holds: push every "
            f"chunk's clean latents (LatentRing.push) to re-cache after a prompt switch"
        )


def ring_spec(config: WanConfig, rc: R.RolloutConfig) -> RingSpec:
    """The slots of a stream's latent ring: the cache's own sink + window, or with dilated layers the span that
    reaches their horizon (`jaxkv.recache_dilated.history_spec`)."""
    return D.history_spec(config, rc) if rc.dilated_every else rc.spec(config)


def switch_prompt(
    params,
    config: WanConfig,
    rc: R.RolloutConfig,
    state: R.RolloutState,
    ring: LatentRing,
    context,
    negative_context=None,
    *,
    keep_sink: bool = True,
    cross: M.CrossKV | None = None,
) -> R.RolloutState:
    """The state under a new prompt: new cross-attention K/V and the retained frames re-cached (module docstring).

    Call it between chunks (after chunk n - 1 is committed, before chunk n). Pure; `jit_switch_prompt` compiles it
    once per shape.

    Args:
      state: the stream's state; its cache's sessions are the ring's rows (twice as many with guidance).
      ring: the clean latents of the retained chunks (`LatentRing`, pushed after every chunk).
      context: [batch, text_tokens, text_dim]; negative_context: same, iff rc.guidance_scale is set.
      keep_sink: keep the sink chunks' K/V (True, LongLive's global sink) or recompute them too (False).
      cross: the contexts' cross-attention K/V when already projected (`jaxkv.models.wan.cross_kv` of the
        sessions, conditional rows then negative rows); a mesh projects them for the whole batch at once, as its
        first state does, so that each data group's rows round as one device's.
    Returns:
      the new RolloutState (same cache layout, positions and clock).
    """
    R._check_model(config)
    if rc.policy not in RECACHE_POLICIES:
        raise ValueError(
            f"prompt switching re-runs slots that hold whole chunks: policies "
            f"{sorted(RECACHE_POLICIES)}, got {rc.policy!r}"
        )
    if not isinstance(keep_sink, bool):
        raise ValueError(f"keep_sink must be a bool, got {keep_sink!r}")
    sessions = R._check_context(config, rc, context, negative_context)
    cache = state.cache
    if sessions.shape[0] != cache.batch:
        raise ValueError(f"the new context has {sessions.shape[0]} sessions but the state has {cache.batch}")
    guided = rc.guidance_scale is not None
    if ring.batch * (2 if guided else 1) != cache.batch:
        raise ValueError(
            f"the ring has {ring.batch} rows but the state has {cache.batch} sessions"
            f"{' (guidance doubles them)' if guided else ''}"
        )
    if cross is None:
        cross = M.cross_kv(params, config, sessions, run=rc.run)
    elif _shapes(cross) != _shapes(state.cross):
        raise ValueError(f"the given cross-attention K/V are {_shapes(cross)}, the state's {_shapes(state.cross)}")
    if D.has_dilated_layers(cache):  # replayed chunk by chunk (their visibility is no positional mask)
        cache = D.replay_recache(params, config, rc, cache, cross, ring.latents, ring.chunks, keep_sink)
        return R.RolloutState(cache, cross)
    latents, _ = ring.for_cache(cache, _period(rc, cache.spec))
    if guided:
        latents = jnp.concatenate([latents, latents], axis=0)
    keep = ((cache.positions >= 0) & (cache.positions < cache.spec.sink)) if keep_sink else None
    t = jnp.full((cache.batch,), rc.schedule.context_noise, jnp.float32)
    cache = recompute(params, config, rc, cache, cross, latents, t, keep)
    return R.RolloutState(cache, cross)


def _shapes(cross: M.CrossKV):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), cross)


def recompute(params, config: WanConfig, rc: R.RolloutConfig, cache, cross, latents, t, keep=None):
    """`jaxkv.models.wan.recompute_cache` of ``cache`` under ``rc``, an `Fp8Cache` included: that one is read as
    the read-dtype ring it stands for (`Fp8Cache.dequantized`, so the re-run frames attend to the kept sink exactly
    as a step reads it), re-computed, and each re-run slot quantized with its own per-(chunk, head) scales by the
    rule a step's write uses (`Fp8Cache.requantized`); kept slots keep their FP8 bytes and scales. The re-cache
    forward itself attends in the read dtype (as `recompute_cache` does on every cache: no FP8 attention)."""
    if not isinstance(cache, Fp8Cache):
        return M.recompute_cache(params, config, cache, cross, latents, t, keep=keep, rope=rc.rope, run=rc.run)
    run = dataclasses.replace(rc.run, precision=dataclasses.replace(rc.run.precision, fp8_kv=False))
    dense = M.recompute_cache(params, config, cache.dequantized(), cross, latents, t, keep=keep, rope=rc.rope, run=run)
    return cache.requantized(dense, None if keep is None else keep[:, :: cache.spec.chunk])


jit_switch_prompt = jax.jit(
    switch_prompt, static_argnums=(1, 2), static_argnames=("keep_sink",), donate_argnames=("state",)
)
jit_switch_prompt.__doc__ = "`switch_prompt` under jax.jit (config, rc, keep_sink static; the state donated)."


@functools.partial(jax.jit, static_argnums=(3,))
def push_chunk(ring: LatentRing, latents, chunk_start, chunk: int) -> LatentRing:
    """Pushes a finished chunk (what `jaxkv.stream.Stream` runs after each step, a program of its own so the step's
    is unchanged): the cache's reserved chunk (``chunk_start`` int32 [sessions], tokens) is ``latents``
    [batch, chunk_frames, h, w, c]."""
    index = jnp.where(chunk_start < 0, EMPTY, chunk_start // chunk)
    return ring.push(latents, index[: ring.batch])


def switch_refusal(rc: R.RolloutConfig) -> str | None:
    """Why a stream (or a pool) under ``rc`` cannot switch prompts (so keeps no latent history), or None when it
    can: a re-cachable policy (`RECACHE_POLICIES`; dilated layers are replayed, an FP8 cache re-quantized:
    `recompute`)."""
    if rc.policy not in RECACHE_POLICIES:
        return (
            f"prompt switching re-runs slots that hold whole chunks: policies {sorted(RECACHE_POLICIES)}, "
            f"got {rc.policy!r}"
        )
    return None


def ring_from_extra(extra, like: LatentRing) -> LatentRing:
    """The `LatentRing` a session saved as ``extras[RING_EXTRA]`` ({"latents", "chunks"}), checked against ``like``
    (the ring of the stream that takes it): ValueError naming what does not fit."""
    if not isinstance(extra, dict) or set(extra) != {"latents", "chunks"}:
        raise ValueError(f"the saved latent ring must hold 'latents' and 'chunks', got {sorted(extra or {})}")
    for name in ("latents", "chunks"):
        want, got = getattr(like, name), extra[name]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ValueError(
                f"the saved latent ring's {name} are {got.dtype}{list(got.shape)}, this stream's "
                f"{want.dtype}{list(want.shape)}"
            )
    return like.replace(latents=jnp.asarray(extra["latents"]), chunks=jnp.asarray(extra["chunks"]))


def SwitchableStream(stream):
    """Deprecated (one release): a `jaxkv.stream.Stream` keeps its latent history and switches itself
    (`Stream.switch_prompt`). Returns ``stream`` itself, after a DeprecationWarning; a stream built with
    ``history=False`` gets an empty history here, as the wrapper started one."""
    warnings.warn(
        "jaxkv.recache.SwitchableStream is deprecated: a Stream switches itself (stream.switch_prompt), keeps its "
        "latent history (stream.ring) and saves it in stream.session()",
        DeprecationWarning,
        stacklevel=2,
    )
    if stream.ring is None and stream._empty_ring() is not None:
        stream._put_ring(stream._empty_ring())
    return stream
