"""The XLA:CPU attention path (`jaxkv.attention.xla_cpu`): exact against the dense reference and a float64 NumPy
history on every mask kind and ring layout, its per-block branch choice (skip / mask / no mask) sound against the
brute-force mask, and `attend(backend="auto")` choosing it on CPU."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import CacheRope, MaskSpec, attend, dense_attention, xla_cpu
from jaxkv.attention.dispatch import resolve_backend
from jaxkv.attention.xla_cpu import HIDDEN, MASKED, OPEN, key_blocks
from jaxkv.compilation import count_compiles
from tests.helpers.attention_cases import (
    MASKS,
    brute_visible,
    make_case,
    numpy_attention,
    permuted,
    physical,
    unwrapped_positions,
)

_STATIC = ("causal", "chunk", "window", "sink", "scale", "rope", "block_k", "return_lse")
# Jitted once per static setting: eager dispatch of the unrolled blocks would dominate the test time.
xla_cpu_attention = jax.jit(xla_cpu.xla_cpu_attention, static_argnames=_STATIC)
dense_attention = jax.jit(dense_attention, static_argnames=tuple(n for n in _STATIC if n != "block_k"))
block_branch = jax.jit(xla_cpu.block_branch, static_argnums=2)


def branches(q_positions, kv_positions, spec: MaskSpec, block_k: int):
    """The branch `xla_cpu_attention` takes for each of its key blocks."""
    unit = spec.chunk if spec.chunk is not None and kv_positions.shape[1] % spec.chunk == 0 else 1
    return [
        int(block_branch(q_positions, kv_positions[:, a:b], spec))
        for a, b in key_blocks(kv_positions.shape[1], block_k, unit)
    ]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("block_k", [4, 6, 512])
def test_matches_dense_and_numpy_over_layouts_and_masks(mask, block_k):
    # Session 0 has wrapped its window (8 chunks in a 1 + 3 chunk ring), session 1 is partially filled (2 chunks).
    case = make_case(0, written=(8, 2))
    seen = set()
    for name, pos in [
        ("ring", case["pos"]),
        ("unwrapped", np.stack([unwrapped_positions(p) for p in case["pos"]])),
        ("permuted", permuted(case["pos"], 5)),
    ]:
        args = physical(case, pos)
        got = np.asarray(xla_cpu_attention(*args, block_k=block_k, **mask))
        np.testing.assert_allclose(got, np.asarray(dense_attention(*args, **mask)), atol=2e-6, err_msg=name)
        np.testing.assert_allclose(got, numpy_attention(*args, **mask), atol=2e-5, err_msg=name)
        seen.update(branches(args[3], args[4], MaskSpec(**mask), block_k))
    assert MASKED in seen  # the two sessions differ, so some block always needs the mask
    if block_k == 4 and mask.get("window") == 8 and not mask.get("causal"):
        assert HIDDEN in seen  # blocks of one chunk that every query's window has passed are skipped


def test_every_branch_is_exact():
    # One session, blocks of one chunk: empty blocks (HIDDEN), history (OPEN) and the query's own chunk under a
    # causal mask (MASKED); each must agree with the dense reference on its own.
    case = make_case(1, batch=1, sink_chunks=0, window_chunks=6, written=(4,))
    args = physical(case, case["pos"])
    spec = dict(causal=True, chunk=4)
    assert branches(args[3], args[4], MaskSpec(**spec), 4) == [OPEN, OPEN, OPEN, MASKED, HIDDEN, HIDDEN]
    np.testing.assert_allclose(xla_cpu_attention(*args, block_k=4, **spec), dense_attention(*args, **spec), atol=2e-6)
    assert branches(args[3], args[4], MaskSpec(chunk=4), 4) == [OPEN] * 4 + [HIDDEN] * 2  # streaming: no mask


def test_block_branch_is_sound_against_brute_force():
    # OPEN must mean every pair visible and HIDDEN no pair visible, for random blocks, queries and masks.
    rng = np.random.default_rng(2)
    specs = [MaskSpec(**m) for m in MASKS] + [MaskSpec(window=5), MaskSpec(causal=True, window=3, sink=2)]
    counts = {HIDDEN: 0, MASKED: 0, OPEN: 0}
    for spec, trial in itertools.product(specs, range(40)):
        q0 = int(rng.integers(0, 30))
        qp = np.arange(q0, q0 + 3)[None]  # fixed shapes: one compilation per spec
        kp = rng.integers(-3, 36, size=(1, 5))
        if trial % 3 == 0:
            kp = np.maximum(kp, 0) % (q0 + 1)  # histories at or before the queries: the streaming case
        elif trial % 3 == 1:
            kp = np.maximum(kp, 0)  # no empty slot
        branch = int(block_branch(jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32), spec))
        m = brute_visible(qp[0], kp[0], causal=spec.causal, chunk=spec.chunk, window=spec.window, sink=spec.sink)
        if branch == OPEN:
            assert m.all(), (spec, qp, kp)
        if branch == HIDDEN:
            assert not m.any(), (spec, qp, kp)
        counts[branch] += 1
    assert min(counts.values()) > 20, counts  # every branch was exercised


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 1), (4, 4), (6, 2)])
def test_gqa_mqa_and_sink_window(q_heads, kv_heads):
    case = make_case(3, q_heads=q_heads, kv_heads=kv_heads, written=(9, 3))
    args = physical(case, case["pos"])
    mask = dict(chunk=4, window=12, sink=4)
    np.testing.assert_allclose(xla_cpu_attention(*args, block_k=8, **mask), numpy_attention(*args, **mask), atol=2e-5)


def test_empty_cache_and_unseeing_queries_give_zeros_and_minus_inf_lse():
    case = make_case(4, written=(3, 1))
    q, k, v, qp, pos = physical(case, case["pos"])
    empty = jnp.full_like(pos, -1)
    out, lse = xla_cpu_attention(q, k, v, qp, empty, chunk=4, block_k=4, return_lse=True)
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(np.isneginf(lse))
    # causal with a window of 1: each query sees exactly its own key (blocks mixing visible and hidden pairs).
    got, got_lse = xla_cpu_attention(q, k, v, qp, pos, causal=True, window=1, block_k=4, return_lse=True)
    want, want_lse = dense_attention(q, k, v, qp, pos, causal=True, window=1, return_lse=True)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-6)


def test_lse_matches_dense():
    case = make_case(5, written=(7, 2))
    args = physical(case, case["pos"])
    mask = dict(chunk=4, window=8, sink=4)
    _, got = xla_cpu_attention(*args, block_k=4, return_lse=True, **mask)
    _, want = dense_attention(*args, return_lse=True, **mask)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_bfloat16_inputs_accumulate_in_float32():
    case = make_case(6, dtype=jnp.bfloat16, written=(6, 4))
    args = physical(case, case["pos"])
    got = xla_cpu_attention(*args, chunk=4, block_k=8)
    assert got.dtype == jnp.bfloat16
    want = dense_attention(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args), chunk=4)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)


def test_cache_relative_rope_matches_dense():
    case = make_case(7, written=(8, 3))
    args = physical(case, case["pos"])
    rope = CacheRope()
    got = xla_cpu_attention(*args, chunk=4, window=8, sink=4, rope=rope, block_k=8)
    want = dense_attention(*args, chunk=4, window=8, sink=4, rope=rope)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_gradients_match_dense():
    case = make_case(8, written=(6, 2))
    q, k, v, qp, pos = physical(case, case["pos"])
    w = jnp.asarray(np.random.default_rng(0).normal(size=q.shape), jnp.float32)
    loss = lambda fn: lambda q, k, v: jnp.sum(w * fn(q, k, v, qp, pos, causal=True, chunk=4))
    got = jax.jit(jax.grad(loss(functools.partial(xla_cpu.xla_cpu_attention, block_k=4)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(jaxkv.attention.dense_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_key_blocks_cover_the_keys_on_chunk_boundaries():
    assert key_blocks(2730, 1560, 390) == [(0, 1560), (1560, 2730)]
    assert key_blocks(780, 1560, 390) == [(0, 780)]
    assert key_blocks(10, 4, 1) == [(0, 4), (4, 8), (8, 10)]
    assert key_blocks(12, 2, 4) == [(0, 4), (4, 8), (8, 12)]  # never below one chunk
    assert xla_cpu.blocks_for(5460, 390) == 4


def test_rejects_bad_block_k():
    case = make_case(9)
    args = physical(case, case["pos"])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_k"):
            xla_cpu.xla_cpu_attention(*args, block_k=bad)


def test_auto_chooses_it_on_cpu_and_attend_runs_it():
    kw = dict(head_dim=128, dtypes=(jnp.float32,) * 3, rope=None, logits=10)
    assert resolve_backend("auto", platform="cpu", **kw) == "xla_cpu"
    assert resolve_backend("auto", platform="cpu", **{**kw, "logits": 1 << 30}) == "xla_cpu"
    case = make_case(10, written=(8, 3))
    args = physical(case, case["pos"])
    mask = dict(chunk=4, window=8, sink=4)
    got = attend(*args, backend="xla_cpu", **mask)
    np.testing.assert_array_equal(got, xla_cpu_attention(*args, **mask))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(attend(*args, backend="auto", **mask), got)


@pytest.mark.slow
def test_ring_cache_stream_matches_history_in_one_compilation():
    spec = jaxkv.RingSpec(chunk=4, window=12, sink=4)
    heads, d = 2, 8
    cache = jaxkv.RingCache.init(spec, batch=2, heads=heads, head_dim=d)
    rng = np.random.default_rng(11)
    hist_k, hist_v = [], []
    step = jax.jit(lambda c, k, v: c.begin_chunk().write(k, v))
    run = jax.jit(functools.partial(xla_cpu.xla_cpu_attention, chunk=4, window=16, sink=4, block_k=4))
    with count_compiles(run) as compiles:
        for n in range(10):  # the window wraps twice
            k, v, q = (jnp.asarray(rng.normal(size=(2, 4, heads, d)), jnp.float32) for _ in range(3))
            hist_k.append(k)
            hist_v.append(v)
            cache = step(cache, k, v)
            qp = cache.chunk_positions()
            got = run(q, cache.k, cache.v, qp, cache.positions)
            hk, hv = jnp.concatenate(hist_k, 1), jnp.concatenate(hist_v, 1)
            hpos = jnp.broadcast_to(jnp.arange(hk.shape[1], dtype=jnp.int32), (2, hk.shape[1]))
            want = dense_attention(q, hk, hv, qp, hpos, chunk=4, window=12, sink=4)
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"chunk {n}")
            if n >= 3:  # full: the steady state reads every block without a mask
                assert branches(qp, cache.positions, MaskSpec(chunk=4, window=16, sink=4), 4) == [OPEN] * 4
        assert compiles() == 1
