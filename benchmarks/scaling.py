"""Per-chunk latency of the Wan streaming rollout on 1, 2, 4 and 8 simulated CPU devices: a sanity figure that the
mesh step runs, compiles once and stays equal to one device, not a speed claim (the "devices" are threads of one
shared CPU, so more of them cannot be faster; on GPUs see docs/scaling.md's plan).

One process with 8 host devices (set before JAX initialises). For each device count n the same model, weights,
context and key run on a ``model=n`` mesh (tensor parallel, batch 1), a ``data=n`` mesh (n sessions, one per
device) and a ``seq=n`` mesh (Ulysses sequence parallel, batch 1) next to the single-device
`jaxkv.stream.Stream`; after a warm-up chunk (compilation) the timed chunks are waited for one by one and the table
shows the median. Every chunk is the whole Self-Forcing sampler (4 denoising passes + the context pass).
"max |diff|" is the largest difference of the mesh's latents from the single-device ones.

    python benchmarks/scaling.py [--quick] [--chunks N] [--json PATH]
    python benchmarks/scaling.py --plan      # the arithmetic plan of docs/scaling.md for Wan 1.3B / 14B on 1, 4, 8 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxkv import parallel as PL
from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.stream import Stream

# 8 heads of 32 so model=8 still holds a whole head per device
MODEL = WanConfig(dim=256, ffn_dim=1024, num_heads=8, num_layers=4, text_dim=64, text_len=16, freq_dim=64)
TINY = WanConfig(dim=64, ffn_dim=128, num_heads=8, num_layers=2, text_dim=32, text_len=16, freq_dim=32)


# ------------------------------------------------------------------------------------------------ the GPU plan
# Assumptions of the plan (docs/scaling.md): bf16 weights and KV ring, float32 activations and cross K/V (as jaxkv
# holds them), 480x832 video (1,560 tokens per latent frame), 3-frame chunks (4,680 tokens), a 21-frame window
# (Self-Forcing), 5 forwards per chunk (4 steps + the context pass), a flash-style attention kernel (no
# [heads, queries, keys] logits in memory), bf16 matmul 790 TFLOP/s (measured on the lent H200, DESIGN.md) and
# 400 GB/s of NVLink bus bandwidth per GPU for collectives (an assumption: H100/H200 SXM NVLink 4 is 450 GB/s per
# direction).
PEAK_FLOPS, LINK_BYTES_S = 790e12, 400e9
TOKENS_PER_FRAME, CHUNK_FRAMES, WINDOW_FRAMES, FORWARDS = 1560, 3, 21, 5


def plan_row(name: str, config: WanConfig, gpus: int, scheme: str) -> dict:
    """Per-GPU memory, FLOP, bytes communicated and latency bounds of one 480p chunk (see the assumptions above).

    scheme: "data" (one stream per GPU, nothing shared), "model" (Megatron tensor parallel over all GPUs: 3
    all-reduces of [tokens, dim] float32 per block and forward) or "ulysses" (sequence parallel: 4 all-to-alls of
    [tokens, dim] bf16 per block and forward around self-attention; cross-attention and FFN are token-local)."""
    from jaxkv.models.wan.params import flat_param_shapes
    from jaxkv.parallel.rules import P, spec_of

    d, f, layers, n = config.dim, config.ffn_dim, config.num_layers, CHUNK_FRAMES * TOKENS_PER_FRAME
    keys = WINDOW_FRAMES * TOKENS_PER_FRAME
    shapes = flat_param_shapes(config)
    total = sum(int(np.prod(s)) for s in shapes.values())
    replicated = sum(int(np.prod(s)) for k, s in shapes.items() if spec_of(k, s) == P())
    split = gpus if scheme in ("model", "ulysses") else 1
    weights = (replicated + (total - replicated) / split if scheme == "model" else total) * 2
    kv = layers * 2 * keys * d * 2 / split
    cross = layers * 2 * config.text_len * d * 4 / split
    if scheme == "model":  # residual and normed input stay whole; q, k, v, attention out and FFN hidden split
        acts = (2 * n * d + (4 * n * d + 2 * n * f) / gpus) * 4
    else:
        acts = (6 * n * d + 2 * n * f) * 4 / split
    # FLOP of one forward: block matmuls on the chunk's tokens (self q/k/v/o, cross q/o, FFN) + attention over the
    # window and the text; the cross K/V are computed once per prompt, not per chunk
    matmul = 2 * n * layers * (4 * d * d + 2 * d * d + 2 * d * f)
    attention = 4 * n * layers * d * (keys + config.text_len)
    flops = FORWARDS * (matmul + attention) / split
    if scheme == "model" and gpus > 1:
        comm = FORWARDS * layers * 3 * n * d * 4 * 2 * (gpus - 1) / gpus
    elif scheme == "ulysses" and gpus > 1:
        comm = FORWARDS * layers * 4 * (n * d * 2 / gpus) * (gpus - 1) / gpus
    else:
        comm = 0.0
    compute_s, comm_s = flops / PEAK_FLOPS, comm / LINK_BYTES_S
    return {
        "model": name,
        "gpus": gpus,
        "scheme": scheme,
        "weights_gb": weights / 1e9,
        "kv_gb": kv / 1e9,
        "cross_kv_gb": cross / 1e9,
        "activations_gb": acts / 1e9,
        "total_gb": (weights + kv + cross + acts) / 1e9,
        "tflop": flops / 1e12,
        "comm_gb": comm / 1e9,
        "compute_ms": compute_s * 1e3,
        "comm_ms": comm_s * 1e3,
        "bound_ms": max(compute_s, comm_s) * 1e3,
        "no_overlap_ms": (compute_s + comm_s) * 1e3,
        "streams": gpus if scheme == "data" else 1,
    }


def plan() -> list[dict]:
    rows = []
    for name in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b"):
        config = wan.preset(name)
        for gpus in (1, 4, 8):
            for scheme in ("data",) if gpus == 1 else ("data", "model", "ulysses"):
                if scheme != "data" and config.num_heads % gpus:
                    continue  # whole heads per GPU: 1.3B's 12 heads do not split 8 ways
                rows.append(plan_row(name, config, gpus, scheme))
    return rows


def print_plan(rows: list[dict]) -> None:
    print(
        "| model | GPUs | scheme | streams | weights GB | KV GB | cross K/V GB | activations GB | total GB/GPU "
        "| TFLOP/GPU | comm GB/GPU | compute ms | comm ms | chunk ms (overlap / none) |"
    )
    print("|" + "---|" * 14)
    for r in rows:
        print(
            f"| {r['model'].replace('wan2.1-t2v-', '')} | {r['gpus']} | {r['scheme']} | {r['streams']} "
            f"| {r['weights_gb']:.2f} | {r['kv_gb']:.2f} | {r['cross_kv_gb']:.2f} | {r['activations_gb']:.2f} "
            f"| {r['total_gb']:.1f} | {r['tflop']:.0f} | {r['comm_gb']:.2f} | {r['compute_ms']:.0f} "
            f"| {r['comm_ms']:.0f} | {r['bound_ms']:.0f} / {r['no_overlap_ms']:.0f} |"
        )


def timed_stream(stream, chunks: int) -> tuple[list[float], list[np.ndarray]]:
    """Latencies of ``chunks`` chunks after the first (compiling) one, each waited for; all chunks' latents."""
    xs, times = [np.asarray(next(stream))], []
    for _ in range(chunks):
        start = time.perf_counter()
        x = next(stream)
        x.block_until_ready()
        times.append(time.perf_counter() - start)
        xs.append(np.asarray(x))
    return times, xs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 timed chunks")
    parser.add_argument("--chunks", type=int, help="timed chunks per mesh (default 8, 3 with --quick)")
    parser.add_argument("--devices", default="1,2,4,8", help="device counts, comma-separated (each divides 8)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plan", action="store_true", help="print only the arithmetic GPU plan (no timing)")
    args = parser.parse_args()
    if args.plan:
        print_plan(plan())
        return
    config = TINY if args.quick else MODEL
    chunks = args.chunks or (3 if args.quick else 8)
    counts = [int(n) for n in args.devices.split(",")]
    rc = R.RolloutConfig(8, 8, chunk_frames=3, window_frames=9, sink_frames=3)
    params = wan.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    key = jax.random.key(1)
    rows = []
    print(
        f"model dim {config.dim}, {config.num_heads} heads, {config.num_layers} layers; {rc.tokens_per_frame(config)}"
        f" tokens/frame, {rc.chunk_frames}-frame chunks, window {rc.window_frames}; {chunks} timed chunks; "
        f"{jax.device_count()} CPU devices on {os.cpu_count()} cores"
    )
    print(
        f"{'devices':>7} {'mesh':>15} {'batch':>5} {'1 device ms':>12} {'mesh ms':>9} {'ratio':>6} "
        f"{'compiles':>8} {'max |diff|':>10}"
    )
    for n in counts:
        for layout in ("model", "data", "seq"):
            if n == 1 and layout != "model":
                continue
            sizes = {"data": 1, "model": 1, "seq": 1} | {layout: n}
            batch = sizes["data"]
            context = rng.standard_normal((batch, 8, config.text_dim)).astype(np.float32)
            mesh = PL.make_mesh(**sizes, devices=jax.devices()[:n])
            one_t, one_x = timed_stream(Stream(params, config, rc, context, num_chunks=chunks + 1, key=key), chunks)
            stream = PL.MeshStream(params, config, rc, context, mesh=mesh, num_chunks=chunks + 1, key=key)
            mesh_t, mesh_x = timed_stream(stream, chunks)
            row = {
                "devices": n,
                "mesh": sizes,
                "batch": batch,
                "one_device_ms": statistics.median(one_t) * 1e3,
                "mesh_ms": statistics.median(mesh_t) * 1e3,
                "compiles": compile_count(stream.step),
                "max_abs_diff": float(max(np.abs(a - b).max() for a, b in zip(one_x, mesh_x))),
            }
            row["ratio"] = row["mesh_ms"] / row["one_device_ms"]
            rows.append(row)
            print(
                f"{n:>7} {PL.mesh.describe(mesh).split(' ')[0]:>15} {batch:>5} {row['one_device_ms']:>12.1f} "
                f"{row['mesh_ms']:>9.1f} {row['ratio']:>6.2f} {row['compiles']:>8} {row['max_abs_diff']:>10.1e}",
                flush=True,
            )
    if args.json:
        result = {
            "benchmark": "scaling",
            "config": config.to_dict(),
            "rollout": {
                "latent": [rc.latent_height, rc.latent_width],
                "chunk_frames": rc.chunk_frames,
                "window_frames": rc.window_frames,
                "sink_frames": rc.sink_frames,
                "steps": list(rc.schedule.steps),
            },
            "timed_chunks": chunks,
            "jax": jax.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "rows": rows,
            "gpu_plan": plan(),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
