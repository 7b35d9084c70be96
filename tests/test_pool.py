"""Many streams in one batch (`jaxkv.pool`): staggered admits and finishes, each stream against its solo run, one
compilation per operation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import pool as P
from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4


def _rc(**kw):  # the settings of tests/test_recache.py
    base = dict(
        chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500), context_noise=20.0)
    )
    base.update(kw)
    return R.RolloutConfig(H, W, **base)


def _ctx(seed):
    return jax.random.normal(jax.random.key(seed), (1, 3, CFG.text_dim))


def _solo(params, rc, seed, num_chunks):
    """The stream alone: batch 1, its own Stream."""
    return [
        np.asarray(x[0])
        for x in Stream(params, CFG, rc, _ctx(seed), num_chunks=num_chunks, key=jax.random.key(100 + seed))
    ]


@pytest.mark.slow
def test_pool_of_four_rows_matches_each_stream_run_alone_with_one_compilation():
    rc = _rc()
    params = wan.init_params(CFG, jax.random.key(0))
    pool = P.StreamPool(params, CFG, rc, rows=4)
    got: dict[int, list] = {}  # stream id -> its chunks
    where: dict[int, int] = {}  # stream id -> row
    before = {f: compile_count(getattr(P, f)) for f in ("jit_admit", "jit_step", "jit_finish")}

    def admit(stream):
        where[stream] = pool.admit(_ctx(stream), jax.random.key(100 + stream))
        got[stream] = []

    def step():
        out = pool.step()
        assert sorted(out) == sorted(where.values())
        for stream, row in where.items():
            got[stream].append(np.asarray(out[row]))

    def finish(stream):
        pool.finish(where.pop(stream))

    admit(1), admit(2)
    step(), step()
    admit(3)  # joins at chunk 0 while 1 and 2 are at chunk 2
    step()
    finish(1)  # row 0 frees
    admit(4)  # reuses row 0: must start clean
    assert where[4] == 0
    admit(5)
    for _ in range(3):  # 2 and 3 wrap their windows; 4 and 5 start
        step()
    finish(2)
    step()
    with pytest.raises(RuntimeError, match="occupied"):
        admit(6), admit(7)  # 6 takes row 1; 7 finds no free row
    assert len(pool.free_rows) == 0
    step()
    lengths = {1: 3, 2: 6, 3: 6, 4: 5, 5: 5, 6: 1}
    assert {s: len(c) for s, c in got.items() if s != 7} == lengths
    for stream, n in lengths.items():
        want = _solo(params, rc, stream, n)
        for i, (g, w) in enumerate(zip(got[stream], want, strict=True)):
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"stream {stream}, chunk {i}")
    for f in ("jit_admit", "jit_step", "jit_finish"):
        assert compile_count(getattr(P, f)) - before[f] == 1, f  # row numbers and positions are traced


def test_pool_refuses_bad_rows_and_contexts():
    rc = _rc()
    params = wan.init_params(CFG, jax.random.key(0))
    pool = P.StreamPool(params, CFG, rc, rows=2)
    with pytest.raises(ValueError, match="no stream in the pool"):
        pool.step()
    with pytest.raises(ValueError, match="row 1 holds no stream"):
        pool.finish(1)
    with pytest.raises(ValueError, match="row 5 holds no stream"):
        pool.finish(5)
    with pytest.raises(ValueError, match="admit takes one stream"):
        pool.admit(jnp.zeros((2, 3, CFG.text_dim)), jax.random.key(0))
    assert pool.free_rows == [0, 1]


@pytest.mark.slow  # compiles the tiny preset's step, switch and pool step
def test_docs_switching_and_pool_example_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "streaming.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "StreamPool" in b)
    scope: dict = {}
    exec(compile(block, "docs/streaming.md", "exec"), scope)
    assert len(scope["chunks"]) == 8 and all(bool(np.isfinite(c).all()) for c in scope["chunks"])
    assert sorted(scope["out"]) == [scope["a"], scope["b"]] and scope["out"][scope["a"]].shape == (3, 16, 16, 16)
    assert sorted(scope["alone"]) == [scope["a"]]  # the step of row a alone returns row a's chunk only
    assert scope["pool"].free_rows == [0, 2, 3]
