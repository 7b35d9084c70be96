"""Continuation from pixels (`jaxkv.continuation`): the size and count rules against hand-built frames; the context
a continued stream commits against the cache a stream that generated the same latents holds; sessions of a continued
stream; the Wan VAE path (encoder and the decoder carrying on); files refused with their problem named; the toy world
continued vs started from noise; and ``jaxkv generate --image / --video``."""

from __future__ import annotations

import json
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import continuation as C
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.generate.png import write_png
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream
from jaxkv.video import VideoWriter

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
RC = R.RolloutConfig(
    2, 4, chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500), context_noise=20.0)
)


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed=1, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


# ------------------------------------------------------------------------------------------------ the rules


def _numbered(t, h=4, w=4):
    """uint8 [t, h, w, 3] whose frame i is filled with the value i + 1."""
    return np.broadcast_to(np.arange(1, t + 1, dtype=np.uint8)[:, None, None, None], (t, h, w, 3)).copy()


@pytest.mark.parametrize(
    "t, keep, padded, dropped",
    [(1, 9, 8, 0), (5, 9, 4, 0), (9, 9, 0, 0), (10, 9, 0, 1), (20, 9, 0, 11), (21, 21, 0, 0), (34, 33, 0, 1)],
)
def test_wan_counts_keep_the_latest_frames_or_repeat_the_first_in_front(t, keep, padded, dropped):
    # Wan: 1 + 4 (L - 1) frames -> L latent frames; 3-frame chunks take 9, 21, 33 ... frames
    counted = C.whole_chunks(_numbered(t), 3, 4)
    values = counted.frames[:, 0, 0, 0]
    assert (len(values), counted.padded, counted.dropped) == (keep, padded, dropped)
    assert counted.chunks == (keep + 3) // 12
    if padded:
        assert list(values) == [1] * padded + list(range(1, t + 1))
    else:
        assert list(values) == list(range(t - keep + 1, t + 1))  # the latest frames, in order


def test_toy_counts_and_a_picture_is_a_still_chunk():
    assert [C.whole_chunks(_numbered(t), 3).frames.shape[0] for t in (1, 2, 3, 5, 6, 7)] == [3, 3, 3, 3, 6, 6]
    assert list(C.whole_chunks(_numbered(7), 3).frames[:, 0, 0, 0]) == [2, 3, 4, 5, 6, 7]
    assert list(C.whole_chunks(_numbered(1), 3).frames[:, 0, 0, 0]) == [1, 1, 1]
    batch = np.stack([_numbered(2), 10 + _numbered(2)])  # time on axis -4
    assert C.whole_chunks(batch, 3).frames[:, :, 0, 0, 0].tolist() == [[1, 1, 2], [11, 11, 12]]
    with pytest.raises(C.ContinuationError, match="zero frames"):
        C.whole_chunks(_numbered(1)[:0], 3)
    assert C.frames_for_chunks(2, 3, 4) == 21 and C.frames_for_chunks(2, 3, 1) == 6


def test_fit_frames_scales_to_cover_and_keeps_the_centre():
    # 64 x 128 (wide): left half red, right half blue, a green column band 56..71 in the middle
    frame = np.zeros((64, 128, 3), np.uint8)
    frame[:, :64] = (200, 0, 0)
    frame[:, 64:] = (0, 0, 200)
    frame[:, 56:72] = (0, 200, 0)
    out = C.fit_frames(frame, 32, 32)  # scale 0.5 -> 32 x 64, centre 32 columns = source columns 32..95
    assert out.shape == (1, 32, 32, 3) and out.dtype == np.uint8
    assert np.abs(out[0, 16, 1].astype(int) - (200, 0, 0)).max() <= 2  # source column ~34: red
    assert np.abs(out[0, 16, 30].astype(int) - (0, 0, 200)).max() <= 2  # source column ~92: blue
    assert np.abs(out[0, 16, 15].astype(int) - (0, 200, 0)).max() <= 2  # source column ~62: green, the centre
    # a tall frame keeps its vertical centre; enlarging works too
    tall = np.zeros((40, 10, 3), np.uint8)
    tall[:15], tall[25:] = 255, 255  # white top and bottom, black middle rows 15..24
    up = C.fit_frames(tall, 20, 20)  # scale 2 -> 80 x 20, centre rows 30..49 = source rows 15..24
    assert up[0, 1:-1].max() <= 8
    # the stream's own size is passed through bit for bit, a batch of frames keeps its count
    same = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    assert np.array_equal(C.fit_frames(same, 32, 32), same)
    assert C.fit_frames(np.repeat(frame[None], 2, 0), 16, 8).shape == (2, 16, 8, 3)
    for bad in (frame.astype(np.float32), frame[..., :2], frame[:0], np.zeros((4, 4), np.uint8)):
        with pytest.raises(C.ContinuationError, match="uint8 RGB"):
            C.fit_frames(bad, 32, 32)


# ------------------------------------------------------------------------------------------------ files


def _png(path, frame):
    write_png(str(path), frame)
    return str(path)


def _mp4(path, frames):
    with VideoWriter(str(path), 16, crf=0) as v:
        v.append(frames)
    return str(path)


def test_read_frames_from_png_jpeg_and_mp4(tmp_path):
    frame = np.zeros((48, 64, 3), np.uint8)
    frame[:, :32] = (220, 30, 30)
    got = C.read_frames(_png(tmp_path / "a.png", frame), 48, 64, image=True)
    assert got.source_size == (48, 64) and np.array_equal(got.frames, frame[None])  # PNG, same size: exact
    small = C.read_frames(str(tmp_path / "a.png"), 24, 24, image=True).frames  # 48x64 -> 24x32, centre 24 columns
    assert small.shape == (1, 24, 24, 3) and small[0, 12, 2, 0] > 200 and small[0, 12, 21, 0] < 40
    import av

    with av.open(str(tmp_path / "a.jpg"), "w", format="image2") as c:  # a JPEG through PyAV's own encoder
        s = c.add_stream("mjpeg")
        s.width, s.height, s.pix_fmt = 64, 48, "yuvj420p"
        for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    jpeg = C.read_frames(str(tmp_path / "a.jpg"), 48, 64, image=True).frames
    assert np.abs(jpeg.astype(int) - frame).mean() < 8
    clip = np.repeat(frame[None], 5, axis=0)
    clip[:, :, :, 1] = np.arange(5, dtype=np.uint8)[:, None, None] * 40  # a green ramp over time
    video = C.read_frames(_mp4(tmp_path / "c.mp4", clip), 48, 64).frames
    assert video.shape == (5, 48, 64, 3)
    assert np.abs(video[:, 24, 48, 1].astype(int) - clip[:, 24, 48, 1]).max() <= 8  # frames in order


def test_bad_files_are_refused_with_their_problem(tmp_path):
    frame = np.zeros((16, 16, 3), np.uint8)
    cases = {
        "no such file": str(tmp_path / "missing.png"),
        "is a directory": str(tmp_path),
        "not an image that can be decoded": str(tmp_path / "junk.png"),
        "more than one frame": _mp4(tmp_path / "two.mp4", np.stack([frame, frame])),
    }
    (tmp_path / "junk.png").write_bytes(b"this is not a picture")
    for message, path in cases.items():
        with pytest.raises(C.ContinuationError, match=message):
            C.read_frames(path, 16, 16, image=True)
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(C.ContinuationError, match="is empty"):
        C.read_frames(str(tmp_path / "empty.mp4"), 16, 16)
    (tmp_path / "junk.mp4").write_bytes(b"junk" * 100)
    with pytest.raises(C.ContinuationError, match=r"junk.mp4 is not a video that can be decoded \(InvalidDataError"):
        C.read_frames(str(tmp_path / "junk.mp4"), 16, 16)
    import av

    with av.open(str(tmp_path / "sound.wav"), "w") as c:  # audio only: no picture
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
    with pytest.raises(C.ContinuationError, match="sound.wav holds no video stream"):
        C.read_frames(str(tmp_path / "sound.wav"), 16, 16)


# ------------------------------------------------------------------------------------------------ the cache


def test_a_continued_stream_commits_what_a_generating_stream_holds():
    # a stream generates 4 chunks (past the first eviction: sink 1 + window 2); another starts from those latents:
    # its cache (K/V, positions, clock) is the first's, and both generate the same next chunks
    params, ctx, key = _params(20), _ctx(21, batch=2), jax.random.key(22)
    first = Stream(params, CFG, RC, ctx, num_chunks=6, key=key)
    latents = jnp.concatenate([next(first) for _ in range(4)], axis=1)  # [2, 4, 2, 4, 4]
    continued = C.start_stream(params, CFG, RC, ctx, latents, num_chunks=2, key=key)
    assert continued.index == continued.start == 4 and first.index == 4
    a, b = continued.state.cache, first.state.cache
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.chunk_start, b.chunk_start)
    chex.assert_trees_all_close(a, b, atol=1e-5, rtol=1e-7)
    ours = jnp.concatenate(list(continued), axis=1)
    theirs = jnp.concatenate(list(first), axis=1)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5)


@pytest.mark.slow  # ~40 s on 2 loaded cores: the prompt switch compiles a re-cache
def test_a_continued_stream_recaches_the_given_chunks():
    # a continued stream holds the given chunks in its latent ring, as one that generated them, so a
    # prompt switch re-caches them alike
    params, ctx, key = _params(20), _ctx(21, batch=2), jax.random.key(22)
    first = Stream(params, CFG, RC, ctx, num_chunks=4, key=key)
    latents = jnp.concatenate(list(first), axis=1)
    gen = Stream(params, CFG, RC, ctx, num_chunks=5, key=key)
    for _ in range(4):
        next(gen)
    sw = C.start_stream(params, CFG, RC, ctx, latents, num_chunks=1, key=key)
    assert np.array_equal(sw.ring.chunks, gen.ring.chunks)
    np.testing.assert_allclose(np.asarray(sw.ring.latents), np.asarray(gen.ring.latents), atol=1e-5)
    for s in (sw, gen):
        s.switch_prompt(_ctx(23, batch=2))
    np.testing.assert_allclose(np.asarray(next(sw)), np.asarray(next(gen)), atol=1e-4)


def test_commit_checks_before_touching_the_cache():
    params, ctx, key = _params(), _ctx(batch=2), jax.random.key(0)
    latents = jax.random.normal(jax.random.key(1), (2, 2, 2, 4, 4))
    stream = Stream(params, CFG, RC, ctx, num_chunks=2, key=key)
    before = jax.device_get(stream.state.cache)  # a host copy: the cache as it was
    for bad, message in (
        (latents[:1], "batch"),
        (latents[:, :0], "whole chunks"),
        (latents[..., :2], "the stream's"),
        (latents.at[0, 0, 0, 0, 0].set(jnp.nan), "non-finite"),
    ):
        with pytest.raises(ValueError, match=message):
            stream.commit(bad)
    chex.assert_trees_all_equal(stream.state.cache, before)
    assert stream.index == 0
    next(stream)
    with pytest.raises(ValueError, match="already at chunk 1"):
        stream.commit(latents)


@pytest.mark.slow  # ~20 s on 2 loaded cores
def test_a_continued_stream_saves_and_resumes(tmp_path):
    params, ctx, key = _params(30), _ctx(31), jax.random.key(32)
    latents = jax.random.normal(jax.random.key(33), (1, 3, 2, 4, 4))
    whole = C.start_stream(params, CFG, RC, ctx, latents, num_chunks=4, key=key)
    want = [np.asarray(next(whole)) for _ in range(4)]
    part = C.start_stream(params, CFG, RC, ctx, latents, num_chunks=4, key=key)
    got = [np.asarray(next(part)) for _ in range(2)]
    path = S.save(str(tmp_path / "s"), part.session())
    resumed = Stream.from_session(params, CFG, RC, S.load(path, CFG, RC), num_chunks=2)
    assert resumed.start == 5  # 3 given + 2 generated
    got += [np.asarray(x) for x in resumed]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------ encoders


def test_toy_encoder_context_is_the_latent_map_of_the_counted_frames():
    from jaxkv.toyworld import latents as L
    from jaxkv.toyworld import world

    clip = world.render(world.sample_scene(np.random.default_rng(0), "a red circle, slow"), 7)
    latent_map = L.LatentMap.fit(clip)
    rc = R.RolloutConfig(16, 16, chunk_frames=3, window_frames=6, sink_frames=3)
    got = C.context_from_frames(clip, C.ToyEncoder(latent_map), rc, batch=2)
    assert (got.chunks, got.padded, got.dropped) == (2, 0, 1)
    want = latent_map.encode(clip[1:])
    assert got.latents.shape == (2, 6, 16, 16, 16)
    np.testing.assert_array_equal(np.asarray(got.latents), np.stack([want, want]))
    picture = C.context_from_frames(clip[3:4], C.ToyEncoder(latent_map), rc)
    assert picture.padded == 2 and np.array_equal(np.asarray(picture.latents[0]), latent_map.encode(clip[[3, 3, 3]]))
    with pytest.raises(C.ContinuationError, match="64x64.*fit_frames"):
        C.context_from_frames(clip[:, :32], C.ToyEncoder(latent_map), rc)


@pytest.mark.slow  # ~30 s on 2 loaded cores: the tiny VAE's encoder and decoder compile
def test_wan_encoder_and_the_decoder_carrying_on():
    from jaxkv.models import wan_vae

    vae = wan_vae.preset("tiny")
    params = wan_vae.init_params(0, vae, jnp.float32)
    rc = R.RolloutConfig(2, 2, chunk_frames=3, window_frames=6, sink_frames=3)
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    got = C.context_from_frames(picture[None], C.WanEncoder(params, vae), rc)
    assert (got.chunks, got.padded, got.frames.shape[1]) == (1, 8, 9)  # one frame -> 9 frames -> 3 latent frames
    video = np.repeat(picture[None, None], 9, axis=1).astype(np.float32) / 127.5 - 1.0
    mean, _ = wan_vae.encode(params, vae, jnp.asarray(video))
    np.testing.assert_allclose(np.asarray(got.latents), np.asarray(wan_vae.normalize(vae, mean)), atol=1e-5)
    # a decoder primed with the given latents decodes the next chunk as one stream through both would
    nxt = jax.random.normal(jax.random.key(3), (1, 3, 2, 2, 16))
    primed = wan_vae.StreamDecoder(params, vae, latent_height=2, latent_width=2)
    assert C.prime_decoder(primed, got.latents).shape == (1, 9, 16, 16, 3)
    one = wan_vae.StreamDecoder(params, vae, latent_height=2, latent_width=2)
    one(got.latents)
    np.testing.assert_array_equal(np.asarray(primed(nxt)), np.asarray(one(nxt)))
    assert primed.first is False
    with pytest.raises(C.ContinuationError, match="no encoder"):
        C.WanEncoder({k: v for k, v in params.items() if k != "encoder"}, vae)


# ------------------------------------------------------------------------------------------------ toy world


@pytest.mark.slow
def test_toy_world_continuation_beats_starting_from_noise():
    # the shipped model continuing the world's own clips from their first 9 frames puts the shapes nearer the
    # world's next 6 frames than its stream of the same prompt from noise (offset clips: canonical scenes from a
    # random frame; random scenes)
    from jaxkv.toyworld import continuation as TC
    from jaxkv.toyworld import model as toy_model

    model = toy_model.load()
    for scenes in ("offset", "random"):
        reading = TC.measure(model, clips=6, given=9, ahead=6, scenes=scenes)
        s = reading.summary()
        assert s["continued"]["median_px"] < 0.5 * s["noise"]["median_px"], (scenes, s)
        assert s["continued"]["hits"] > s["noise"]["hits"], (scenes, s)
        assert s["world"]["median_px"] < 1.0  # the floor: detection reads the world's frames to a pixel


# ------------------------------------------------------------------------------------------------ jaxkv generate


def _generate(argv):
    from jaxkv.generate import loop

    return loop.main(["--no-progress", *argv])


def test_generate_refuses_bad_given_frames_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    frame = np.zeros((64, 64, 3), np.uint8)
    png = _png(tmp_path / "a.png", frame)
    (tmp_path / "junk.mp4").write_bytes(b"junk")
    for argv, message in (
        (["--image", str(tmp_path / "nope.png")], "--image: .*nope.png: no such file"),
        (["--video", str(tmp_path / "junk.mp4")], "--video: .*junk.mp4 is not a video that can be decoded"),
        (["--image", png, "--video", png], "--image and --video both"),
        (["--image", png, "--resume", str(tmp_path)], "--resume continues a saved session"),
        (["--image", png, "--out", png], None),
    ):
        assert _generate([*argv, "--out", str(out)] if "--out" not in argv else argv) == 2
        err = capsys.readouterr().err
        if message:
            assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
        assert not out.exists()


@pytest.mark.slow
def test_generate_continues_a_video_and_resumes(tmp_path):
    # jaxkv generate --video: the toy world continues a clip of the world; the chunks written are the library's
    # continued stream's; --save-state / --resume carry on from a continued start bit for bit
    from jaxkv.generate import load_latents
    from jaxkv.toyworld import model as toy_model
    from jaxkv.toyworld import world

    clip = world.render(world.canonical_scene("a red circle and a blue square, slow"), 7, 40)
    path = _mp4(tmp_path / "clip.mp4", clip)
    a, b, c, state = (str(tmp_path / n) for n in ("a", "b", "c", "state"))
    assert _generate(["--video", path, "--num-chunks", "3", "--out", a]) == 0
    summary = json.load(open(os.path.join(a, "summary.json")))
    assert summary["first_chunk"] == 2 and summary["given"]["chunks"] == 2 and summary["given"]["dropped"] == 1
    assert summary["video_frames"] == 9
    model = toy_model.load()
    rc = model.settings.rollout_config()
    frames = C.read_frames(path, 64, 64).frames
    given = C.context_from_frames(frames, C.ToyEncoder(model.latent_map), rc)
    stream = C.start_stream(
        model.params,
        model.config,
        rc,
        model.context([model.settings.prompt]),
        given.latents,
        num_chunks=3,
        key=jax.random.key(0),
    )
    want = np.concatenate([np.asarray(x) for x in stream], axis=1)
    np.testing.assert_allclose(load_latents(a), want, atol=1e-5)
    assert _generate(["--video", path, "--num-chunks", "1", "--out", b, "--save-state", state]) == 0
    assert _generate(["--resume", state, "--num-chunks", "2", "--out", c]) == 0
    assert json.load(open(os.path.join(c, "summary.json")))["first_chunk"] == 3
    np.testing.assert_array_equal(np.concatenate([load_latents(b), load_latents(c)], axis=1), load_latents(a))
