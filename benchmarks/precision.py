"""How far the bfloat16 precision (`jaxkv.precision.Precision.bf16()`) lands from the float32 path, chunk by chunk.

For each model, one set of float32 weights W, one text context and one explicit noise tensor run three streaming
rollouts (`jaxkv.rollout.jit_rollout`, the full Self-Forcing sampler: 4 denoising passes + the context pass per
chunk, on a ring that wraps):

* ``f32``: `Precision.f32()` on W (the reference);
* ``bf16``: `Precision.bf16()` on W rounded to bfloat16 (weights, matmul inputs, KV and cross K/V in bfloat16;
  accumulation, softmax, norms, modulation, time embedding and head in float32): what a user gets by switching a
  float32 checkpoint to ``--precision bfloat16``;
* ``f32_on_bf16_weights``: `Precision.f32()` on W rounded to bfloat16 and widened back, so that
  ``bf16`` vs this row is the compute's share of the distance and this row vs ``f32`` the weights' share.

Per chunk it prints the max abs difference of the clean latents, that over the reference's max abs ("rel"), and the
RMS difference over the reference's RMS ("rms rel"); errors carry from chunk to chunk through the KV cache, so the
later chunks show whether they grow. Writes everything to --json.

    PYTHONPATH=. python benchmarks/precision.py [--models tiny,medium] [--chunks 6] [--seeds 0,1,2] [--json PATH]

Models: ``tiny`` (the preset: dim 64, 4 x 16 heads, 2 layers; 8x8 latents = 16 tokens per frame) and ``medium``
(the peer benchmark's: dim 256, 2 x 128 heads, 4 layers, text 512 x 256; 20x26 latents = 130 tokens per frame);
3-frame chunks, a 6-frame window (the ring wraps from the third chunk on).

``--toyworld`` measures the FP8 options instead, on the shipped toy-world model (a trained model, so attention is
not the near-uniform attention of random weights): the quality bar's four prompts (`jaxkv.toyworld.quality`) are
streamed for ``--chunks`` chunks (default 16 = the bar's 48 frames) with one seed under ``f32``, ``bf16``,
``bf16+fp8_kv`` (the FP8 cache alone) and ``fp8`` (`Precision.fp8()`: FP8 cache and FP8 attention, emulated on
CPU), the model's own settings otherwise (sink 3 + window 6 frames, cache-relative RoPE). Per precision: the bar's
scores of the decoded frames (`jaxkv.toyworld.quality.scores_of`: overall, adherence, continuity, tracking), the
KV cache bytes, and per chunk the latents' distance from the bf16 stream (same noise, rel and rms rel as above).

    PYTHONPATH=. python benchmarks/precision.py --toyworld [--chunks 16] [--seeds 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.precision import Precision
from jaxkv.stream import Stream

MODELS = {
    "tiny": (wan.preset("tiny"), (8, 8)),
    "medium": (
        WanConfig(dim=256, ffn_dim=1024, num_heads=2, num_layers=4, text_dim=256, text_len=512, freq_dim=256),
        (20, 26),
    ),
}
CHUNK_FRAMES, WINDOW_FRAMES = 3, 6
MODES = ("f32", "bf16", "f32_on_bf16_weights")
TOY_PRECISIONS = {
    "f32": Precision.f32(),
    "bf16": Precision.bf16(),
    "bf16+fp8_kv": dataclasses.replace(Precision.bf16(), fp8_kv=True),
    "fp8": Precision.fp8(),
}


def chunk_errors(got, want, chunk_frames: int = CHUNK_FRAMES) -> list[dict]:
    """Per-chunk distance of latents ``got`` from ``want`` (both [batch, chunks * chunk_frames, h, w, c])."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rows = []
    for i in range(want.shape[1] // chunk_frames):
        g, w = (a[:, i * chunk_frames : (i + 1) * chunk_frames] for a in (got, want))
        diff = np.abs(g - w)
        rows.append(
            {
                "chunk": i,
                "max_abs": float(diff.max()),
                "rel": float(diff.max() / np.abs(w).max()),
                "rms_rel": float(np.sqrt(np.mean(diff**2) / np.mean(w**2))),
            }
        )
    return rows


def rollouts(config: WanConfig, latent_hw, num_chunks: int, seed: int) -> dict[str, np.ndarray]:
    """The latents of the three modes (see the module docstring) for one seed."""
    k_w, k_ctx, k_noise = jax.random.split(jax.random.key(seed), 3)
    weights = wan.init_params(config, k_w)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights)
    widened = jax.tree.map(lambda a: a.astype(jnp.float32), rounded)
    context = jax.random.normal(k_ctx, (1, config.text_len, config.text_dim))
    out = {}
    for mode, params, precision in (
        ("f32", weights, Precision.f32()),
        ("bf16", rounded, Precision.bf16()),
        ("f32_on_bf16_weights", widened, Precision.f32()),
    ):
        rc = R.RolloutConfig(*latent_hw, chunk_frames=CHUNK_FRAMES, window_frames=WINDOW_FRAMES, precision=precision)
        noise = jax.random.normal(k_noise, rc.noise_shape(config, 1, num_chunks))
        out[mode] = np.asarray(R.jit_rollout(params, config, rc, context, num_chunks=num_chunks, noise=noise).latents)
    return out


def toyworld_streams(num_chunks: int, seed: int, precisions=TOY_PRECISIONS) -> dict:
    """The toy-world model's streams of the quality bar's prompts under each precision: {name: (latents float32
    [prompts, frames, 16, 16, c], frames uint8 [prompts, frames, 64, 64, 3], cache bytes)}."""
    from jaxkv.toyworld import model as toy_model
    from jaxkv.toyworld import quality

    model = toy_model.load()
    prompts = list(quality.PROMPTS)
    context = model.context(prompts)
    decode = jax.jit(model.latent_map.decode_uint8)
    out = {}
    for name, precision in precisions.items():
        params = jax.tree.map(lambda a: a.astype(precision.param_dtype), model.params)  # noqa: B023 - called in the iteration that defines it
        rc = model.settings.rollout_config(precision=precision)
        stream = Stream(
            params,
            model.config,
            rc,
            context,
            num_chunks=num_chunks,
            key=jax.random.key(seed),
            negative_context=model.negative_context(len(prompts), rc),
        )
        latents = [np.asarray(chunk, np.float32) for chunk in stream]
        frames = np.concatenate([np.asarray(decode(x)) for x in latents], axis=1)
        cache_bytes = int(sum(x.nbytes for x in jax.tree.leaves(stream.state.cache)))
        out[name] = (np.concatenate(latents, axis=1), frames, cache_bytes)
    return out


def run_toyworld(num_chunks: int, seeds: list[int]) -> dict:
    """`toyworld_streams` for every seed, scored: the JSON rows of ``--toyworld``."""
    from jaxkv.toyworld import quality

    rows = {name: [] for name in TOY_PRECISIONS}
    for seed in seeds:
        streams = toyworld_streams(num_chunks, seed)
        chunk_frames = 3
        ref = streams["bf16"][0]
        for name, (latents, frames, cache_bytes) in streams.items():
            report = quality.scores_of(frames, quality.PROMPTS, chunk_frames)
            rows[name].append(
                {
                    "seed": seed,
                    "overall": report.overall,
                    "adherence": float(np.mean([r["adherence"] for r in report.per_prompt])),
                    "continuity": float(np.mean([r["continuity"] for r in report.per_prompt])),
                    "tracking": report.tracking,
                    "passed": report.passed,
                    "cache_bytes": cache_bytes,
                    "vs_bf16": chunk_errors(latents, ref, chunk_frames),
                }
            )
    return rows


def print_toyworld(rows: dict, num_chunks: int) -> None:
    print(
        "\n| precision | overall | adherence | continuity | tracking | cache bytes | vs bf16: rel, worst chunk "
        "| rms rel, worst chunk | rms rel, last chunk |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in rows.items():
        mean = lambda key: float(np.mean([r[key] for r in runs]))  # noqa: B023 - called in the iteration that defines it
        worst = lambda field: max(c[field] for r in runs for c in r["vs_bf16"])  # noqa: B023 - called in the iteration that defines it
        last = max(r["vs_bf16"][-1]["rms_rel"] for r in runs)
        print(
            f"| {name} | {mean('overall'):.3f} | {mean('adherence'):.3f} | {mean('continuity'):.3f} "
            f"| {mean('tracking'):.3f} | {runs[0]['cache_bytes']} | {worst('rel'):.2e} | {worst('rms_rel'):.2e} "
            f"| {last:.2e} |"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,medium", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--chunks", type=int, help="chunks per rollout (default 6; 16 with --toyworld)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (weights, context and noise)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--toyworld", action="store_true", help="the FP8 options on the toy-world model (see above)")
    args = p.parse_args(argv)
    if args.toyworld:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        chunks = args.chunks or 16
        print(f"jax {jax.__version__}, {jax.default_backend()}; toy world, {chunks} chunks, seeds {seeds}")
        rows = run_toyworld(chunks, seeds)
        print_toyworld(rows, chunks)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "jax": jax.__version__,
                        "backend": jax.default_backend(),
                        "chunks": chunks,
                        "seeds": seeds,
                        "toyworld": rows,
                    },
                    f,
                    indent=1,
                )
            print(f"\nwrote {args.json}")
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; expected some of {sorted(MODELS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    args.chunks = args.chunks or 6
    print(
        f"jax {jax.__version__}, {jax.default_backend()}; {CHUNK_FRAMES}-frame chunks, {WINDOW_FRAMES}-frame "
        f"window, {args.chunks} chunks, seeds {seeds}"
    )
    results = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "chunk_frames": CHUNK_FRAMES,
        "window_frames": WINDOW_FRAMES,
        "chunks": args.chunks,
        "seeds": seeds,
        "models": {},
    }
    for name in models:
        config, hw = MODELS[name]
        per_seed = []
        for seed in seeds:
            lat = rollouts(config, hw, args.chunks, seed)
            per_seed.append(
                {
                    "seed": seed,
                    "bf16_vs_f32": chunk_errors(lat["bf16"], lat["f32"]),
                    "bf16_vs_f32_on_bf16_weights": chunk_errors(lat["bf16"], lat["f32_on_bf16_weights"]),
                    "f32_on_bf16_weights_vs_f32": chunk_errors(lat["f32_on_bf16_weights"], lat["f32"]),
                }
            )
        results["models"][name] = {"config": config.to_dict(), "latent_hw": list(hw), "runs": per_seed}
        print(
            f"\n{name}: dim {config.dim}, {config.num_heads} x {config.head_dim} heads, {config.num_layers} "
            f"layers, {hw[0] * hw[1] // 4} tokens/frame; worst over seeds"
        )
        print(
            "| chunk | bf16 vs f32: max abs | rel | rms rel | compute share (bf16 vs f32 on bf16 weights): rel "
            "| weights share (f32 on bf16 weights vs f32): rel |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for i in range(args.chunks):
            worst = lambda key, field: max(r[key][i][field] for r in per_seed)  # noqa: B023 - called in the iteration that defines it
            print(
                f"| {i} | {worst('bf16_vs_f32', 'max_abs'):.2e} | {worst('bf16_vs_f32', 'rel'):.2e} "
                f"| {worst('bf16_vs_f32', 'rms_rel'):.2e} | {worst('bf16_vs_f32_on_bf16_weights', 'rel'):.2e} "
                f"| {worst('f32_on_bf16_weights_vs_f32', 'rel'):.2e} |"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
