"""Rows of a pool stepping at their own pace (`StreamPool.step(rows=[...])`): random schedules of which rows step,
with admits, finishes and prompt switches interleaved, give each row exactly its solo stream's chunks on every cache
a pool runs; a waiting row's state is bit for bit what it was; bad ``rows`` change nothing; one compiled step for
every subset; a row that waited goes out as a session and continues solo bit for bit.

Below the pool: a cache's `only_writing` mask (the masked write a partial step relies on) leaves the other sessions'
bytes untouched although they hold chunks, and `wrap_clock(active)` moves only active sessions."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import pool as P
from jaxkv.cache import DilatedCache, DilatedSpec, Fp8Cache, RingCache, RingSpec, RollingCache
from jaxkv.cache.clock import wrap_clock
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.precision import Precision
from jaxkv.stream import Stream
from tests.test_pool import CFG, _ctx, _rc
from tests.test_pool_dilated import _dilated_rc

CASES = {
    "ring": dict(),
    "rolling-cache-relative": dict(policy="rolling", rope="cache-relative"),
    "ring-guided": dict(guidance_scale=3.0),
    "dilated": "dilated",
    "mixed": "mixed",
    # float32 params and reads: the tiny model's params as they are. (The case's name seeds its schedule: "fp8-kv"
    # ends with 3 rows running, after 2 switches, 17 waits and 3 streams.)
    "fp8-kv": dict(precision=Precision(fp8_kv=True)),
}


def _case_rc(name):
    kw = CASES[name]
    if kw == "dilated":
        return _dilated_rc(1)
    if kw == "mixed":
        return _dilated_rc(2)
    return _rc(**kw)


def _neg(rc, seed):
    return None if rc.guidance_scale is None else _ctx(50 + seed)


def _row_state(pool, row):
    """Every byte of row ``row``'s state, copied to the host: its sessions' cache leaves (whatever the cache kind),
    cross K/V, key, chunk count, occupancy and ring row."""
    st, rows = pool.state, pool.rows
    idx = np.asarray(P.state.session_index(pool.rc, rows, row))

    def sessions(path, x):
        x = np.asarray(x)
        names = [getattr(p, "name", getattr(p, "key", None)) for p in path]
        # positions / chunk_start / writers lead with the session axis; K/V, scales and cross K/V with the layer axis
        axis = 0 if any(n in ("positions", "chunk_start") for n in names) else 1
        return np.take(x, idx, axis=axis)

    cache = jax.tree_util.tree_map_with_path(sessions, st.rollout.cache)
    cross = jax.tree.map(lambda x: np.take(np.asarray(x), idx, axis=1), st.rollout.cross)
    ring = None if st.ring is None else jax.tree.map(lambda x: np.asarray(x)[row], (st.ring.latents, st.ring.chunks))
    return cache, cross, np.asarray(st.keys[row]), np.asarray(st.chunks[row]), np.asarray(st.occupied[row]), ring


def _equal(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), f"{what}: leaf {i} differs"


def _solo(params, rc, stream):
    """Stream ``stream``'s chunks alone (batch 1): a `Stream` switched before chunk n to the context of each
    (n, seed) in its switches; ``extra`` chunks past what the pool generated, for the session check."""
    s = Stream(
        params,
        CFG,
        rc,
        _ctx(stream["seed"]),
        key=jax.random.key(100 + stream["seed"]),
        negative_context=_neg(rc, stream["seed"]),
    )
    out = []
    for i in range(len(stream["chunks"]) + stream["extra"]):
        if i in stream["switches"]:
            seed = stream["switches"][i]
            s.switch_prompt(_ctx(seed), _neg(rc, seed))
        out.append(np.asarray(next(s)[0]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_rows_stepping_at_random_paces_are_their_solo_streams_and_waiting_rows_keep_every_byte(case):
    rc = _case_rc(case)
    params = wan.init_params(CFG, jax.random.key(0))
    rng = random.Random(sum(map(ord, case)))
    pool = P.StreamPool(params, CFG, rc, rows=3)
    streams, where = [], {}  # every stream's record; row -> its record while it runs
    steps_before = compile_count(P.jit_step)

    def admit():
        seed = len(streams) + 1
        stream = dict(seed=seed, chunks=[], switches={}, extra=0)
        streams.append(stream)
        where[pool.admit(_ctx(seed), jax.random.key(100 + seed), negative_context=_neg(rc, seed))] = stream

    admit()
    admit()
    waited = 0
    for t in range(14):
        event = rng.random()
        if event < 0.2 and pool.free_rows:
            admit()
        elif event < 0.3 and len(where) > 1:
            row = rng.choice(sorted(where))
            pool.finish(row)
            del where[row]
        elif event < 0.45 and P.switchable(rc):
            row = rng.choice(sorted(where))
            seed = 20 + t
            pool.switch_prompt(row, _ctx(seed), _neg(rc, seed))
            where[row]["switches"][len(where[row]["chunks"])] = seed
        busy = sorted(where)
        # mostly a strict subset (someone waits), sometimes every row (None)
        rows = rng.sample(busy, rng.randint(1, max(1, len(busy) - 1))) if rng.random() < 0.8 else None
        stepping = busy if rows is None else rows
        before = {r: _row_state(pool, r) for r in busy if r not in stepping}
        out = pool.step(rows)
        assert sorted(out) == sorted(stepping)
        for r in stepping:
            where[r]["chunks"].append(np.asarray(out[r]))
        for r, state in before.items():
            _equal(_row_state(pool, r), state, f"row {r}, waiting at step {t}")
            waited += 1
    assert waited >= 5 and len(streams) >= 3  # the schedule exercised waiting rows and admits
    assert compile_count(P.jit_step) - steps_before == 1  # one program for every subset of rows (and None)

    # a row that waited goes out as a session and continues solo where its stream goes on: the first row steps once
    # more, so every other row has just waited
    assert len(where) >= 2
    first = sorted(where)[0]
    where[first]["chunks"].append(np.asarray(pool.step([first])[first]))
    tails = {}
    for row, stream in where.items():
        stream["extra"] = 2
        tails[row] = [np.asarray(x[0]) for x in Stream.from_session(params, CFG, rc, pool.session(row), num_chunks=2)]
    for stream in streams:
        want = _solo(params, rc, stream)
        got = stream["chunks"] + next((tails.get(r, []) for r, s in where.items() if s is stream), [])
        assert len(got) == len(want) and len(stream["chunks"]) >= 1
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_array_equal(g, w, err_msg=f"{case}: stream {stream['seed']}, chunk {i}")
    # the streams differ from each other (a pool that mixed up rows would not pass unnoticed)
    assert np.abs(streams[0]["chunks"][0] - streams[1]["chunks"][0]).max() > 1e-3


def test_bad_rows_raise_before_anything_changes():
    rc = _rc()
    params = wan.init_params(CFG, jax.random.key(0))
    pool = P.StreamPool(params, CFG, rc, rows=3)
    a = pool.admit(_ctx(1), jax.random.key(101))
    b = pool.admit(_ctx(2), jax.random.key(102))
    pool.step([a])
    before = jax.tree.map(np.asarray, pool.state)
    for rows, match in (
        ([], "rows is empty"),
        ([2], "row 2 holds no stream"),
        ([a, 3], "row 3 holds no stream"),
        ([-1], "row must be >= 0"),
        ([b, b], "repeats a row"),
        ([True], "row must be an int"),
        (a, "rows must be a list"),
        (np.array([a]), "rows must be a list"),
    ):
        with pytest.raises(ValueError, match=match):
            pool.step(rows)
    _equal(pool.state, before, "the pool after refused steps")
    assert (pool.chunks(a), pool.chunks(b)) == (1, 0)
    pool.finish(a)
    with pytest.raises(ValueError, match="row 0 holds no stream"):
        pool.step([a])


def test_a_partial_step_is_one_program_that_aliases_the_donated_pool_state():
    rc = _rc()
    params = wan.init_params(CFG, jax.random.key(0))
    state = P.jit_init_pool(params, CFG, rc, 3)
    program = P.jit_step.lower(params, CFG, rc, state, np.array([True, False, True])).compile()
    cache = state.rollout.cache
    assert program.memory_analysis().alias_size_in_bytes >= cache.nbytes, (program.memory_analysis(), cache.nbytes)


# ------------------------------------------------------------------------------------------------ the cache rules


def _filled(cache, chunks, layers):
    """``cache`` after ``chunks`` chunks written with random K/V in every session (every layer)."""
    key = jax.random.key(7)
    for _ in range(chunks):
        cache = cache.begin_chunk()
        for layer in range(layers):
            key, sub = jax.random.split(key)
            k = jax.random.normal(sub, (cache.batch, cache.spec.chunk, cache.heads, cache.head_dim)).astype(cache.dtype)
            cache = cache.write(k, -k, layer=layer)
    return cache


@pytest.mark.parametrize("kind", ["ring", "rolling", "dilated", "fp8"])
def test_only_writing_leaves_a_session_that_holds_chunks_untouched(kind):
    layers, heads, dim = 2, 2, 4
    if kind == "dilated":
        cache = DilatedCache.init(DilatedSpec(2, 2, 2, 2), 2, heads, dim, layers=layers)
    else:
        cls = {"ring": RingCache, "rolling": RollingCache, "fp8": Fp8Cache}[kind]
        kw = dict(dtype=jnp.float32) if kind == "fp8" else {}
        cache = cls.init(RingSpec(chunk=4, window=8, sink=4), 2, heads, dim, layers=layers, **kw)
    cache = _filled(cache, 4, layers)  # full: the next chunk would evict (or shift) in every session
    active = jnp.array([True, False])
    before = jax.tree.map(np.asarray, cache)
    k = jnp.full((2, cache.spec.chunk, heads, dim), 3.0, cache.dtype)

    def chunk(cache, mask):
        cache = cache.begin_chunk(active)
        cache = cache if mask is None else cache.only_writing(mask)
        for layer in range(layers):
            cache = cache.write(k, k, layer=layer)
        return cache if mask is None else cache.only_writing(None)

    new = jax.jit(chunk)(cache, active)
    assert jax.tree.structure(new) == jax.tree.structure(cache)  # the mask is gone again
    # session 1 (waiting): every leaf's row 1 as it was; session 0 wrote its chunk
    for got, old in zip(jax.tree.leaves(new), jax.tree.leaves(before), strict=True):
        got = np.asarray(got)
        axis = 0 if got.ndim <= 2 else 1  # positions, chunk_start lead with the session; K/V and scales with layers
        assert np.array_equal(np.take(got, 1, axis=axis), np.take(old, 1, axis=axis)), kind
    assert not np.array_equal(np.take(np.asarray(new.k), 0, axis=1), np.take(before.k, 0, axis=1)), kind
    # without the mask the same write lands in session 1 too (the check above can fail)
    free = chunk(cache, None)
    assert not np.array_equal(np.take(np.asarray(free.k), 1, axis=1), np.take(before.k, 1, axis=1)), kind


def test_wrap_clock_moves_only_active_sessions():
    spec = RingSpec(chunk=4, window=8, sink=4)
    cache = RingCache.init(spec, 2, 1, 2)
    last = spec.max_chunks - 1
    near = cache.replace(chunk_start=jnp.full((2,), last * spec.chunk, jnp.int32))
    moved = wrap_clock(near)
    assert bool(jnp.all(moved.chunk_start < near.chunk_start))  # both due: both move
    half = wrap_clock(near, jnp.array([True, False]))
    assert int(half.chunk_start[0]) == int(moved.chunk_start[0])
    assert int(half.chunk_start[1]) == int(near.chunk_start[1])


@pytest.mark.slow
def test_a_row_waiting_at_the_wrapped_clock_keeps_its_clock_until_its_own_step():
    """Cache-relative RoPE: two rows whose clocks are due to wrap (moved near the int32 limit, as
    tests/test_rope_modes.py moves a stream). Row a steps past the wrap while row b waits bit for bit (its clock is
    due too: a wrap of every row would move it); then b steps and wraps. Every chunk equals the same pool's at the
    true positions."""
    from tests.test_rope_modes import _advanced

    rc = _rc(rope="cache-relative")
    params = wan.init_params(CFG, jax.random.key(0))
    pools = [P.StreamPool(params, CFG, rc, rows=2) for _ in range(2)]
    for pool in pools:
        a, b = (pool.admit(_ctx(s), jax.random.key(100 + s)) for s in (1, 2))
    shifted, true = pools
    for pool in pools:
        for _ in range(3):
            pool.step()
    spec, cache = rc.spec(CFG), shifted.state.rollout.cache
    d = (spec.max_chunks - 6) // spec.window_chunks * spec.window_chunks
    shifted.state = shifted.state._replace(rollout=shifted.state.rollout._replace(cache=_advanced(cache, d)))
    while int(shifted.state.rollout.cache.chunk_start[b]) // spec.chunk < spec.max_chunks - 1:  # until both are due
        for x, y in zip(shifted.step().values(), true.step().values(), strict=True):
            np.testing.assert_array_equal(x, y)
    for rows in ([a], [a], [b], [b], None):
        waiting = [r for r in (a, b) if rows is not None and r not in rows]
        before = {r: _row_state(shifted, r) for r in waiting}
        got, want = shifted.step(rows), true.step(rows)
        for r in got:
            np.testing.assert_array_equal(got[r], want[r], err_msg=f"row {r}")
        for r in waiting:
            _equal(_row_state(shifted, r), before[r], f"row {r} waiting at the wrap")
    ends = np.asarray(shifted.state.rollout.cache.chunk_start) // spec.chunk
    assert (ends < spec.max_chunks // 2 + 8).all(), ends  # both clocks wrapped (by about half the int32 range)
