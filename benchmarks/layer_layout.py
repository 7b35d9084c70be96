"""Stacked vs per-layer inference layout of a streaming Wan rollout: first-chunk time (the step's compilation),
steady ms per chunk, and the compiled step's scratch memory, side by side in one process.

* stacked: the blocks' params, the KV cache and the cross K/V stacked on a layer axis; the model scans over layers
  (each layer's weights and K/V sliced out of the stacks inside the scan).
* per-layer: the same arrays held one buffer per layer (`jaxkv.models.wan.params.per_layer_params`); the model
  unrolls its layer loop and reads every buffer where it lies. Bit-identical results (checked here too).

The point of the per-layer layout is the GPU (kernels that take whole buffers turn each slice into a copy); on
XLA:CPU this shows what it costs to compile and that a chunk does not get slower. Run it with an older jaxkv on the
path and only the stacked row is measured (the "before" of a comparison).

    python benchmarks/layer_layout.py [--layers 30] [--dim 512] [--timed 5] [--json PATH]
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
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.stream import Stream

try:
    from jaxkv.models.wan.params import per_layer_params
except ImportError:  # a jaxkv without the per-layer layout: measure the stacked one only
    per_layer_params = None

LATENT_HW, CHUNK_FRAMES = (16, 16), 3


def measure(config: WanConfig, params, rc, context, timed: int) -> dict:
    before = compile_count(R.stream_step)
    stream = Stream(params, config, rc, context, key=jax.random.key(0))
    t0 = time.perf_counter()
    first = np.asarray(jax.block_until_ready(next(stream)))
    first_s = time.perf_counter() - t0
    for _ in range(rc.window_frames // CHUNK_FRAMES + 1):  # fill and wrap
        jax.block_until_ready(next(stream))
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        jax.block_until_ready(next(stream))
        times.append(time.perf_counter() - t0)
    noise = jnp.zeros((rc.steps, *rc.chunk_shape(config, 1)))
    step = jax.jit(lambda p, s, n: R.generate_chunk(p, config, rc, s, n), donate_argnums=1)
    state = R.init_state(params, config, rc, context)
    temp = step.lower(params, state, noise).compile().memory_analysis().temp_size_in_bytes
    return {
        "first_chunk_s": first_s,
        "ms_per_chunk": statistics.median(times) * 1e3,
        "compiles": compile_count(R.stream_step) - before,
        "step_temp_mib": temp / 2**20,
        "first_chunk": first,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=12, help="window frames (a multiple of 3)")
    parser.add_argument("--timed", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    config = WanConfig(
        dim=args.dim,
        ffn_dim=2 * args.dim,
        num_heads=args.heads,
        num_layers=args.layers,
        text_dim=64,
        text_len=16,
        freq_dim=64,
    )
    rc = R.RolloutConfig(*LATENT_HW, chunk_frames=CHUNK_FRAMES, window_frames=args.window, sink_frames=CHUNK_FRAMES)
    params = M.init_params(config, jax.random.key(1))
    context = jax.random.normal(jax.random.key(2), (1, 8, config.text_dim))
    layouts = {"stacked": params}
    if per_layer_params is not None:
        layouts["per_layer"] = per_layer_params(params)
    print(
        f"Wan dim {config.dim}, {config.num_layers} layers, {config.num_heads} heads, "
        f"{config.tokens_per_frame(*LATENT_HW)} tokens/frame, sink 3 + window {args.window} frames, float32, "
        f"{jax.default_backend()}; median of {args.timed} chunks (each 5 forwards)"
    )
    print(f"{'layout':>10} {'first chunk s':>14} {'ms/chunk':>9} {'compiles':>8} {'step temp MiB':>13}")
    rows = {}
    for name, p in layouts.items():
        row = measure(config, p, rc, context, args.timed)
        rows[name] = row
        print(
            f"{name:>10} {row['first_chunk_s']:>14.2f} {row['ms_per_chunk']:>9.1f} {row['compiles']:>8} "
            f"{row['step_temp_mib']:>13.2f}",
            flush=True,
        )
    if len(rows) == 2:
        same = bool(np.array_equal(rows["stacked"]["first_chunk"], rows["per_layer"]["first_chunk"]))
        print(f"first chunk identical in both layouts: {same}")
    if args.json:
        result = {
            "benchmark": "layer_layout",
            "config": config.to_dict(),
            "latent_hw": list(LATENT_HW),
            "window_frames": args.window,
            "rows": {n: {k: v for k, v in r.items() if k != "first_chunk"} for n, r in rows.items()},
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "command": "python benchmarks/layer_layout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
