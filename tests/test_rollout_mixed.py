"""Wan rollouts with mixed dense / dilated layers (`RolloutConfig.dilated_every`) against a cache-free reference
whose per-layer visibility comes from the chronological dilated model (tests/helpers/dilated_reference.py), the
all-dense configuration against today's rollout, one compilation, a flat compiled memory, and the configuration
checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.cache as C
from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream
from tests.helpers.dilated_reference import DilatedHistory
from tests.helpers.masked_reference import chunk_rows, dense_window_rows, reference_rollout

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=4, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame
SCHEDULE = Schedule(steps=(1000, 500), context_noise=21.0)


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed=1, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


def dilated_rows(num_frames, chunk_frames, dilation, buckets):
    """What a dilated layer's chunk n sees, read from the chronological model after chunk n's committed write."""
    hist = DilatedHistory(1, chunk_frames, dilation, buckets, batch=1)
    seen = {}
    kv = np.zeros((1, chunk_frames, 1, 1), np.float32)
    for n in range(num_frames // chunk_frames):
        hist.begin()
        hist.write(kv, kv, commit=True)
        seen[n] = hist.visible_frames(0)
    return chunk_rows(lambda n: seen[n], num_frames, chunk_frames)


def layer_masks(rc, num_chunks):
    frames = num_chunks * rc.chunk_frames
    dense = dense_window_rows(frames, rc.chunk_frames, rc.window_frames, rc.sink_frames)
    dilated = dilated_rows(frames, rc.chunk_frames, rc.dilation, rc.buckets)
    k = rc.dilated_every
    return np.stack([dilated if layer % k == k - 1 else dense for layer in range(CFG.num_layers)])


@pytest.mark.slow  # each case compiles a rollout and ~20 reference forwards: minutes on 2 loaded cores
@pytest.mark.parametrize(
    "every,chunk_frames,window,sink,dilation,buckets,num_chunks",
    [
        (2, 2, 4, 2, 3, 2, 6),  # 12 frames: kept 0, 3, 6, 9 in 2 buckets (wraps twice); kept frames fall mid-chunk
        (1, 1, 1, 0, 2, 2, 9),  # every layer dilated, 9 one-frame chunks
    ],
)
def test_mixed_rollout_equals_cache_free_reference(every, chunk_frames, window, sink, dilation, buckets, num_chunks):
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=chunk_frames,
        window_frames=window,
        sink_frames=sink,
        schedule=SCHEDULE,
        dilated_every=every,
        dilation=dilation,
        buckets=buckets,
    )
    masks = layer_masks(rc, num_chunks)
    # The dilated rows really differ from the dense ones and drop frames (the test would not see a dense rollout
    # pass for a dilated one): some kept frame stays visible past the dense window, some frame is never seen later.
    if every > 1:
        assert (masks[every - 1] & ~masks[0]).any() and (masks[0] & ~masks[every - 1]).any()
    params, ctx = _params(), _ctx()
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 1, num_chunks))
    out = R.jit_rollout(params, CFG, rc, ctx, num_chunks=num_chunks, noise=noise)
    want = reference_rollout(params, CFG, rc, ctx, noise, masks)
    assert isinstance(out.state.cache, C.MixedCache if every > 1 else C.DilatedCache)
    err = float(jnp.abs(out.latents - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err


@pytest.mark.slow  # two 4-layer rollouts
def test_all_dense_configuration_is_todays_rollout_and_dilation_one_is_a_dense_window():
    base = dict(latent_height=H, latent_width=W, chunk_frames=1, window_frames=3, schedule=SCHEDULE)
    dense = R.RolloutConfig(**base)
    # dilated_every=0 is the plain rollout: the same static config (same jit cache entry, same program), a RingCache
    assert R.RolloutConfig(**base, dilated_every=0) == dense and hash(R.RolloutConfig(**base, dilated_every=0)) == hash(
        dense
    )
    params, ctx = _params(), _ctx()
    state = R.init_state(params, CFG, dense, ctx)
    assert type(state.cache) is C.RingCache and state.cache.layers == CFG.num_layers
    # A dilated layer with dilation 1 and as many buckets as the window keeps the same frames as the dense window:
    # the mixed rollout equals the dense one (to float tolerance: the slots are in another physical order).
    noise = jax.random.normal(jax.random.key(3), dense.noise_shape(CFG, 1, 5))
    want = R.jit_rollout(params, CFG, dense, ctx, num_chunks=5, noise=noise).latents
    mixed = R.RolloutConfig(**base, dilated_every=2, dilation=1, buckets=3)
    got = R.jit_rollout(params, CFG, mixed, ctx, num_chunks=5, noise=noise).latents
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err <= 1e-5, err


@pytest.mark.slow  # six 12-layer compilations and a stream
def test_mixed_stream_compiles_once_and_its_memory_does_not_grow_with_the_dilated_horizon():
    # memory_analysis of the donated stream step, 12 layers, buckets 2 vs 128: a copy of a stack (per layer or per
    # chunk) would add temporaries of the stack's size; reading one layer for attention adds O(one layer), whatever
    # the number of layers. The single-stack all-dilated model is the in-place baseline.
    cfg12 = dataclasses.replace(CFG, num_layers=12)
    params12, ctx = wan.init_params(cfg12, jax.random.key(0)), _ctx()

    def growth(every):
        temps, sizes = [], []
        for buckets in (2, 128):
            rc = R.RolloutConfig(
                H,
                W,
                chunk_frames=1,
                window_frames=2,
                schedule=SCHEDULE,
                dilated_every=every,
                dilation=2,
                buckets=buckets,
            )
            state = R.init_state(params12, cfg12, rc, ctx)
            noise = jnp.zeros((rc.steps, *rc.chunk_shape(cfg12, 1)))
            compiled = R.stream_step.lower(cfg12, rc, params12, state, None, None, noise).compile()
            temps.append(compiled.memory_analysis().temp_size_in_bytes)
            sizes.append(state.cache.nbytes)
        return temps[1] - temps[0], sizes[1] - sizes[0]

    single, _ = growth(1)
    for every in (2, 3):
        temp, cache = growth(every)
        assert temp <= 1.05 * single and temp < 0.5 * cache, (every, temp, single, cache)

    params = _params()
    rc = R.RolloutConfig(
        H, W, chunk_frames=1, window_frames=2, schedule=SCHEDULE, dilated_every=2, dilation=2, buckets=2
    )
    before = compile_count(R.stream_step)
    chunks = list(Stream(params, CFG, rc, ctx, num_chunks=7, key=jax.random.key(4)))
    assert len(chunks) == 7 and compile_count(R.stream_step) - before == 1
    noise = jnp.stack([R.chunk_noise(jax.random.key(4), CFG, rc, 1, n) for n in range(7)])
    scan = R.jit_rollout(params, CFG, rc, ctx, num_chunks=7, noise=noise).latents
    np.testing.assert_allclose(np.concatenate([np.asarray(c) for c in chunks], axis=1), scan, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_dilated_rollout_configuration_errors_are_clear():
    base = dict(latent_height=H, latent_width=W, chunk_frames=2, window_frames=4)
    with pytest.raises(ValueError, match="dilation is set but dilated_every is 0"):
        R.RolloutConfig(**base, dilation=2)
    with pytest.raises(ValueError, match="needs buckets"):
        R.RolloutConfig(**base, dilated_every=2, dilation=2)
    with pytest.raises(ValueError, match="dilated_every"):
        R.RolloutConfig(**base, dilated_every=-1, dilation=2, buckets=2)
    with pytest.raises(ValueError, match=r"buckets \(1\) must be >= ceil"):
        R.RolloutConfig(**base, dilated_every=2, dilation=1, buckets=1)
    with pytest.raises(ValueError, match="has no sink"):
        R.RolloutConfig(**base, sink_frames=2, dilated_every=1, dilation=2, buckets=2)
    with pytest.raises(ValueError, match="policy is the dense layers"):
        R.RolloutConfig(**base, policy="dilated")
    rc = R.RolloutConfig(**base, dilated_every=3, dilation=2, buckets=2)  # 4 layers: not a multiple of 3
    with pytest.raises(ValueError, match="4 layers is not a multiple of 3"):
        R.init_state(_params(), CFG, rc, _ctx())


def test_registry_and_mixed_cache_layout():
    assert C.policy_class("dilated") is C.DilatedCache and C.WINDOW_POLICIES == ("ring", "rolling")
    ring, dil = C.RingSpec(chunk=4, window=8, sink=4), C.DilatedSpec(2, 2, 3, 2)
    with pytest.raises(ValueError, match="'dilated' takes a DilatedSpec, got a RingSpec"):
        C.policy_class("dilated", ring)
    with pytest.raises(ValueError, match="'ring' takes a RingSpec, got a DilatedSpec"):
        wan.init_cache(CFG, dil, 1, policy="ring")
    assert isinstance(wan.init_cache(CFG, dil, 1, policy="dilated"), C.DilatedCache)
    with pytest.raises(ValueError, match="chunk"):
        C.MixedSpec(C.RingSpec(chunk=2, window=4), dil, 2)
    spec = C.MixedSpec(ring, dil, 2)
    cache = wan.init_cache(CFG, spec, 2, policy="rolling")
    assert type(cache.dense) is C.RollingCache and cache.dense.layers == 2 and cache.dilated.layers == 2
    assert [cache.locate(layer) for layer in range(4)] == [("dense", 0), ("dilated", 0), ("dense", 1), ("dilated", 1)]
    assert cache.nbytes == cache.dense.nbytes + cache.dilated.nbytes
    cache = cache.begin_chunk().begin_chunk(jnp.array([True, False]))
    np.testing.assert_array_equal(cache.dense.chunk_start, cache.dilated.chunk_start)
    np.testing.assert_array_equal(cache.chunk_positions(), cache.dilated.chunk_positions())
    cache = cache.reset(jnp.array([True, False]))
    assert cache.chunk_start.tolist() == [-1, 0] and cache.dilated.chunk_start.tolist() == [-1, 0]
