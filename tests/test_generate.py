"""`jaxkv generate`: the default run works offline and writes readable outputs; checkpoints and context files are
used; bad arguments get one clear line and exit code 2 before anything is compiled or written."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv.models import wan
from tests.helpers.images import read_png

FAST = ["--num-chunks", "3", "--no-progress", "--no-video"]  # the mp4 path: test_generate_media.py
RANDOM = ["--preset", "tiny", "--random-weights"]  # the random-weight model (the default: test_generate_toy.py)


@pytest.mark.slow
def test_default_run_writes_latents_preview_and_summary(tmp_path, capsys):
    from jaxkv import rollout as R

    out = tmp_path / "out"
    R.stream_step.clear_cache()  # so that the count below does not depend on which tests ran before
    assert G.main(["--out", str(out), *RANDOM, *FAST]) == 0
    printed = capsys.readouterr().out
    assert "per chunk" in printed and "compile" in printed
    latents = G.load_latents(str(out))
    d = G.DEFAULTS
    assert latents.shape == (1, 3 * d["chunk_frames"], d["height"], d["width"], 16)
    assert np.isfinite(latents).all() and latents.std() > 0.1
    image = read_png(out / "preview.png")
    np.testing.assert_array_equal(image, G.preview_image(latents, d["preview_scale"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compilations"] == 1 and summary["cache_bytes"] > 0
    assert summary["precision"] == "float32" and summary["param_dtype"] == summary["cache_dtype"] == "float32"
    assert summary["status"] == "complete" and summary["chunks_written"] == 3
    # one file per chunk, each the chunk's frames of the whole
    for i in range(3):
        chunk = np.load(out / "latents" / f"chunk_{i:06d}.npy")
        np.testing.assert_array_equal(chunk, latents[:, 3 * i : 3 * i + 3])
    # the same seed gives the same latents (from the same program: no new compilation); another seed does not
    assert G.main(["--out", str(tmp_path / "again"), *RANDOM, *FAST]) == 0
    np.testing.assert_array_equal(G.load_latents(str(tmp_path / "again")), latents)
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["compilations"] == 0
    assert G.main(["--out", str(tmp_path / "other"), "--seed", "1", *RANDOM, *FAST]) == 0
    assert np.abs(G.load_latents(str(tmp_path / "other")) - latents).max() > 1e-3


@pytest.mark.slow
def test_checkpoint_and_context_files_are_used(tmp_path):
    from jaxkv.models.wan import checkpoint

    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))  # the default --weights-seed
    checkpoint.save(str(tmp_path / "ckpt"), config, params)
    ctx = G.standin_context(0, config.text_dim, config.text_len)
    np.save(tmp_path / "ctx.npy", ctx)
    from safetensors.numpy import save_file

    save_file({"prompt_embeds": ctx}, str(tmp_path / "ctx.safetensors"))
    base = tmp_path / "base"
    assert G.main(["--out", str(base), *RANDOM, *FAST]) == 0
    for extra in (
        ["--checkpoint", str(tmp_path / "ckpt")],
        ["--context", str(tmp_path / "ctx.npy")],
        ["--context", str(tmp_path / "ctx.safetensors"), "--format", "safetensors"],
        ["--checkpoint", str(tmp_path / "ckpt"), "--precision", "bfloat16"],
    ):
        out = tmp_path / extra[-1].replace("/", "_")
        model = [] if "--checkpoint" in extra else RANDOM
        assert G.main(["--out", str(out), *model, *FAST, *extra]) == 0
        if "safetensors" in extra:
            from safetensors.numpy import load_file

            assert sorted(os.listdir(out / "latents"))[0] == "chunk_000000.safetensors"
            first = load_file(str(out / "latents" / "chunk_000000.safetensors"))["latents"]
        got = G.load_latents(str(out))
        if "safetensors" in extra:
            np.testing.assert_array_equal(first, got[:, :3])
        if "bfloat16" in extra:  # weights rounded to bf16, bf16 matmul inputs and caches: close, not equal
            want = G.load_latents(str(base))
            assert 0 < np.abs(got - want).max() <= 0.05 * np.abs(want).max()
            summary = json.loads((out / "summary.json").read_text())
            assert (summary["precision"], summary["param_dtype"], summary["cache_dtype"]) == ("bfloat16",) * 3
            continue
        np.testing.assert_allclose(got, G.load_latents(str(base)), atol=1e-5)
    # a different context changes the video
    np.save(tmp_path / "ctx2.npy", ctx + 1.0)
    assert G.main(["--out", str(tmp_path / "c2"), *RANDOM, *FAST, "--context", str(tmp_path / "ctx2.npy")]) == 0
    assert np.abs(G.load_latents(str(tmp_path / "c2")) - G.load_latents(str(base))).max() > 1e-3


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--chunk-frames", "2", "--window-frames", "3"], "multiples"),
        (["--height", "15"], "divisible"),
        (["--context", "/nonexistent.npy"], "does not exist"),
        (["--checkpoint", "/nonexistent_dir"], "not a jaxkv Wan checkpoint directory"),
        (["--preset", "nope"], "unknown Wan preset"),
        (["--steps", "250,500"], "decreasing"),
        (["--steps", "abc"], "comma-separated"),
        (["--num-chunks", "0"], "positive"),
        (["--negative-context", "x.npy"], "guidance"),
        (["--guidance-scale", "3", "--context", "c.npy"], "needs --negative-context"),
        (["--guidance-scale", "inf"], "guidance_scale"),
        (["--shift", "inf"], "shift"),
        (["--precision", "float16"], "invalid choice"),
        (["--param-dtype", "bfloat16"], "--param-dtype was replaced by --precision float32|bfloat16"),
        (["--cache-dtype", "bfloat16"], "--cache-dtype was replaced by --precision"),
        (["--seed", "-1"], "--seed: expected an int in [0, 9223372036854775807], got -1"),
        (["--seed", str(2**63)], "--seed: expected an int in [0, 9223372036854775807]"),
        (["--weights-seed", str(2**64)], "--weights-seed: expected an int in [0,"),
        (["--seed", "1.5"], "--seed: expected an int"),
        (["--preview-frames", "0"], "--preview-frames"),
        (
            ["--checkpoint", "/nonexistent_dir", "--weights-seed", "3"],
            "--weights-seed chooses random weights: add --random-weights",
        ),
        (["--num-chunks", str(2**31 // 192 + 1)], "int32 position limit: chunks of 192 tokens fit 11184810"),
    ],
)
def test_bad_arguments_print_one_clear_line(tmp_path, capsys, argv, expect):
    out = tmp_path / "out"
    model = [] if "--checkpoint" in argv else RANDOM  # the toy model's own errors: test_generate_toy.py
    code = G.main(["--out", str(out), "--no-progress", *model, *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert expect in err and "Traceback" not in err
    assert not out.exists()  # refused before anything is written


def test_bad_context_file_shapes(tmp_path, capsys):
    np.save(tmp_path / "wrong.npy", np.zeros((3, 5), np.float32))
    assert G.main(["--out", str(tmp_path / "o"), *RANDOM, "--context", str(tmp_path / "wrong.npy")]) == 2
    assert "text_dim=32" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_latent_to_rgb_is_a_fixed_linear_map():
    rng = np.random.default_rng(0)
    a, b = 0.3 * rng.standard_normal((5, 16)), 0.3 * rng.standard_normal((5, 16))
    gray = G.latent_to_rgb(np.zeros((1, 16))).astype(float)
    assert (np.abs(gray - 127.5) <= 0.5).all()
    lhs = G.latent_to_rgb(a + b).astype(float)
    rhs = G.latent_to_rgb(a).astype(float) + G.latent_to_rgb(b).astype(float) - gray
    assert np.abs(lhs - rhs).max() <= 2.0  # linear up to byte rounding
    # unit-variance latents give unit-variance colours: the byte spread is ~50
    spread = G.latent_to_rgb(rng.standard_normal((20000, 16))).astype(float).std(0)
    assert np.all(np.abs(spread - 50) < 5)


def test_png_writer_roundtrip_and_pillow_if_present(tmp_path):
    image = np.random.default_rng(1).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    G.write_png(str(tmp_path / "x.png"), image)
    np.testing.assert_array_equal(read_png(tmp_path / "x.png"), image)
    try:
        from PIL import Image
    except ImportError:
        return
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "x.png").convert("RGB")), image)


@pytest.mark.slow
def test_checkpoint_with_different_in_and_out_channels_is_a_clear_error(tmp_path, capsys):
    import dataclasses

    from jaxkv import rollout as R
    from jaxkv.models.wan import checkpoint

    config = dataclasses.replace(wan.preset("tiny"), in_dim=4, out_dim=6)
    params = wan.init_params(config, jax.random.key(0))
    checkpoint.save(str(tmp_path / "ckpt"), config, params)
    assert G.main(["--out", str(tmp_path / "o"), *FAST, "--checkpoint", str(tmp_path / "ckpt")]) == 2
    assert "in_dim == out_dim" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    rc = R.RolloutConfig(latent_height=4, latent_width=4, chunk_frames=1, window_frames=2)
    with pytest.raises(ValueError, match="in_dim == out_dim"):
        R.init_state(params, config, rc, np.zeros((1, 2, config.text_dim), np.float32))
