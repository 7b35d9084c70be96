"""benchmarks/finetune_scenes.py: stage 4 of the recipe from a release's weights, on random or canonical scenes,
written as a release that loads (the fine-tune itself is the integrator's experiment, issue 44)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers.benchmarks import load_benchmark

SMALL = dict(steps=0, refine_steps=0, sf_steps=0, sf_chunks=1, sf_batch=1, fit_frames=64)
SMALL.update(dit_dim=32, dit_ffn_dim=32, dit_heads=1, dit_layers=1)


@pytest.fixture(scope="module")
def small_release(tmp_path_factory):
    """A release of the smallest DiT, as initialised (every stage 0 steps), recording a 1-clip, 1-chunk stage 4."""
    from jaxkv.toyworld import train as T

    out = str(tmp_path_factory.mktemp("release") / "small")
    T.train(out, T.TrainConfig(**SMALL), progress=False)
    return out


@pytest.mark.slow  # four compilations of a (small) self-forcing step
def test_finetune_writes_a_release_of_its_steps_reproducibly(small_release, tmp_path, capsys):
    from safetensors.numpy import load_file

    from jaxkv.toyworld import model as TM

    bench = load_benchmark("finetune_scenes")
    dirs = {name: str(tmp_path / name) for name in ("random", "again", "canonical", "placed", "taught", "then")}
    for name, out in dirs.items():
        scenes = "canonical" if name == "canonical" else "random"
        release = dirs["taught"] if name == "then" else small_release
        argv = ["--release", release, "--out", out, "--steps", "2", "--scenes", scenes]
        if name == "placed":
            argv += ["--position-weight", "0.25", "--sampler-steps", "1000,500,100", "--lr", "3e-5", "--sf-chunks", "2"]
            argv += ["--apart-weight", "0.5"]
        if name == "taught":
            argv += ["--stage", "teacher-forcing", "--lr", "1e-3"]
        assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("steps 1-2 of 2: mean loss") == 6 and "benchmarks/motion.py --release" in printed
    assert printed.count("teacher forcing, level-1 share (random scenes) steps 1-2 of 2") == 1
    taught, then = (TM.load(dirs[n]).info for n in ("taught", "then"))
    assert taught["finetune"]["stage"] == "teacher forcing, level-1 share" and "finetune_history" not in taught
    recipe = taught["finetune"]["train_config"]
    assert (recipe["refine_steps"], recipe["refine_lr"], recipe["sf_steps"]) == (2, 1e-3, 0)  # sf_steps: the recipe's
    assert then["finetune"]["stage"] == "self-forcing" and then["finetune_history"] == [taught["finetune"]]
    placed = TM.load(dirs["placed"])
    assert placed.settings.steps == (1000, 500, 100) and placed.info["finetune"]["sampler_steps"] == [1000, 500, 100]
    assert placed.info["finetune"]["train_config"]["sf_position_weight"] == 0.25
    assert placed.info["finetune"]["train_config"]["sf_apart_weight"] == 0.5
    assert placed.info["finetune"]["train_config"]["sf_lr"] == 3e-5
    assert placed.info["finetune"]["train_config"]["sf_chunks"] == 2  # the small release's recipe rolls out 1
    assert TM.load(dirs["random"]).settings == TM.load(small_release).settings  # by default the release's own
    toy = TM.load(dirs["random"])
    assert toy.config == TM.load(small_release).config
    record = toy.info["finetune"]
    assert (record["steps"], record["scenes"], record["seed"], record["from"]) == (2, "random", 1, small_release)
    assert record["train_config"]["sf_chunks"] == 1 and record["train_config"]["dit_dim"] == 32
    assert len(record["loss_per_10_steps"]) == 1 and np.isfinite(record["loss_per_10_steps"][0])
    assert toy.info["training"] == TM.load(small_release).info["training"]  # the original's record is kept
    weights = {
        n: load_file(os.path.join(d, "dit", "params.safetensors")) for n, d in {"start": small_release, **dirs}.items()
    }
    same = lambda a, b: all(np.array_equal(weights[a][k], weights[b][k]) for k in weights[a])
    assert same("random", "again")  # drawn from (seed, stage, step): reproducible
    assert not same("random", "start") and not same("random", "canonical")
    assert not same("taught", "start") and not same("taught", "random") and not same("then", "taught")
    with open(os.path.join(dirs["canonical"], "toyworld.json")) as f:
        assert json.load(f)["finetune"]["scenes"] == "canonical"


def test_finetune_refuses_bad_arguments_before_writing_anything(tmp_path, capsys):
    bench = load_benchmark("finetune_scenes")
    out = tmp_path / "out"
    assert bench.main(["--out", str(out), "--steps", "0"]) == 2
    assert "--steps and --snapshot-every must be >= 1" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--snapshot-every", "0"]) == 2
    assert "--snapshot-every must be >= 1" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--resume"]) == 2  # nothing to resume
    assert "no snapshot at" in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path), "--steps", "1"]) == 2  # exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--release", str(out), "--overwrite"]) == 2
    assert "must not be the --release" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--release", str(tmp_path / "none")]) == 2
    assert "is not a toy-world release" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--lr", "0"]) == 2
    assert "--lr must be finite and > 0" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--position-weight", "-1"]) == 2
    assert "--position-weight must be finite and >= 0" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--apart-weight", "nan"]) == 2
    assert "--apart-weight must be finite and >= 0" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--stage", "teacher-forcing", "--position-weight", "0.1"]) == 2
    assert "--position-weight, --apart-weight and --sf-chunks are for --stage self-forcing" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--stage", "teacher-forcing", "--apart-weight", "0.1"]) == 2
    assert "are for --stage self-forcing" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--stage", "teacher-forcing", "--sf-chunks", "2"]) == 2
    assert "are for --stage self-forcing" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--sf-chunks", "0"]) == 2
    assert "--sf-chunks must be >= 1" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--sampler-steps", "500,1000"]) == 2  # the schedule's own check
    assert "strictly decreasing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--out", str(out), "--scenes", "sampled"])
    assert not out.exists()


@pytest.mark.slow  # three compilations of a (small) self-forcing step
def test_an_interrupted_finetune_resumes_from_its_snapshot_to_the_same_release(small_release, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from jaxkv.toyworld import model as TM

    bench = load_benchmark("finetune_scenes")
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    quiet = dict(snapshot_every=1, log=lambda *_: None)
    bench.finetune(small_release, whole, 3, "random", 1, **quiet)
    assert not os.path.exists(bench.snapshot_path(whole))  # gone once the release is written

    draw = bench.T.step_inputs

    def interrupted(*args):
        if args[6] == 2:  # the step index: Ctrl-C once two steps are done
            raise KeyboardInterrupt
        return draw(*args)

    monkeypatch.setattr(bench.T, "step_inputs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.finetune(small_release, cut, 3, "random", 1, **quiet)
    monkeypatch.setattr(bench.T, "step_inputs", draw)
    snapshot = bench.snapshot_path(cut)
    assert not os.path.exists(cut) and bench.read_position(snapshot)["step"] == 2
    with pytest.raises(FileExistsError, match="--resume"):  # never started over on top of it
        bench.finetune(small_release, cut, 3, "random", 1, **quiet)
    with pytest.raises(ValueError, match="another fine-tune"):
        bench.finetune(small_release, cut, 3, "random", 2, resume=True, **quiet)
    assert bench.read_position(snapshot)["step"] == 2  # refused before anything changed
    bench.finetune(small_release, cut, 3, "random", 1, resume=True, **quiet)
    assert not os.path.exists(snapshot)
    a, b = (load_file(os.path.join(d, "dit", "params.safetensors")) for d in (whole, cut))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    losses = [TM.load(d).info["finetune"]["loss_per_10_steps"] for d in (whole, cut)]
    assert losses[0] == losses[1]
