"""benchmarks/rebuild_release.py: the one command that retrains the shipped toy-world release from scratch. Its
steps are checked against the commands the shipped release records; its bookkeeping (done, continue, refuse) on
directories made for the test; and, slow, a small chain of the same programs run end to end and run again."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

from jaxkv.toyworld import model as TM
from tests.helpers.benchmarks import load_benchmark


def _parsed(step_or_command, finetune_parser):
    """A fine-tune's flags with defaults filled in, less where it reads from and writes to."""
    words = shlex.split(step_or_command)[2:]  # less "python benchmarks/finetune_scenes.py"
    args = vars(finetune_parser.parse_args(words))
    return {k: v for k, v in args.items() if k not in ("release", "out")}


def _lineage(step, steps):
    """The step and the steps it starts from, oldest first, following each fine-tune's --release."""
    by_out = {s.out: s for s in steps}
    chain = [step]
    while chain[0].program == "finetune":
        args = list(chain[0].args)
        chain.insert(0, by_out[args[args.index("--release") + 1]])
    return chain


def test_the_steps_are_the_commands_the_shipped_release_records(tmp_path):
    from jaxkv.toyworld.cli import _parser

    bench = load_benchmark("rebuild_release")
    finetune_parser = load_benchmark("finetune_scenes").parser()
    steps = bench.release_10(str(tmp_path))
    assert [s.name for s in steps] == ["r8", "r9_tf", "r9", "r2_tf", "r2_sf", "rnd", "apart", "release"]
    assert all(s.out == str(tmp_path / s.name) for s in steps) and len({s.out for s in steps}) == len(steps)
    shipped = TM.load(TM.RELEASE_DIR).info
    average = shipped["average"]
    # release 8's command, recorded with DIR for its directory
    train = lambda command: vars(_parser().parse_args(shlex.split(command)[2:]))  # less "jaxkv toyworld"
    recorded = train(shipped["training"]["command"].replace("DIR", steps[0].out))
    assert train(steps[0].command()) == recorded
    # the average: the same parts in the same order (a float sum's order is part of its result), the same weights
    *_, release = steps
    parts = [spec.rpartition(":") for spec in release.args[2:]]
    assert release.args[:2] == ("--out", release.out)
    assert [float(w) for _, _, w in parts] == [p["weight"] for p in average["parts"]]
    # each part's fine-tunes, oldest first: what its record holds, with the two hand-written teacher-forcing ones in
    # their places (before release 9's stage 4 and before R2_SF's)
    hand = average["records_written_by_hand"]
    by_out = {s.out: s for s in steps}
    for (out, _, _), part in zip(parts, average["parts"]):
        record = part["record"]
        history = [*record["finetune_history"], record["finetune"]]
        release_9 = hand["release_9"]["finetune"]["command"]  # the same run, named in the docs' words
        assert _parsed(history[0]["command"], finetune_parser) == _parsed(release_9, finetune_parser)
        commands = [hand["release_9"]["finetune_history"][0]["command"], history[0]["command"]]
        commands += [hand["r2_tf"]["command"], *(h["command"] for h in history[1:])]
        chain = _lineage(by_out[out], steps)
        assert chain[0] is steps[0] and len(chain) == 1 + len(commands)
        for step, command in zip(chain[1:], commands):
            assert _parsed(step.command(), finetune_parser) == _parsed(command, finetune_parser), step.name
    assert {s.name for s in steps} == {"release"} | {s.name for p in parts for s in _lineage(by_out[p[0]], steps)}


def _fake_release(step, command):
    os.makedirs(step.out)
    key, field = load_benchmark("rebuild_release").PROGRAMS[step.program][2]
    with open(os.path.join(step.out, "toyworld.json"), "w") as f:
        json.dump({key: {field: command}}, f)


def test_done_steps_are_skipped_snapshots_continued_and_strange_directories_refused(tmp_path):
    bench = load_benchmark("rebuild_release")
    steps = bench.release_10(str(tmp_path))
    r8, r9_tf, r9 = steps[:3]
    _fake_release(r8, r8.command() + " --resume")  # a release written by a continued run is done too
    os.makedirs(r9_tf.out + ".partial")
    assert [bench.state(s) for s in steps[:3]] == ["done", "resume", "run"]
    lines = []
    assert bench.rebuild(steps, dry_run=True, log=lines.append) == 0
    assert lines[0] == f"[1/8] r8: done ({r8.out})"
    assert lines[1].startswith("[2/8] r9_tf: continuing: ") and lines[1].endswith(" --resume")
    assert f"--release {r8.out}" in lines[1] and f"--out {r9_tf.out}" in lines[1]
    assert all(" --resume" not in line for line in lines[2:]) and len(lines) == 8  # a dry run writes nothing
    assert not os.path.exists(r9.out)
    os.makedirs(r9.out)  # a directory without a release: refused before anything runs
    with pytest.raises(ValueError, match="holds no release of r9's"):
        bench.rebuild(steps, dry_run=True, log=lines.append)
    os.rmdir(r9.out)
    _fake_release(r9, r9.command().replace("--seed 1", "--seed 5"))
    with pytest.raises(ValueError, match="written by another command"):
        bench.state(r9)
    assert bench.main(["--work", str(tmp_path), "--dry-run"]) == 2
    (tmp_path / "file").write_text("")
    assert bench.main(["--work", str(tmp_path / "file")]) == 2


def test_one_rebuild_at_a_time_in_a_directory(tmp_path, capsys):
    import subprocess

    bench = load_benchmark("rebuild_release")
    lock = tmp_path / bench.LOCK
    lock.write_text(str(os.getpid()))  # a live process holds it
    (tmp_path / "r9").mkdir()  # were the lock not heeded, this refusal would stop the rebuild (not training)
    assert bench.main(["--work", str(tmp_path)]) == 2
    assert f"another rebuild (process {os.getpid()}) is running in {tmp_path}" in capsys.readouterr().err
    assert lock.read_text() == str(os.getpid()) and sorted(os.listdir(tmp_path)) == [bench.LOCK, "r9"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(str(gone.pid))  # left by a process that is gone: taken over
    assert bench.claim(str(tmp_path)) == str(lock) and lock.read_text() == str(os.getpid())


@pytest.mark.slow  # four processes, each compiling a small training step
def test_a_small_chain_runs_end_to_end_and_a_second_run_runs_nothing(tmp_path):
    from jaxkv.toyworld import model as TM

    bench = load_benchmark("rebuild_release")
    w = {n: str(tmp_path / n) for n in ("a", "b", "c", "avg")}
    small = ("--steps", "2", "--refine-steps", "0", "--sf-steps", "0", "--sf-chunks", "1", "--sf-batch", "1")
    small += ("--dit-dim", "32", "--dit-ffn-dim", "32", "--dit-heads", "1", "--dit-layers", "1", "--no-progress")
    teach = ("--stage", "teacher-forcing", "--steps", "2", "--scenes", "canonical", "--release", w["a"])
    steps = [
        bench.Step("a", "train", ("--out", w["a"], *small), w["a"]),
        bench.Step("b", "finetune", (*teach, "--seed", "1", "--out", w["b"]), w["b"]),
        bench.Step("c", "finetune", (*teach, "--seed", "2", "--out", w["c"]), w["c"]),
        bench.Step("avg", "average", ("--out", w["avg"], f"{w['b']}:0.5", f"{w['c']}:0.5"), w["avg"]),
    ]
    lines = []
    assert bench.rebuild(steps, log=lines.append) == 0
    assert [line.split(":")[0] for line in lines if "wrote" in line] == ["[1/4] a", "[2/4] b", "[3/4] c", "[4/4] avg"]
    assert lines[-1] == f"every step done; read the release with: jaxkv toyworld check {w['avg']} --survey"
    made = TM.load(w["avg"]).info["average"]
    assert [p["release"] for p in made["parts"]] == [w["b"], w["c"]]
    assert [p["record"]["finetune"]["from"] for p in made["parts"]] == [w["a"], w["a"]]
    assert made["parts"][1]["record"]["finetune"]["seed"] == 2
    written = {n: os.path.getmtime(os.path.join(d, "toyworld.json")) for n, d in w.items()}
    lines.clear()
    assert bench.rebuild(steps, log=lines.append) == 0  # everything done: nothing runs
    assert lines[:4] == [f"[{i}/4] {n}: done ({w[n]})" for i, n in enumerate(w, 1)]
    assert written == {n: os.path.getmtime(os.path.join(d, "toyworld.json")) for n, d in w.items()}
    failing = bench.Step("d", "finetune", (*teach, "--seed", "-1", "--out", str(tmp_path / "d")), str(tmp_path / "d"))
    assert bench.rebuild([*steps, failing], log=lines.append) == 2  # finetune_scenes refuses a negative seed
    assert lines[-1] == "rebuild_release: d failed (exit 2); run the same command again to continue"
    assert sys.executable in bench.argv(steps[0], "run")
