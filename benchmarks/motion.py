"""Where a toy model's motion goes: each named shape's speed over a stream, against the world's own clip of the
same prompt, for prompts that differ only in their speed word.

Per prompt and named shape it reports
  * travel: the median over 30-frame windows of how far the shape's centre gets (`jaxkv.toyworld.metric.travel`),
    for the model's stream and for the world's canonical scene of the prompt rendered through the model's latent
    map (what the stream is meant to show), and their ratio;
  * roam: how far across the box the shape's centre gets over the whole stream (the longer side of the box it
    keeps to, `jaxkv.toyworld.metric.roam`), model and world, and their ratio: a shape looping near its start can
    travel like the world per window and roam a fraction of the box;
  * a profile over time: the travel of each successive 30-frame window (does motion die in the first chunks, at
    the first eviction, or slowly?);
  * heading: the median cosine between consecutive chunks' displacements (1: the shape keeps its direction from
    chunk to chunk, as the world's do but for bounces; ~0: every chunk sets off anew);
  * the mean step per frame (px) in each of the first chunks, around the first eviction (the chunk after the sink
    and the window are full).

The prompts come in slow / fast pairs: if the model reads the speed word, "fast" travels ~2x "slow" as in the world.

It also reads the one step a stream repeats, from the world's own frames (`jaxkv.toyworld.quality.next_chunk`),
on each prompt's canonical scene and on random scenes of the same prompts: a model that continues the random
scenes as well as the canonical ones reads the motion from the frames, not from a memory of the prompt's scene.
``--sampler-steps`` streams with other sampler steps than the release's (the model is trained on every level).

    python benchmarks/motion.py [--frames 600] [--seed 0] [--release DIR] [--sampler-steps 1000,750,500,100]
                                [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time

import numpy as np

from jaxkv.generate.options import parse_steps
from jaxkv.toyworld import metric, quality, sample, world
from jaxkv.toyworld import model as toy_model

PROMPTS = (
    "a red circle and a blue square, slow",
    "a red circle and a blue square, fast",
    "a blue circle, slow",
    "a blue circle, fast",
    "a green triangle, slow",
    "a green triangle, fast",
)
FIRST_CHUNKS = 8  # chunks whose mean step per frame is listed one by one


def _steps_per_chunk(centre: np.ndarray, chunk_frames: int, chunks: int) -> list[float]:
    """Mean step per frame (px) of a centre path float [T, 2] within each of the first ``chunks`` chunks (steps
    into the chunk's frames; NaN where the shape is absent)."""
    step = np.linalg.norm(np.diff(centre, axis=0), axis=-1)  # [T - 1]: step into frame t + 1
    step = np.concatenate([[np.nan], step])
    out = []
    for c in range(chunks):
        part = step[c * chunk_frames : (c + 1) * chunk_frames]
        out.append(float(np.nanmean(part)) if np.isfinite(part).any() else float("nan"))
    return out


def _heading(centre: np.ndarray, chunk_frames: int) -> float:
    """Median cosine between the displacements of consecutive chunks (each from a chunk's first frame to the next
    chunk's): 1 when a shape keeps its heading from chunk to chunk (the world's, but for bounces), ~0 when each
    chunk sets off in a new direction, -1 when it goes back and forth."""
    starts = centre[::chunk_frames]
    d = np.diff(starts, axis=0)  # [chunks - 1, 2]
    a, b = d[:-1], d[1:]
    norm = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    cos = np.sum(a * b, axis=-1) / np.where(norm > 0, norm, np.nan)
    return float(np.nanmedian(cos)) if np.isfinite(cos).any() else float("nan")


def _profile(centre: np.ndarray, present: np.ndarray, frames: int) -> list[float]:
    """Travel (diagonal of the centre's box, px) of each successive ``frames``-frame window; NaN where the shape is
    present in under half of it."""
    out = []
    for start in range(0, len(centre) - frames + 1, frames):
        here = present[start : start + frames]
        if here.sum() * 2 < frames:
            out.append(float("nan"))
            continue
        c = centre[start : start + frames][here]
        out.append(float(np.linalg.norm(c.max(0) - c.min(0))))
    return out


def measure(model: toy_model.ToyModel, prompts, frames: int, seed: int) -> list[dict]:
    """One row per (prompt, named shape)."""
    cf = model.settings.chunk_frames
    videos = sample.video(model, list(prompts), num_chunks=frames // cf, seed=seed)
    truth = np.stack([world.render(world.canonical_scene(p), frames) for p in prompts])
    truth = np.asarray(model.latent_map.decode_uint8(model.latent_map.encode(truth)))
    rows = []
    for prompt, video, clip in zip(prompts, videos, truth):
        mine, theirs = metric.detect(video), metric.detect(clip)
        model_travel = metric.travel(mine, prompt)
        world_travel = metric.travel(theirs, prompt)
        model_roam, world_roam = metric.roam(mine, prompt), metric.roam(theirs, prompt)
        colours = [metric.COLOUR_NAMES.index(c) for c, _ in world.parse_prompt(prompt)[0]]
        for n, (colour, shape) in enumerate(world.parse_prompt(prompt)[0]):
            k = colours[n]
            rows.append(
                {
                    "prompt": prompt,
                    "shape": f"{colour} {shape}",
                    "world_travel_px": float(world_travel[n]),
                    "model_travel_px": float(model_travel[n]),
                    "ratio": float(model_travel[n] / world_travel[n]),
                    "world_roam_px": float(world_roam[n]),
                    "model_roam_px": float(model_roam[n]),
                    "roam_ratio": float(model_roam[n] / world_roam[n]),
                    "seen": float(mine.present[:, k].mean()),
                    "heading_model": _heading(mine.centroid[:, k], cf),
                    "heading_world": _heading(theirs.centroid[:, k], cf),
                    "profile_model_px": _profile(mine.centroid[:, k], mine.present[:, k], metric.TRAVEL_FRAMES),
                    "profile_world_px": _profile(theirs.centroid[:, k], theirs.present[:, k], metric.TRAVEL_FRAMES),
                    "first_chunks_step_model_px": _steps_per_chunk(mine.centroid[:, k], cf, FIRST_CHUNKS),
                    "first_chunks_step_world_px": _steps_per_chunk(theirs.centroid[:, k], cf, FIRST_CHUNKS),
                }
            )
    return rows


def _fmt(values) -> str:
    return " ".join("  -  " if not np.isfinite(v) else f"{v:5.1f}" for v in values)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=600, help="frames per stream (whole chunks; default 600)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--release", default=toy_model.RELEASE_DIR, help="a toy-world release (default: the shipped one)")
    ap.add_argument(
        "--sampler-steps",
        type=parse_steps,
        help="the sampler's timesteps, comma-separated, first step first (default: the release's own)",
    )
    ap.add_argument("--json", help="write the rows and the settings here")
    args = ap.parse_args(argv)
    model = toy_model.load(args.release)
    if args.sampler_steps is not None:
        settings = dataclasses.replace(model.settings, steps=args.sampler_steps)
        try:
            settings.schedule()  # checks the steps as every schedule's are checked
        except ValueError as e:
            ap.error(f"--sampler-steps: {e}")
        model = dataclasses.replace(model, settings=settings)
    st = model.settings
    if args.frames % st.chunk_frames or args.frames < metric.TRAVEL_FRAMES:
        ap.error(f"--frames must be whole {st.chunk_frames}-frame chunks and at least {metric.TRAVEL_FRAMES}")
    t0 = time.perf_counter()
    rows = measure(model, PROMPTS, args.frames, args.seed)
    steps_from_truth = {
        scenes: quality.next_chunk(model, seed=args.seed, scenes=scenes) for scenes in ("canonical", "random")
    }
    seconds = time.perf_counter() - t0
    evict = (st.sink_frames + st.window_frames) // st.chunk_frames
    print(
        f"{args.frames} frames per stream, seed {args.seed}; chunks of {st.chunk_frames} frames, sink "
        f"{st.sink_frames} + window {st.window_frames} frames: chunk {evict} is the first to evict; sampler steps "
        f"{list(st.steps)}; {seconds:.0f} s"
    )
    print(f"{'':<53} {'travel / 30 frames':>20}   {'roam (whole stream)':>20}")
    print(
        f"{'prompt':<38} {'shape':<14} {'world':>6} {'model':>6} {'ratio':>6}   {'world':>6} {'model':>6} "
        f"{'ratio':>6} {'seen':>5} {'heading m/w':>12}"
    )
    for r in rows:
        print(
            f"{r['prompt']:<38} {r['shape']:<14} {r['world_travel_px']:6.1f} {r['model_travel_px']:6.1f} "
            f"{r['ratio']:6.2f}   {r['world_roam_px']:6.1f} {r['model_roam_px']:6.1f} {r['roam_ratio']:6.2f} "
            f"{r['seen']:5.2f} {r['heading_model']:5.2f}/{r['heading_world']:5.2f}"
        )
    print(f"\ntravel per successive {metric.TRAVEL_FRAMES}-frame window (px), model / world:")
    for r in rows:
        print(f"  {r['prompt'][:30]:<30} {r['shape']:<14} model {_fmt(r['profile_model_px'][:12])}")
        print(f"  {'':<30} {'':<14} world {_fmt(r['profile_world_px'][:12])}")
    print(f"\nmean step per frame (px) in chunks 0..{FIRST_CHUNKS - 1}, model / world:")
    for r in rows:
        print(
            f"  {r['prompt'][:30]:<30} {r['shape']:<14} model {_fmt(r['first_chunks_step_model_px'])} | world "
            f"{_fmt(r['first_chunks_step_world_px'])}"
        )
    print(f"\nthe next chunk from the world's own frames ({quality.NEXT_CLIPS} clips), px from the world per frame:")
    for scenes, step in steps_from_truth.items():
        print(
            f"  {scenes + ' scenes':<17} model {_fmt(step.model)} | held still {_fmt(step.still)} | the world through "
            f"the latent map {_fmt(step.world)}"
        )
    for shape_rows in _pairs(rows):
        slow, fast = shape_rows
        print(
            f"fast / slow travel, {slow['shape']} ({slow['prompt'].rsplit(',', 1)[0]}): model "
            f"{fast['model_travel_px'] / slow['model_travel_px']:.2f}, world "
            f"{fast['world_travel_px'] / slow['world_travel_px']:.2f}"
        )
    if args.json:
        meta = {
            "frames": args.frames,
            "seed": args.seed,
            "release": args.release,
            "sampler_steps": list(st.steps),
            "seconds": seconds,
            "machine": platform.platform(),
            "python": sys.version.split()[0],
        }
        with open(args.json, "w") as f:
            next_chunk = {k: {f: v.tolist() for f, v in step._asdict().items()} for k, step in steps_from_truth.items()}
            json.dump({"settings": meta, "rows": rows, "next_chunk": next_chunk}, f, indent=1)
    return 0


def _pairs(rows):
    """(slow row, fast row) of the same shape in prompts that differ only in the speed word."""
    by = {(r["prompt"].rsplit(",", 1)[0], r["shape"], r["prompt"].rsplit(" ", 1)[1]): r for r in rows}
    for (scene, shape, speed), row in by.items():
        if speed == "slow" and (scene, shape, "fast") in by:
            yield row, by[(scene, shape, "fast")]


if __name__ == "__main__":
    sys.exit(main())
