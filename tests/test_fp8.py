"""The FP8 options of the precision policy: e4m3 quantization (`jaxkv.fp8`), the FP8 ring cache
(`jaxkv.cache.fp8.Fp8Cache`), FP8 attention (`jaxkv.attention.fp8`, emulated on CPU) and a rollout under
`Precision.fp8()` against bf16 (bounds from `benchmarks/precision.py`, see docs/precision-fp8.md)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv import fp8
from jaxkv import rollout as R
from jaxkv.attention import MaskSpec, dense_attention
from jaxkv.attention.fp8 import cudnn_fp8_supported, fp8_attend, fp8_attention_emulated
from jaxkv.cache import RingCache, RingSpec
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.models import wan
from jaxkv.precision import Precision
from tests.helpers.trees import as_f32

CFG = wan.preset("tiny")
HW = (8, 8)
E4M3_REL = 2.0**-4  # half an ulp of e4m3's 3-bit mantissa, relative


# ------------------------------------------------------------------------------------------------ quantization


def test_quantize_round_trip_matches_numpy_e4m3_and_keeps_zeros_and_nan_visible():
    x = np.asarray(jax.random.normal(jax.random.key(0), (4, 64)) * 30.0)
    s = np.asarray(fp8.scale_of(x, axis=1))
    assert np.allclose(s, np.abs(x).max(axis=1) / 448.0)
    x8 = fp8.quantize(x, s[:, None])
    assert x8.dtype == jnp.float8_e4m3fn
    # an independent reference: numpy's e4m3 (ml_dtypes) on the same scaled values
    want = (x / s[:, None]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s[:, None]
    got = np.asarray(fp8.dequantize(x8, s[:, None]))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    normal = np.abs(x) >= s[:, None] * 2.0**-6  # below that, e4m3 subnormals: absolute steps of s * 2**-9
    assert np.all(np.abs(got - x)[normal] <= E4M3_REL * np.abs(x)[normal] * 1.0001)
    assert np.all(np.abs(got - x) <= E4M3_REL * np.abs(x) + s[:, None] * 2.0**-10 * 1.0001)
    assert np.abs(got).max() <= np.abs(x).max() * (1 + 1e-6)  # the amax itself maps to 448 exactly: no overflow
    assert float(fp8.scale_of(jnp.zeros(3))) == 1.0
    assert np.all(np.asarray(fp8.round_trip(jnp.zeros((2, 3)), axis=1)) == 0)
    assert np.isnan(float(fp8.scale_of(jnp.array([1.0, jnp.nan]))))


# ------------------------------------------------------------------------------------------------ the cache


def _chunk(key, b, c, h, d, loud_head=True):
    kk, kv = jax.random.split(key)
    gain = (1.0 + 99.0 * (jnp.arange(h) == h - 1)) if loud_head else jnp.ones(h)  # one head 100x the others
    k = (jax.random.normal(kk, (b, c, h, d)) * gain[None, None, :, None]).astype(jnp.bfloat16)
    return k, jax.random.normal(kv, (b, c, h, d)).astype(jnp.bfloat16)


def test_fp8_cache_tracks_a_bf16_ring_through_fill_wrap_sessions_and_reset():
    """Same begin/write/reset sequence on a bf16 RingCache and an Fp8Cache (2 layers, 2 sessions, sink 1 + window
    2 chunks, 6 chunks: the ring wraps twice; session 1 inactive on chunk 3; session 0 reset before chunk 5):
    positions and chunk starts are identical, and every dequantized element is within e4m3's rounding of the bf16
    one (per-(slot, head) scales: the quiet heads keep their precision beside a head 100x louder)."""
    spec = RingSpec(chunk=4, window=8, sink=4)
    b, h, d, layers = 2, 3, 16, 2
    ref = RingCache.init(spec, b, h, d, dtype=jnp.bfloat16, layers=layers)
    cache = Fp8Cache.init(spec, b, h, d, dtype=jnp.bfloat16, layers=layers)
    key = jax.random.key(1)
    for n in range(6):
        active = jnp.array([True, n != 3])
        if n == 5:
            ref, cache = ref.reset(jnp.array([True, False])), cache.reset(jnp.array([True, False]))
        ref, cache = ref.begin_chunk(active), cache.begin_chunk(active)
        before = (np.asarray(cache.k_scale), np.asarray(cache.k.astype(jnp.float32)))
        for layer in range(layers):
            key, sub = jax.random.split(key)
            k, v = _chunk(sub, b, 4, h, d)
            ref = ref.write(k, v, layer=layer, active=active)
            cache = cache.write(k, v, layer=jnp.int32(layer), active=active)
        if n == 3:  # the inactive session kept its bytes and scales
            np.testing.assert_array_equal(np.asarray(cache.k_scale)[:, 1], before[0][:, 1])
            np.testing.assert_array_equal(np.asarray(cache.k.astype(jnp.float32))[:, 1], before[1][:, 1])
    np.testing.assert_array_equal(cache.positions, ref.positions)
    np.testing.assert_array_equal(cache.chunk_start, ref.chunk_start)
    for layer in range(layers):
        k8, _, k_s, _ = cache.layer_fp8(layer)
        assert k8.dtype == jnp.float8_e4m3fn and k_s.shape == (b, spec.num_slots, h)
        for want, got in zip(ref.layer_kv(layer), cache.layer_kv(layer), strict=True):
            assert got.dtype == jnp.bfloat16
            want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
            filled = np.asarray(ref.positions >= 0)[:, :, None, None]
            floor = np.abs(want).reshape(b, -1, 4, h, d).max(axis=(2, 4), keepdims=True) * 2.0**-9  # subnormals
            floor = np.broadcast_to(floor, (b, spec.num_slots, 4, h, d)).reshape(want.shape)
            ok = np.abs(got - want) <= (E4M3_REL + 2.0**-8) * np.abs(want) + floor
            assert np.all(ok | ~filled)
            quiet = np.abs(got - want)[..., :-1][np.broadcast_to(filled, want.shape)[..., :-1]]
            assert quiet.max() <= 0.1 * np.abs(want[..., :-1]).max()  # not flattened by the loud head
    # one quantization rule: the bf16 ring's whole buffer re-quantized (what a re-cache writes back) is the FP8
    # cache its chunk-by-chunk writes made, bit for bit; kept slots keep the FP8 bytes and scales whatever the K/V
    again = cache.requantized(ref)
    chex.assert_trees_all_equal(as_f32(again), as_f32(cache))
    noisy = ref.replace(k=ref.k * 3, v=ref.v + 1)
    keep = jnp.array([[True, False, True], [False, True, True]])
    mixed = cache.requantized(noisy, keep)
    fresh = cache.requantized(noisy)
    slot = keep[None, :, :, None]
    np.testing.assert_array_equal(mixed.k_scale, jnp.where(slot, cache.k_scale, fresh.k_scale))
    tokens = jnp.repeat(keep, 4, axis=1)[None, :, :, None, None]
    np.testing.assert_array_equal(
        np.asarray(mixed.v.astype(jnp.float32)), np.asarray(jnp.where(tokens, cache.v, fresh.v).astype(jnp.float32))
    )
    assert not np.array_equal(np.asarray(fresh.k_scale), np.asarray(cache.k_scale))
    with pytest.raises(ValueError, match="requantized: the K/V must be bfloat16"):
        cache.requantized(ref.replace(k=ref.k.astype(jnp.float32), v=ref.v.astype(jnp.float32)))


def test_fp8_cache_halves_the_kv_bytes_and_refuses_what_would_bypass_quantization():
    spec = RingSpec(chunk=16, window=48, sink=16)
    bf16 = RingCache.init(spec, 2, 4, 32, dtype=jnp.bfloat16, layers=3)
    cache = Fp8Cache.init(spec, 2, 4, 32, dtype=jnp.bfloat16, layers=3)
    kv_bytes = lambda c: c.k.nbytes + c.v.nbytes
    assert kv_bytes(cache) * 2 == kv_bytes(bf16)
    leaves = sum(x.nbytes for x in jax.tree.leaves(cache))
    scales = 2 * 3 * 2 * spec.num_slots * 4 * 4  # k and v: [layers, batch, slots, heads] float32
    assert cache.nbytes == kv_bytes(bf16) // 2 + bf16.positions.nbytes + scales  # as RingCache.nbytes: + scales
    assert leaves == cache.nbytes + cache.chunk_start.nbytes
    assert leaves < 0.52 * sum(x.nbytes for x in jax.tree.leaves(bf16))
    cache = cache.begin_chunk()
    k = jnp.zeros((2, 16, 4, 32), jnp.float32)
    with pytest.raises(ValueError, match="must be in the cache's read dtype bfloat16, got float32"):
        cache.write(k, k, layer=0)
    with pytest.raises(ValueError, match=r"cannot replace \['k'\]"):
        cache.replace(k=k)
    with pytest.raises(ValueError, match="read dtype must be one of"):
        Fp8Cache.init(spec, 1, 4, 32, dtype=jnp.int8)
    moved = cache.replace(positions=cache.positions + 1)
    assert isinstance(moved, Fp8Cache) and int(moved.positions[0, 0]) == int(cache.positions[0, 0]) + 1


# ------------------------------------------------------------------------------------------------ attention


def _attention_inputs(seed=0, b=2, lq=16, lk=64, h=2, d=32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(kk, (b, n, h, d)) for kk, n in zip(ks, (lq, lk, lk)))
    qp = jnp.broadcast_to(jnp.arange(48, 48 + lq, dtype=jnp.int32), (b, lq))
    kp = jnp.broadcast_to(jnp.where(jnp.arange(lk) < 56, jnp.arange(lk), -1).astype(jnp.int32), (b, lk))
    return q, k, v, qp, kp


def test_emulated_fp8_attention_is_near_the_float32_reference_and_respects_the_mask():
    q, k, v, qp, kp = _attention_inputs()
    mask = MaskSpec(chunk=16)
    ref = np.asarray(dense_attention(q, k, v, qp, kp, mask=mask))
    got = np.asarray(fp8_attention_emulated(q, k, v, qp, kp, mask=mask))
    rms = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
    assert 5e-3 < rms < 0.1, rms  # it does round (P in e4m3 dominates), and not more than that
    # empty slots (positions -1) may hold NaN: they neither set a scale nor reach the output
    poisoned_k = k.at[:, 60:].set(jnp.nan)
    poisoned_v = v.at[:, 60:].set(1e6)
    np.testing.assert_array_equal(np.asarray(fp8_attention_emulated(q, poisoned_k, poisoned_v, qp, kp, mask=mask)), got)
    # a key hidden by the mask (a later chunk) does not matter (negated: the per-tensor scale, which every valid
    # key sets as cuDNN's would, stays the same); a query that sees no key gets zeros
    later = kp.at[:, 0:16].set(200)
    hidden = np.asarray(fp8_attention_emulated(q, k.at[:, 0:16].mul(-1.0), v, qp, later, mask=mask))
    np.testing.assert_array_equal(hidden, np.asarray(fp8_attention_emulated(q, k, v, qp, later, mask=mask)))
    blind = fp8_attention_emulated(q, k, v, qp, jnp.full_like(kp, -1), mask=mask)
    assert np.all(np.asarray(blind) == 0)


def test_fp8_attend_on_cpu_is_the_emulation():
    assert not cudnn_fp8_supported(128)  # no GPU here
    assert not cudnn_fp8_supported(72)  # and never a head_dim that is not a multiple of 16
    q, k, v, qp, kp = _attention_inputs(seed=3)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    mask = MaskSpec(chunk=16)
    got = jax.jit(lambda *a: fp8_attend(*a, mask=mask))(q, k, v, qp, kp)
    assert got.dtype == jnp.bfloat16
    want = jax.jit(lambda *a: fp8_attention_emulated(*a, mask=mask))(q, k, v, qp, kp)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ------------------------------------------------------------------------------------------------ the model


def test_fp8_precision_builds_an_fp8_ring_and_mismatches_are_refused():
    precision = Precision.fp8()
    assert Precision.named("fp8") == precision and precision.name == "fp8"
    assert precision.fp8_kv and precision.fp8_attention and precision.cache_dtype == "bfloat16"
    assert not Precision.bf16().fp8_kv and not Precision().fp8_attention  # off by default
    with pytest.raises(ValueError, match="fp8_kv must be a bool"):
        Precision(fp8_kv=1)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), wan.init_params(CFG, jax.random.key(0)))
    ctx = jax.random.normal(jax.random.key(1), (1, CFG.text_len, CFG.text_dim))
    rc = R.RolloutConfig(*HW, chunk_frames=1, window_frames=2, precision=precision)
    state = jax.eval_shape(lambda p, c: R.init_state(p, CFG, rc, c), params, ctx)
    assert isinstance(state.cache, Fp8Cache) and state.cache.k.dtype == jnp.float8_e4m3fn
    assert state.cross.k.dtype == jnp.bfloat16  # the cross-attention K/V stay in cache_dtype
    with pytest.raises(ValueError, match="an FP8 KV cache .* is a ring cache"):
        R.RolloutConfig(*HW, chunk_frames=1, window_frames=2, precision=precision, policy="rolling")
    bf16_cache = wan.init_cache(CFG, rc.spec(CFG), 1, dtype=jnp.bfloat16).begin_chunk()
    cross = wan.cross_kv(params, CFG, ctx, precision=precision)
    x = jnp.zeros((1, 1, *HW, CFG.in_dim))
    with pytest.raises(ValueError, match="the cache is a bfloat16 cache but the precision's fp8_kv is True"):
        wan.forward_chunk(params, CFG, bf16_cache, cross, x, jnp.zeros((1,)), precision=precision)
    fp8_cache = wan.init_cache(CFG, rc.spec(CFG), 1, dtype=jnp.bfloat16, fp8=True).begin_chunk()
    with pytest.raises(ValueError, match="the cache is an FP8 cache but the precision's fp8_kv is False"):
        wan.forward_chunk(params, CFG, fp8_cache, cross, x, jnp.zeros((1,)), precision=Precision.bf16())
    with pytest.raises(ValueError, match="does not rebuild an FP8 cache"):
        wan.recompute_cache(
            params, CFG, fp8_cache, cross, jnp.zeros((1, 2, *HW, CFG.in_dim)), jnp.zeros((1,)), precision=precision
        )
    with pytest.raises(ValueError, match="an FP8 cache is a ring cache"):
        wan.init_cache(CFG, rc.spec(CFG), 1, policy="rolling", fp8=True)


@pytest.mark.slow  # three rollout compilations
def test_fp8_rollout_stays_within_the_measured_distance_of_bf16():
    """Five 3-frame chunks of the tiny model on a sink 3 + window 6 ring (it wraps), absolute RoPE, same bf16
    weights, context and noise under bf16, bf16 + the FP8 cache, and `Precision.fp8()`. Measured on this model
    (seeds 7/8/9 of this test): per-chunk max-abs error over the bf16 latents' max abs 2.3e-3..4.2e-3 for the FP8
    cache, 4.0e-3..8.4e-3 with FP8 attention too. Bounds: 3x the worst; at least 5x below the least (it does
    quantize); no growth along the stream beyond 2x the first chunk."""
    weights = jax.tree.map(lambda a: a.astype(jnp.bfloat16), wan.init_params(CFG, jax.random.key(7)))
    ctx = jax.random.normal(jax.random.key(8), (1, CFG.text_len, CFG.text_dim))
    out = {}
    for name, precision in (
        ("bf16", Precision.bf16()),
        ("kv", dataclasses.replace(Precision.bf16(), fp8_kv=True)),
        ("fp8", Precision.fp8()),
    ):
        rc = R.RolloutConfig(*HW, chunk_frames=3, window_frames=6, sink_frames=3, precision=precision)
        noise = jax.random.normal(jax.random.key(9), rc.noise_shape(CFG, 1, 5))
        out[name] = np.asarray(R.jit_rollout(weights, CFG, rc, ctx, num_chunks=5, noise=noise).latents, np.float64)
    for name, bound in (("kv", 1.3e-2), ("fp8", 2.6e-2)):
        rel = []
        for i in range(5):
            got, want = out[name][:, 3 * i : 3 * i + 3], out["bf16"][:, 3 * i : 3 * i + 3]
            rel.append(np.abs(got - want).max() / np.abs(want).max())
        assert max(rel) <= bound, (name, rel)
        assert min(rel) >= 4e-4, (name, rel)
        assert max(rel[1:]) <= 2 * max(rel[0], 1e-3), (name, rel)


def test_the_per_layer_fp8_cache_holds_the_stacked_bytes_and_scales():
    """The FP8 cache per layer (tuples of per-layer K/V and scale buffers, for the unrolled layer loop): the same
    begin/write/reset sequence as on the stacked cache (3 layers, 2 sessions, the ring wrapping, a row inactive)
    leaves the same FP8 bytes, scales and positions, bit for bit; the layouts convert both ways; a traced layer is
    refused by the per-layer form (its layers are separate buffers)."""
    spec = RingSpec(chunk=4, window=8, sink=4)
    b, h, d, layers = 2, 3, 16, 3
    stacked = Fp8Cache.init(spec, b, h, d, dtype=jnp.float32, layers=layers)
    per_layer = Fp8Cache.init(spec, b, h, d, dtype=jnp.float32, layers=layers, per_layer=True)
    assert per_layer.is_per_layer and not stacked.is_per_layer and per_layer.per_layer() is per_layer
    assert len(per_layer.k) == len(per_layer.k_scale) == layers and per_layer.k_scale[0].shape == (b, 3, h)
    assert per_layer.nbytes == stacked.nbytes and stacked.stacked() is stacked
    key = jax.random.key(3)
    for n in range(5):
        active = jnp.array([True, n != 2])
        stacked, per_layer = stacked.begin_chunk(active), per_layer.begin_chunk(active)
        for layer in range(layers):
            key, sub = jax.random.split(key)
            k, v = (x.astype(jnp.float32) for x in _chunk(sub, b, 4, h, d))
            stacked = stacked.write(k, v, layer=jnp.int32(layer), active=active)
            per_layer = per_layer.write(k, v, layer=layer, active=active)
            chex.assert_trees_all_equal(as_f32(per_layer.layer_fp8(layer)), as_f32(stacked.layer_fp8(layer)))
    back = per_layer.stacked()
    chex.assert_trees_all_equal(as_f32(back), as_f32(stacked))
    chex.assert_trees_all_equal(as_f32(stacked.per_layer()), as_f32(per_layer))
    k = jnp.zeros((b, 4, h, d), jnp.float32)
    with pytest.raises(ValueError, match="addressed by a Python int layer"):
        jax.jit(lambda c, i: c.write(k, k, layer=i))(per_layer.begin_chunk(), jnp.int32(0))
    with pytest.raises(ValueError, match="not stacked"):
        Fp8Cache.init(spec, b, h, d, dtype=jnp.float32, per_layer=True)
