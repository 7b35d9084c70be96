"""Retrains the shipped toy-world release (release 10) from scratch: one command that runs the eight commands that
made it, in order, each into its own directory under ``--work``, and that continues where it stopped when run again
(issue 44: retraining from scratch with the documented command).

    python benchmarks/rebuild_release.py --work DIR [--dry-run]

The steps (``--dry-run`` prints them with their paths; docs/toyworld.md, "Release 10", says what each one is):

    r8       jaxkv toyworld train: release 8's recipe (stages 2-4 from nothing)
    r9_tf    finetune_scenes.py --stage teacher-forcing, 1,200 steps, seed 6, from r8
    r9       finetune_scenes.py, 300 stage-4 steps, seed 1, from r9_tf (release 9's weights)
    r2_tf    finetune_scenes.py --stage teacher-forcing, 1,200 steps, seed 7, from r9
    r2_sf    finetune_scenes.py, 1,000 stage-4 steps, seed 2, rollouts sampled with steps ending at 100, from r2_tf
    rnd      finetune_scenes.py, 300 stage-4 steps on random scenes, seed 3, from r2_sf
    apart    finetune_scenes.py, 300 stage-4 steps with the apart term at 0.02, seed 3, from r2_sf
    release  average_releases.py: rnd 0.65, r2_sf 0.2, apart 0.15

A step whose directory holds a release written by that same command is done and skipped; one whose snapshot
(``DIR.partial``, written as it goes and on Ctrl-C) is there continues from it with ``--resume``, bit for bit as
an uninterrupted run. A directory written by another command, or one that holds no release, is refused before
anything runs, as is a ``--work`` where another rebuild is running. Each step runs as its own process (so its
release records the command a user would type) and prints its own progress. On 2 CPU cores the whole takes about
6 hours (docs/toyworld.md); interrupt it at will.

Release 9 as shipped samples with steps ending at 100 where ``r9`` keeps release 8's (ending at 250): its
stage-4 fine-tune rolled out with release 8's and the shipped settings were changed afterwards. Nothing after it
reads them (teacher forcing draws its own noise levels and ``r2_sf`` sets its sampler steps), so ``release``
does not depend on that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))

# program -> (how to run it, how its release's record names the command, where the record keeps that command)
PROGRAMS = {
    "train": ((sys.executable, "-m", "jaxkv.toyworld", "train"), "jaxkv toyworld train", ("training", "command")),
    "finetune": (
        (sys.executable, os.path.join(HERE, "finetune_scenes.py")),
        "python benchmarks/finetune_scenes.py",
        ("finetune", "command"),
    ),
    "average": (
        (sys.executable, os.path.join(HERE, "average_releases.py")),
        "python benchmarks/average_releases.py",
        ("average", "command"),
    ),
}
RESUMABLE = ("train", "finetune")  # average_releases takes seconds and keeps no snapshot
LOCK = ".rebuild.lock"  # in --work while a rebuild runs there: the pid of its process


class Step(NamedTuple):
    """One command of a rebuild: ``program`` (a key of `PROGRAMS`) with ``args``, writing the release ``out``."""

    name: str
    program: str
    args: tuple[str, ...]
    out: str

    def command(self) -> str:
        """The command as the written release records it (without ``--resume``, which a continued run adds)."""
        return " ".join((PROGRAMS[self.program][1], *self.args))


def release_10(work: str) -> list[Step]:
    """The steps that made the shipped release, writing under ``work`` (module docstring)."""
    names = ("r8", "r9_tf", "r9", "r2_tf", "r2_sf", "rnd", "apart", "release")
    w = {n: os.path.join(os.path.abspath(work), n) for n in names}

    def finetune(name, *args):
        return Step(name, "finetune", (*args, "--out", w[name]), w[name])

    teacher = ("--stage", "teacher-forcing", "--steps", "1200")
    return [
        Step(
            "r8",
            "train",
            ("--out", w["r8"], "--seed", "0", "--dit-dim", "192", "--dit-ffn-dim", "512", "--dit-heads", "6")
            + ("--sf-steps", "1000", "--remat"),
            w["r8"],
        ),
        finetune("r9_tf", *teacher, "--seed", "6", "--scenes", "canonical", "--release", w["r8"]),
        finetune("r9", "--release", w["r9_tf"], "--steps", "300", "--scenes", "canonical", "--seed", "1"),
        finetune("r2_tf", *teacher, "--seed", "7", "--scenes", "canonical", "--release", w["r9"]),
        finetune(
            "r2_sf",
            *("--release", w["r2_tf"], "--steps", "1000", "--scenes", "canonical", "--seed", "2"),
            *("--sampler-steps", "1000,750,500,100"),
        ),
        finetune("rnd", "--release", w["r2_sf"], "--steps", "300", "--scenes", "random", "--seed", "3"),
        finetune(
            "apart",
            *("--release", w["r2_sf"], "--steps", "300", "--scenes", "canonical", "--seed", "3"),
            *("--apart-weight", "0.02"),
        ),
        Step(
            "release",
            "average",
            ("--out", w["release"], f"{w['rnd']}:0.65", f"{w['r2_sf']}:0.2", f"{w['apart']}:0.15"),
            w["release"],
        ),
    ]


def recorded_command(step: Step) -> str | None:
    """The command the release in ``step.out`` records (``--resume`` dropped), or None where no release is there."""
    path = os.path.join(step.out, "toyworld.json")  # toy_model.SETTINGS_FILE (not imported: jax starts slowly)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = json.load(f)
    for key in PROGRAMS[step.program][2]:
        record = record.get(key) if isinstance(record, dict) else None
    return None if record is None else " ".join(a for a in str(record).split() if a != "--resume")


def state(step: Step) -> str:
    """One of "done", "resume" or "run"; ValueError where ``step.out`` holds something this step would not write."""
    if os.path.exists(step.out):
        recorded = recorded_command(step)
        if recorded is None:
            raise ValueError(
                f"{step.out} exists and holds no release of {step.name}'s: delete it or use another --work"
            )
        if recorded != step.command():
            raise ValueError(
                f"{step.out} was written by another command ({recorded!r}, not {step.command()!r}): delete it or use "
                "another --work"
            )
        return "done"
    if step.program in RESUMABLE and os.path.isdir(step.out + ".partial"):
        return "resume"
    return "run"


def argv(step: Step, how: str) -> list[str]:
    return [*PROGRAMS[step.program][0], *step.args, *(("--resume",) if how == "resume" else ())]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def claim(work: str) -> str:
    """Claims ``work`` for this process (`LOCK`, holding its pid) and returns the lock's path; ValueError where a
    live process holds it (two rebuilds in one directory would run the same step twice). A lock left by a process
    that is gone is taken over."""
    path = os.path.join(work, LOCK)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        with open(path) as f:
            held = f.read().strip()
        if held.isdigit() and _alive(int(held)):
            raise ValueError(f"another rebuild (process {held}) is running in {work}") from None
        os.remove(path)
        return claim(work)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return path


def rebuild(steps: list[Step], *, dry_run: bool = False, log=print) -> int:
    """Runs the steps not yet done, in order (module docstring); returns an exit code (0 once every step is done).
    ValueError (from `state`) before anything runs where a step's directory holds what it would not write."""
    states = [state(s) for s in steps]
    for i, (step, how) in enumerate(zip(steps, states), 1):
        head = f"[{i}/{len(steps)}] {step.name}"
        if how == "done":
            log(f"{head}: done ({step.out})")
            continue
        cmd = argv(step, how)
        log(f"{head}: {'continuing' if how == 'resume' else 'running'}: {' '.join(cmd)}")
        if dry_run:
            continue
        started = time.perf_counter()
        child = subprocess.Popen(cmd)
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the child has the same Ctrl-C and writes its snapshot
            child.wait()
            log(f"rebuild_release: interrupted in {step.name}; run the same command again to continue")
            return 130
        if code != 0:
            log(f"rebuild_release: {step.name} failed (exit {code}); run the same command again to continue")
            return code
        log(f"{head}: wrote {step.out} in {time.perf_counter() - started:.0f} s")
    if not dry_run:
        log(f"every step done; read the release with: jaxkv toyworld check {steps[-1].out} --survey")
    return 0


def main(argv_=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, metavar="DIR", help="where each step writes its release (created)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands that would run, run nothing")
    args = ap.parse_args(argv_)
    if os.path.exists(args.work) and not os.path.isdir(args.work):
        print(f"rebuild_release: --work {args.work} is not a directory", file=sys.stderr)
        return 2
    lock = None
    try:
        if not args.dry_run:
            os.makedirs(args.work, exist_ok=True)
            lock = claim(args.work)
        return rebuild(release_10(args.work), dry_run=args.dry_run, log=lambda line: print(line, flush=True))
    except ValueError as e:
        print(f"rebuild_release: {e}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            os.remove(lock)


if __name__ == "__main__":
    sys.exit(main())
