"""The cache contract: RingCache and RollingCache against an independent chronological history."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.attention import dense_attention
from jaxkv.compilation import compile_count
from tests.helpers.cache_reference import ReferenceHistory

POLICIES = [jaxkv.RingCache, jaxkv.RollingCache]
HEADS, HEAD_DIM = 2, 3


# ------------------------------------------------------------------ jitted transitions (one compile per layout)


@functools.lru_cache(maxsize=None)
def _ops(cls, spec, batch, dtype):
    del cls, spec, batch, dtype  # part of the cache key only
    begin = jax.jit(lambda c, a: c.begin_chunk(active=a))
    begin_all = jax.jit(lambda c: c.begin_chunk())
    write = jax.jit(lambda c, k, v, a: c.write(k, v, active=a))
    write_all = jax.jit(lambda c, k, v: c.write(k, v))
    reset = jax.jit(lambda c, s: c.reset(s))
    chrono = jax.jit(lambda c: c.chronological())
    return begin, begin_all, write, write_all, reset, chrono


def _assert_matches(cache, ref, chrono):
    k, v, pos = (np.asarray(x) for x in chrono(cache))
    for b in range(cache.batch):
        rk, rv, rpos = ref.logical(b)
        n = len(rpos)
        np.testing.assert_array_equal(pos[b, :n], rpos, err_msg=f"session {b} positions")
        assert np.all(pos[b, n:] < 0), f"session {b}: extra filled slots {pos[b]}"
        if n:
            # Bit-identical: the cache only moves bytes.
            np.testing.assert_array_equal(k[b, :n], rk, err_msg=f"session {b} keys")
            np.testing.assert_array_equal(v[b, :n], rv, err_msg=f"session {b} values")


def _run_sequence(cls, chunk, window_chunks, sink_chunks, batch, ops, dtype=jnp.float32):
    spec = jaxkv.RingSpec(chunk=chunk, window=window_chunks * chunk, sink=sink_chunks * chunk)
    begin, begin_all, write, write_all, reset, chrono = _ops(cls, spec, batch, dtype)
    cache = cls.init(spec, batch, HEADS, HEAD_DIM, dtype=dtype)
    ref = ReferenceHistory(spec.chunk, spec.window, spec.sink, batch)
    rng = np.random.default_rng(len(ops))
    for op, mask in ops:
        if op == "begin":
            cache = begin_all(cache) if mask is None else begin(cache, jnp.asarray(mask))
            ref.begin(mask)
        elif op == "write":
            k = rng.standard_normal((batch, chunk, HEADS, HEAD_DIM)).astype(dtype)
            v = rng.standard_normal((batch, chunk, HEADS, HEAD_DIM)).astype(dtype)
            if mask is None:
                cache = write_all(cache, jnp.asarray(k), jnp.asarray(v))
            else:
                cache = write(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
            ref.write(k, v, mask)
        else:
            cache = reset(cache, jnp.asarray(mask)) if mask is not None else cache.reset()
            ref.reset(mask)
        _assert_matches(cache, ref, chrono)
    return cache, ref


# ------------------------------------------------------------------ seeded sweep: thousands of checked steps

LAYOUTS = [  # (chunk, window_chunks, sink_chunks)
    (1, 1, 0),
    (2, 1, 0),
    (1, 3, 0),
    (3, 4, 0),
    (2, 2, 1),
    (1, 1, 2),
    (2, 5, 1),
    (1, 4, 3),
    (4, 3, 2),
]


def _random_ops(rng, batch, n):
    ops = []
    for _ in range(n):
        r = rng.random()
        mask = None if rng.random() < 0.5 else rng.random(batch) < 0.7
        if r < 0.4:
            ops.append(("begin", mask))
        elif r < 0.95:
            ops.append(("write", mask))
        else:
            ops.append(("reset", mask))
    return ops


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_random_sequences_match_reference(cls, layout):
    chunk, window_chunks, sink_chunks = layout
    rng = np.random.default_rng(hash(layout) % 2**32)
    for batch in (1, 3):
        # Starts with a begin so that sequences exercise the stream, then 150 random transitions.
        _run_sequence(cls, chunk, window_chunks, sink_chunks, batch, [("begin", None)] + _random_ops(rng, batch, 150))


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    cls=st.sampled_from(POLICIES),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["begin", "begin", "write", "write", "write", "reset"]),
            st.one_of(st.none(), st.lists(st.booleans(), min_size=2, max_size=2)),
        ),
        min_size=1,
        max_size=40,
    ),
)
@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_property_any_sequence_matches_reference(layout, cls, ops):
    _run_sequence(cls, *layout, batch=2, ops=ops)


# ------------------------------------------------------------------ the named edge cases


def _stream(cls, spec, n_chunks, batch=1, layers=None):
    cache = cls.init(spec, batch, 1, 1, layers=layers)
    for n in range(n_chunks):
        cache = cache.begin_chunk()
        value = jnp.full((batch, spec.chunk, 1, 1), float(n))
        if layers is None:
            cache = cache.write(value, value)
        else:
            for layer in range(layers):
                cache = cache.write(value + layer, value + layer, layer=layer)
    return cache


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_first_chunk_fill_eviction_and_wraps(cls):
    spec = jaxkv.RingSpec(chunk=2, window=6, sink=2)  # 1 sink chunk + 3 window chunks
    # First chunk: reserved but not written -> nothing visible; written -> positions 0, 1.
    cache = cls.init(spec, 1, 1, 1).begin_chunk()
    assert np.all(np.asarray(cache.positions) < 0)
    np.testing.assert_array_equal(cache.chunk_positions(), [[0, 1]])
    expected = {  # chunks streamed -> retained positions in order (sink chunk 0 + the three most recent)
        1: [0, 1],
        3: [0, 1, 2, 3, 4, 5],
        4: [0, 1, 2, 3, 4, 5, 6, 7],
        5: [0, 1, 4, 5, 6, 7, 8, 9],  # first eviction: chunk 1 goes
        50: [0, 1, 94, 95, 96, 97, 98, 99],  # many wraps
    }
    for n, want in expected.items():
        cache = _stream(cls, spec, n)
        k, _, pos = cache.chronological()
        np.testing.assert_array_equal(pos[0, : len(want)], want)
        assert np.all(np.asarray(pos[0, len(want) :]) < 0)
        np.testing.assert_array_equal(k[0, : len(want), 0, 0], np.asarray(want) // 2)  # data follows positions


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_reset_mid_stream_restarts_one_session(cls):
    spec = jaxkv.RingSpec(chunk=1, window=2, sink=1)
    cache = _stream(cls, spec, 7, batch=2)
    cache = cache.reset(jnp.array([True, False]))
    np.testing.assert_array_equal(cache.chunk_start, [-1, 6])
    assert np.all(np.asarray(cache.positions[0]) < 0)
    cache = cache.begin_chunk()
    cache = cache.write(jnp.full((2, 1, 1, 1), 9.0), jnp.full((2, 1, 1, 1), 9.0))
    _, _, pos = cache.chronological()
    np.testing.assert_array_equal(pos[0], [0, -1, -1])  # restarted at position 0
    np.testing.assert_array_equal(pos[1], [0, 6, 7])
    np.testing.assert_array_equal(cache.k.shape, (2, 3, 1, 1))  # nothing reallocated


def test_repeated_write_last_wins_and_inactive_sessions_keep_state():
    spec = jaxkv.RingSpec(chunk=2, window=4)
    cache = jaxkv.RingCache.init(spec, 2, 1, 1).begin_chunk()
    for value in (1.0, 2.0, 3.0):
        cache = cache.write(jnp.full((2, 2, 1, 1), value), jnp.full((2, 2, 1, 1), -value))
    np.testing.assert_array_equal(cache.k[:, :2, 0, 0], 3.0)
    np.testing.assert_array_equal(cache.v[:, :2, 0, 0], -3.0)
    before = cache
    cache = cache.begin_chunk(active=jnp.array([False, True]))
    cache = cache.write(jnp.full((2, 2, 1, 1), 7.0), jnp.full((2, 2, 1, 1), 7.0), active=jnp.array([False, True]))
    np.testing.assert_array_equal(cache.k[0], before.k[0])
    np.testing.assert_array_equal(cache.positions[0], before.positions[0])
    np.testing.assert_array_equal(cache.chunk_start, [0, 2])
    np.testing.assert_array_equal(cache.positions[1], [0, 1, 2, 3])


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_stacked_layers_match_per_layer_caches(cls):
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=2)
    stacked = _stream(cls, spec, 9, batch=2, layers=3)
    single = _stream(cls, spec, 9, batch=2)
    k, v, pos = stacked.chronological()
    k1, _, pos1 = single.chronological()
    np.testing.assert_array_equal(pos, pos1)
    for layer in range(3):
        np.testing.assert_array_equal(k[layer], k1 + layer)
        lk, _ = stacked.layer_kv(jnp.int32(layer))
        np.testing.assert_array_equal(lk, stacked.k[layer])


def test_ring_and_rolling_give_same_logical_content_in_bf16():
    spec = jaxkv.RingSpec(chunk=3, window=9, sink=3)
    rng = np.random.default_rng(0)
    caches = [cls.init(spec, 2, 2, 4, dtype=jnp.bfloat16) for cls in POLICIES]
    for _ in range(11):
        k = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.bfloat16)
        caches = [c.begin_chunk().write(k, -k) for c in caches]
    (k0, v0, p0), (k1, v1, p1) = (c.chronological() for c in caches)
    assert k0.dtype == jnp.bfloat16
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(np.asarray(k0, np.float32), np.asarray(k1, np.float32))
    np.testing.assert_array_equal(np.asarray(v0, np.float32), np.asarray(v1, np.float32))


# ------------------------------------------------------------------ attention over the ring


def _attention_on(cache, query):
    q_pos = cache.chunk_positions()
    return dense_attention(query, cache.k, cache.v, q_pos, cache.positions, causal=True)


def test_attention_in_physical_order_equals_chronological():
    spec = jaxkv.RingSpec(chunk=4, window=12, sink=4)
    rng = np.random.default_rng(1)
    cache = jaxkv.RingCache.init(spec, 1, 2, 8)
    for _ in range(15):
        k = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
        cache = cache.begin_chunk().write(k, k * 0.5 + 1)
    query = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
    k, v, pos = cache.chronological()
    assert not np.array_equal(pos, cache.positions), "the ring should be out of order here"
    physical = _attention_on(cache, query)
    chrono = dense_attention(query, k, v, cache.chunk_positions(), pos, causal=True)
    np.testing.assert_allclose(physical, chrono, rtol=1e-6, atol=1e-6)


def test_wrapped_ring_and_never_wrapped_ring_are_bit_identical():
    """Same slot contents, positions shifted by whole wraps: the same code gives the same bits."""
    spec = jaxkv.RingSpec(chunk=3, window=12)
    w = spec.window_chunks
    rng = np.random.default_rng(2)
    data = [jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.float32) for _ in range(w)]
    query = jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.float32)

    fresh = jaxkv.RingCache.init(spec, 1, 2, 8)
    for d in data:
        fresh = fresh.begin_chunk().write(d, d + 1)
    wrapped = jaxkv.RingCache.init(spec, 1, 2, 8)
    wraps = 25
    for n in range(wraps * w + w):
        d = data[n % w] if n >= wraps * w else jnp.full_like(data[0], 100.0)
        wrapped = wrapped.begin_chunk().write(d, d + 1)
    assert int(wrapped.chunk_start[0]) == (wraps * w + w - 1) * spec.chunk
    np.testing.assert_array_equal(wrapped.positions - fresh.positions, wraps * spec.window)
    np.testing.assert_array_equal(_attention_on(wrapped, query), _attention_on(fresh, query))


# ------------------------------------------------------------------ compilation and in-place writes


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_jit_loop_over_many_wraps_compiles_once(cls):
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=2)
    begin = jax.jit(lambda c: c.begin_chunk(), donate_argnums=0)
    write = jax.jit(lambda c, k, v: c.write(k, v), donate_argnums=0)
    cache = cls.init(spec, 2, 1, 2)
    for n in range(6 * spec.window_chunks + 1):  # six wraps
        cache = begin(cache)
        x = jnp.full((2, 2, 1, 2), float(n))
        cache = write(cache, x, x)
    assert compile_count(begin) == 1
    assert compile_count(write) == 1
    _, _, pos = cache.chronological()
    np.testing.assert_array_equal(pos[0], [0, 1, 22, 23, 24, 25])


def _write_fn(spec, layers):
    def fn(cache, k, v):
        def body(c, layer):
            return c.write(k, v, layer=layer), None

        return jax.lax.scan(body, cache, jnp.arange(layers, dtype=jnp.int32))[0]

    return jax.jit(fn, donate_argnums=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_donated_scanned_multilayer_write_is_in_place(dtype):
    """Temp memory of a 4-layer scanned write stays O(chunk), whatever the window (no copy of any cache).

    (Memory only: on XLA:CPU a bf16 stack write is an in-place whole-buffer conversion, see `write_chunk_rows`.)"""
    tokens, chunk_frames, heads, dim, layers = 64, 2, 4, 32, 4
    temps = []
    for window_frames in (8, 64):
        spec = jaxkv.RingSpec.from_frames(tokens, chunk_frames, window_frames)
        cache = jaxkv.RingCache.init(spec, 1, heads, dim, dtype=dtype, layers=layers).begin_chunk()
        k = jnp.ones((1, spec.chunk, heads, dim), dtype)
        compiled = _write_fn(spec, layers).lower(cache, k, k).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        # At most the k and v chunks being written, in float32 at most (XLA:CPU computes bf16 updates in f32),
        # plus small index scratch: never a layer of the cache.
        chunk_bytes_f32 = spec.chunk * heads * dim * 4
        assert temp <= 2 * chunk_bytes_f32 + 4096, (window_frames, temp, chunk_bytes_f32)
        temps.append(temp)
    assert temps[1] < cache.nbytes / 32, (temps, cache.nbytes)
    assert temps[0] == temps[1], temps


def test_single_layer_bf16_write_is_in_place_in_the_compiled_program():
    """The compiled write (not a timing, which is flaky on shared machines): the donated buffers alias the
    outputs, no whole-buffer float32 conversion appears (XLA:CPU's bf16 dynamic_update_slice becomes a
    bf16->f32->bf16 pass over the whole buffer, O(window) per write, unless written through the integer view),
    and scratch memory does not depend on the window."""
    from jaxkv.cache import rows

    heads, dim, chunk = 4, 64, 256
    k = jnp.ones((1, chunk, heads, dim), jnp.bfloat16)

    def compiled(window_chunks, write):
        cache = jaxkv.RingCache.init(
            jaxkv.RingSpec(chunk=chunk, window=chunk * window_chunks), 1, heads, dim, dtype=jnp.bfloat16
        ).begin_chunk()
        return jax.jit(write, donate_argnums=0).lower(cache, k, k).compile()

    temps = []
    for w in (2, 32):
        program = compiled(w, lambda c, k, v: c.write(k, v))
        text = program.as_text()
        whole = f"[1,{chunk * w},{heads},{dim}]"
        assert "input_output_alias" in text
        assert f"f32{whole}" not in text, f"whole-buffer float32 conversion at window {w} chunks"
        temps.append(program.memory_analysis().temp_size_in_bytes)
    assert temps[0] == temps[1] <= 2 * chunk * heads * dim * 4, temps

    # The check can fail: a native bf16 update (no integer view) shows the whole-buffer conversion.
    native = compiled(32, lambda c, k, v: c.replace(k=rows.write_rows_in_dtype(c.k, k, c.chunk_start, None)))
    assert f"f32[1,{chunk * 32},{heads},{dim}]" in native.as_text()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk=0, window=4), "positive"),
        (dict(chunk=2, window=1), "at least one chunk"),
        (dict(chunk=2, window=5), "whole number of chunks"),
        (dict(chunk=2, window=4, sink=3), "sink"),
        (dict(chunk=2, window=4, sink=-2), "sink"),
        (dict(chunk=2.0, window=4), "int"),
    ],
)
def test_invalid_specs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxkv.RingSpec(**kwargs)


def test_from_frames_maps_self_forcing_settings():
    # Self-Forcing: local_attn_size 21 frames with a 3-frame sink, 1560 tokens per frame, 3-frame chunks.
    spec = jaxkv.RingSpec.from_frames(1560, 3, window_frames=21 - 3, sink_frames=3)
    assert (spec.chunk, spec.window, spec.sink, spec.capacity) == (4680, 18 * 1560, 3 * 1560, 21 * 1560)
    with pytest.raises(ValueError, match="multiples of chunk_frames"):
        jaxkv.RingSpec.from_frames(1560, 3, window_frames=20)


def test_write_rejects_bad_shapes_dtypes_and_layers_at_trace_time():
    spec = jaxkv.RingSpec(chunk=2, window=4)
    cache = jaxkv.RingCache.init(spec, 2, 3, 4).begin_chunk()
    good = jnp.zeros((2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"\[batch, chunk, heads, head_dim\] = \[2, 2, 3, 4\]"):
        jax.jit(lambda c: c.write(jnp.zeros((2, 3, 3, 4)), good))(cache)
    with pytest.raises(ValueError, match="dtype float32"):
        jax.jit(lambda c: c.write(good.astype(jnp.bfloat16), good))(cache)
    with pytest.raises(ValueError, match="not stacked"):
        cache.write(good, good, layer=0)
    stacked = jaxkv.RingCache.init(spec, 2, 3, 4, layers=2).begin_chunk()
    with pytest.raises(ValueError, match="pass layer="):
        stacked.write(good, good)
    with pytest.raises(ValueError, match="out of range"):
        stacked.write(good, good, layer=2)
    with pytest.raises(ValueError, match="out of range"):
        stacked.write(good, good, layer=jnp.int32(-1))  # a concrete array is checked too, never clamped
    with pytest.raises(ValueError, match="out of range"):
        stacked.layer_kv(np.int64(2))
    with pytest.raises(ValueError, match="integer scalar"):
        stacked.write(good, good, layer=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="integer scalar"):
        stacked.write(good, good, layer=1.0)
    with pytest.raises(ValueError, match="bool array of shape"):
        cache.begin_chunk(active=jnp.array([1, 0]))
    with pytest.raises(ValueError, match="begin_chunk"):
        jaxkv.RingCache.init(spec, 2, 3, 4).write(good, good)
    with pytest.raises(ValueError, match="positive int"):
        jaxkv.RingCache.init(spec, 0, 3, 4)


# ------------------------------------------------------------------ int32 positions


def test_max_chunks_is_where_int32_positions_end():
    # Wan 2.1 at 480p: 4,680-token chunks. The last representable chunk is the last whose final token fits int32.
    wan = jaxkv.RingSpec.from_frames(1560, 3, window_frames=18, sink_frames=3)
    last_ok = (2**31 - 1 - (wan.chunk - 1)) // wan.chunk
    assert wan.max_chunks == last_ok + 1 == 458_864
    video_frames = 1 + 4 * (3 * wan.max_chunks - 1)  # the Wan VAE: 1 + 4 (T - 1) frames from T latent frames
    assert 95 < video_frames / 16 / 3600 < 96  # hours at 16 fps, as documented
    assert jaxkv.RingSpec(chunk=1, window=1).max_chunks == 2**31


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_begin_chunk_refuses_to_pass_the_int32_position_limit(cls):
    spec = jaxkv.RingSpec(chunk=4, window=8)
    last = spec.max_chunks - 1
    cache = cls.init(spec, 2, 1, 2)
    near = cache.replace(chunk_start=jnp.array([(last - 1) * 4, 0], jnp.int32))  # session 0: one chunk left
    near = near.begin_chunk()
    assert int(near.chunk_start[0]) == last * 4
    assert int(near.chunk_positions()[0, -1]) == 2**31 - 1  # the very last int32 position is usable
    with pytest.raises(OverflowError, match=f"chunk {spec.max_chunks} would pass the int32 position limit"):
        near.begin_chunk()
    # A session that does not advance is not in the way of the others.
    moved = near.begin_chunk(active=jnp.array([False, True]))
    assert int(moved.chunk_start[0]) == last * 4 and int(moved.chunk_start[1]) == 8
    # Reset starts the session again from position 0.
    assert int(near.reset().begin_chunk().chunk_start[0]) == 0


def test_write_of_a_list_names_the_expected_shape():
    spec = jaxkv.RingSpec.from_frames(tokens_per_frame=2, chunk_frames=1, window_frames=2, sink_frames=1)
    cache = jaxkv.RingCache.init(spec, batch=1, heads=1, head_dim=2).begin_chunk()
    rows = [[[[1.0, 2.0]]] * spec.chunk]
    with pytest.raises(
        ValueError, match=r"k must be an array of shape \[batch, chunk, heads, head_dim\] = \[1, 2, 1, 2\], got list"
    ):
        cache.write(rows, rows)


# ------------------------------------------------------------------ out-of-range layers


def _stacked_after_one_write(cls, layers=3):
    """A 3-layer stack with one chunk written to every layer (k = v = layer + 1), then chunk 1 reserved."""
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=2)
    cache = cls.init(spec, 2, 1, 1, layers=layers).begin_chunk()
    for layer in range(layers):
        x = jnp.full((2, 2, 1, 1), float(layer + 1))
        cache = cache.write(x, x, layer=layer)
    return cache.begin_chunk()


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("layer", [7, 3, -1])
def test_a_traced_out_of_range_layer_writes_nothing_and_checkify_names_it(cls, layer):
    """Outside jit an out-of-range layer is a ValueError; inside jit (traced) nothing is written, never the first
    or last layer (XLA's dynamic_update_slice would clamp), and a checkified program reports the layer."""
    from jax.experimental import checkify

    cache = _stacked_after_one_write(cls)
    x = jnp.full((2, 2, 1, 1), 9.0)
    with pytest.raises(ValueError, match=rf"write: layer {layer} out of range \[0, 3\)"):
        cache.write(x, x, layer=layer)

    write = jax.jit(lambda c, layer: c.write(x, x, layer=layer))
    out = write(cache, jnp.int32(layer))
    for name in ("k", "v", "positions", "chunk_start"):
        np.testing.assert_array_equal(getattr(out, name), getattr(cache, name), err_msg=name)
    # The same program with an index in range writes that layer and only it (the guard is not a no-op).
    wrote = write(cache, jnp.int32(1))
    assert float(jnp.max(wrote.k[1])) == 9.0
    np.testing.assert_array_equal(wrote.k[0], cache.k[0])
    np.testing.assert_array_equal(wrote.k[2], cache.k[2])
    assert int(jnp.max(wrote.positions)) == 3 and int(jnp.max(cache.positions)) == 1

    checked = jax.jit(checkify.checkify(lambda c, layer: c.write(x, x, layer=layer)))
    err, _ = checked(cache, jnp.int32(layer))
    with pytest.raises(checkify.JaxRuntimeError, match=rf"write: layer {layer} out of range \[0, 3\)"):
        err.throw()
    err, _ = checked(cache, jnp.int32(2))
    assert err.get() is None


def test_a_scanned_write_with_an_out_of_range_layer_list_leaves_no_trace_on_other_layers():
    """The bug as a model would meet it: a scan over layer indices [0, 1, 7] on a 3-layer stack."""
    cache = _stacked_after_one_write(jaxkv.RingCache)
    x = jnp.full((2, 2, 1, 1), 9.0)

    def fn(c, layers):
        return jax.lax.scan(lambda c, layer: (c.write(x, x, layer=layer), None), c, layers)[0]

    out = jax.jit(fn)(cache, jnp.array([0, 1, 7], jnp.int32))
    assert float(jnp.max(out.k[0])) == float(jnp.max(out.k[1])) == 9.0
    np.testing.assert_array_equal(out.k[2], cache.k[2])  # clamped, layer 2 would hold 9.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32], ids=["f32", "bf16", "int32"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stack", "single"])
def test_both_programs_of_a_guarded_write_equal_the_write_or_write_nothing(dtype, stacked):
    """The two programs of a write that may write nothing: XLA:CPU's (a cond) and the one GPUs and TPUs compile
    (a dropping scatter, never run by the cache on a CPU, so run here directly), against the plain write."""
    from jaxkv.cache import rows

    rng = np.random.default_rng(0)
    lead = (3,) if stacked else ()
    buf = jnp.asarray(rng.normal(size=(*lead, 2, 8, 2, 3)) * 100, dtype)
    update = jnp.asarray(rng.normal(size=(2, 4, 2, 3)) * 100, dtype)
    offsets = jnp.array([4, 0], jnp.int32)
    for program in (rows._only_if_by_cond, rows._only_if_by_scatter):
        run = jax.jit(program)
        for layer in range(3) if stacked else [None]:
            layer_arg = None if layer is None else jnp.int32(layer)
            expected = rows.write_rows_in_dtype(buf, update, offsets, layer_arg)
            np.testing.assert_array_equal(run(buf, update, offsets, layer_arg, jnp.bool_(True)), expected)
            np.testing.assert_array_equal(run(buf, update, offsets, layer_arg, jnp.bool_(False)), buf)
    for layer in (3, 7, -1) if stacked else ():  # the scatter drops an out-of-range layer by itself
        np.testing.assert_array_equal(jax.jit(rows._scatter_rows_or_drop)(buf, update, offsets, jnp.int32(layer)), buf)


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_replace_layer_follows_the_write_rules_for_layers(cls):
    """`replace_layer` (a whole layer's K/V, as a re-cache writes them) on a stack: a known out-of-range layer is a
    ValueError, a traced one replaces nothing (never the first or last layer) and checkify names it; in range only
    that layer changes. The per-layer form gives the same cache and takes a Python int only; k/v of the wrong
    shape or dtype are refused before anything changes."""
    from jax.experimental import checkify

    cache = _stacked_after_one_write(cls)
    new = jnp.full((2, cache.spec.capacity, 1, 1), 5.0)
    with pytest.raises(ValueError, match=r"replace_layer: layer 3 out of range \[0, 3\)"):
        cache.replace_layer(3, new, new)
    replace = jax.jit(lambda c, layer: c.replace_layer(layer, new, new))
    for layer in (3, 9, -1):
        out = replace(cache, jnp.int32(layer))
        for name in ("k", "v", "positions", "chunk_start"):
            np.testing.assert_array_equal(getattr(out, name), getattr(cache, name), err_msg=f"{layer} {name}")
    out = replace(cache, jnp.int32(2))
    np.testing.assert_array_equal(out.k[2], new)
    np.testing.assert_array_equal(out.v[2], new)
    np.testing.assert_array_equal(out.k[:2], cache.k[:2])
    np.testing.assert_array_equal(out.positions, cache.positions)
    err, _ = jax.jit(checkify.checkify(lambda c, layer: c.replace_layer(layer, new, new)))(cache, jnp.int32(4))
    with pytest.raises(checkify.JaxRuntimeError, match=r"replace_layer: layer 4 out of range \[0, 3\)"):
        err.throw()

    per_layer = cache.per_layer().replace_layer(2, new, new)
    assert per_layer.is_per_layer
    chex.assert_trees_all_equal(per_layer.stacked(), out)
    with pytest.raises(ValueError, match="a per-layer cache holds each layer in its own buffer"):
        jax.jit(lambda c, layer: c.replace_layer(layer, new, new))(cache.per_layer(), jnp.int32(1))
    for bad in (new[:, :-1], new.astype(jnp.bfloat16)):
        with pytest.raises(ValueError, match=r"replace_layer: k must be float32\[2, 6, 1, 1\]"):
            cache.replace_layer(1, bad, new)
