"""`jaxkv generate`'s default, the toy world shipped in the package: with no arguments the flags resolve to the
release's own settings and prompt; its bad combinations are one-line UsageErrors before anything is written; a run
writes an mp4 and a contact sheet of num_chunks * chunk_frames 64x64 frames whose latents equal the toy model's
own stream (`jaxkv.toyworld`'s loader, not generate's) and whose frames equal its latent map's decode; a toy session
resumes bit for bit; toy prompts switch mid-stream; ``--preset tiny --random-weights`` is the old random path."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.generate import options, settings, toy
from jaxkv.generate.options import UsageError
from jaxkv.stream import Stream
from jaxkv.toyworld import model as toy_model
from jaxkv.toyworld import world

RELEASE = toy_model.RELEASE_DIR


def _settings_json(directory=RELEASE) -> dict:
    """The settings as toyworld.json spells them (read here, not through the code under test)."""
    with open(os.path.join(directory, toy_model.SETTINGS_FILE)) as f:
        return json.load(f)["settings"]


def _resolve(argv) -> object:
    """The settings as `jaxkv generate` resolves them (`jaxkv.generate.settings`; nothing loaded, nothing
    compiled)."""
    return settings.from_argv(argv)


def _copy_release(tmp_path, name="rel", **settings) -> str:
    """A copy of the shipped release with some settings replaced in its toyworld.json."""
    directory = tmp_path / name
    shutil.copytree(RELEASE, directory)
    path = directory / toy_model.SETTINGS_FILE
    meta = json.loads(path.read_text())
    meta["settings"].update(settings)
    path.write_text(json.dumps(meta))
    return str(directory)


# ------------------------------------------------------------------------------------------------ resolution (quick)


def test_no_arguments_resolve_to_the_shipped_release_and_its_settings():
    want = _settings_json()
    args = _resolve([])
    assert os.path.samefile(args.release, RELEASE) and not args.random_weights
    assert (args.height, args.width) == (16, 16)  # 64x64 frames in 4x4 latent patches
    assert (args.chunk_frames, args.window_frames, args.sink_frames) == (
        want["chunk_frames"],
        want["window_frames"],
        want["sink_frames"],
    )
    assert list(args.steps) == want["steps"] and args.shift == want["shift"] and args.rope == want["rope"]
    assert args.prompt == want["prompt"] and world.parse_prompt(args.prompt)
    assert args.num_chunks == options.DEFAULT_NUM_CHUNKS >= 200
    assert str(options.DEFAULT_NUM_CHUNKS) in options.build_parser().format_help()
    # the release's parts are the ones generate reads (the release path, latent map in place of the VAE)
    where = args.picked_up
    assert args.checkpoint == os.path.join(RELEASE, "dit") and args.vae is None
    assert args.text_encoder == os.path.join(RELEASE, "text_encoder") and args.release == os.path.abspath(RELEASE)
    assert where.startswith(f"toy-world release {RELEASE}: DiT from") and "latent map from" in where


def test_a_release_trained_for_guidance_streams_with_it_unless_told_otherwise(tmp_path):
    rel = _copy_release(tmp_path, guidance_scale=2.5, negative_prompt="")
    args = _resolve(["--checkpoint", rel])
    assert args.guidance_scale == 2.5 and args.negative_prompt == ""
    args = _resolve(["--checkpoint", rel, "--guidance-scale", "4", "--negative-prompt", "a red circle, slow"])
    assert args.guidance_scale == 4.0 and args.negative_prompt == "a red circle, slow"
    args = _resolve(["--checkpoint", rel, "--prompt-schedule", str(tmp_path / "unused.json")])
    assert args.guidance_scale == 2.5 and args.negative_prompt == ""
    context = tmp_path / "context.npy"
    np.save(context, np.zeros((16, 32), np.float32))
    args = _resolve(["--checkpoint", rel, "--context", str(context)])  # no negative to go with precomputed text
    assert args.guidance_scale is None and args.negative_prompt is None
    with pytest.raises(UsageError, match="--negative-prompt 'a red cat, slow' is not a toy-world prompt"):
        _resolve(["--checkpoint", rel, "--negative-prompt", "a red cat, slow"])
    # the shipped release and releases written before guidance existed stream without it
    assert _resolve([]).guidance_scale is None


def test_a_toy_checkpoint_fills_only_the_flags_not_passed(tmp_path):
    rel = _copy_release(
        tmp_path,
        window_frames=12,
        sink_frames=0,
        steps=[1000, 500],
        shift=3.0,
        prompt="a green triangle, fast",
        rope="absolute",
    )
    args = _resolve(["--checkpoint", rel])
    shipped = json.load(open(os.path.join(RELEASE, "toyworld.json")))["settings"]
    assert (args.chunk_frames, args.window_frames, args.sink_frames) == (shipped["chunk_frames"], 12, 0)
    assert args.steps == (1000, 500) and args.shift == 3.0 and args.prompt == "a green triangle, fast"
    assert args.rope == "absolute"
    # a flag passed keeps its value, even one equal to the generic default
    args = _resolve(
        [
            "--checkpoint",
            rel,
            "--window-frames",
            "9",
            "--steps",
            "1000,750,500,250",
            "--prompt",
            "a yellow square, slow",
        ]
    )
    assert (args.window_frames, args.sink_frames) == (9, 0) and args.steps == (1000, 750, 500, 250)
    assert args.prompt == "a yellow square, slow"
    # the text given another way: no default prompt
    assert _resolve(["--checkpoint", rel, "--context", "c.npy"]).prompt is None
    # --random-weights keeps the generic defaults (the old default run)
    args = _resolve(["--random-weights"])
    assert args.checkpoint is None and args.prompt is None and args.preset == "tiny"
    d = options.DEFAULTS
    assert (args.height, args.chunk_frames, args.window_frames, args.sink_frames) == (
        d["height"],
        d["chunk_frames"],
        d["window_frames"],
        d["sink_frames"],
    )


BAD = [
    (["--prompt", "a purple circle, slow"], "--prompt 'a purple circle, slow' is not a toy-world prompt"),
    (["--prompt", "a red fox, snow"], "The toy world's words are a, and, red, green, blue, yellow, circle"),
    (["--guidance-scale", "3", "--negative-prompt", "blurry"], "--negative-prompt 'blurry' is not a toy-world"),
    (["--vae", "somewhere"], "--vae: the toy-world model"),
    (["--preset", "tiny"], "--preset chooses random weights: add --random-weights"),
    (["--weights-seed", "3"], "--weights-seed chooses random weights: add --random-weights"),
    (["--random-weights", "--checkpoint", RELEASE], "--random-weights and --checkpoint both choose the weights"),
    (["--guidance-scale", "3"], "--guidance-scale with --prompt needs --negative-prompt"),
    (["--schedule-bad"], "--prompt-schedule entry 1: prompt 'a dog, fast' is not a toy-world prompt"),
    (["--bad-json"], "is not a jaxkv-toyworld v1 file"),
    (["--missing-release"], "the toy-world release shipped in the package is missing"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:40] for _, m in BAD])
def test_toy_usage_errors_are_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch, argv, message):
    if argv == ["--schedule-bad"]:
        (tmp_path / "s.json").write_text(
            json.dumps([{"chunk": 0, "prompt": "a red circle, slow"}, {"chunk": 1, "prompt": "a dog, fast"}])
        )
        argv = ["--prompt-schedule", str(tmp_path / "s.json")]
    elif argv == ["--bad-json"]:
        rel = _copy_release(tmp_path)
        meta = json.loads((tmp_path / "rel" / toy_model.SETTINGS_FILE).read_text())
        meta["format_version"] = 99
        (tmp_path / "rel" / toy_model.SETTINGS_FILE).write_text(json.dumps(meta))
        argv = ["--checkpoint", rel]
    elif argv == ["--missing-release"]:
        monkeypatch.setattr(toy_model, "RELEASE_DIR", str(tmp_path / "gone"))
        argv = []
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--num-chunks", "2", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_the_vocabulary_error_names_every_word():
    with pytest.raises(UsageError) as e:
        toy.check_prompt("a red dragon, slow", "--prompt")
    assert all(word in str(e.value) for word in world.VOCABULARY)


# ------------------------------------------------------------------------------------------------ runs (slow)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One toy-world compilation, four runs: 4 chunks with frames; 2 chunks saved; the session resumed for 2; a
    prompt schedule switching slow -> fast at chunk 2 (no video)."""
    pytest.importorskip("av")
    base = tmp_path_factory.mktemp("toy")
    media = ["--num-chunks", "4", "--no-progress", "--frames", "npy"]
    assert G.main(["--out", str(base / "full"), *media]) == 0
    assert (
        G.main(
            [
                "--out",
                str(base / "a"),
                "--num-chunks",
                "2",
                "--no-progress",
                "--frames",
                "npy",
                "--save-state",
                str(base / "S"),
            ]
        )
        == 0
    )
    assert (
        G.main(
            [
                "--resume",
                str(base / "S"),
                "--out",
                str(base / "b"),
                "--num-chunks",
                "2",
                "--no-progress",
                "--frames",
                "npy",
            ]
        )
        == 0
    )
    prompt = _settings_json()["prompt"]
    objects, speed = world.parse_prompt(prompt)
    other = world.format_prompt(objects, "fast" if speed == "slow" else "slow")
    (base / "switch.json").write_text(json.dumps([{"chunk": 0, "prompt": prompt}, {"chunk": 2, "prompt": other}]))
    assert (
        G.main(
            [
                "--out",
                str(base / "switch"),
                "--num-chunks",
                "4",
                "--no-progress",
                "--no-video",
                "--prompt-schedule",
                str(base / "switch.json"),
            ]
        )
        == 0
    )
    return base


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _frames(out, n):
    return np.concatenate([np.load(out / "frames" / f"chunk_{i:06d}.npy") for i in range(n)], axis=1)


@pytest.mark.slow  # the toy step's compile (~20-30 s on 2 busy cores), shared by the tests below
def test_a_toy_run_is_the_toy_models_own_stream_decoded_by_its_latent_map(runs):
    from jaxkv.toyworld import sample
    from jaxkv.video import read_video_info

    out = runs / "full"
    latents = G.load_latents(str(out))
    settings = _settings_json()
    assert latents.shape == (1, 4 * settings["chunk_frames"], 16, 16, 16)
    # the reference: the release loaded by jaxkv.toyworld itself, streamed with its own settings and prompt
    m = toy_model.load(RELEASE)
    rc = sample.rollout_config(m)
    stream = Stream(m.params, m.config, rc, m.context([m.settings.prompt]), num_chunks=4, key=jax.random.key(0))
    want = np.concatenate([np.asarray(c) for c in stream], axis=1)
    np.testing.assert_allclose(latents, want, rtol=1e-5, atol=1e-5)
    # video: one 64x64 frame per latent frame, the latent map's decode
    frames = _frames(out, 4)
    n = 4 * settings["chunk_frames"]
    assert frames.shape == (1, n, 64, 64, 3)
    np.testing.assert_array_equal(frames, np.asarray(m.latent_map.decode_uint8(latents)))
    assert read_video_info(str(out / "video.mp4")) == {"frames": n, "height": 64, "width": 64, "fps": 16.0}
    s = _summary(out)
    assert s["video_frames"] == n and s["video_size"] == [64, 64] and s["prompt"] == settings["prompt"]
    assert s["vae"].startswith("toy-world latent map") and s["model"].startswith("checkpoint ")
    assert (s["chunk_frames"], s["window_frames"], s["sink_frames"]) == (
        settings["chunk_frames"],
        settings["window_frames"],
        settings["sink_frames"],
    )
    # the contact sheet: every frame of so short a stream, up to 8 to a row
    from tests.helpers.images import read_png

    assert s["contact_sheet"] == str(out / "contact_sheet.png") and s["contact_sheet_frames"] == list(range(n))
    sheet = read_png(out / "contact_sheet.png")
    cols = min(n, 8)
    rows = -(-n // cols)
    assert sheet.shape == (rows * 65 - 1, cols * 65 - 1, 3)
    for k in (0, n - 1):  # first and last tile, row-major
        r, c = divmod(k, cols)
        np.testing.assert_array_equal(sheet[65 * r : 65 * r + 64, 65 * c : 65 * c + 64], frames[0, k])
    assert "contact_sheet.png" in json.loads((out / "manifest.json").read_text())["entries"]


@pytest.mark.slow
def test_a_toy_session_resumes_bit_for_bit(runs):
    full, a, b = (G.load_latents(str(runs / n)) for n in ("full", "a", "b"))
    assert np.concatenate([a, b], axis=1).tobytes() == full.tobytes()
    assert (
        np.concatenate([_frames(runs / "a", 2), _frames(runs / "b", 2)], axis=1).tobytes()
        == _frames(runs / "full", 4).tobytes()
    )
    recorded = S.read_manifest(str(runs / "S"))["metadata"]["generate"]
    assert recorded["checkpoint"] == os.path.abspath(RELEASE) and recorded["random_weights"] is False
    s = _summary(runs / "b")
    assert s["first_chunk"] == 2 and s["compilations"] == 0 and s["vae"].startswith("toy-world latent map")


@pytest.mark.slow
def test_toy_prompts_switch_mid_stream(runs):
    full, switched = G.load_latents(str(runs / "full")), G.load_latents(str(runs / "switch"))
    cf = _settings_json()["chunk_frames"]
    np.testing.assert_array_equal(switched[:, : 2 * cf], full[:, : 2 * cf])  # the same prompt until chunk 2
    assert np.abs(switched[:, 2 * cf :] - full[:, 2 * cf :]).max() > 1e-4  # the other speed after it
    assert [e["chunk"] for e in _summary(runs / "switch")["prompt_schedule"]] == [0, 2]


@pytest.mark.slow  # the tiny preset's step compile
def test_preset_tiny_random_weights_is_the_old_default_path(tmp_path):
    from jaxkv.models import wan
    from jaxkv.schedule import Schedule

    out = tmp_path / "o"
    assert (
        G.main(
            [
                "--out",
                str(out),
                "--preset",
                "tiny",
                "--random-weights",
                "--num-chunks",
                "2",
                "--no-progress",
                "--no-video",
            ]
        )
        == 0
    )
    config = wan.preset("tiny")
    d = options.DEFAULTS
    rc = R.RolloutConfig(
        d["height"],
        d["width"],
        chunk_frames=d["chunk_frames"],
        window_frames=d["window_frames"],
        sink_frames=d["sink_frames"],
        schedule=Schedule(steps=(1000, 750, 500, 250), shift=5.0),
    )
    context = G.standin_context(0, config.text_dim, config.text_len)[None]
    stream = Stream(
        wan.init_params(config, jax.random.key(0)), config, rc, context, num_chunks=2, key=jax.random.key(0)
    )
    want = np.concatenate([np.asarray(c) for c in stream], axis=1)
    np.testing.assert_allclose(G.load_latents(str(out)), want, rtol=1e-5, atol=1e-5)
    assert _summary(out)["model"] == "preset 'tiny' with random weights (seed 0)"


def test_a_prompt_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, capsys):
    # what Python makes of the argv bytes b"a red circle\xff, slow" (surrogateescape): a lone surrogate
    prompt = b"a red circle\xff, slow".decode("utf-8", "surrogateescape")
    out = tmp_path / "o"
    assert G.main(["--prompt", prompt, "--out", str(out), "--num-chunks", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--prompt" in err and "byte 0xff at character 12 is not valid UTF-8" in err
    assert not out.exists()
    schedule = tmp_path / "s.json"
    schedule.write_text('[{"chunk": 0, "prompt": "a red circle\\udcff, slow"}]')
    assert G.main(["--prompt-schedule", str(schedule), "--out", str(out), "--num-chunks", "1", "--no-progress"]) == 2
    assert "entry 0: prompt: byte 0xff at character 12 is not valid UTF-8" in capsys.readouterr().err


def test_a_long_prompt_is_shortened_in_messages(tmp_path, capsys):
    prompt = "a red circle " * 800  # 10,400 characters, not a toy-world prompt
    assert G.main(["--prompt", prompt, "--out", str(tmp_path / "o"), "--num-chunks", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"({len(prompt)} characters)" in err
    assert len(err) < 1000, len(err)
