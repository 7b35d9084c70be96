"""`jaxkv.decoding`: a chunk decoded from the VAE decoder state the stream carries equals the same chunks decoded by
one `StreamDecoder` keeping its own state, bit for bit, also across a session saved and resumed between two chunks
(the state travels in ``carry.extras["vae_decoder"]``); caches that do not fit are refused before anything changes.
The end-to-end checks (``jaxkv generate``'s mp4 resumed, the Pipeline's frames) are in test_session_cli.py and
test_pipeline.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import decoding
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.models import wan, wan_vae
from jaxkv.stream import Stream

H = W = 4  # latent size: 32x32 frames


@pytest.fixture(scope="module")
def parts():
    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))
    rc = R.RolloutConfig(latent_height=H, latent_width=W, chunk_frames=3, window_frames=9, sink_frames=3)
    vae = wan_vae.preset("tiny")
    return config, params, rc, vae, wan_vae.init_params(5, vae)


def _stream(parts) -> Stream:
    config, params, rc, *_ = parts
    context = jax.random.normal(jax.random.key(1), (1, config.text_len, config.text_dim))
    return Stream(params, config, rc, context, key=jax.random.key(2), history=False)


def _decoder(parts, h=H, w=W):
    *_, vae, vae_params = parts
    return wan_vae.StreamDecoder(vae_params, vae, latent_height=h, latent_width=w)


def _chunks(parts, n=3):
    vae = parts[3]
    return [jax.random.normal(jax.random.key(10 + i), (1, 3, H, W, vae.z_dim)) for i in range(n)]


def test_decoding_from_the_carry_equals_one_decoder_and_survives_a_session(parts, tmp_path):
    config, params, rc, *_ = parts
    chunks = _chunks(parts)
    alone = _decoder(parts)
    want = [np.asarray(alone(c)) for c in chunks]  # 9, 12, 12 frames: the first chunk drops the padding
    assert [w.shape[1] for w in want] == [9, 12, 12]

    stream, decoder = _stream(parts), _decoder(parts)
    assert S.VAE_DECODER not in stream.carry.extras
    decoding.adopt(stream, decoder)  # a new stream takes the decoder's fresh state
    before = stream.carry.extras[S.VAE_DECODER]
    np.testing.assert_array_equal(decoding.decode(stream, decoder, chunks[0]), want[0])
    assert stream.carry.extras[S.VAE_DECODER] is not before  # the new state replaced the carried one

    S.save(str(tmp_path / "s"), stream.session())  # the carried decoder state is saved with the stream
    resumed = Stream.from_session(params, config, rc, S.load(str(tmp_path / "s"), config, rc), history=False)
    fresh = _decoder(parts)  # a new decoder continues the session's caches: no second first frame
    decoding.adopt(resumed, fresh)
    assert not fresh.first
    for c, w in zip(chunks[1:], want[1:], strict=True):
        np.testing.assert_array_equal(decoding.decode(resumed, fresh, c), w)
        np.testing.assert_array_equal(decoding.decode(stream, decoder, c), w)


def test_adopt_refuses_caches_that_do_not_fit_and_changes_nothing(parts):
    stream = _stream(parts)
    decoding.adopt(stream, _decoder(parts))
    carried = stream.carry
    other = _decoder(parts, h=2, w=2)  # another video size
    with pytest.raises(ValueError, match="do not fit this VAE and video size"):
        decoding.adopt(stream, other)
    assert stream.carry is carried and other.first


def test_a_stateless_decoder_leaves_the_carry_alone(parts):
    stream = _stream(parts)
    carried, calls = stream.carry, []

    def toy(latents):
        calls.append(latents)
        return latents[..., :3]

    decoding.adopt(stream, toy)
    out = decoding.decode(stream, toy, _chunks(parts, 1)[0])
    assert out.shape == (1, 3, H, W, 3) and len(calls) == 1
    assert stream.carry is carried and S.VAE_DECODER not in stream.carry.extras
