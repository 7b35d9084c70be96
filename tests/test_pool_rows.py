"""One row of a pool on its own (`jaxkv.pool.rows`, `StreamPool.switch_prompt` / `session` / `admit_session`):
per-row prompt switching and negative prompts against the solo `Stream`, rows taken out as sessions and
sessions admitted, each against the solo stream; the other rows untouched bit for bit.

Tolerance: a pooled row runs in a batch of ``rows`` sessions and its solo stream in a batch of 1; XLA's CPU kernels
may round a float32 matmul differently for another batch size, so rows that *ran in the pool* are compared to their
solo streams at 2e-5 (as tests/test_pool.py does). What involves no step of another batch size is compared bit for
bit: the switch itself (a row switched in the pool against the solo switch from the same state), a row taken out
and put back, and every row the operation must not touch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import pool as P
from jaxkv import recache as RC
from jaxkv import session as S
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.precision import Precision
from jaxkv.stream import Stream
from tests.test_pool import CFG, _ctx, _rc


def _params():
    return wan.init_params(CFG, jax.random.key(0))


def _leaves_equal(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.array_equal(np.asarray(x), np.asarray(y)), f"{what}: leaf {i} differs"


def _row(pool, row):
    """Row ``row``'s whole state (cache, cross, key, chunks, ring), copied to the host."""
    return jax.tree.map(np.asarray, P.jit_take_row(pool.rc, pool.state, np.int32(row)))


def _solo(params, rc, seed, switches, num_chunks, negatives=None):
    """Stream ``seed`` alone (batch 1): a Stream on _ctx(seed), switched to _ctx(c) before chunk n for
    each (n, c) in ``switches``. With guidance ``negatives`` = (first negative seed, {n: negative seed})."""
    neg = None if negatives is None else _ctx(negatives[0])
    s = Stream(params, CFG, rc, _ctx(seed), key=jax.random.key(100 + seed), negative_context=neg)
    out = []
    for i in range(num_chunks):
        if i in switches:
            s.switch_prompt(_ctx(switches[i]), None if negatives is None else _ctx(negatives[1][i]))
        out.append(np.asarray(next(s)[0]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, keep_sink, rope",
    [("ring", True, "absolute"), ("rolling", False, "absolute"), ("ring", False, "cache-relative")],
)
def test_a_row_that_switches_at_chunk_n_is_its_solo_switchable_stream_and_other_rows_are_untouched(
    policy, keep_sink, rope
):
    rc = _rc(policy=policy, rope=rope)
    params = _params()
    pool = P.StreamPool(params, CFG, rc, rows=3)
    a = pool.admit(_ctx(1), jax.random.key(101))
    got = {a: []}
    for _ in range(2):
        got[a].append(np.asarray(pool.step()[a]))
    b = pool.admit(_ctx(2), jax.random.key(102))  # b joins at chunk 0 while a is at chunk 2
    got[b] = []
    before = compile_count(P.jit_switch_row)
    for i in range(5):
        if i == 1:  # a switches before its chunk 3, b goes on
            untouched = _row(pool, b)
            pool.switch_prompt(a, _ctx(7), keep_sink=keep_sink)
            _leaves_equal(_row(pool, b), untouched, "row b after row a's switch")
        if i == 3:  # b switches before its chunk 3 (its window has wrapped)
            pool.switch_prompt(b, _ctx(8), keep_sink=keep_sink)
        out = pool.step()
        for r in (a, b):
            got[r].append(np.asarray(out[r]))
    assert compile_count(P.jit_switch_row) - before == 1  # rows are traced: one program for both rows
    assert len(got[a]) == 7 and len(got[b]) == 5

    def solo(seed, switches, n):
        s = Stream(params, CFG, rc, _ctx(seed), key=jax.random.key(100 + seed))
        out = []
        for i in range(n):
            if i in switches:
                s.switch_prompt(_ctx(switches[i]), keep_sink=keep_sink)
            out.append(np.asarray(next(s)[0]))
        return out

    want = {a: solo(1, {3: 7}, 7), b: solo(2, {3: 8}, 5)}
    for r in (a, b):
        for i, (g, w) in enumerate(zip(got[r], want[r], strict=True)):
            np.testing.assert_array_equal(g, w, err_msg=f"row {r}, chunk {i}")
    # the switch changed the chunks that follow it (the comparison would see a switch that did nothing)
    unswitched = solo(1, {}, 7)
    assert np.abs(got[a][3] - unswitched[3]).max() > 1e-3


@pytest.mark.slow
def test_per_row_negative_prompts_with_guidance_admit_and_switch_as_solo_streams():
    rc = _rc(guidance_scale=3.0)
    params = _params()
    pool = P.StreamPool(params, CFG, rc, rows=2)
    a = pool.admit(_ctx(1), jax.random.key(101), negative_context=_ctx(11))
    b = pool.admit(_ctx(2), jax.random.key(102), negative_context=_ctx(12))
    got = {a: [], b: []}
    for i in range(5):
        if i == 2:  # a switches prompt and negative; b keeps its own
            untouched = _row(pool, b)
            pool.switch_prompt(a, _ctx(7), negative_context=_ctx(17))
            _leaves_equal(_row(pool, b), untouched, "row b after row a's guided switch")
        out = pool.step()
        for r in (a, b):
            got[r].append(np.asarray(out[r]))
    want = {a: _solo(params, rc, 1, {2: 7}, 5, (11, {2: 17})), b: _solo(params, rc, 2, {}, 5, (12, {}))}
    for r in (a, b):
        for i, (g, w) in enumerate(zip(got[r], want[r], strict=True)):
            np.testing.assert_array_equal(g, w, err_msg=f"row {r}, chunk {i}")
    # each row's own negative matters: b's stream under a's negative is another stream
    assert np.abs(got[b][0] - _solo(params, rc, 2, {}, 1, (11, {}))[0]).max() > 1e-3
    # and so does the switched negative: a switched to the new prompt but its old negative differs
    assert np.abs(got[a][2] - _solo(params, rc, 1, {2: 7}, 3, (11, {2: 11}))[2]).max() > 1e-3
    with pytest.raises(ValueError, match="needs a negative_context"):
        pool.switch_prompt(a, _ctx(7))
    pool.finish(b)
    with pytest.raises(ValueError, match="needs a negative_context"):
        pool.admit(_ctx(3), jax.random.key(3))
    assert pool.free_rows == [b]


@pytest.mark.slow
@pytest.mark.parametrize("precision", [None, Precision(fp8_kv=True)], ids=["f32", "fp8"])
def test_a_row_taken_out_resumes_solo_and_a_solo_session_joins_a_pool_bit_for_bit(tmp_path, precision):
    """On the float32 cache and the FP8 one (its bytes and per-(chunk, head) scales go in and out with the row)."""
    rc = _rc() if precision is None else _rc(precision=precision)
    params = _params()
    pool = P.StreamPool(params, CFG, rc, rows=2)
    other = pool.admit(_ctx(2), jax.random.key(102))
    pool.step()
    # a solo Stream, 3 chunks in, saved (its ring comes with the session by itself), joins the pool (row 1) at chunk 3
    solo = Stream(params, CFG, rc, _ctx(1), key=jax.random.key(101))
    head = [np.asarray(next(solo)[0]) for _ in range(3)]
    saved = solo.session()
    assert set(saved.extras) == {RC.RING_EXTRA}
    row = pool.admit_session(saved)
    assert row == 1 and pool.chunks(row) == 3
    _leaves_equal(pool.session(row), saved, "a session put in and taken out")  # cache, cross, key, chunk, ring
    # ...and goes on in the pool as the solo stream goes on, switch included (its ring came with it)
    pool.switch_prompt(row, _ctx(7))
    solo.switch_prompt(_ctx(7))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(pool.step()[row]), np.asarray(next(solo)[0]), err_msg=f"chunk {i}")
    # the pool row taken out at chunk 6 resumes solo (from_session restores its ring), exactly where the row goes on
    out = pool.session(row)
    assert int(out.next_chunk) == 6 and len(head) == 3
    resumed = Stream.from_session(params, CFG, rc, out.fork(), num_chunks=3)
    resumed.switch_prompt(_ctx(8))
    pool.switch_prompt(row, _ctx(8))
    for i, x in enumerate(resumed):
        step = pool.step()
        np.testing.assert_array_equal(np.asarray(step[row]), np.asarray(x[0]), err_msg=f"chunk {6 + i}")
    assert sorted(step) == [other, row]
    # saved to disk and loaded, the row's session is the same session, and joins another pool as it left
    loaded = S.load(S.save(str(tmp_path / "row.session"), out), CFG, rc)
    _leaves_equal(loaded, out, "the row's session saved and loaded")
    again = P.StreamPool(params, CFG, rc, rows=1)
    _leaves_equal(again.session(again.admit_session(loaded)), out, "the loaded session in another pool")


def test_admit_session_refuses_what_a_row_cannot_hold_before_anything_changes():
    rc = _rc()
    params = _params()
    pool = P.StreamPool(params, CFG, rc, rows=2)
    pool.admit(_ctx(1), jax.random.key(101))
    stream = Stream(params, CFG, rc, _ctx(1), key=jax.random.key(1), history=False)
    next(stream), next(stream)
    ok = stream.session()  # saved without a ring (its stream kept none)
    before = _row(pool, 1)
    other_rc = _rc(window_frames=3)
    with pytest.raises(S.SessionError, match="window_frames"):
        pool.admit_session(Stream(params, CFG, other_rc, _ctx(1), key=jax.random.key(1)).session())
    with pytest.raises(S.SessionError, match="one stream"):
        pool.admit_session(
            Stream(params, CFG, rc, jnp.concatenate([_ctx(1), _ctx(2)]), key=jax.random.key(1)).session()
        )
    noise = jnp.zeros(rc.noise_shape(CFG, 1, 1))
    with pytest.raises(S.SessionError, match="explicit noise"):
        pool.admit_session(Stream(params, CFG, rc, _ctx(1), noise=noise).session())
    with pytest.raises(S.SessionError, match="vae_decoder"):
        pool.admit_session(ok.replace(extras={S.VAE_DECODER: {"first": jnp.ones((), bool)}}))
    with pytest.raises(TypeError, match="Session"):
        pool.admit_session(stream.state)
    _leaves_equal(_row(pool, 1), before, "the free row after refused sessions")
    assert pool.free_rows == [1]
    # a session without its ring joins, but cannot switch until its ring holds what its cache holds
    row = pool.admit_session(ok)
    pool.step()
    with pytest.raises(ValueError, match="lacks chunk"):
        pool.switch_prompt(row, _ctx(7))
    with pytest.raises(RuntimeError, match="occupied"):
        pool.admit_session(ok)
    with pytest.raises(ValueError, match="row 3 holds no stream"):
        pool.switch_prompt(3, _ctx(7))
    with pytest.raises(ValueError, match="switch_prompt takes one stream"):
        pool.switch_prompt(0, jnp.concatenate([_ctx(1), _ctx(2)]))
