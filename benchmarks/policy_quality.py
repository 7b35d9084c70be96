"""What each cache policy costs in quality on long streams: the shipped toy-world model streamed under several
retention policies, scored by `jaxkv.toyworld.metric` per window of chunks, with speed and cache bytes.

The model was trained with 3-frame chunks, a 3-frame sink plus a 6-frame window (9 frames in all) and cache-relative
RoPE. The same prompts and seeds are streamed under every policy; the chunks of all policies are generated in turn
in this one process (chunk i of every policy, then chunk i + 1), so the speed column compares like with like. Speed
is the median time of a chunk (4 denoising passes + the commit pass, the stream's donated jitted step) after the
first. Cache bytes are the stream's whole KV cache (all layers, K + V + positions) for the batch.

Scores (1 = perfect; see `jaxkv.toyworld.metric.score`): adherence (the prompt's shapes, in its colours, and no
others), continuity (plausible frame-to-frame motion), overall = their product; "drift" columns are the overall
score of the chunk windows named. Travel is what a viewer sees of motion (`jaxkv.toyworld.quality.travel_scores`):
per named shape, the median over the stream of how far it gets per 30 frames, as a share of the world's own clip of
the same prompt; the table gives the least and the median share over the prompts' named shapes (target 0.6).

    python benchmarks/policy_quality.py [--chunks 1000] [--window-chunks 50] [--json PATH] [--release DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import jax
import numpy as np

from jaxkv.stream import Stream
from jaxkv.toyworld import metric, quality, sample
from jaxkv.toyworld import model as toy_model

PROMPTS = quality.PROMPTS  # the check's prompts, so travel compares with the world's clips of the same prompts

# name -> RolloutConfig overrides of the model's own settings (3-frame chunks, 3-frame sink + 6-frame window,
# cache-relative RoPE); dilated layers run on absolute RoPE only (RolloutConfig refuses them with cache-relative)
POLICIES = {
    "ring, sink 3 + window 6 (trained)": {},
    "rolling, sink 3 + window 6": {"policy": "rolling"},
    "ring, sink 3 + window 6, absolute RoPE": {"rope": "absolute"},
    "ring, no sink, window 6": {"sink_frames": 0},
    "ring, no sink, window 3 (chunk only)": {"sink_frames": 0, "window_frames": 3},
    "ring, no sink, window 9": {"sink_frames": 0, "window_frames": 9},
    "ring, sink 3 + window 3": {"window_frames": 3},
    "ring, sink 3 + window 12": {"window_frames": 12},
    "mixed: odd layers dilated (every 2nd frame, 4 buckets), absolute RoPE": {
        "dilated_every": 2,
        "dilation": 2,
        "buckets": 4,
        "rope": "absolute",
    },
}


def run(release: str, chunks: int, window_chunks: int, seed: int, policies: dict) -> list[dict]:
    model = toy_model.load(release)
    context = model.context(list(PROMPTS))
    decode = jax.jit(model.latent_map.decode_uint8)
    streams, frames, times = {}, {}, {}
    for name, overrides in policies.items():
        rc = sample.rollout_config(model, **overrides)
        streams[name] = Stream(model.params, model.config, rc, context, num_chunks=chunks, key=jax.random.key(seed))
        frames[name], times[name] = [], []
    chunk_frames = next(iter(streams.values())).rc.chunk_frames
    truth = quality.world_videos(model, frames=chunks * chunk_frames, seed=seed, canonical=True)
    for i in range(chunks):
        for name, stream in streams.items():
            start = time.perf_counter()
            latents = next(stream)
            latents.block_until_ready()
            times[name].append(time.perf_counter() - start)
            frames[name].append(np.asarray(decode(latents)))
        if (i + 1) % 100 == 0:
            print(f"  {i + 1}/{chunks} chunks", file=sys.stderr, flush=True)
    rows = []
    for name, stream in streams.items():
        video = np.concatenate(frames.pop(name), axis=1)  # [prompts, T, 64, 64, 3]
        scores = [
            metric.score(video[p], PROMPTS[p], chunk_frames=stream.rc.chunk_frames, window_chunks=window_chunks)
            for p in range(len(PROMPTS))
        ]
        moved = [r["ratio"] for r in quality.travel_scores(video, truth, PROMPTS).rows]
        cache = stream.state.cache
        rows.append(
            {
                "policy": name,
                "overrides": policies[name],
                "adherence": float(np.mean([s.adherence for s in scores])),
                "continuity": float(np.mean([s.continuity for s in scores])),
                "overall": float(np.mean([s.overall for s in scores])),
                "window_start": scores[0].window_start.tolist(),
                "window_overall": np.mean([s.window_overall for s in scores], axis=0).tolist(),
                "per_prompt_overall": [s.overall for s in scores],
                "travel_least": min(moved),
                "travel_median": float(np.median(moved)),
                "ms_per_chunk": 1e3 * statistics.median(times[name][1:]) if chunks > 1 else None,
                "cache_bytes": int(sum(x.nbytes for x in jax.tree.leaves(cache))),
            }
        )
    return rows


def table(rows: list[dict], columns: int = 5) -> str:
    starts = rows[0]["window_start"]
    picks = sorted(set(np.linspace(0, len(starts) - 1, min(columns, len(starts))).round().astype(int).tolist()))
    step = starts[1] - starts[0] if len(starts) > 1 else None
    heads = [f"chunks {starts[i]}-{starts[i] + step - 1}" if step else f"from {starts[i]}" for i in picks]
    lines = [
        "| policy | adherence | continuity | overall | "
        + " | ".join(heads)
        + " | travel least / median | ms/chunk | cache KiB |",
        "| --- " * (7 + len(picks)) + "|",
    ]
    for r in rows:
        drift = " | ".join(f"{r['window_overall'][i]:.2f}" for i in picks)
        ms = f"{r['ms_per_chunk']:.1f}" if r["ms_per_chunk"] is not None else "-"
        lines.append(
            f"| {r['policy']} | {r['adherence']:.2f} | {r['continuity']:.2f} | {r['overall']:.2f} | {drift} "
            f"| {r['travel_least']:.2f} / {r['travel_median']:.2f} | {ms} | {r['cache_bytes'] / 1024:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default=toy_model.RELEASE_DIR, help="toy-world release (default: the shipped)")
    parser.add_argument("--chunks", type=int, default=1000, help="chunks per stream")
    parser.add_argument("--window-chunks", type=int, default=50, help="chunks per drift window")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise")
    parser.add_argument("--policies", help="comma-separated indices into the policy list (default: all)")
    parser.add_argument("--json", help="write the rows and the machine description here")
    args = parser.parse_args(argv)
    policies = POLICIES
    if args.policies:
        names = list(POLICIES)
        policies = {names[int(i)]: POLICIES[names[int(i)]] for i in args.policies.split(",")}
    start = time.perf_counter()
    rows = run(args.release, args.chunks, args.window_chunks, args.seed, policies)
    print(f"{len(PROMPTS)} prompts x {args.chunks} chunks, seed {args.seed}, {time.perf_counter() - start:.0f} s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    prompts=PROMPTS,
                    chunks=args.chunks,
                    window_chunks=args.window_chunks,
                    seed=args.seed,
                    jax=jax.__version__,
                    backend=jax.default_backend(),
                    machine=platform.machine(),
                ),
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
