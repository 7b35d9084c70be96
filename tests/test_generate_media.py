"""`jaxkv generate` video out and text in: the mp4 (and --frames) equals an independent whole-clip decode of the
latents it wrote, an interrupted run leaves a playable mp4 of the chunks done, --prompt gives exactly the context
`TextEncoder.encode` gives, and bad combinations are refused before anything is written."""

from __future__ import annotations

import json
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("av")

from jaxkv import generate as G
from jaxkv.generate import inputs, loop
from jaxkv.models import umt5, wan_vae
from jaxkv.models.umt5.tokenizer import tiny_tokenizer_json
from jaxkv.video import read_video_info, to_uint8

# 4x4 latents (32x32 video), 2 chunks of 3 latent frames: T = 6 latent frames -> 1 + 4 * 5 = 21 video frames.
# The random-weight model with the tiny random VAE (the toy-world default's video: test_generate_toy.py).
RANDOM = ["--preset", "tiny", "--random-weights"]
SMALL = ["--height", "4", "--width", "4", "--num-chunks", "2", "--no-progress", *RANDOM]


def whole_decode(params, config, latents):
    """The reference: the whole clip decoded at once (not streamed), uint8 [batch, 1 + 4(T-1), H, W, 3]."""
    return np.asarray(to_uint8(wan_vae.decode(params, config, wan_vae.denormalize(config, jnp.asarray(latents)))))


@pytest.mark.slow
def test_default_writes_an_mp4_equal_to_the_whole_decode(tmp_path, capsys):
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--frames", "npy", *SMALL]) == 0
    printed = capsys.readouterr().out
    latents = G.load_latents(str(out))
    t = latents.shape[1]
    assert t == 6
    info = read_video_info(str(out / "video.mp4"))
    assert info == {"frames": 1 + 4 * (t - 1), "height": 32, "width": 32, "fps": 16.0}
    frames = np.concatenate([np.load(out / "frames" / f"chunk_{i:06d}.npy") for i in range(2)], axis=1)
    config = wan_vae.preset("tiny")
    ref = whole_decode(wan_vae.init_params(inputs.DEFAULT_VAE_SEED, config, jnp.float32), config, latents)
    assert frames.shape == ref.shape == (1, 21, 32, 32, 3)
    assert np.abs(frames.astype(int) - ref).max() <= 1  # streamed vs whole in f32, then rounded to bytes
    assert ref.std() > 1  # not a constant picture
    summary = json.loads((out / "summary.json").read_text())
    assert summary["video"] == str(out / "video.mp4") and summary["video_frames"] == 21
    assert summary["fps"] == 16 and summary["video_size"] == [32, 32]
    assert summary["denoise_latent_frames_per_s"] > 0 and summary["end_to_end_video_frames_per_s"] > 0
    assert summary["end_to_end_latent_frames_per_s"] * 4 > summary["end_to_end_video_frames_per_s"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"video.mp4", "frames"} <= set(manifest["entries"])
    assert "video        " in printed and "throughput   denoise only" in printed
    # a previous output with a video and frames may be replaced with --overwrite
    assert G.main(["--out", str(out), "--overwrite", "--no-video", *SMALL]) == 0
    assert not (out / "video.mp4").exists() and not (out / "frames").exists()


@pytest.mark.slow
def test_mp4_sink_streams_chunks_into_a_playable_mp4(tmp_path):
    """The sink alone (no DiT): three 1-frame chunks of 2x2 latents -> 1 + 4 * 2 frames of 16x16, equal to the
    whole-clip decode."""
    config = wan_vae.preset("tiny")
    params = wan_vae.init_params(1, config, jnp.float32)
    from jaxkv.generate.video import Mp4Sink

    latents = np.random.default_rng(0).standard_normal((1, 3, 2, 2, 16)).astype(np.float32)
    decoder = wan_vae.StreamDecoder(params, config, latent_height=2, latent_width=2, batch=1)
    sink = Mp4Sink(str(tmp_path), decoder, batch=1, fps=12, frames="npy")
    for i in range(3):
        sink.write_chunk(i, latents[:, i : i + 1])
    summary = sink.close()
    assert summary["video_frames"] == 9 and summary["video_size"] == [16, 16]
    assert read_video_info(str(tmp_path / "video.mp4")) == {"frames": 9, "height": 16, "width": 16, "fps": 12.0}
    frames = np.concatenate([np.load(tmp_path / "frames" / f"chunk_{i:06d}.npy") for i in range(3)], axis=1)
    assert np.abs(frames.astype(int) - whole_decode(params, config, latents)).max() <= 1
    # the contact sheet: all 9 frames (fewer than its 32 slots), 8 to a row, 1-pixel gaps
    from tests.helpers.images import read_png

    assert summary["contact_sheet_frames"] == list(range(9))
    sheet = read_png(tmp_path / "contact_sheet.png")
    assert sheet.shape == (2 * 16 + 1, 8 * 16 + 7, 3)
    np.testing.assert_array_equal(sheet[17:, :16], frames[0, 8])
    np.testing.assert_array_equal(sheet[:16, 17 * 3 : 17 * 3 + 16], frames[0, 3])


@pytest.mark.slow
def test_no_video_writes_latents_only(tmp_path):
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--no-video", *SMALL]) == 0
    assert sorted(os.listdir(out)) == ["latents", "manifest.json", "preview.png", "summary.json"]
    assert json.loads((out / "summary.json").read_text())["vae"] is None


@pytest.mark.slow
def test_vae_dir_fps_and_png_frames(tmp_path):
    config = wan_vae.preset("tiny")
    params = wan_vae.init_params(7, config, jnp.float32)
    wan_vae.save(str(tmp_path / "vae"), config, params)
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--vae", str(tmp_path / "vae"), "--fps", "8", "--frames", "png", *SMALL]) == 0
    assert read_video_info(str(out / "video.mp4")) == {"frames": 21, "height": 32, "width": 32, "fps": 8.0}
    from tests.helpers.images import read_png

    names = sorted(os.listdir(out / "frames"))
    assert names == [f"frame_0_{i:06d}.png" for i in range(21)]
    ref = whole_decode(params, config, G.load_latents(str(out)))
    pngs = np.stack([read_png(out / "frames" / n) for n in names])
    assert np.abs(pngs.astype(int) - ref[0]).max() <= 1
    # another seed gives other frames: the --vae params were used, not the default's
    other = whole_decode(
        wan_vae.init_params(inputs.DEFAULT_VAE_SEED, config, jnp.float32), config, G.load_latents(str(out))
    )
    assert np.abs(other.astype(int) - ref).max() > 10


@pytest.mark.slow
def test_interrupted_run_leaves_a_playable_mp4_of_the_chunks_done(tmp_path, capsys, monkeypatch):
    real, calls = loop._chunk_finite, []

    def signal_on_second(x):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(x)

    monkeypatch.setattr(loop, "_chunk_finite", signal_on_second)
    out = tmp_path / "o"
    argv = ["--out", str(out), *SMALL[:4], *RANDOM, "--num-chunks", "6", "--no-progress"]
    assert G.main(argv) == 128 + signal.SIGINT
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    t = 3 * manifest["chunks"]
    assert 1 <= manifest["chunks"] < 6
    assert read_video_info(str(out / "video.mp4")) == {
        "frames": 1 + 4 * (t - 1),
        "height": 32,
        "width": 32,
        "fps": 16.0,
    }


def _save_text_encoder(path, seed=3, **overrides):
    config = umt5.preset("tiny")
    if overrides:
        import dataclasses

        config = dataclasses.replace(config, **overrides)
    umt5.save(
        str(path),
        config,
        umt5.init_params(config, seed),
        tokenizer_files={"tokenizer.json": tiny_tokenizer_json().encode()},
    )
    return path


def _run_latents(tmp_path, name, argv):
    out = tmp_path / name
    assert (
        G.main(["--out", str(out), "--no-video", *SMALL[:4], *RANDOM, "--num-chunks", "1", "--no-progress", *argv]) == 0
    )
    return G.load_latents(str(out)), json.loads((out / "summary.json").read_text())


def test_prompt_on_the_default_is_the_tiny_encoders_context(tmp_path):
    prompt = "a red fox, snow"
    context = umt5.TextEncoder.tiny().encode([prompt])[0]
    np.save(tmp_path / "ctx.npy", context)
    by_prompt, summary = _run_latents(tmp_path, "p", ["--prompt", prompt])
    by_file, _ = _run_latents(tmp_path, "f", ["--context", str(tmp_path / "ctx.npy")])
    np.testing.assert_array_equal(by_prompt, by_file)
    other, _ = _run_latents(tmp_path, "q", ["--prompt", "a blue whale"])
    assert np.abs(other - by_prompt).max() > 1e-3  # the prompt reaches the model
    assert summary["prompt"] == prompt and summary["text_encoder_released"] is False


@pytest.mark.slow
def test_prompt_with_a_saved_encoder_guidance_cache_and_offload(tmp_path, monkeypatch):
    enc_dir = _save_text_encoder(tmp_path / "enc")
    encoded = umt5.TextEncoder.load(str(enc_dir)).encode(["a fox", "blurry"])
    np.save(tmp_path / "pos.npy", encoded[0])
    np.save(tmp_path / "neg.npy", encoded[1])
    cache = tmp_path / "cache"
    argv = [
        "--prompt",
        "a fox",
        "--negative-prompt",
        "blurry",
        "--guidance-scale",
        "3",
        "--text-encoder",
        str(enc_dir),
        "--embeddings-cache",
        str(cache),
        "--offload-text-encoder",
    ]
    by_prompt, summary = _run_latents(tmp_path, "p", argv)
    assert summary["text_encoder_released"] is True and summary["text_encoder"] == str(enc_dir)
    assert len([n for n in os.listdir(cache) if n.endswith(".npy")]) == 2
    by_file, _ = _run_latents(
        tmp_path,
        "f",
        [
            "--context",
            str(tmp_path / "pos.npy"),
            "--negative-context",
            str(tmp_path / "neg.npy"),
            "--guidance-scale",
            "3",
        ],
    )
    np.testing.assert_array_equal(by_prompt, by_file)
    # a repeated prompt is served from the cache: the encoder is not run again
    monkeypatch.setattr(umt5.encoder, "encode_prompts", lambda *a: pytest.fail("encoded again"))
    again, _ = _run_latents(tmp_path, "again", argv)
    np.testing.assert_array_equal(again, by_prompt)


def _vae_config_dir(path, config):
    os.makedirs(path)
    (path / "config.json").write_text(wan_vae.checkpoint.config_json(config))
    return path


BAD = [
    (["--prompt", "x", "--context", "c.npy"], "--prompt and --context"),
    (["--negative-prompt", "x"], "--negative-prompt needs --prompt"),
    (["--text-encoder", "d"], "--text-encoder needs --prompt"),
    (["--embeddings-cache", "d"], "--embeddings-cache needs --prompt"),
    (["--offload-text-encoder"], "--offload-text-encoder needs --prompt"),
    (["--prompt", "x", "--negative-prompt", "y"], "--negative-prompt needs --guidance-scale"),
    (["--prompt", "x", "--guidance-scale", "2"], "needs --negative-prompt"),
    (["--vae", "d", "--no-video"], "--vae has no effect with --no-video"),
    (["--fps", "8", "--no-video"], "--fps has no effect with --no-video"),
    (["--frames", "png", "--no-video"], "--frames has no effect with --no-video"),
    (["--vae", "{tmp}/missing"], "not a jaxkv Wan VAE checkpoint directory"),
    (["--vae", "{tmp}/vae48"], "decodes 48-channel latents; the model makes 16"),
    (["--vae", "{tmp}/enc"], "--vae"),
    (["--prompt", "x", "--text-encoder", "{tmp}/vae48"], "--text-encoder"),
    (["--prompt", "x", "--text-encoder", "{tmp}/enc64"], "gives [16, 64] contexts; the model takes text_dim 32"),
    (["--prompt", "x", "--text-encoder", "{tmp}/notok"], "--text-encoder"),
    (
        ["--prompt", "x", "--preset", "wan2.1-t2v-1.3b"],
        "tiny text encoder gives [16, 32] contexts; the model takes text_dim 4096",
    ),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m for _, m in BAD])
def test_bad_combinations_are_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    if any("{tmp}" in a for a in argv):
        _vae_config_dir(
            tmp_path / "vae48", wan_vae.WanVAEConfig(z_dim=48, latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48)
        )
        _save_text_encoder(tmp_path / "enc")
        _save_text_encoder(tmp_path / "enc64", dim=64)
        _save_text_encoder(tmp_path / "notok")
        os.remove(tmp_path / "notok" / "tokenizer.json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--no-progress", *RANDOM, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
