"""Fine-tunes a toy-world release with stage 4 of the recipe (self-forcing through the ring, past the cache; or
with ``--stage teacher-forcing`` stage 3's teacher forcing with its level-1 share) on clips of random scenes of each
prompt (``--scenes random``: random positions and directions, so the prompt says what and how fast, never where) or
of its one canonical scene (``--scenes canonical``, the recipe's) or of either, clip by clip (``--scenes mixed``:
half random), and writes the result as a release directory
(issue 44: what teaches the default stream's shapes to keep moving?).

    python benchmarks/finetune_scenes.py --out DIR [--stage self-forcing] [--steps 300] [--scenes random]
                                         [--release DIR] [--seed 1] [--snapshot-every 50] [--resume] [--lr 2e-5]
                                         [--position-weight 0.03] [--apart-weight 0.1] [--sf-chunks 9]
                                         [--sampler-steps 1000,750,500,100]

It starts from the release's weights (its DiT is stored in bfloat16 and read as float32) and the recipe its
toyworld.json records (`TrainConfig`: the ``sf_*`` loss and settings, remat), with ``--steps`` self-forcing steps of
the recipe's stage-4 optimizer (lr ``sf_lr`` or ``--lr``, 20 warm-up steps, cosine decay to a tenth over
``--steps``), the position term (`jaxkv.toyworld.losses.position_error`) at ``--position-weight``, the apart
term (`jaxkv.toyworld.losses.apart_error`: two named shapes drawn into each other) at ``--apart-weight``, rollouts with
``--sampler-steps`` (written into the release's settings; default the release's own), ``--sf-chunks`` chunks
rolled out past each clip's context (default the recipe's) and clips
and noise drawn from (``--seed``, stage 3, step) as `jaxkv.toyworld.train` draws them. The default seed, 1, is
not release 8's, whose stage 4 drew seed 0's clips. It prints the mean loss per 10 steps and the wall time; the
release it writes keeps the original's record ("training") and adds this run's ("finetune"), and reads with
``python benchmarks/motion.py --release DIR`` and ``jaxkv toyworld check DIR``. Like ``jaxkv toyworld train`` it
keeps a snapshot in ``DIR.partial`` (every ``--snapshot-every`` steps and on Ctrl-C): ``--resume`` continues an
interrupted run exactly.

With ``--stage teacher-forcing`` the steps are stage 3's (`jaxkv.toyworld.losses.teacher_forcing_loss` with the
recipe's ``refine_pure_noise_share``; its optimizer: lr ``refine_lr`` or ``--lr``, ``refine_warmup`` warm-up
steps, cosine decay), the clips drawn from (``--seed``, stage 2, step); ``--position-weight``, ``--apart-weight``
and ``--sf-chunks`` are stage 4's and refused with it. A release fine-tuned in turn keeps every earlier fine-tune's
record, oldest first, in "finetune_history".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import time

import jax
import numpy as np

from jaxkv.generate.options import parse_steps
from jaxkv.toyworld import clips, text
from jaxkv.toyworld import model as toy_model
from jaxkv.toyworld import train as T
from jaxkv.toyworld.snapshot import load_snapshot, read_position, save_snapshot

# --stage: (its row of `train.stage_table`, its stage index in the draws of `train.train` (seed, stage, step))
STAGES = {"self-forcing": (2, 3), "teacher-forcing": (1, 2)}


def recipe(
    toy: toy_model.ToyModel,
    steps: int,
    scenes: str,
    seed: int,
    position_weight: float = 0.0,
    lr: float | None = None,
    sf_chunks: int | None = None,
    stage: str = "self-forcing",
    apart_weight: float = 0.0,
) -> T.TrainConfig:
    """The `TrainConfig` the release records (defaults where it records none; the DiT's shape is the release's own)
    with ``steps`` steps of ``stage`` at peak ``lr`` (None: the recipe's), ``scenes``, ``seed``, and stage 4's
    ``position_weight``, ``apart_weight`` and chunks each clip rolls out past its context, ``sf_chunks`` (None: the
    recipe's)."""
    recorded = toy.info.get("training", {}).get("train_config") or {}
    known = {f.name for f in dataclasses.fields(T.TrainConfig)}
    tc = T.TrainConfig(**{k: v for k, v in recorded.items() if k in known})
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}")
    if stage == "teacher-forcing" and (position_weight or apart_weight or sf_chunks is not None):
        raise ValueError(
            "--position-weight, --apart-weight and --sf-chunks are stage 4's (self-forcing), not teacher forcing's"
        )
    if stage == "teacher-forcing":
        tc = dataclasses.replace(tc, refine_steps=steps, refine_lr=tc.refine_lr if lr is None else lr)
    else:
        tc = dataclasses.replace(
            tc,
            sf_steps=steps,
            sf_position_weight=position_weight,
            sf_apart_weight=apart_weight,
            sf_lr=tc.sf_lr if lr is None else lr,
            sf_chunks=tc.sf_chunks if sf_chunks is None else sf_chunks,
        )
    c = toy.config
    tc = dataclasses.replace(
        tc,
        scenes=scenes,
        seed=seed,
        dit_dim=c.dim,
        dit_ffn_dim=c.ffn_dim,
        dit_heads=c.num_heads,
        dit_layers=c.num_layers,
    )
    if tc.wan_config() != c:
        raise ValueError(f"the release's DiT ({c}) is not a toy-world training shape ({tc.wan_config()})")
    return tc


def snapshot_path(out: str) -> str:
    """Where a fine-tune writing ``out`` keeps its snapshot (as `jaxkv.toyworld.train` does: ``out.partial``)."""
    return os.path.abspath(out) + ".partial"


def finetune(
    release: str,
    out: str,
    steps: int,
    scenes: str,
    seed: int,
    *,
    force: bool = False,
    resume: bool = False,
    snapshot_every: int = 50,
    position_weight: float = 0.0,
    sampler_steps: tuple[int, ...] | None = None,
    lr: float | None = None,
    sf_chunks: int | None = None,
    stage: str = "self-forcing",
    apart_weight: float = 0.0,
    log=print,
) -> dict:
    """Runs the fine-tune of the module docstring and writes the release ``out``; returns its "finetune" record.

    Every ``snapshot_every`` steps and on Ctrl-C it writes params, optimizer state and losses to `snapshot_path`
    (`jaxkv.toyworld.snapshot`); ``resume`` continues from there, bit for bit as the uninterrupted run, after
    checking that the snapshot is this fine-tune's (release, steps, scenes, seed, position and apart weights, lr,
    sampler steps, chunks rolled out, stage).
    The snapshot goes once the release is written. ``sampler_steps``: the rollouts' and the written release's
    sampler steps (default: the release's own)."""
    toy = toy_model.load(release)
    if sampler_steps is not None:
        toy = dataclasses.replace(toy, settings=dataclasses.replace(toy.settings, steps=tuple(sampler_steps)))
        toy.settings.schedule()  # checks the steps as every schedule's are checked (ValueError)
    tc = recipe(toy, steps, scenes, seed, position_weight, lr, sf_chunks, stage, apart_weight)
    row, draws = STAGES[stage]
    params = {"dit": toy.params, "text": toy_model.load_text_params(release)}
    name, _, size, after_sink, loss_fn, optimizer = T.stage_table(tc, toy.settings, toy.latent_map)[row]
    step_fn = T._step_fn(loss_fn, optimizer)
    opt_state = optimizer.init(params)
    snapshot = snapshot_path(out)
    origin = {"finetune_from": os.path.abspath(release), "sampler_steps": list(toy.settings.steps), "stage": stage}
    first, losses, before = 0, [], 0.0
    if resume:
        if not os.path.isdir(snapshot):
            raise FileNotFoundError(f"--resume: no snapshot at {snapshot}")
        position = read_position(snapshot)
        mine = json.loads(json.dumps(dataclasses.asdict(tc)))  # as position.json holds it (tuples as lists)
        keys = ("finetune_from", "sampler_steps", "stage")
        theirs = (*(position.get(k) for k in keys), position.get("train_config"))
        if theirs != (*(origin[k] for k in keys), mine):
            raise ValueError(
                f"--resume: the snapshot at {snapshot} is another fine-tune's (from "
                f"{position.get('finetune_from')!r}); resume with the --stage, --release, --steps, --scenes, "
                "--seed, --position-weight, --apart-weight, --sampler-steps, --lr and --sf-chunks it was started with"
            )
        position, (params, opt_state) = load_snapshot(snapshot, (params, opt_state))
        first, losses, before = position["step"], position["losses"], position["seconds"]
    elif os.path.exists(snapshot):
        raise FileExistsError(f"{snapshot} holds an interrupted fine-tune: pass --resume, or delete it to start over")
    tokenizer, key = text.tokenizer(), jax.random.key(seed)
    started, first_done, done = time.perf_counter(), None, first

    def seconds():
        return before + time.perf_counter() - started

    try:
        for step in range(first, steps):
            batch, key_step = T.step_inputs(
                toy.latent_map, tokenizer, toy.settings, tc, seed, draws, step, size, after_sink, key
            )
            params, opt_state, loss = step_fn(params, opt_state, batch, key_step)
            losses.append(float(loss))  # waits for the step
            done = step + 1
            if first_done is None:
                first_done = (time.perf_counter(), done)  # the first step includes compiling it
            if done % 10 == 0 or done == steps:
                tens = 10 * (step // 10)
                log(
                    f"{name} ({scenes} scenes) steps {tens + 1}-{done} of {steps}: mean loss "
                    f"{np.mean(losses[tens:]):.4f}, {seconds():.0f} s"
                )
            if done % snapshot_every == 0 and done < steps:
                save_snapshot(snapshot, draws, done, params, opt_state, losses, [], (seconds(), seconds()), tc, origin)
    except KeyboardInterrupt:
        save_snapshot(snapshot, draws, done, params, opt_state, losses[:done], [], (seconds(), seconds()), tc, origin)
        log(f"interrupted: snapshot at step {done} in {snapshot}; continue with --resume")
        raise
    total = seconds()
    timed = None if first_done is None else steps - first_done[1]  # steps after this process's first
    per_step = (time.perf_counter() - first_done[0]) / timed if timed else None
    record = {
        "from": os.path.abspath(release),
        "command": "python benchmarks/finetune_scenes.py " + " ".join(sys.argv[1:]),
        "stage": name,
        "steps": steps,
        "scenes": scenes,
        "seed": seed,
        "sampler_steps": list(toy.settings.steps),
        "train_config": dataclasses.asdict(tc),
        "seconds": round(total, 1),
        "seconds_per_step_after_the_first": None if per_step is None else round(per_step, 2),
        "loss_per_10_steps": [round(float(np.mean(losses[i : i + 10])), 5) for i in range(0, steps, 10)],
        "jax_version": jax.__version__,
        "machine": platform.platform(),
    }
    earlier = [*toy.info.get("finetune_history", []), *([toy.info["finetune"]] if "finetune" in toy.info else [])]
    info = {**toy.info, "finetune": record, **({"finetune_history": earlier} if earlier else {})}
    toy_model.save(
        out, params["dit"], params["text"], toy.latent_map, toy.settings, info, config=toy.config, force=force
    )
    shutil.rmtree(snapshot, ignore_errors=True)  # the release holds everything it held
    return record


def parser() -> argparse.ArgumentParser:
    """The command line of the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="the release directory to write")
    ap.add_argument(
        "--stage",
        choices=tuple(STAGES),
        default="self-forcing",
        help="the recipe's stage 4 (self-forcing, the default) or stage 3 (teacher-forcing, with its level-1 share)",
    )
    ap.add_argument("--steps", type=int, default=300, help="steps of the stage (default 300)")
    ap.add_argument(
        "--scenes", choices=clips.SCENES, default="random", help="the clips' scenes (default random; mixed: half each)"
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the clips and the noise (default 1)")
    ap.add_argument("--release", default=toy_model.RELEASE_DIR, help="the release to start from (default: shipped)")
    ap.add_argument("--overwrite", action="store_true", help="replace DIR if it is a toy-world release")
    ap.add_argument("--resume", action="store_true", help="continue the interrupted run from DIR.partial")
    ap.add_argument("--snapshot-every", type=int, default=50, help="steps between snapshots (default 50)")
    ap.add_argument(
        "--position-weight",
        type=float,
        default=0.0,
        help="weight of stage 4's position term (losses.position_error; default 0, the recipe's)",
    )
    ap.add_argument(
        "--apart-weight",
        type=float,
        default=0.0,
        help="weight of stage 4's apart term (losses.apart_error: two named shapes drawn into each other, px; "
        "default 0, the recipe's)",
    )
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help="the peak learning rate (default: the recipe's, sf_lr or refine_lr: 1e-4 or 5e-4 for release 8)",
    )
    ap.add_argument(
        "--sf-chunks",
        type=int,
        default=None,
        help="chunks each clip rolls out past its context (default: the recipe's sf_chunks, 4 for release 8)",
    )
    ap.add_argument(
        "--sampler-steps",
        type=parse_steps,
        default=None,
        help="the rollouts' and the written release's sampler timesteps, comma-separated (default: the release's)",
    )
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.stage == "teacher-forcing" and (args.position_weight or args.apart_weight or args.sf_chunks is not None):
        print(
            "finetune_scenes: --position-weight, --apart-weight and --sf-chunks are for --stage self-forcing",
            file=sys.stderr,
        )
        return 2
    if args.sf_chunks is not None and args.sf_chunks < 1:
        print(f"finetune_scenes: --sf-chunks must be >= 1, got {args.sf_chunks}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.seed < 0 or args.snapshot_every < 1:
        print("finetune_scenes: --steps and --snapshot-every must be >= 1 and --seed >= 0", file=sys.stderr)
        return 2
    if args.lr is not None and not (0.0 < args.lr < float("inf")):
        print(f"finetune_scenes: --lr must be finite and > 0, got {args.lr}", file=sys.stderr)
        return 2
    for name in ("position_weight", "apart_weight"):
        if not (0.0 <= getattr(args, name) < float("inf")):
            flag = "--" + name.replace("_", "-")
            print(f"finetune_scenes: {flag} must be finite and >= 0, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if os.path.exists(args.out) and not args.overwrite:
        print(f"finetune_scenes: {args.out} exists; pass --overwrite to replace a toy-world release", file=sys.stderr)
        return 2
    if os.path.abspath(args.out) == os.path.abspath(args.release):
        print("finetune_scenes: --out must not be the --release it starts from", file=sys.stderr)
        return 2
    try:
        record = finetune(
            args.release,
            args.out,
            args.steps,
            args.scenes,
            args.seed,
            force=args.overwrite,
            resume=args.resume,
            snapshot_every=args.snapshot_every,
            position_weight=args.position_weight,
            sampler_steps=args.sampler_steps,
            lr=args.lr,
            sf_chunks=args.sf_chunks,
            stage=args.stage,
            apart_weight=args.apart_weight,
        )
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"finetune_scenes: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out} in {record['seconds']:.0f} s ({record['seconds_per_step_after_the_first']} s per step after "
        f"the first); read it with: python benchmarks/motion.py --release {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
