"""One row of a pool on its own: switch its prompt, take it out as a solo stream's state, put one in.

A row is exactly a solo stream (`jaxkv.pool.state`), so everything a solo stream does to its state is done to the
row's slice of the pool's state, with the row traced (one compilation per pool shape) and the other rows' buffers
untouched:

- `switch_row`: `jaxkv.recache.switch_prompt` on the row's sessions (1, or 2 with guidance: its own negative) and
  its ring row, the result written back: a pooled row that switches at chunk n is the solo `Stream` that
  switches at chunk n.
- `take_row` / `put_row`: the row's (cache, cross K/V, key, chunk count, ring row) out, or in, bit for bit: what a
  `jaxkv.session.Session` of batch 1 holds (the driver, `jaxkv.pool.StreamPool`, builds and checks the session).
"""

from __future__ import annotations

import jax

from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv.models.wan.config import WanConfig
from jaxkv.pool import state as PS


def switch_row(
    params,
    config: WanConfig,
    rc: R.RolloutConfig,
    state: PS.PoolState,
    row,
    context,
    negative_context=None,
    *,
    keep_sink: bool = True,
) -> PS.PoolState:
    """The pool with ``row`` (an int or traced int32 scalar) switched to ``context`` [1, text_tokens, text_dim]
    (and ``negative_context``, same shape, iff guidance): new cross K/V and the row's retained frames re-cached from
    its ring (`jaxkv.recache.switch_prompt`, ``keep_sink`` as there). Positions, clock, key and chunk count do not
    change; other rows are untouched. Call it between steps."""
    if state.ring is None:
        raise ValueError(
            "prompt switching in a pool re-caches from the rows' latent rings, which this pool keeps none of: "
            f"{RC.switch_refusal(rc)}"
        )
    index = PS.session_index(rc, state.rows, row)
    sub = R.RolloutState(PS.take_sessions(state.rollout.cache, index), PS.take_cross(state.rollout.cross, index))
    new = RC.switch_prompt(
        params, config, rc, sub, PS.ring_row(state.ring, row), context, negative_context, keep_sink=keep_sink
    )
    rollout = R.RolloutState(
        PS.put_sessions(state.rollout.cache, index, new.cache), PS.put_cross(state.rollout.cross, index, new.cross)
    )
    return state._replace(rollout=rollout)


def take_row(rc: R.RolloutConfig, state: PS.PoolState, row):
    """Row ``row``'s own state, in new buffers: (`RolloutState` of its 1 (2 with guidance) sessions, key data
    uint32 [key_words], chunks generated int32 [], its ring as a `LatentRing` of batch 1 or None)."""
    index = PS.session_index(rc, state.rows, row)
    sub = R.RolloutState(PS.take_sessions(state.rollout.cache, index), PS.take_cross(state.rollout.cross, index))
    ring = None if state.ring is None else PS.ring_row(state.ring, row)
    return sub, state.keys[row], state.chunks[row], ring


def put_row(rc: R.RolloutConfig, state: PS.PoolState, row, sub: R.RolloutState, key_data, chunks, ring=None):
    """The pool with ``row`` holding a stream's state (what `take_row` returns) and occupied; ``ring`` None
    empties the row's ring (the row can switch once its ring holds every chunk its cache does)."""
    index = PS.session_index(rc, state.rows, row)
    rollout = R.RolloutState(
        PS.put_sessions(state.rollout.cache, index, sub.cache), PS.put_cross(state.rollout.cross, index, sub.cross)
    )
    pool_ring = state.ring
    if pool_ring is not None:
        pool_ring = PS.clear_ring_row(pool_ring, row) if ring is None else PS.put_ring_row(pool_ring, row, ring)
    return PS.PoolState(
        rollout,
        state.keys.at[row].set(key_data.astype(state.keys.dtype)),
        state.chunks.at[row].set(chunks),
        state.occupied.at[row].set(True),
        pool_ring,
    )


jit_switch_row = jax.jit(switch_row, static_argnums=(1, 2), static_argnames=("keep_sink",), donate_argnames=("state",))
jit_take_row = jax.jit(take_row, static_argnums=(0,))
jit_put_row = jax.jit(put_row, static_argnums=(0,), donate_argnames=("state",))
