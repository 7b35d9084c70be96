"""Prompt-switch re-cache of caches with dilated layers (`DilatedCache`, `MixedCache`): replay the held chunks.

A sink + window cache is re-cached in one forward under its positional mask (`jaxkv.models.wan.recompute_cache`).
A dilated layer's visibility is not a positional mask (chunk m sees the kept frames f % dilation == 0 that fewer
than ``buckets`` newer kept frames have displaced by chunk m), so a cache with dilated layers is re-cached by
replaying instead: every chunk some layer still holds is committed again, oldest first, from its clean latents at
the context-pass timestep under the new cross K/V, into the cache emptied of what it held. Each layer's cache then
applies its own rule (the dense window, the dilated ring) exactly as the stream did, so every layer's K/V are
rebuilt at the slots and positions it holds them, and each replayed chunk sees what the stream showed it,
restricted to the held chunks (as the one-forward re-cache of a ring does: the oldest held chunk sees the sink and
itself). The positions and the clock end as they were.

``keep_sink`` keeps the sink chunks' K/V in every layer as they were (their slots are not emptied, the replay
skips them and the later chunks attend to the kept K/V); without it the sink chunks are replayed too.

The history: a chunk is held as long as a dense layer's window or sink holds it or a dilated layer holds one of its
kept frames, so the latent ring keeps the sink chunks and `history_window_chunks` chunks. Costs: one chunk forward
per held chunk (a ``lax.scan`` over the ring's slots, a ``lax.cond`` skipping the slots not to replay).

All rows of a stream are in step (one clock), which the replay relies on: `check_history` checks it eagerly. With
cache-relative RoPE the clock wraps (`jaxkv.cache.clock.wrap_clock`): the history's chunks pushed before a wrap are
matched to the cache's modulo the wrap period (`on_clock`), whose multiple of the history's window also keeps
their history slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import rollout as R
from jaxkv.cache import DilatedCache, DilatedSpec, MixedCache, MixedSpec, RingSpec
from jaxkv.cache.clock import history_chunks, wrap_period
from jaxkv.cache.dilated import stored_positions
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.validate import is_concrete

EMPTY = -1


def has_dilated_layers(cache) -> bool:
    """Whether ``cache`` is re-cached by replay (a `DilatedCache` or a `MixedCache`)."""
    return isinstance(cache, (DilatedCache, MixedCache))


def history_window_chunks(rc: R.RolloutConfig) -> int:
    """Non-sink chunks the latent history keeps: the dense window's, or enough for the dilated horizon (after
    chunk n - 1, kept frames back to about frame n*c - (buckets + 1) * dilation are held), whichever is more
    (the cache's rule, `jaxkv.cache.clock.history_chunks`, which the wrapped clock's period also keeps)."""
    dilated = DilatedSpec(1, rc.chunk_frames, rc.dilation, rc.buckets)
    if rc.dilated_every == 1:
        return history_chunks(dilated)
    dense = RingSpec.from_frames(1, rc.chunk_frames, rc.window_frames, rc.sink_frames)
    return history_chunks(MixedSpec(dense, dilated, rc.dilated_every))


def history_spec(config: WanConfig, rc: R.RolloutConfig) -> RingSpec:
    """The `RingSpec` whose slots the latent history (`jaxkv.recache.LatentRing`) of a dilated / mixed stream
    uses: the dense sink (none when every layer is dilated) and `history_window_chunks`."""
    sink = rc.sink_frames if rc.dilated_every != 1 else 0
    c = rc.chunk_frames
    return RingSpec.from_frames(rc.tokens_per_frame(config), c, history_window_chunks(rc) * c, sink)


def _stacks(cache) -> list:
    return [cache.dense, cache.dilated] if isinstance(cache, MixedCache) else [cache]


def _rebuild(cache, stacks):
    if isinstance(cache, MixedCache):
        return cache.replace(dense=stacks[0], dilated=stacks[1])
    return stacks[0]


def held_chunks(cache) -> jax.Array:
    """int32 [batch, capacity of all stacks]: the chunk index each slot of any layer holds (pending frames
    included), -1 for empty slots."""
    chunk = cache.spec.chunk
    pos = jnp.concatenate([stored_positions(s.positions) for s in _stacks(cache)], axis=1)
    return jnp.where(pos >= 0, pos // chunk, EMPTY)


def period_of(rc: R.RolloutConfig, cache) -> int | None:
    """Chunks by which the cache's clock may have wrapped (`jaxkv.cache.clock.wrap_period`; cache-relative RoPE),
    None when it never wraps (absolute RoPE)."""
    return None if rc.bounded else wrap_period(cache.spec)


def on_clock(cache, chunks, period: int | None):
    """int32 [rows, slots]: the history's chunk indices (``chunks``, -1 empty) on the cache's clock now. The
    history was pushed with the clock of its time; after a wrap (`jaxkv.cache.clock.wrap_clock`) the chunks pushed
    before it are ``period`` ahead of the cache's: each non-sink chunk is taken to the one congruent modulo
    ``period`` among the ``period`` chunks before the cache's next (the history reaches fewer chunks back than
    that); sink chunks never move. ``period`` None: as they are."""
    chunks = jnp.asarray(chunks)
    if period is None:
        return chunks
    sink = cache.dense.spec.sink_chunks if isinstance(cache, MixedCache) else 0
    last = cache.next_chunk_index()[: chunks.shape[0], None] - 1
    moved = last - jnp.mod(last - chunks, period)
    return jnp.where((chunks >= 0) & (chunks >= sink), moved, chunks).astype(jnp.int32)


def check_history(cache, chunks, period: int | None = None) -> None:
    """ValueError (eager, concrete arrays) when the rows are not in step or the history (``chunks`` int32 [rows,
    slots], a `LatentRing`'s) lacks a chunk some layer holds (matched modulo ``period`` on a wrapped clock,
    `on_clock`). Traced arguments are not checked."""
    if not (is_concrete(cache.chunk_start) and is_concrete(chunks)):
        return
    start = np.asarray(cache.chunk_start)
    if (start != start[0]).any():
        raise ValueError(f"a dilated cache's rows must be in step to re-cache (one clock), got chunk_start {start}")
    held = np.asarray(held_chunks(cache))[: chunks.shape[0]]
    have = np.asarray(on_clock(cache, chunks, period))
    for row in range(held.shape[0]):
        missing = sorted(set(held[row][held[row] >= 0].tolist()) - set(have[row].tolist()))
        if missing:
            raise ValueError(
                f"the latent history lacks chunk {missing[0]} (row {row}) that the cache holds: push every chunk's "
                f"clean latents (LatentRing.push) to re-cache after a prompt switch"
            )


def replay_recache(params, config: WanConfig, rc: R.RolloutConfig, cache, cross, latents, chunks, keep_sink: bool):
    """The cache re-cached by replay (module docstring).

    Args:
      cache: a `DilatedCache` or `MixedCache` between two chunks; its sessions are the history's rows (twice as
        many with guidance: the negative rows follow and share the positions).
      cross: the new cross K/V [layers, sessions, text_tokens, heads, head_dim].
      latents: float32 [rows, slots, chunk_frames, h, w, in_dim]: the history's clean chunks (`LatentRing.latents`).
      chunks: int32 [rows, slots]: the chunk each history slot holds, -1 empty (`LatentRing.chunks`), on the
        clock of its push: matched to the cache's modulo the wrap period with cache-relative RoPE (`on_clock`).
      keep_sink: keep the sink chunks' K/V as they were.
    Returns:
      the cache with every held chunk's K/V recomputed; positions and clock as before.
    """
    chunks = on_clock(cache, chunks, period_of(rc, cache))
    chunk = cache.spec.chunk
    keep_tokens = rc.sink_frames * rc.tokens_per_frame(config) if keep_sink and rc.dilated_every != 1 else 0
    sessions = cache.batch
    # what is held, by chunk (rows in step: row 0 speaks for all)
    held = held_chunks(cache)[0]
    order = jnp.argsort(jnp.where(chunks[0] < 0, jnp.iinfo(jnp.int32).max, chunks[0]))  # oldest first
    todo = chunks[0][order]
    replay = (todo >= 0) & jnp.any(todo[:, None] == held[None, :], axis=1) & (todo * chunk >= keep_tokens)
    rows = latents[:, order]
    if sessions != latents.shape[0]:  # guidance: the negative rows replay the same frames
        rows = jnp.concatenate([rows, rows], axis=0)

    # empty every slot but the kept sink's (K/V left in place: invisible until a replayed chunk overwrites them)
    def empty(s):
        p = stored_positions(s.positions)
        return s.replace(positions=jnp.where((p >= 0) & (p < keep_tokens), s.positions, EMPTY))

    start = cache.chunk_start
    work = _rebuild(cache, [empty(s) for s in _stacks(cache)])
    t = jnp.full((sessions,), rc.schedule.context_noise, jnp.float32)

    def one(work, xs):
        index, x, go = xs

        def run(work):
            before = jnp.full((sessions,), jnp.where(index > 0, (index - 1) * chunk, EMPTY), jnp.int32)
            work = _rebuild(work, [s.replace(chunk_start=before) for s in _stacks(work)]).begin_chunk()
            _, work = M.forward_chunk(params, config, work, cross, x, t, rope=rc.rope, run=rc.run)
            return work

        return lax.cond(go, run, lambda w: w, work), None

    work, _ = lax.scan(one, work, (todo, jnp.moveaxis(rows, 1, 0), replay))
    return _rebuild(work, [s.replace(chunk_start=start) for s in _stacks(work)])
