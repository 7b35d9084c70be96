"""The pool's state and its three row operations: admit, finish, step (pure functions, rows traced).

Every row of the pool is a cache session (two with guidance: the row and its negative at ``rows + row``). One step
advances every occupied row by one chunk in a single compiled program, whatever their positions: the cache reserves
per session (``begin_chunk(active=occupied)``), positions and slots are per session, and masks come from positions.
A step may also advance only some occupied rows (``step(..., rows=mask)``): the others wait, bit for bit.
A stream is *admitted* into a free row (the row's sessions are reset, its cross-attention K/V and noise key set),
and *finished* (the row reset, freed). Row indices are traced, so admitting, finishing and stepping each compile
once per pool shape, never per row or per position.

What a row computes is exactly its solo stream's (`jaxkv.stream.Stream` with the same context and key): its
noise is ``chunk_noise(key, ..., batch=1, n)`` at the row's own chunk count n, and a row sees only its own
sessions. Free rows run through the step too (a fixed-shape batch) on empty caches; their outputs are
meaningless, they stay empty, and nothing they compute can reach another row. Any cache a rollout runs works:
ring / rolling, all-dilated (``dilated_every=1``) and mixed dense / dilated (``dilated_every >= 2``): ``reset``
and ``begin_chunk(active)`` act per session on every stack.

The pool also keeps each row's clean chunks (``ring``, a `jaxkv.recache.LatentRing` with
one row per pool row, pushed by every step), which a per-row prompt switch (`jaxkv.pool.rows`) re-caches from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv.cache import ChunkCache, Fp8Cache, MixedCache
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.validate import check_int


class PoolState(NamedTuple):
    """rollout: cache and cross K/V for ``sessions = rows`` (``2 * rows`` with guidance: cond rows first);
    keys: uint32 [rows, key_words] key data of each row's noise key (`jax.random.key_data`);
    chunks: int32 [rows] chunks the row's stream has generated (its next noise index);
    occupied: bool [rows];
    ring: the rows' clean latents (`LatentRing`, batch = rows) when the pool can switch prompts
    (`switchable`), else None."""

    rollout: R.RolloutState
    keys: jax.Array
    chunks: jax.Array
    occupied: jax.Array
    ring: RC.LatentRing | None = None

    @property
    def rows(self) -> int:
        return self.occupied.shape[0]


def switchable(rc: R.RolloutConfig) -> bool:
    """True when a pool under ``rc`` keeps latent rings and can switch a row's prompt: when a solo stream under
    ``rc`` could (`jaxkv.recache.switch_refusal` is None; the rings reach the dilated horizon of dilated and mixed
    caches: `jaxkv.recache.ring_spec`)."""
    return RC.switch_refusal(rc) is None


def session_index(rc: R.RolloutConfig, rows: int, row) -> jax.Array:
    """int32 [1] (or [2] with guidance: the row, then its negative): the cache sessions of ``row``."""
    row = jnp.asarray(row, jnp.int32)
    return jnp.stack([row, row + rows]) if rc.guidance_scale is not None else row[None]


def _sessions_of(rc: R.RolloutConfig, rows: int, row) -> jax.Array:
    """bool [sessions]: the sessions of ``row`` (and its negative session with guidance)."""
    one = jnp.arange(rows) == row
    return jnp.concatenate([one, one]) if rc.guidance_scale is not None else one


def _check_stacked(cache) -> None:
    parts = {MixedCache: lambda c: (c.dense, c.dilated), Fp8Cache: lambda c: (c.inner,)}.get(type(cache))
    for part in (cache,) if parts is None else parts(cache):
        if not isinstance(part, ChunkCache):
            raise ValueError(
                f"a pool row is taken from a ChunkCache, MixedCache or Fp8Cache, got {type(part).__name__}"
            )
        if part.is_per_layer:
            raise ValueError("a pool row is taken from a stacked cache, got a per-layer one")


def take_sessions(cache, index):
    """The sessions ``index`` (int32 [n]) of a stacked cache (`ChunkCache`, `MixedCache` or `Fp8Cache`), as a cache
    of n sessions: k, v [layers, n, ...] (and an FP8 cache's scales [layers, n, slots, heads]), positions
    [n, capacity], chunk_start [n]."""
    _check_stacked(cache)
    if isinstance(cache, MixedCache):
        return cache.replace(dense=take_sessions(cache.dense, index), dilated=take_sessions(cache.dilated, index))
    if isinstance(cache, Fp8Cache):
        take = lambda x: jnp.take(x, index, axis=1)
        return cache.replace(
            inner=take_sessions(cache.inner, index), k_scale=take(cache.k_scale), v_scale=take(cache.v_scale)
        )
    return cache.replace(
        k=jnp.take(cache.k, index, axis=1),
        v=jnp.take(cache.v, index, axis=1),
        positions=jnp.take(cache.positions, index, axis=0),
        chunk_start=jnp.take(cache.chunk_start, index, axis=0),
    )


def put_sessions(cache, index, part):
    """``cache`` with its sessions ``index`` (int32 [n]) replaced by ``part`` (a cache of n sessions, the same
    class, spec and dtype); the other sessions' buffers are untouched."""
    _check_stacked(cache)
    if type(part) is not type(cache) or part.spec != cache.spec or part.dtype != cache.dtype:
        raise ValueError(
            f"the row's cache ({type(part).__name__}, {part.spec}, {part.dtype}) does not fit the pool's "
            f"({type(cache).__name__}, {cache.spec}, {cache.dtype})"
        )
    if isinstance(cache, MixedCache):
        return cache.replace(
            dense=put_sessions(cache.dense, index, part.dense), dilated=put_sessions(cache.dilated, index, part.dilated)
        )
    if isinstance(cache, Fp8Cache):
        return cache.replace(
            inner=put_sessions(cache.inner, index, part.inner),
            k_scale=cache.k_scale.at[:, index].set(part.k_scale),
            v_scale=cache.v_scale.at[:, index].set(part.v_scale),
        )
    return cache.replace(
        k=cache.k.at[:, index].set(part.k),
        v=cache.v.at[:, index].set(part.v),
        positions=cache.positions.at[index].set(part.positions),
        chunk_start=cache.chunk_start.at[index].set(part.chunk_start),
    )


def take_cross(cross: M.CrossKV, index) -> M.CrossKV:
    """The cross K/V [layers, n, ...] of sessions ``index`` (int32 [n])."""
    return M.CrossKV(jnp.take(cross.k, index, axis=1), jnp.take(cross.v, index, axis=1))


def put_cross(cross: M.CrossKV, index, part: M.CrossKV) -> M.CrossKV:
    return M.CrossKV(cross.k.at[:, index].set(part.k.astype(cross.k.dtype)), cross.v.at[:, index].set(part.v))


def ring_row(ring: RC.LatentRing, row) -> RC.LatentRing:
    """Row ``row`` of the pool's ring as a ring of batch 1 (what a solo `Stream` holds)."""
    row = jnp.asarray(row, jnp.int32)
    return ring.replace(
        latents=lax.dynamic_slice_in_dim(ring.latents, row, 1, axis=0),
        chunks=lax.dynamic_slice_in_dim(ring.chunks, row, 1, axis=0),
    )


def put_ring_row(ring: RC.LatentRing, row, part: RC.LatentRing) -> RC.LatentRing:
    """``ring`` with row ``row`` replaced by ``part`` (a ring of batch 1)."""
    row = jnp.asarray(row, jnp.int32)
    return ring.replace(
        latents=lax.dynamic_update_slice_in_dim(ring.latents, part.latents.astype(jnp.float32), row, axis=0),
        chunks=lax.dynamic_update_slice_in_dim(ring.chunks, part.chunks.astype(jnp.int32), row, axis=0),
    )


def clear_ring_row(ring: RC.LatentRing | None, row) -> RC.LatentRing | None:
    if ring is None:
        return None
    return ring.replace(chunks=jnp.where((jnp.arange(ring.batch) == row)[:, None], RC.EMPTY, ring.chunks))


def _push_rows(ring: RC.LatentRing, latents, chunk_index) -> RC.LatentRing:
    """Each row's clean chunk ``latents`` [rows, chunk_frames, h, w, c] stored as chunk ``chunk_index`` int32 [rows]
    (rows with a negative index untouched): `LatentRing.push` in one scatter (each row writes its own slot)."""
    rows = jnp.arange(ring.batch)
    slots = ring.slot_of_chunk(jnp.maximum(chunk_index, 0))
    live = chunk_index >= 0
    old = ring.latents[rows, slots]
    lat = ring.latents.at[rows, slots].set(jnp.where(live[:, None, None, None, None], latents, old))
    chunks = ring.chunks.at[rows, slots].set(jnp.where(live, chunk_index, ring.chunks[rows, slots]))
    return ring.replace(latents=lat, chunks=chunks)


def init_pool(params, config: WanConfig, rc: R.RolloutConfig, rows: int) -> PoolState:
    """An empty pool of ``rows`` rows (all free)."""
    R._check_model(config)
    rows = check_int("rows", rows, minimum=1)
    sessions = rows * (2 if rc.guidance_scale is not None else 1)
    cache = R.empty_cache(config, rc, sessions)
    one = jax.eval_shape(
        lambda p: M.cross_kv(p, config, jnp.zeros((1, 1, config.text_dim), jnp.float32), run=rc.run), params
    )
    shape = (config.num_layers, sessions, *one.k.shape[2:])
    cross = M.CrossKV(jnp.zeros(shape, one.k.dtype), jnp.zeros(shape, one.v.dtype))
    key_words = jax.random.key_data(jax.random.key(0)).shape
    ring = RC.LatentRing.init(RC.ring_spec(config, rc), rc.chunk_shape(config, rows)) if switchable(rc) else None
    return PoolState(
        R.RolloutState(cache, cross),
        jnp.zeros((rows, *key_words), jnp.uint32),
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows,), bool),
        ring,
    )


def admit(
    params, config: WanConfig, rc: R.RolloutConfig, state: PoolState, row, context, key, negative_context=None
) -> PoolState:
    """Starts a stream in ``row`` (an int or traced int32 scalar; the caller picks a free row): its sessions are
    emptied, its cross K/V computed from ``context`` [1, text_tokens, text_dim] (and the row's own
    ``negative_context`` [1, text_tokens, text_dim] with guidance), its noise key set, its chunk count zeroed and its
    latent ring emptied."""
    rows = state.rows
    ctx = R._check_context(config, rc, context, negative_context)  # [1 or 2, text_len, text_dim]
    if ctx.shape[0] != (2 if rc.guidance_scale is not None else 1):
        raise ValueError(f"admit takes one stream: context [1, text_tokens, text_dim], got {list(jnp.shape(context))}")
    row = jnp.asarray(row, jnp.int32)
    cross = M.cross_kv(params, config, ctx, run=rc.run)  # [layers, 1 or 2, text_len, ...]
    cross = put_cross(state.rollout.cross, session_index(rc, rows, row), cross)
    cache = state.rollout.cache.reset(_sessions_of(rc, rows, row))
    data = jax.random.key_data(key).astype(jnp.uint32)
    return PoolState(
        R.RolloutState(cache, cross),
        lax.dynamic_update_slice(state.keys, data[None], (row, 0)),
        state.chunks.at[row].set(0),
        state.occupied.at[row].set(True),
        clear_ring_row(state.ring, row),
    )


def finish(rc: R.RolloutConfig, state: PoolState, row) -> PoolState:
    """Ends the stream in ``row``: its sessions and ring row are emptied (nothing reallocated) and the row is
    free."""
    row = jnp.asarray(row, jnp.int32)
    cache = state.rollout.cache.reset(_sessions_of(rc, state.rows, row))
    return PoolState(
        R.RolloutState(cache, state.rollout.cross),
        state.keys,
        state.chunks.at[row].set(0),
        state.occupied.at[row].set(False),
        clear_ring_row(state.ring, row),
    )


def step(params, config: WanConfig, rc: R.RolloutConfig, state: PoolState, rows=None):
    """Advances every occupied row, or those of them where ``rows`` (bool [rows], traced: one program for every
    subset) is True, by one chunk: (latents float32 [rows, chunk_frames, h, w, in_dim] (meaningless in the rows that
    did not step), new state). A row that does not step keeps every byte of its state (cache rows, cross K/V, key,
    chunk count, ring row): `jaxkv.rollout.generate_chunk`'s ``active``. The ring gets each stepping row's chunk,
    under the index its cache reserved (as a `jaxkv.stream.Stream` pushes it: the wrapped clock's index on
    cache-relative RoPE)."""
    active = state.occupied if rows is None else state.occupied & jnp.asarray(rows, bool)
    keys = jax.random.wrap_key_data(state.keys)
    noise = jax.vmap(lambda k, n: R.chunk_noise(k, config, rc, 1, n)[:, 0])(keys, state.chunks)
    noise = jnp.moveaxis(noise, 0, 1)  # [steps, rows, ...]
    x, rollout = R.generate_chunk(params, config, rc, state.rollout, noise, active=active)
    ring = state.ring
    if ring is not None:
        start = rollout.cache.chunk_start[: state.rows]  # free rows reserved nothing: -1
        index = jnp.where(active & (start >= 0), start // rollout.cache.spec.chunk, RC.EMPTY)
        ring = _push_rows(ring, x, index)
    return x, PoolState(rollout, state.keys, state.chunks + active.astype(jnp.int32), state.occupied, ring)


jit_init_pool = jax.jit(init_pool, static_argnums=(1, 2, 3))
jit_admit = jax.jit(admit, static_argnums=(1, 2), donate_argnames=("state",))
jit_finish = jax.jit(finish, static_argnums=(0,), donate_argnames=("state",))
jit_step = jax.jit(step, static_argnums=(1, 2), donate_argnames=("state",))
