"""The DilatedCache contract: against a chronological history, against a transcription of the seed's upsert, and
attention over it (every backend, physical order) against dense attention over the history."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.attention import dense_attention
from jaxkv.cache.dilated import DilatedCache, DilatedSpec
from tests.helpers.dilated_reference import DilatedHistory, SeedUpsert

HEADS, HEAD_DIM = 2, 3

# (tokens_per_frame, chunk_frames, dilation, buckets): d = 1, c < d, c = d, c > d, c % d != 0, minimal buckets.
LAYOUTS = [
    (1, 1, 1, 1),
    (1, 1, 1, 3),
    (2, 1, 3, 2),
    (1, 3, 3, 2),
    (1, 3, 2, 2),
    (2, 3, 2, 4),
    (1, 2, 4, 3),
    (1, 4, 1, 6),
    (3, 2, 2, 1),
    (1, 5, 2, 3),
]


@functools.lru_cache(maxsize=None)
def _ops(spec, batch):
    del spec, batch  # part of the cache key only
    return dict(
        begin=jax.jit(lambda c, a: c.begin_chunk(active=a)),
        begin_all=jax.jit(lambda c: c.begin_chunk()),
        write=jax.jit(lambda c, k, v, a: c.write(k, v, active=a)),
        write_all=jax.jit(lambda c, k, v: c.write(k, v)),
        scratch=jax.jit(lambda c, k, v, a: c.write(k, v, active=a, commit=False)),
        scratch_all=jax.jit(lambda c, k, v: c.write(k, v, commit=False)),
        reset=jax.jit(lambda c, s: c.reset(s)),
        chrono=jax.jit(lambda c: c.chronological()),
    )


def _assert_matches(cache, ref, chrono):
    k, v, pos = (np.asarray(x) for x in chrono(cache))
    for b in range(cache.batch):
        rk, rv, rpos = ref.logical(b)
        n = len(rpos)
        np.testing.assert_array_equal(pos[b, :n], rpos, err_msg=f"session {b} positions")
        assert np.all(pos[b, n:] < 0), f"session {b}: extra visible slots {pos[b]}"
        if n:
            np.testing.assert_array_equal(k[b, :n], rk, err_msg=f"session {b} keys")
            np.testing.assert_array_equal(v[b, :n], rv, err_msg=f"session {b} values")


def _run_sequence(layout, batch, ops, dtype=jnp.float32, check=True, head_dim=HEAD_DIM, on_step=None):
    spec = DilatedSpec(*layout)
    f = _ops(spec, batch)
    cache = DilatedCache.init(spec, batch, HEADS, head_dim, dtype=dtype)
    ref = DilatedHistory(*layout, batch)
    rng = np.random.default_rng(len(ops))
    for op, mask in ops:
        if op == "begin":
            cache = f["begin_all"](cache) if mask is None else f["begin"](cache, jnp.asarray(mask))
            ref.begin(mask)
        elif op in ("write", "scratch"):
            k = rng.standard_normal((batch, spec.chunk, HEADS, head_dim)).astype(dtype)
            v = rng.standard_normal((batch, spec.chunk, HEADS, head_dim)).astype(dtype)
            if mask is None:
                cache = f[op + "_all"](cache, jnp.asarray(k), jnp.asarray(v))
            else:
                cache = f[op](cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
            ref.write(k, v, mask, commit=op == "write")
        else:
            cache = f["reset"](cache, jnp.asarray(mask)) if mask is not None else cache.reset()
            ref.reset(mask)
        if check:
            _assert_matches(cache, ref, f["chrono"])
        if on_step is not None:
            on_step(cache, ref)
    return cache, ref


def _random_ops(rng, batch, n):
    ops = [("begin", None)]
    for _ in range(n):
        r = rng.random()
        mask = None if rng.random() < 0.5 else rng.random(batch) < 0.7
        if r < 0.35:
            ops.append(("begin", mask))
        elif r < 0.7:
            ops.append(("write", mask))
        elif r < 0.95:
            ops.append(("scratch", mask))
        else:
            ops.append(("reset", mask))
    return ops


# ------------------------------------------------------------------ the contract: thousands of checked transitions


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.slow
def test_random_sequences_match_chronological_history(layout):
    rng = np.random.default_rng(sum(layout) * 7919 + layout[2])
    for batch in (1, 3):
        _run_sequence(layout, batch, _random_ops(rng, batch, 100))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["begin", "begin", "write", "write", "scratch", "reset"]),
            st.one_of(st.none(), st.lists(st.booleans(), min_size=2, max_size=2)),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_property_any_sequence_matches_history(layout, ops):
    _run_sequence(layout, 2, ops)


# ------------------------------------------------------------------ the seed's upsert, frame by frame


def _frames_seen(cache, tokens_per_frame):
    pos = np.asarray(cache.positions[0])
    return sorted(set((pos[pos >= 0] // tokens_per_frame).tolist()))


@pytest.mark.parametrize("dilation, buckets", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 1), (3, 5)])
def test_one_frame_chunks_see_what_the_seed_upsert_sees(dilation, buckets):
    """chunk_frames = 1 is the seed's unit. With every kept frame committed at least once (the seed's rollout does
    that on its context pass), the visible frames equal the seed's visibility row at every upsert."""
    rng = np.random.default_rng(dilation * 31 + buckets)
    t = 2
    spec = DilatedSpec(t, 1, dilation, buckets)
    seed = SeedUpsert(dilation, buckets)
    cache = DilatedCache.init(spec, 1, 1, 1)
    for frame in range(12 * dilation * buckets + 5):
        flags = list(rng.random(rng.integers(1, 4)) < 0.5)
        if frame % dilation == 0 and not any(flags):
            flags[rng.integers(len(flags))] = True
        cache = cache.begin_chunk()
        for commit in flags:
            x = jnp.full((1, t, 1, 1), float(frame))
            cache = cache.write(x, x, commit=bool(commit))
            assert _frames_seen(cache, t) == seed.upsert(frame, bool(commit)), (frame, flags)


def test_kept_frames_sit_at_the_seed_slot():
    """bucket = (f + d - 1) // d, slot = bucket % buckets: read which ring slot holds each kept frame."""
    spec = DilatedSpec(tokens_per_frame=2, chunk_frames=3, dilation=2, buckets=4)
    cache = DilatedCache.init(spec, 1, 1, 1)
    for _ in range(9):
        cache = cache.begin_chunk()
        cache = cache.write(jnp.zeros((1, 6, 1, 1)), jnp.zeros((1, 6, 1, 1)))
    cache = cache.begin_chunk()  # publishes chunk 8's frames 24, 26
    pos = np.asarray(cache.positions[0])
    for slot in range(spec.buckets):
        frame_tokens = pos[slot * 2 : (slot + 1) * 2]
        if frame_tokens[0] < 0:
            continue
        frame = frame_tokens[0] // 2
        np.testing.assert_array_equal(frame_tokens, [2 * frame, 2 * frame + 1])
        assert frame % 2 == 0 and ((frame + 1) // 2) % 4 == slot, (slot, frame)
    # Chunk 9 = frames 27, 28, 29 keeps 28 (bucket 14, slot 2): reserved, so slot 2 is empty; the rest hold the
    # three newest kept frames before it.
    assert _frames_seen(cache, 2) == [22, 24, 26]
    assert np.all(pos[4:6] < 0)


def test_never_committed_kept_frame_differs_from_the_seed_as_documented():
    """Reservation evicts here; the seed only hides the slot while the frame is current."""
    spec = DilatedSpec(1, 1, 2, 2)  # kept frames 0, 2, 4, ...; two buckets
    seed = SeedUpsert(2, 2)
    cache = DilatedCache.init(spec, 1, 1, 1)
    seen = []
    for frame, commit in [(0, True), (1, True), (2, True), (3, True), (4, False), (5, True)]:
        cache = cache.begin_chunk().write(jnp.ones((1, 1, 1, 1)), jnp.ones((1, 1, 1, 1)), commit=commit)
        seen.append((_frames_seen(cache, 1), seed.upsert(frame, commit)))
    assert seen[4] == ([2, 4], [2, 4])  # frame 4 uncommitted: both hide frame 0's slot
    assert seen[5] == ([2, 5], [0, 2, 5])  # the seed shows frame 0 again, 5 frames behind (horizon 4)


# ------------------------------------------------------------------ the named rules


def _write(cache, value, commit=True, active=None):
    x = jnp.full((cache.batch, cache.spec.chunk, cache.heads, cache.head_dim), float(value), cache.dtype)
    return cache.write(x, -x, commit=commit, active=active)


def test_uncommitted_writes_are_visible_to_their_chunk_only():
    spec = DilatedSpec(tokens_per_frame=1, chunk_frames=2, dilation=2, buckets=2)  # keeps the first frame of a chunk
    cache = DilatedCache.init(spec, 1, 1, 1).begin_chunk()
    cache = _write(cache, 1.0, commit=False)
    assert _frames_seen(cache, 1) == [0, 1]  # the chunk sees itself (scratch)
    cache = cache.begin_chunk()
    assert _frames_seen(cache, 1) == []  # nothing of chunk 0 was committed: gone
    cache = _write(cache, 2.0, commit=True)
    cache = cache.begin_chunk()
    assert _frames_seen(cache, 1) == [2]  # chunk 1's kept frame 2; frame 3 was scratch only
    np.testing.assert_array_equal(cache.chronological()[0][0, :1, 0, 0], [2.0])


def test_commit_then_uncommitted_write_keeps_the_commit_for_later_chunks():
    spec = DilatedSpec(1, 1, 1, 3)
    cache = DilatedCache.init(spec, 1, 1, 1).begin_chunk()
    cache = _write(cache, 5.0, commit=True)
    cache = _write(cache, 6.0, commit=False)
    k, _, pos = cache.chronological()
    assert int(pos[0, 0]) == 0 and float(k[0, 0, 0, 0]) == 6.0  # the chunk sees its latest write, once
    assert int(np.sum(np.asarray(pos[0]) >= 0)) == 1
    k, _, pos = cache.begin_chunk().chronological()
    assert int(pos[0, 0]) == 0 and float(k[0, 0, 0, 0]) == 5.0  # later chunks see the committed one


def test_committing_every_pass_equals_committing_the_last():
    spec = DilatedSpec(2, 3, 2, 3)
    a = DilatedCache.init(spec, 1, 1, 2)
    b = DilatedCache.init(spec, 1, 1, 2)
    for n in range(7):
        a, b = a.begin_chunk(), b.begin_chunk()
        for step in range(4):
            a = _write(a, 10 * n + step, commit=True)
            b = _write(b, 10 * n + step, commit=step == 3)
        for x, y in zip(a.chronological(), b.chronological(), strict=True):
            np.testing.assert_array_equal(x, y)


def test_horizon_and_memory_against_a_dense_window():
    spec = DilatedSpec(tokens_per_frame=4, chunk_frames=3, dilation=3, buckets=5)
    assert spec.horizon_frames == 15 and spec.capacity == (5 + 3) * 4
    cache = DilatedCache.init(spec, 1, 1, 1)
    for n in range(20):
        cache = _write(cache.begin_chunk(), n)
    frames = _frames_seen(cache, 4)
    # Chunk 19 = frames 57..59; kept frames 45, 48, 51, 54 from earlier chunks (57 took the fifth slot, evicting 42).
    assert frames == [45, 48, 51, 54, 57, 58, 59]
    dense = jaxkv.RingCache.init(jaxkv.RingSpec.from_frames(4, 3, spec.horizon_frames), 1, 1, 1)
    assert dense.nbytes > 1.8 * cache.nbytes


def test_inactive_sessions_and_reset():
    spec = DilatedSpec(1, 2, 2, 2)
    cache = DilatedCache.init(spec, 2, 1, 1)
    for n in range(4):
        cache = _write(cache.begin_chunk(), n)
    before = cache
    cache = cache.begin_chunk(active=jnp.array([False, True]))
    cache = _write(cache, 9.0, active=jnp.array([False, True]))
    np.testing.assert_array_equal(cache.positions[0], before.positions[0])
    np.testing.assert_array_equal(cache.k[0], before.k[0])
    np.testing.assert_array_equal(cache.chunk_start, [6, 8])
    cache = cache.reset(jnp.array([True, False]))
    assert np.all(np.asarray(cache.positions[0]) < 0) and int(cache.chunk_start[0]) == -1
    cache = _write(cache.begin_chunk(), 1.0)
    np.testing.assert_array_equal(cache.chunk_positions()[0], [0, 1])
    assert _frames_seen(cache, 1) == [0, 1]


def test_stacked_layers_match_single_layer_caches():
    spec = DilatedSpec(2, 3, 2, 3)
    stacked = DilatedCache.init(spec, 2, 1, 1, layers=3)
    single = DilatedCache.init(spec, 2, 1, 1)
    for n in range(8):
        stacked, single = stacked.begin_chunk(), single.begin_chunk()
        x = jnp.full((2, 6, 1, 1), float(n))
        for layer in range(3):
            stacked = stacked.write(x + layer, x + layer, layer=layer, commit=n % 2 == 0)
        single = single.write(x, x, commit=n % 2 == 0)
    k, _, pos = stacked.chronological()
    k1, _, pos1 = single.chronological()
    np.testing.assert_array_equal(pos, pos1)
    filled = np.asarray(pos) >= 0
    # Chunk 7 (uncommitted) sees its 3 scratch frames and kept frames 18, 20 of chunk 6: 5 frames x 2 tokens x 2.
    assert filled.sum() == 20
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(k[layer])[filled], np.asarray(k1 + layer)[filled])
        np.testing.assert_array_equal(stacked.layer_kv(jnp.int32(layer))[0], stacked.k[layer])


def test_bf16_contract():
    _run_sequence((2, 3, 2, 3), 2, _random_ops(np.random.default_rng(5), 2, 60), dtype=jnp.bfloat16)


# ------------------------------------------------------------------ attention over the cache in physical order


@functools.partial(jax.jit, static_argnames=("mask",))
def _dense(q, k, v, q_pos, kv_pos, mask=()):
    return dense_attention(q, k, v, q_pos, kv_pos, **dict(mask))


def _reference_attention(ref, q, q_pos, capacity, mask):
    """Dense attention over each session's chronological history, padded with empty slots to ``capacity``."""
    b, _, heads, dim = q.shape
    k = np.zeros((b, capacity, heads, dim), np.float32)
    v = np.zeros_like(k)
    pos = np.full((b, capacity), -1, np.int32)
    for i in range(b):
        rk, rv, rpos = ref.logical(i)
        n = len(rpos)
        if n:
            k[i, :n], v[i, :n], pos[i, :n] = rk, rv, rpos
    return _dense(q, jnp.asarray(k), jnp.asarray(v), q_pos, jnp.asarray(pos), mask=tuple(sorted(mask.items())))


def _check_attention(layout, batch, head_dim, n_ops, seed, attend_kwargs, every=5):
    """Along one random sequence, every ``every`` steps: attention over the cache as it lies == dense attention
    over the chronological history, unmasked and chunk-causal."""
    spec = DilatedSpec(*layout)
    q = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, spec.chunk, HEADS, head_dim)), jnp.float32)
    fns = {}
    for mask in ((), (("chunk", spec.chunk),)):
        fns[mask] = jax.jit(
            lambda q, k, v, qp, kp, mask=mask: jaxkv.attend(q, k, v, qp, kp, **attend_kwargs, **dict(mask))
        )
    steps = []

    def on_step(cache, ref):
        steps.append(None)
        if len(steps) % every:
            return
        q_pos = cache.chunk_positions()
        for mask, fn in fns.items():
            got = fn(q, cache.k, cache.v, q_pos, cache.positions)
            want = _reference_attention(ref, q, q_pos, spec.capacity, dict(mask))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"step {len(steps)} mask {mask}")

    ops = _random_ops(np.random.default_rng(seed), batch, n_ops)
    _run_sequence(layout, batch, ops, check=False, head_dim=head_dim, on_step=on_step)
    assert len(steps) >= every


@pytest.mark.parametrize("backend", ["xla_dense", "xla_blockwise"])
@pytest.mark.parametrize("layout", [(4, 3, 2, 4), (8, 2, 3, 3), (3, 3, 1, 5)], ids=str)
def test_attend_in_physical_order_equals_dense_over_history(layout, backend):
    _check_attention(layout, 2, 8, 40, seed=sum(layout), attend_kwargs=dict(backend=backend, block_k=8))


@pytest.mark.slow
def test_pallas_interpret_over_dilated_cache_equals_dense_over_history():
    _check_attention(
        (8, 3, 2, 4),
        2,
        16,
        24,
        seed=3,
        every=8,
        attend_kwargs=dict(
            backend="pallas", interpret=True, block_sizes=jaxkv.attention.BlockSizes(block_q=16, block_k=16)
        ),
    )


# ------------------------------------------------------------------ compilation and in-place writes


def test_jit_loop_over_many_wraps_compiles_once():
    from jaxkv.compilation import count_compiles

    spec = DilatedSpec(2, 3, 2, 3)
    begin = jax.jit(lambda c: c.begin_chunk(), donate_argnums=0)
    write = jax.jit(lambda c, k, v: c.write(k, v), donate_argnums=0)
    cache = DilatedCache.init(spec, 2, 1, 2)
    x = jnp.zeros((2, 6, 1, 2), jnp.float32)
    cache = write(begin(cache), x, x)  # compile
    with count_compiles(begin) as new_begin, count_compiles(write) as new_write:
        for n in range(1, 40):  # 40 chunks = 120 frames = 60 kept frames: twenty wraps of 3 buckets
            x = jnp.full((2, 6, 1, 2), float(n), jnp.float32)
            cache = write(begin(cache), x, x)
        assert new_begin() == 0 and new_write() == 0
    # Chunk 39 = frames 117..119 (kept 118): kept frames 114, 116 of earlier chunks + its own scratch.
    assert _frames_seen(cache, 2) == [114, 116, 117, 118, 119]


def test_donated_scanned_multilayer_write_is_in_place():
    """Temp memory of a 4-layer scanned commit write stays O(chunk), whatever the number of buckets."""
    tokens, chunk_frames, heads, dim, layers = 64, 2, 4, 32, 4
    temps, nbytes = [], []
    for buckets in (4, 64):
        spec = DilatedSpec(tokens, chunk_frames, 2, buckets)
        cache = DilatedCache.init(spec, 1, heads, dim, layers=layers).begin_chunk()
        k = jnp.ones((1, spec.chunk, heads, dim))

        def fn(cache, k, v):
            def body(c, layer):
                return c.write(k, v, layer=layer), None

            return jax.lax.scan(body, cache, jnp.arange(layers, dtype=jnp.int32))[0]

        temp = jax.jit(fn, donate_argnums=0).lower(cache, k, k).compile().memory_analysis().temp_size_in_bytes
        chunk_bytes = spec.chunk * heads * dim * 4
        assert temp <= 2 * chunk_bytes + 4096, (buckets, temp, chunk_bytes)
        temps.append(temp)
        nbytes.append(cache.nbytes)
    assert temps[1] < nbytes[1] / 32, (temps, nbytes)
    assert temps[0] == temps[1], temps


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 3, 2, 2), "tokens_per_frame must be >= 1"),
        ((4, 0, 2, 2), "chunk_frames must be >= 1"),
        ((4, 3, 0, 2), "dilation must be >= 1"),
        ((4, 3, 2, 0), "buckets must be >= 1"),
        ((4, 3, 2, 1), r"buckets \(1\) must be >= ceil\(chunk_frames / dilation\) = 2"),
        ((4, 3, 1, 2), r"= 3"),
        ((4, 3.0, 2, 2), "chunk_frames must be an int"),
        ((4, 3, True, 2), "dilation must be an int"),
    ],
)
def test_invalid_specs_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        DilatedSpec(*args)


def test_bad_writes_are_rejected_before_any_state_changes():
    spec = DilatedSpec(2, 2, 2, 2)
    cache = DilatedCache.init(spec, 2, 3, 4)
    good = jnp.zeros((2, 4, 3, 4))
    with pytest.raises(ValueError, match="begin_chunk"):
        cache.write(good, good)
    cache = cache.begin_chunk()
    with pytest.raises(ValueError, match=r"\[batch, chunk, heads, head_dim\] = \[2, 4, 3, 4\]"):
        cache.write(jnp.zeros((2, 2, 3, 4)), good)
    with pytest.raises(ValueError, match="dtype float32"):
        cache.write(good.astype(jnp.bfloat16), good)
    with pytest.raises(ValueError, match="commit must be a Python bool"):
        cache.write(good, good, commit=jnp.array(True))
    with pytest.raises(ValueError, match="not stacked"):
        cache.write(good, good, layer=0)
    with pytest.raises(ValueError, match="bool array of shape"):
        cache.begin_chunk(active=jnp.array([1, 0]))
    stacked = DilatedCache.init(spec, 2, 3, 4, layers=2).begin_chunk()
    with pytest.raises(ValueError, match="out of range"):
        stacked.write(good, good, layer=2)
    with pytest.raises(ValueError, match="pass layer="):
        stacked.write(good, good)
    with pytest.raises(TypeError, match="DilatedSpec"):
        DilatedCache.init(jaxkv.RingSpec(chunk=2, window=4), 1, 1, 1)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        DilatedCache.init(spec, 0, 1, 1)
    with pytest.raises(NotImplementedError, match="no single slot"):
        cache.slot_of_chunk(jnp.zeros((2,), jnp.int32))


# ------------------------------------------------------------------ drop-in use by the Wan model's forward_chunk


@pytest.mark.slow
def test_wan_forward_chunk_on_a_dilation_1_cache_equals_the_ring_window():
    """DilatedCache(d=1, buckets=W) holds the same W frames as RingCache(window=W): history W - c frames in the
    ring plus the chunk in the scratch. forward_chunk (layer scan, in-place writes) takes either unchanged."""
    from jaxkv.models import wan

    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))
    cross = wan.cross_kv(params, config, jax.random.normal(jax.random.key(1), (1, config.text_len, config.text_dim)))
    hw, c, window = (4, 4), 3, 6
    t = config.tokens_per_frame(*hw)
    ring = wan.init_cache(config, jaxkv.RingSpec.from_frames(t, c, window), 1)
    dilated = DilatedCache.init(
        DilatedSpec(t, c, 1, window), 1, config.num_heads, config.head_dim, layers=config.num_layers
    )
    step = jax.jit(lambda cache, x, ts: wan.forward_chunk(params, config, cache.begin_chunk(), cross, x, ts))
    again = jax.jit(lambda cache, x, ts: wan.forward_chunk(params, config, cache, cross, x, ts))
    rng = np.random.default_rng(0)
    for n in range(6):  # past two wraps of the ring
        x = jnp.asarray(rng.standard_normal((1, c, *hw, config.in_dim)), jnp.float32)
        ts = jnp.full((1,), 700.0)
        out_r, ring = step(ring, x, ts)
        out_d, dilated = step(dilated, x, ts)
        np.testing.assert_allclose(out_d, out_r, rtol=1e-5, atol=1e-5, err_msg=f"chunk {n}, first pass")
        out_r, ring = again(ring, x * 0.5, jnp.zeros((1,)))  # the context pass: last write wins
        out_d, dilated = again(dilated, x * 0.5, jnp.zeros((1,)))
        np.testing.assert_allclose(out_d, out_r, rtol=1e-5, atol=1e-5, err_msg=f"chunk {n}, context pass")
    assert step._cache_size() == 2 and again._cache_size() == 2  # one program per cache type
    _, _, pos = ring.chronological()
    assert _frames_seen(dilated, t) == sorted(set((np.asarray(pos[0])[np.asarray(pos[0]) >= 0] // t).tolist()))


@pytest.mark.parametrize("commit", [False, True])
@pytest.mark.parametrize("layer", [3, -1])
def test_a_traced_out_of_range_layer_writes_nothing(layer, commit):
    """As for the ring cache: a ValueError outside jit; under jit neither the scratch nor the ring (keys, values,
    positions) of any layer changes, and checkify names the layer."""
    from jax.experimental import checkify

    spec = DilatedSpec(2, 3, 2, 3)
    cache = DilatedCache.init(spec, 2, 1, 1, layers=3)
    for n in range(3):
        cache = cache.begin_chunk()
        for i in range(3):
            x = jnp.full((2, 6, 1, 1), float(10 * n + i + 1))
            cache = cache.write(x, x, layer=i)
    cache = cache.begin_chunk()
    x = jnp.full((2, 6, 1, 1), 99.0)
    with pytest.raises(ValueError, match=rf"layer {layer} out of range"):
        cache.write(x, x, layer=layer, commit=commit)
    write = jax.jit(lambda c, layer: c.write(x, x, layer=layer, commit=commit))
    out = write(cache, jnp.int32(layer))
    for name in ("k", "v", "positions", "chunk_start"):
        np.testing.assert_array_equal(getattr(out, name), getattr(cache, name), err_msg=name)
    assert float(jnp.max(write(cache, jnp.int32(2)).k[2])) == 99.0  # in range: written
    err, _ = jax.jit(checkify.checkify(lambda c, layer: c.write(x, x, layer=layer, commit=commit)))(
        cache, jnp.int32(layer)
    )
    assert err.get() is not None and f"layer {layer} out of range [0, 3)" in err.get()
