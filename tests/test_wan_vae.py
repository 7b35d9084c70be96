"""Torch-free tests of the JAX Wan 2.1 VAE: streaming == whole-clip decode for any chunk schedule, one program per
chunk length (first chunk included), donated state, shapes, the real-size cache, errors, the checkpoint format and
the sink helper. Parity with diffusers is in test_wan_vae_parity.py.

Every decode here uses the tiny preset at latent size 2x3 and chunk lengths 1, 2, 3 (and 7 for the whole clip),
so the compiled programs are shared between tests; each new program takes 5-15 s to compile on 2 shared cores,
hence the slow marks."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.compilation import count_compiles
from jaxkv.models.wan_vae import (
    DecoderState,
    StreamDecoder,
    WanVAEConfig,
    cache_bytes,
    decode,
    decode_chunk,
    denormalize,
    encode,
    init_decoder_state,
    init_params,
    load,
    normalize,
    preset,
    save,
)
from jaxkv.models.wan_vae.checkpoint import CheckpointError

CONFIG = preset("tiny")
H, W = 2, 3
TOL = 2e-5


@pytest.fixture(scope="module")
def params():
    return init_params(0, CONFIG)


@pytest.fixture(scope="module")
def latents():
    return jax.random.normal(jax.random.key(1), (1, 7, H, W, CONFIG.z_dim)) * 1.5


@pytest.fixture(scope="module")
def whole(params, latents):
    return np.asarray(decode(params, CONFIG, latents, clamp=False))


def _stream(params, latents, schedule, clamp=False):
    state = init_decoder_state(CONFIG, 1, H, W)
    pieces, start = [], 0
    for n in schedule:
        frames, state = decode_chunk(params, CONFIG, state, latents[:, start : start + n], clamp=clamp)
        assert frames.shape == (1, 4 * n, 8 * H, 8 * W, 3)
        pieces.append(np.asarray(frames))
        start += n
    return pieces


def test_config_counts():
    real = preset("wan2.1-vae")
    assert (real.base_dim, real.z_dim, real.dim_mult, real.num_res_blocks, real.temporal_downsample) == (
        96,
        16,
        (1, 2, 4, 4),
        2,
        (False, True, True),
    )
    assert real.temporal_upsample == (True, True, False)
    assert (real.temporal_factor, real.spatial_factor, real.first_chunk_padding) == (4, 8, 3)
    assert [real.video_frames(t) for t in (1, 2, 3, 21)] == [1, 5, 9, 81]
    assert WanVAEConfig.from_dict(json.loads(real.to_json())) == real
    with pytest.raises(ValueError, match="temporal_downsample must be 3 bools"):
        WanVAEConfig(temporal_downsample=(True, True))
    with pytest.raises(ValueError, match="latents_mean must be 4 finite floats"):
        WanVAEConfig(z_dim=4)
    with pytest.raises(ValueError, match="unknown Wan VAE preset"):
        preset("wan2.2-vae")


def test_real_size_feature_cache():
    """32 caches and ~1.8 GiB in bf16 per stream at 480x832, against a count written out from the architecture:
    every temporal-kernel-3 conv keeps its last 2 input frames."""
    real = preset("wan2.1-vae")
    shapes = jax.eval_shape(lambda: init_decoder_state(real, 1, 60, 104, jnp.bfloat16)).caches
    assert len(shapes) == 32
    h, w = 60, 104
    convs = [(1, 16, 1)]  # (spatial scale, input channels, how many): conv_in on the latents
    convs += [(1, 384, 4)]  # middle: 2 residual blocks x 2 convs
    convs += [(1, 384, 6), (1, 384, 1)]  # stage 0: 3 residual blocks at 384, then its time conv
    convs += [(2, 192, 1), (2, 384, 5), (2, 384, 1)]  # stage 1: 192 -> 384, then its time conv
    convs += [(4, 192, 6)]  # stage 2 (no time conv: spatial-only upsampling)
    convs += [(8, 96, 6), (8, 96, 1)]  # stage 3 and conv_out
    assert sum(n for _, _, n in convs) == 32
    expected = sum(2 * (h * s) * (w * s) * c * n * 2 for s, c, n in convs)
    assert cache_bytes(real, 1, 60, 104, jnp.bfloat16) == expected
    assert 1.7 * 2**30 < expected < 1.85 * 2**30


@pytest.mark.slow
def test_whole_decode_shape_and_range(whole):
    assert whole.shape == (1, 25, 16, 24, 3)
    assert 0.05 < np.abs(whole).mean() < 5 and np.isfinite(whole).all()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [(1, 3, 3), (3, 3, 1), (1, 2, 3, 1), (1,) * 7])
def test_streaming_equals_whole_decode(params, latents, whole, schedule):
    pieces = _stream(params, latents, schedule)
    np.testing.assert_array_equal(pieces[0][:, : CONFIG.first_chunk_padding], 0.0)  # first-chunk padding
    streamed = np.concatenate([pieces[0][:, CONFIG.first_chunk_padding :], *pieces[1:]], axis=1)
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=TOL, rtol=0)


@pytest.mark.slow
def test_zero_cache_shortcut_is_not_the_reference(params, latents, whole):
    """Self-Forcing's demo shortcut (an ordinary zero-cache chunk, then drop 3 frames) is what `first=False` on a
    fresh state computes; it must differ from the reference decode — otherwise the tests above prove nothing."""
    state = init_decoder_state(CONFIG, 1, H, W)
    shortcut = DecoderState(state.caches, jnp.asarray(False))
    frames, _ = decode_chunk(params, CONFIG, shortcut, latents[:, :3], clamp=False)
    assert np.abs(np.asarray(frames)[:, 3:] - whole[:, :9]).max() > 1e-2


@pytest.mark.slow
def test_one_program_for_first_and_later_chunks(params, latents):
    state = init_decoder_state(CONFIG, 1, H, W)
    frames, state = decode_chunk(params, CONFIG, state, latents[:, :3])  # may compile (once per chunk length)
    with count_compiles(decode_chunk) as new:
        for start in (3, 0, 2, 4):
            frames, state = decode_chunk(params, CONFIG, state, latents[:, start : start + 3])
        fresh = init_decoder_state(CONFIG, 1, H, W)  # a new stream reuses it too: `first` is traced
        frames, fresh = decode_chunk(params, CONFIG, fresh, latents[:, :3])
        jax.block_until_ready(frames)
    assert new() == 0


@pytest.mark.slow
def test_state_is_donated(params, latents):
    state = init_decoder_state(CONFIG, 1, H, W)
    old = state.caches["conv_out"]
    _, new_state = decode_chunk(params, CONFIG, state, latents[:, :1])
    jax.block_until_ready(new_state)
    assert old.is_deleted()  # the input caches' buffers were handed to the output
    assert not bool(new_state.first)
    assert set(new_state.caches) == set(state.caches)
    assert all(new_state.caches[k].shape == state.caches[k].shape for k in state.caches)


@pytest.mark.slow
def test_donated_cache_is_aliased_not_copied(params, latents):
    state = init_decoder_state(CONFIG, 1, H, W)
    nbytes = sum(x.nbytes for x in state.caches.values())
    compiled = decode_chunk.lower(params, CONFIG, state, latents[:, :3]).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes >= nbytes


def test_errors_name_the_problem(params, latents):
    state = init_decoder_state(CONFIG, 1, H, W)
    with pytest.raises(ValueError, match=r"latents must be \[batch, frames, height, width, 16\].*\(1, 7, 2, 3, 4\)"):
        decode_chunk(params, CONFIG, state, latents[..., :4])
    with pytest.raises(
        ValueError,
        match="latents of batch 1 and size 4x3 do not match the decoder state, made for batch 1 and latent size 2x3",
    ):
        decode_chunk(params, CONFIG, state, jnp.zeros((1, 3, 4, 3, 16)))
    assert not state.caches["conv_in"].is_deleted()  # a refused call touches nothing
    with pytest.raises(ValueError, match="batch must be >= 1"):
        init_decoder_state(CONFIG, 0, H, W)
    with pytest.raises(ValueError, match=r"video must have 1 \+ 4 \* k frames"):
        encode(params, CONFIG, jnp.zeros((1, 4, 16, 24, 3)))
    with pytest.raises(ValueError, match="multiples of 8"):
        encode(params, CONFIG, jnp.zeros((1, 5, 12, 24, 3)))
    with pytest.raises(ValueError, match="16 channels last"):
        normalize(CONFIG, jnp.zeros((2, 4)))


@pytest.mark.slow
def test_encode_shapes(params):
    video = jax.random.uniform(jax.random.key(2), (1, 5, 16, 24, 3), minval=-1, maxval=1)
    mean, logvar = encode(params, CONFIG, video)
    assert mean.shape == logvar.shape == (1, 2, 2, 3, 16)
    assert np.isfinite(np.asarray(mean)).all() and float(jnp.abs(mean).mean()) > 0.01


def test_normalize_round_trip():
    z = jax.random.normal(jax.random.key(3), (2, 3, 16))
    np.testing.assert_allclose(np.asarray(normalize(CONFIG, denormalize(CONFIG, z))), np.asarray(z), atol=1e-5)
    np.testing.assert_allclose(np.asarray(denormalize(CONFIG, jnp.zeros(16))), CONFIG.latents_mean, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(denormalize(CONFIG, jnp.ones(16))), np.add(CONFIG.latents_mean, CONFIG.latents_std), atol=1e-5
    )


@pytest.mark.slow
def test_stream_decoder_drops_first_chunk_padding(params, latents, whole):
    sink = StreamDecoder(params, CONFIG, latent_height=H, latent_width=W)
    normed = normalize(CONFIG, latents)
    out = [np.asarray(sink(normed[:, :1])), np.asarray(sink(normed[:, 1:4])), np.asarray(sink(normed[:, 4:7]))]
    assert [o.shape[1] for o in out] == [1, 12, 12] and sink.frames_out == 25
    assert all(o.dtype == np.uint8 for o in out)
    expected = np.round((np.clip(whole, -1, 1) + 1) * 127.5)
    got = np.concatenate(out, axis=1).astype(np.float64)
    assert np.abs(got - expected).max() <= 1  # rounding of values within 1e-5 of a .5 boundary
    sink.reset()
    assert sink.first and sink.frames_out == 0 and sink(normed[:, :1]).shape[1] == 1


def test_checkpoint_round_trip_and_foreign_dirs(tmp_path, params):
    save(str(tmp_path / "vae"), CONFIG, params)
    config, loaded = load(str(tmp_path / "vae"))
    assert config == CONFIG
    chex.assert_trees_all_equal(loaded, params)
    dit = tmp_path / "dit"
    dit.mkdir()
    (dit / "config.json").write_text(json.dumps({"format": "jaxkv-wan", "format_version": 1}))
    with pytest.raises(CheckpointError, match="jaxkv DiT checkpoint, not a VAE one"):
        load(str(dit))
    with pytest.raises(ValueError, match="params do not match the Wan VAE config"):
        save(str(tmp_path / "bad"), preset("wan2.1-vae"), params)
    assert not (tmp_path / "bad").exists()
