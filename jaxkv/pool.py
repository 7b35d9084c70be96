"""Many independent streams in one batch: a fixed number of rows, each holding one stream at its own position.

Every row of the pool is a cache session (two with guidance: the row and its negative at ``rows + row``). One step
advances every occupied row by one chunk in a single compiled program, whatever their positions: the cache reserves
per session (``begin_chunk(active=occupied)``), positions and slots are per session, and masks come from positions.
A stream is *admitted* into a free row (the row's sessions are reset, its cross-attention K/V and noise key set),
and *finished* (the row reset, freed). Row indices are traced, so admitting, finishing and stepping each compile
once per pool shape, never per row or per position.

What a row computes is exactly its solo stream's (`jaxkv.stream.Stream` with the same context and key): its
noise is ``chunk_noise(key, ..., batch=1, n)`` at the row's own chunk count n, and a row sees only its own
sessions. Free rows run through the step too (a fixed-shape batch) on empty caches; their outputs are
meaningless, they stay empty, and nothing they compute can reach another row.

State (`PoolState`): the rollout state (cache [layers, sessions, ...] and cross K/V), and per row the noise key
data, the chunks generated, and whether it is occupied.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import rollout as R
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.validate import check_int


class PoolState(NamedTuple):
    """rollout: cache and cross K/V for ``sessions = rows`` (``2 * rows`` with guidance: cond rows first);
    keys: uint32 [rows, key_words] key data of each row's noise key (`jax.random.key_data`);
    chunks: int32 [rows] chunks the row's stream has generated (its next noise index);
    occupied: bool [rows]."""

    rollout: R.RolloutState
    keys: jax.Array
    chunks: jax.Array
    occupied: jax.Array

    @property
    def rows(self) -> int:
        return self.occupied.shape[0]


def _sessions_of(rc: R.RolloutConfig, rows: int, row) -> jax.Array:
    """bool [sessions]: the sessions of ``row`` (and its negative session with guidance)."""
    one = jnp.arange(rows) == row
    return jnp.concatenate([one, one]) if rc.guidance_scale is not None else one


def init_pool(params, config: WanConfig, rc: R.RolloutConfig, rows: int) -> PoolState:
    """An empty pool of ``rows`` rows (all free)."""
    R._check_model(config)
    rows = check_int("rows", rows, minimum=1)
    if rc.dilated_every:
        raise ValueError(
            f"a pool runs sink + window caches; RolloutConfig.dilated_every={rc.dilated_every} "
            f"(dilated layers) is not supported by jaxkv.pool yet"
        )
    sessions = rows * (2 if rc.guidance_scale is not None else 1)
    cache = R.empty_cache(config, rc, sessions)
    one = jax.eval_shape(
        lambda p: M.cross_kv(p, config, jnp.zeros((1, 1, config.text_dim), jnp.float32), precision=rc.precision), params
    )
    shape = (config.num_layers, sessions, *one.k.shape[2:])
    cross = M.CrossKV(jnp.zeros(shape, one.k.dtype), jnp.zeros(shape, one.v.dtype))
    key_words = jax.random.key_data(jax.random.key(0)).shape
    return PoolState(
        R.RolloutState(cache, cross),
        jnp.zeros((rows, *key_words), jnp.uint32),
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows,), bool),
    )


def admit(
    params, config: WanConfig, rc: R.RolloutConfig, state: PoolState, row, context, key, negative_context=None
) -> PoolState:
    """Starts a stream in ``row`` (an int or traced int32 scalar; the caller picks a free row): its sessions are
    emptied, its cross K/V computed from ``context`` [1, text_tokens, text_dim] (and ``negative_context`` with
    guidance), its noise key set and its chunk count zeroed."""
    rows = state.rows
    ctx = R._check_context(config, rc, context, negative_context)  # [1 or 2, text_len, text_dim]
    if ctx.shape[0] != (2 if rc.guidance_scale is not None else 1):
        raise ValueError(f"admit takes one stream: context [1, text_tokens, text_dim], got {list(jnp.shape(context))}")
    row = jnp.asarray(row, jnp.int32)
    cross = M.cross_kv(params, config, ctx, precision=rc.precision)  # [layers, 1 or 2, text_len, ...]
    k, v = state.rollout.cross
    for i in range(ctx.shape[0]):  # cond row, then its negative
        at = (0, row + i * rows, 0, 0, 0)
        k = lax.dynamic_update_slice(k, cross.k[:, i : i + 1], at)
        v = lax.dynamic_update_slice(v, cross.v[:, i : i + 1], at)
    cache = state.rollout.cache.reset(_sessions_of(rc, rows, row))
    data = jax.random.key_data(key).astype(jnp.uint32)
    return PoolState(
        R.RolloutState(cache, M.CrossKV(k, v)),
        lax.dynamic_update_slice(state.keys, data[None], (row, 0)),
        state.chunks.at[row].set(0),
        state.occupied.at[row].set(True),
    )


def finish(rc: R.RolloutConfig, state: PoolState, row) -> PoolState:
    """Ends the stream in ``row``: its sessions are emptied (nothing reallocated) and the row is free."""
    row = jnp.asarray(row, jnp.int32)
    cache = state.rollout.cache.reset(_sessions_of(rc, state.rows, row))
    return PoolState(
        R.RolloutState(cache, state.rollout.cross),
        state.keys,
        state.chunks.at[row].set(0),
        state.occupied.at[row].set(False),
    )


def step(params, config: WanConfig, rc: R.RolloutConfig, state: PoolState):
    """Advances every occupied row by one chunk: (latents float32 [rows, chunk_frames, h, w, in_dim] (meaningless
    in free rows), new state)."""
    keys = jax.random.wrap_key_data(state.keys)
    noise = jax.vmap(lambda k, n: R.chunk_noise(k, config, rc, 1, n)[:, 0])(keys, state.chunks)
    noise = jnp.moveaxis(noise, 0, 1)  # [steps, rows, ...]
    x, rollout = R.generate_chunk(params, config, rc, state.rollout, noise, active=state.occupied)
    return x, PoolState(rollout, state.keys, state.chunks + state.occupied.astype(jnp.int32), state.occupied)


jit_init_pool = jax.jit(init_pool, static_argnums=(1, 2, 3))
jit_admit = jax.jit(admit, static_argnums=(1, 2), donate_argnames=("state",))
jit_finish = jax.jit(finish, static_argnums=(0,), donate_argnames=("state",))
jit_step = jax.jit(step, static_argnums=(1, 2), donate_argnames=("state",))


class StreamPool:
    """Host-side driver of a pool: picks free rows, checks row numbers, and steps every occupied row at once.

    ``admit(context, key) -> row``, ``step() -> {row: latents [chunk_frames, h, w, in_dim]}`` for the occupied
    rows, ``finish(row)``. Each operation is one compiled program per pool shape (`jit_admit`, `jit_step`,
    `jit_finish`), counted by ``jaxkv.compilation.compile_count``.
    """

    def __init__(self, params, config: WanConfig, rc: R.RolloutConfig, rows: int):
        self.params, self.config, self.rc = params, config, rc
        self.state = jit_init_pool(params, config, rc, check_int("rows", rows, minimum=1))
        self._occupied = [False] * rows
        self._chunks = [0] * rows

    @property
    def rows(self) -> int:
        return len(self._occupied)

    @property
    def free_rows(self) -> list[int]:
        return [r for r, busy in enumerate(self._occupied) if not busy]

    def admit(self, context, key, negative_context=None) -> int:
        """Admits a stream (context [1, text_tokens, text_dim], a PRNG key) into the first free row; returns the
        row. RuntimeError when every row is occupied (nothing changes)."""
        free = self.free_rows
        if not free:
            raise RuntimeError(f"all {self.rows} rows of the pool are occupied; finish one first")
        row = free[0]
        self.state = jit_admit(
            self.params,
            self.config,
            self.rc,
            self.state,
            np.int32(row),
            jnp.asarray(context),
            key,
            None if negative_context is None else jnp.asarray(negative_context),
        )
        self._occupied[row], self._chunks[row] = True, 0
        return row

    def finish(self, row: int) -> None:
        """Frees an occupied ``row``; ValueError for a row that is out of range or free (nothing changes)."""
        row = check_int("row", row, minimum=0)
        if row >= self.rows or not self._occupied[row]:
            raise ValueError(
                f"row {row} holds no stream (occupied rows: {[r for r, busy in enumerate(self._occupied) if busy]})"
            )
        self.state = jit_finish(self.rc, self.state, np.int32(row))
        self._occupied[row] = False

    def step(self) -> dict[int, jax.Array]:
        """One chunk for every occupied row: {row: latents float32 [chunk_frames, h, w, in_dim]}. ValueError when
        no row is occupied; OverflowError when a row's next chunk would pass the int32 positions (absolute RoPE)."""
        busy = [r for r, b in enumerate(self._occupied) if b]
        if not busy:
            raise ValueError("no stream in the pool; admit one first")
        limit = self.rc.spec(self.config).max_chunks
        if self.rc.bounded and max(self._chunks[r] for r in busy) >= limit:
            raise OverflowError(
                f"a row's next chunk would pass the int32 position limit ({limit} chunks to a stream); finish it"
            )
        x, self.state = jit_step(self.params, self.config, self.rc, self.state)
        for r in busy:
            self._chunks[r] += 1
        return {r: x[r] for r in busy}
