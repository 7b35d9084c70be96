"""``jaxkv toyworld``: ``train`` a toy model from scratch; ``check`` a release against the quality thresholds."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxkv.argparsing import Parser


def _parser() -> argparse.ArgumentParser:
    from jaxkv.toyworld.clips import SCENES
    from jaxkv.toyworld.train import TrainConfig

    d = TrainConfig()
    p = Parser(prog="jaxkv toyworld", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train the toy model from scratch (the shipped recipe: about 2.7 hours on 2 CPU "
        "cores, most of it in self-forcing; docs/toyworld.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument("--out", required=True, metavar="DIR", help="the release directory to write")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the data, the init and the noise")
    t.add_argument("--steps", type=int, default=d.steps, help="teacher-forcing steps")
    t.add_argument(
        "--refine-steps",
        type=int,
        default=d.refine_steps,
        help=f"teacher-forcing steps after --steps (lr {d.refine_lr:g}, "
        f"{d.refine_pure_noise_share * 100:.0f}%% of the chunks at noise level 1)",
    )
    t.add_argument(
        "--scenes",
        choices=SCENES,
        default=d.scenes,
        help="every stage's training clips: windows of each prompt's one canonical scene (the prompt also says where "
        "the shapes start), of random scenes of it (random positions and directions: the prompt says what and how "
        "fast, never where), or mixed (half the clips each, drawn clip by clip)",
    )
    t.add_argument("--sf-steps", type=int, default=d.sf_steps, help="self-forcing steps")
    t.add_argument("--sf-batch", type=int, default=d.sf_batch, help="clips per self-forcing step")
    t.add_argument(
        "--sf-lr",
        type=float,
        default=d.sf_lr,
        help="peak learning rate of the self-forcing stage (20 warm-up steps, cosine decay to a tenth)",
    )
    t.add_argument(
        "--sf-chunks",
        type=int,
        default=d.sf_chunks,
        help="chunks each self-forcing clip rolls out on the ring after its committed frames",
    )
    t.add_argument(
        "--sf-colour-weight",
        type=float,
        default=d.sf_colour_weight,
        help="weight of the self-forcing loss's colour-share term (losses.colour_share_error: the shapes' "
        "pixel shares of the rollout against the world's; it keeps the shapes from fading)",
    )
    t.add_argument(
        "--sf-outline-weight",
        type=float,
        default=d.sf_outline_weight,
        help="weight of the self-forcing loss's outline term (losses.outline_error: each named shape's "
        "colour drawn as that shape, whole and sharp, wherever the rollout puts it)",
    )
    t.add_argument(
        "--sf-position-weight",
        type=float,
        default=d.sf_position_weight,
        help="weight of the self-forcing loss's position term (losses.position_error: how far, in px, each named "
        "shape is drawn from where the world puts it)",
    )
    t.add_argument(
        "--sf-apart-weight",
        type=float,
        default=d.sf_apart_weight,
        help="weight of the self-forcing loss's apart term (losses.apart_error: how far, in px, two named shapes "
        "are drawn into each other; the world bounces them apart)",
    )
    t.add_argument(
        "--remat",
        action="store_true",
        help="recompute each DiT block's activations in the backward pass instead of storing them: "
        "teacher-forcing steps 1.2-1.3x and self-forcing steps 1.7-2.1x faster on 2 CPU cores "
        "(benchmarks/train_step.py), but the weights differ from a run without it in float rounding (the "
        "shipped release 8 and release 7 were trained with it, release 6 without)",
    )
    for name, what in (
        ("dim", "width"),
        ("ffn_dim", "feed-forward width"),
        ("heads", "attention heads"),
        ("layers", "blocks"),
    ):
        t.add_argument(
            f"--dit-{name.replace('_', '-')}",
            type=int,
            default=getattr(d, f"dit_{name}"),
            help=f"the DiT's {what} (a release must stay under 5 MB: 2 bytes a parameter)",
        )
    t.add_argument(
        "--resume",
        action="store_true",
        help=f"continue from the snapshot in DIR.partial (written every {d.snapshot_every} steps and on Ctrl-C)",
    )
    t.add_argument("--overwrite", action="store_true", help="replace DIR if it is a toy-world release")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    c = sub.add_parser(
        "check",
        help="stream the quality check's prompts with a release and score them (exit code 1 below the threshold)",
    )
    c.add_argument("release", nargs="?", help="toy-world release directory (default: the shipped one)")
    c.add_argument(
        "--survey",
        action="store_true",
        help="also stream 16 prompts x 2 seeds (quality.survey): a "
        "steadier reading than the bar's 4 streams, for comparing models",
    )
    c.add_argument(
        "--long",
        action="store_true",
        help="also stream the bar's prompts for 300 frames and print, "
        "per 30 frames, the score and the shares of the named shapes still drawn and still moving",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train":
        from jaxkv.toyworld.train import TrainConfig, train

        for name in ("seed", "steps", "refine_steps", "sf_steps"):
            if getattr(args, name) < 0:
                print(f"jaxkv toyworld train: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
                return 2
        for name in ("sf_chunks", "sf_batch", "dit_dim", "dit_ffn_dim", "dit_heads", "dit_layers"):
            if getattr(args, name) < 1:
                print(f"jaxkv toyworld train: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
                return 2
        if not 0.0 < args.sf_lr < float("inf"):
            print("jaxkv toyworld train: --sf-lr must be finite and > 0", file=sys.stderr)
            return 2
        for name in ("sf_colour_weight", "sf_outline_weight", "sf_position_weight", "sf_apart_weight"):
            if not 0.0 <= getattr(args, name) < float("inf"):
                print(f"jaxkv toyworld train: --{name.replace('_', '-')} must be finite and >= 0", file=sys.stderr)
                return 2
        command = "jaxkv toyworld train " + " ".join(sys.argv[2:] if argv is None else argv[1:])
        try:
            tc = dataclasses.replace(
                TrainConfig(),
                seed=args.seed,
                scenes=args.scenes,
                steps=args.steps,
                refine_steps=args.refine_steps,
                sf_steps=args.sf_steps,
                sf_chunks=args.sf_chunks,
                sf_batch=args.sf_batch,
                sf_lr=args.sf_lr,
                sf_colour_weight=args.sf_colour_weight,
                sf_outline_weight=args.sf_outline_weight,
                sf_position_weight=args.sf_position_weight,
                sf_apart_weight=args.sf_apart_weight,
                remat=args.remat,
                dit_dim=args.dit_dim,
                dit_ffn_dim=args.dit_ffn_dim,
                dit_heads=args.dit_heads,
                dit_layers=args.dit_layers,
            )
            record = train(
                args.out, tc, resume=args.resume, progress=not args.no_progress, command=command, force=args.overwrite
            )
        except FileExistsError:
            print(
                f"jaxkv toyworld train: {args.out} exists; pass --overwrite to replace a toy-world release there",
                file=sys.stderr,
            )
            return 2
        except (FileNotFoundError, ValueError) as e:
            print(f"jaxkv toyworld train: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        print(
            f"wrote {args.out} in {record['seconds']:.0f} s: "
            + ", ".join(
                f"{s['name']} {s['steps']} steps"
                + (f", loss {s['loss_first_50']:.3f} -> {s['loss_last_50']:.3f}" if s["steps"] else "")
                for s in record["stages"]
            )
        )
        print(f"check it with: jaxkv toyworld check {args.out}")
    elif args.command == "check":
        from jaxkv.toyworld import model, quality

        try:
            toy = model.load(args.release or model.RELEASE_DIR)
        except (FileNotFoundError, ValueError) as e:
            print(f"jaxkv toyworld check: {e}", file=sys.stderr)
            return 2
        report = quality.check(toy)
        for row in report.per_prompt:
            print(
                f"{row['prompt']:<44} adherence {row['adherence']:.2f}  continuity {row['continuity']:.2f}  "
                f"overall {row['overall']:.2f}  tracking {row['tracking']:.2f}"
            )
        verdict = "passes" if report.passed else "FAILS"
        print(
            f"mean overall {report.overall:.3f}: {verdict} the threshold {quality.THRESHOLD} "
            f"({quality.FRAMES} frames per prompt, seed {quality.SEED})"
        )
        print(
            f"tracking {report.tracking:.3f}: the share of frames and named shapes drawn within "
            f"{quality.TRACK_RADIUS:g} px of where the world puts them (not part of the bar)"
        )
        moved = quality.travel(toy)
        print(
            f"travel per {quality.metric.TRAVEL_FRAMES} frames (median px) and roam (longer side of the box the "
            f"centre keeps to, px) of each named shape over {quality.TRAVEL_FRAMES}-frame streams, model / the "
            f"world's own clip of the prompt:"
        )
        for row in moved.rows:
            print(
                f"  {row['prompt']:<42} {row['shape']:<15} travel {row['model_px']:5.1f} / {row['world_px']:5.1f} "
                f"= {row['ratio']:.2f}  roam {row['model_roam_px']:5.1f} / {row['world_roam_px']:5.1f} "
                f"= {row['roam_ratio']:.2f}"
            )
        print(
            f"travel {'passes' if moved.passed else 'FAILS'}: every named shape must reach "
            f"{quality.TRAVEL_RATIO:g}x the world's travel and roam (least {moved.ratio:.2f} and "
            f"{moved.roam_ratio:.2f}; not yet part of the exit code)"
        )
        try:
            first = quality.default_stream(toy)
        except ValueError as e:  # a release whose default prompt is not said "slow"
            print(f"default stream: not read ({e})")
        else:
            print(
                f"default stream ({toy.settings.prompt!r} alone, {quality.DEFAULT_FRAMES} frames, seed {quality.SEED}: "
                "what `jaxkv generate` shows), per named shape:"
            )
            for row, seen, pace in zip(first.travel.rows, first.seen, first.pace):
                print(
                    f"  {row['shape']:<15} travel {row['ratio']:.2f}  roam {row['roam_ratio']:.2f} of the world's  "
                    f"seen in {seen:.1%} of frames  said fast / slow {pace:.2f}"
                )
            print(
                f"default stream {'passes' if first.passed else 'FAILS'}: each named shape seen in >= "
                f"{quality.SEEN_SHARE:.0%} of frames, travelling and roaming >= {quality.TRAVEL_RATIO:g}x the "
                f"world's, said fast >= {quality.PACE_RATIO:g}x slow (not part of the exit code)"
            )
        step = quality.next_chunk(toy)
        px = lambda errors: " / ".join(f"{e:.2f}" for e in errors)
        print(
            f"next chunk from the world's own frames ({quality.NEXT_CLIPS} clips; median px from the true centre "
            f"per frame): model {px(step.model)}, the last frame held still {px(step.still)}, the world's own "
            f"chunk {px(step.world)}"
        )
        levels = quality.denoising_errors(toy)
        mse = lambda errors: "/".join(f"{e:.3f}" for e in errors)
        print(
            "denoising that chunk once at each noise level (x0 squared error per frame, latent units): "
            + ", ".join(f"level {s:g}: {mse(e)}" for s, e in zip(levels.sigmas, levels.model))
            + f"; the last frame held still {mse(levels.still)}"
        )
        if args.survey:
            wide = quality.survey(toy)
            print(
                f"survey ({len(wide.prompts)} prompts x {len(wide.by_seed)} seeds, {quality.FRAMES} frames): "
                f"overall {wide.overall:.3f} (per seed {' / '.join(f'{x:.3f}' for x in wide.by_seed)}), "
                f"tracking {wide.tracking:.3f}"
            )
        if args.long:
            run = quality.long_streams(toy)
            row = lambda values: " ".join(f"{v:.2f}" for v in values)
            print(
                f"long streams ({len(quality.PROMPTS)} prompts x {quality.LONG_FRAMES} frames), per "
                f"{run.window_frames} frames: overall {row(run.overall)}; continuity {row(run.continuity)}; "
                f"named shapes seen {row(run.seen)}; named shapes moving {row(run.moving)}"
            )
        return 0 if report.passed else 1
    return 0
