"""Per-chunk latency of streaming Wan rollouts on the ring cache vs the rolling (shift-by-copy) cache, as the window
grows.

The same model, weights, context and noise run through `jaxkv.stream.Stream` (jitted step, cache donated) once
with ``policy="ring"`` and once with ``policy="rolling"``. For every window both streams are first advanced until
their caches are full and wrapping (the first chunk compiles the step), then timed chunks alternate between the
two (ring, rolling, ring, ...) in this one process, each waited for; the table shows the median per chunk. Every
chunk runs the whole Self-Forcing sampler (4 denoising passes + the context pass), so a chunk is 5 forwards; the
ring/rolling difference is the rolling cache's window shift (a copy of every layer's window per chunk) against the
ring's in-place slot reuse. The compiles column is ring/rolling/while-timed: the jitted step's compilations while
each policy filled and wrapped its window, and during the timed chunks (1/1/0: every chunk, wrapping or not, ran
one program per policy). The cache-only columns time just the cache's share of a chunk on the same stacked cache
(reserve the chunk, write every layer's K/V once per pass, in a scan carry, donated): the part the policy
changes.

Models: ``tiny`` (the preset; 2 layers, dim 64) and ``medium`` (4 layers, dim 256, 4 heads of 64); latent frames of
16x16 (64 tokens with the 2x2 patch), 3-frame chunks, float32 caches.

    python benchmarks/rollout.py [--quick] [--model tiny|medium] [--per-layer] [--json PATH]

``--per-layer`` runs the streams on per-layer params (`jaxkv.models.wan.params.per_layer_params`: per-layer cache
and cross K/V, the unrolled layer loop; the same numbers) instead of the stacked ones.
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

from jaxkv import rollout as R
from jaxkv.cache import WINDOW_POLICIES as POLICIES
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.stream import Stream

MODELS = {
    "tiny": wan.preset("tiny"),
    "medium": WanConfig(dim=256, ffn_dim=512, num_heads=4, num_layers=4, text_dim=64, text_len=16, freq_dim=64),
}
LATENT_HW, CHUNK_FRAMES = (16, 16), 3


def _maintenance(cache, k, v, passes: int):
    """What one chunk costs the cache alone: reserve the chunk, then write every layer's K/V once per pass, with
    the stacked cache in a scan carry as the model does."""
    cache = cache.begin_chunk()

    def body(cache, layer):
        return cache.write(k, v, layer=layer), None

    for _ in range(passes):
        cache, _ = jax.lax.scan(body, cache, jnp.arange(cache.layers, dtype=jnp.int32))
    return cache


_maintenance_jit = jax.jit(_maintenance, static_argnums=3, donate_argnums=0)


def measure_maintenance(config: WanConfig, spec, timed: int, passes: int) -> dict:
    k = jax.random.normal(jax.random.key(3), (1, spec.chunk, config.num_heads, config.head_dim))
    caches = {p: wan.init_cache(config, spec, 1, policy=p) for p in POLICIES}
    for policy in caches:  # compile, fill and wrap
        for _ in range(spec.num_slots + 1):
            caches[policy] = _maintenance_jit(caches[policy], k, -k, passes)
        jax.block_until_ready(caches[policy])
    times = {p: [] for p in caches}
    for _ in range(max(timed, 5)):
        for policy in caches:
            t0 = time.perf_counter()
            caches[policy] = jax.block_until_ready(_maintenance_jit(caches[policy], k, -k, passes))
            times[policy].append(time.perf_counter() - t0)
    return {f"{p}_cache_only_ms": statistics.median(t) * 1e3 for p, t in times.items()}


def measure(config: WanConfig, params, context, window_frames: int, timed: int) -> dict:
    streams, first, compiles = {}, {}, {}
    for policy in ("ring", "rolling"):
        rc = R.RolloutConfig(*LATENT_HW, chunk_frames=CHUNK_FRAMES, window_frames=window_frames, policy=policy)
        before = compile_count(R.stream_step)
        stream = Stream(params, config, rc, context, key=jax.random.key(0))
        t0 = time.perf_counter()
        jax.block_until_ready(next(stream))
        first[policy] = time.perf_counter() - t0
        for _ in range(window_frames // CHUNK_FRAMES + 1):  # fill the window and wrap once
            jax.block_until_ready(next(stream))
        compiles[policy] = compile_count(R.stream_step) - before
        streams[policy] = stream
    times = {"ring": [], "rolling": []}
    before = compile_count(R.stream_step)
    for _ in range(timed):
        for policy, stream in streams.items():
            t0 = time.perf_counter()
            jax.block_until_ready(next(stream))
            times[policy].append(time.perf_counter() - t0)
    cache = streams["ring"].state.cache
    row = {
        "window_frames": window_frames,
        "window_tokens": cache.spec.window,
        "cache_mib": cache.nbytes / 2**20,
        "chunks_per_policy": streams["ring"].index,
        "compiles_while_timed": compile_count(R.stream_step) - before,
    }
    for policy in ("ring", "rolling"):
        row[f"{policy}_ms"] = statistics.median(times[policy]) * 1e3
        row[f"{policy}_first_chunk_s"] = first[policy]
        row[f"{policy}_compiles"] = compiles[policy]
        streams[policy].carry = None  # free the caches before the next window
    row["rolling_over_ring"] = row["rolling_ms"] / row["ring_ms"]
    row.update(measure_maintenance(config, cache.spec, timed, len(R.Schedule().steps) + 1))
    row["cache_only_rolling_over_ring"] = row["rolling_cache_only_ms"] / row["ring_cache_only_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short windows (about a minute on 2 cores)")
    parser.add_argument("--model", choices=sorted(MODELS), help="default: medium (tiny with --quick)")
    parser.add_argument("--windows", help="comma-separated window sizes in frames (multiples of 3)")
    parser.add_argument("--timed", type=int, help="timed chunks per policy and window")
    parser.add_argument("--per-layer", action="store_true", help="per-layer params (the unrolled layer loop)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "medium")
    windows = (
        [int(w) for w in args.windows.split(",")] if args.windows else ([3, 12, 48] if args.quick else [3, 12, 24, 48])
    )
    timed = args.timed or (3 if args.quick else 7)
    bad = [w for w in windows if w <= 0 or w % CHUNK_FRAMES]
    if bad:
        print(
            f"rollout benchmark: windows must be positive multiples of {CHUNK_FRAMES} frames, got {bad}",
            file=sys.stderr,
        )
        return 2
    config = MODELS[model]
    params = wan.init_params(config, jax.random.key(1))
    if args.per_layer:
        from jaxkv.models.wan.params import per_layer_params

        params = per_layer_params(params)
    context = jax.random.normal(jax.random.key(2), (1, 8, config.text_dim))
    tpf = config.tokens_per_frame(*LATENT_HW)
    print(
        f"model {model} (dim {config.dim}, {config.num_layers} layers, {config.num_heads} heads), "
        f"{tpf} tokens/frame, chunks of {CHUNK_FRAMES} frames, float32 cache, {jax.default_backend()}; "
        f"median of {timed} alternating chunks (each = {len(R.Schedule().steps) + 1} forwards)"
    )
    header = (
        f"{'window':>7} {'tokens':>7} {'cache MiB':>9} {'ring ms':>9} {'rolling ms':>10} {'roll/ring':>9} "
        f"{'compiles':>9} | {'cache-only ring ms':>18} {'rolling ms':>10} {'roll/ring':>9}"
    )
    print(header)
    rows = []
    for w in windows:
        row = measure(config, params, context, w, timed)
        rows.append(row)
        print(
            f"{w:>7} {row['window_tokens']:>7} {row['cache_mib']:>9.2f} {row['ring_ms']:>9.2f} "
            f"{row['rolling_ms']:>10.2f} {row['rolling_over_ring']:>9.2f} "
            f"{row['ring_compiles']:>5}/{row['rolling_compiles']}/{row['compiles_while_timed']} | "
            f"{row['ring_cache_only_ms']:>18.3f} {row['rolling_cache_only_ms']:>10.3f} "
            f"{row['cache_only_rolling_over_ring']:>9.2f}",
            flush=True,
        )
    if args.json:
        result = {
            "benchmark": "rollout",
            "model": model,
            "per_layer": args.per_layer,
            "config": config.to_dict(),
            "latent_hw": list(LATENT_HW),
            "chunk_frames": CHUNK_FRAMES,
            "timed_chunks": timed,
            "rows": rows,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "command": "python benchmarks/rollout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
