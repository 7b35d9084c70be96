"""`jaxkv generate --checkpoint DST` on a converted release (DST/dit, DST/vae, DST/text_encoder): the three parts
are picked up (explicit --vae / --text-encoder win), the outputs equal a run that names each part explicitly, the
summary says where each part came from, and a directory that is neither a checkpoint nor a release is refused."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv.generate import inputs, settings
from jaxkv.generate.options import UsageError
from jaxkv.models import umt5, wan, wan_vae
from jaxkv.models.release import PARTS, release_parts
from jaxkv.models.umt5.tokenizer import tiny_tokenizer_json
from jaxkv.models.wan import checkpoint as dit_checkpoint

SMALL = ["--height", "4", "--width", "4", "--num-chunks", "1", "--no-progress"]
PROMPT = "a red fox, snow"


def make_release(root, parts=("dit", "vae", "umt5")):
    """A release directory of tiny random parts, none of them the embedded defaults' weights (other seeds)."""
    os.makedirs(root)
    if "dit" in parts:
        config = wan.preset("tiny")
        dit_checkpoint.save(str(root / PARTS["dit"]), config, wan.init_params(config, jax.random.key(7)))
    if "vae" in parts:
        config = wan_vae.preset("tiny")
        wan_vae.checkpoint.save(str(root / PARTS["vae"]), config, wan_vae.init_params(5, config))
    if "umt5" in parts:
        config = umt5.preset("tiny")
        umt5.save(
            str(root / PARTS["umt5"]),
            config,
            umt5.init_params(config, 5),
            tokenizer_files={"tokenizer.json": tiny_tokenizer_json().encode()},
        )
    return root


def make_layout(root, parts=("dit", "vae", "umt5")):
    """The release's directory layout alone (empty parts): all that picking the parts up reads."""
    for family in parts:
        os.makedirs(root / PARTS[family])
    return root


def _args(argv):
    """The settings as `jaxkv generate` resolves them: a release's parts picked up (`inputs.pick_up_release`)."""
    return settings.from_argv(argv)


def _run(tmp_path, name, argv):
    out = tmp_path / name
    assert G.main(["--out", str(out), *SMALL, *argv]) == 0
    return G.load_latents(str(out)), json.loads((out / "summary.json").read_text())


def test_pick_up_release_sets_the_parts_a_run_needs(tmp_path):
    rel = make_layout(tmp_path / "rel")
    assert release_parts(str(rel)) == {f: str(rel / sub) for f, sub in PARTS.items()}
    args = _args(["--checkpoint", str(rel), "--prompt", PROMPT])
    where = args.picked_up
    assert args.release == str(rel) and (args.checkpoint, args.vae, args.text_encoder) == (
        str(rel / "dit"),
        str(rel / "vae"),
        str(rel / "text_encoder"),
    )
    assert where == (
        f"release {rel}: DiT from {rel / 'dit'}, VAE from {rel / 'vae'}, text encoder from {rel / 'text_encoder'}"
    )
    # Explicit flags win; parts the run does not use are left alone and said so.
    args = _args(["--checkpoint", str(rel), "--no-video"])
    where = args.picked_up
    assert (args.vae, args.text_encoder) == (None, None)
    assert "VAE not used (--no-video)" in where and "text encoder not used (no --prompt)" in where
    args = _args(
        [
            "--checkpoint",
            str(rel),
            "--vae",
            str(tmp_path / "mine"),
            "--prompt",
            PROMPT,
            "--text-encoder",
            str(tmp_path / "enc"),
        ]
    )
    where = args.picked_up
    assert (args.vae, args.text_encoder) == (str(tmp_path / "mine"), str(tmp_path / "enc"))
    assert f"VAE from --vae {tmp_path / 'mine'}" in where and "text encoder from --text-encoder" in where
    # A DiT checkpoint directory (it has a config.json) is not a release: untouched.
    (rel / "dit" / "config.json").write_text("{}")
    args = _args(["--checkpoint", str(rel / "dit")])
    assert inputs.pick_up_release(args) == ({}, None) and args.picked_up is None and args.release is None
    assert args.checkpoint == str(rel / "dit") and args.vae is None


def test_a_release_without_a_needed_part_or_a_foreign_directory_is_refused(tmp_path, capsys):
    partial = make_layout(tmp_path / "partial", parts=("dit",))
    with pytest.raises(UsageError, match=r"converted release without vae/; pass --vae DIR or --no-video"):
        _args(["--checkpoint", str(partial)])
    with pytest.raises(UsageError, match=r"without text_encoder/; pass --text-encoder DIR$"):
        _args(["--checkpoint", str(partial), "--prompt", PROMPT, "--no-video"])
    args = _args(["--checkpoint", str(partial), "--no-video"])  # needs only the DiT
    assert args.picked_up is not None and args.checkpoint == str(partial / "dit")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    out = tmp_path / "o"
    for where in (tmp_path / "other", partial):
        assert G.main(["--out", str(out), *SMALL, "--checkpoint", str(where)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    assert "neither a jaxkv DiT checkpoint" not in err  # (the partial release's message)
    assert G.main(["--out", str(out), *SMALL, "--checkpoint", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert (
        f"--checkpoint {tmp_path / 'other'} is neither a jaxkv DiT checkpoint (config.json + "
        f"params.safetensors) nor a converted release (dit/, vae/, text_encoder/)"
    ) in err


@pytest.mark.slow
def test_generate_on_a_release_equals_naming_each_part(tmp_path, capsys):
    rel = make_release(tmp_path / "rel")
    by_release, summary = _run(tmp_path, "a", ["--checkpoint", str(rel), "--prompt", PROMPT, "--no-video"])
    explicit, _ = _run(
        tmp_path,
        "b",
        [
            "--checkpoint",
            str(rel / "dit"),
            "--text-encoder",
            str(rel / "text_encoder"),
            "--prompt",
            PROMPT,
            "--no-video",
        ],
    )
    np.testing.assert_array_equal(by_release, explicit)
    default, _ = _run(tmp_path, "c", ["--random-weights", "--prompt", PROMPT, "--no-video"])  # embedded encoder
    assert np.abs(by_release - default).max() > 1e-3
    assert summary["model"].startswith(f"checkpoint {rel / 'dit'} (release {rel}: DiT from {rel / 'dit'}")
    assert f"text encoder from {rel / 'text_encoder'}" in summary["model"]
    assert summary["text_encoder"] == os.path.abspath(rel / "text_encoder")
    assert "release " in capsys.readouterr().out  # the printed summary's model line


@pytest.mark.slow
def test_the_release_vae_decodes_the_video(tmp_path):
    pytest.importorskip("av")
    rel = make_release(tmp_path / "rel")
    _, summary = _run(tmp_path, "a", ["--checkpoint", str(rel), "--frames", "npy"])
    _, explicit = _run(tmp_path, "b", ["--checkpoint", str(rel / "dit"), "--vae", str(rel / "vae"), "--frames", "npy"])
    _, tiny = _run(tmp_path, "c", ["--checkpoint", str(rel / "dit"), "--frames", "npy"])  # the embedded tiny VAE
    frames = {n: np.load(tmp_path / n / "frames" / "chunk_000000.npy") for n in "abc"}
    np.testing.assert_array_equal(frames["a"], frames["b"])
    assert np.abs(frames["a"].astype(int) - frames["c"]).max() > 0
    assert summary["vae"] == explicit["vae"] == str(rel / "vae") and f"VAE from {rel / 'vae'}" in summary["model"]
