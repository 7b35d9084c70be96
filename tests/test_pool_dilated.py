"""Pools on dilated and mixed dense / dilated caches (`RolloutConfig(dilated_every=k)`): each row equals its solo
`Stream` bit for bit through staggered admits and finishes, a reused row starts clean on its dilated layers too,
a row switches its prompt as its solo `Stream` does, and rows go out as sessions and come back."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import pool as P
from jaxkv.models import wan
from jaxkv.stream import Stream
from tests.test_pool import CFG, _ctx, _rc


def _dilated_rc(every):
    # k = 2: layer 1 dilated (kept frames 0, 2, 4, ... in 2 buckets), layer 0 a 1-sink + 2-frame window;
    # k = 1: both layers dilated (no sink)
    return _rc(sink_frames=0 if every == 1 else 1, dilated_every=every, dilation=2, buckets=2)


def _solo(params, rc, seed, num_chunks):
    return [
        np.asarray(x[0])
        for x in Stream(params, CFG, rc, _ctx(seed), num_chunks=num_chunks, key=jax.random.key(100 + seed))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_dilated_pool_rows_equal_their_solo_streams_and_a_reused_row_starts_clean(every):
    rc = _dilated_rc(every)
    params = wan.init_params(CFG, jax.random.key(0))
    pool = P.StreamPool(params, CFG, rc, rows=2)
    got: dict[int, list] = {}
    where: dict[int, int] = {}

    def admit(stream):
        where[stream] = pool.admit(_ctx(stream), jax.random.key(100 + stream))
        got[stream] = []

    def step(n=1):
        for _ in range(n):
            out = pool.step()
            for stream, row in where.items():
                got[stream].append(np.asarray(out[row]))

    admit(1)
    step(5)  # stream 1's dilated layers keep frames 0, 2, 4 (two buckets: 2 and 4 by now)
    admit(2)
    step(2)
    pool.finish(where.pop(1))
    admit(3)  # reuses row 0, whose dilated kept frames must be gone
    assert where[3] == 0
    step(4)
    lengths = {1: 7, 2: 6, 3: 4}
    assert {s: len(c) for s, c in got.items()} == lengths
    for stream, n in lengths.items():
        for i, (g, w) in enumerate(zip(got[stream], _solo(params, rc, stream, n), strict=True)):
            np.testing.assert_array_equal(g, w, err_msg=f"stream {stream}, chunk {i}")
    # the dilated layers reach past what a dense layer of the same window sees: the comparison covers them
    dense = _solo(params, _rc(sink_frames=0 if every == 1 else 1), 3, 4)
    assert np.abs(got[3][3] - dense[3]).max() > 1e-3

    # a row switches its prompt as its solo Stream does: the dilated layers are replayed from the row's ring
    pool.switch_prompt(where[3], _ctx(7))
    switched = [np.asarray(pool.step()[where[3]]) for _ in range(2)]
    solo = Stream(params, CFG, rc, _ctx(3), key=jax.random.key(103))
    want = []
    for i in range(6):
        if i == 4:
            solo.switch_prompt(_ctx(7))
        want.append(np.asarray(next(solo)[0]))
    for i in range(2):
        np.testing.assert_array_equal(switched[i], want[4 + i], err_msg=f"switched row, chunk {4 + i}")
    assert np.abs(switched[0] - _solo(params, rc, 3, 5)[4]).max() > 1e-3  # the switch changed what follows

    # its rows go out as sessions (mixed caches included) and come back bit for bit
    session = pool.session(where[3])
    tail = [np.asarray(x[0]) for x in Stream.from_session(params, CFG, rc, session.fork(), num_chunks=2)]
    pool.finish(where[2])
    row = pool.admit_session(session)
    for i in range(2):
        out = pool.step()
        np.testing.assert_array_equal(np.asarray(out[row]), tail[i], err_msg=f"admitted session, chunk {i}")
        np.testing.assert_array_equal(np.asarray(out[where[3]]), tail[i], err_msg=f"the row it left, chunk {i}")
