"""Per-chunk cache maintenance: ring write vs rolling copy vs a one-chunk floor, on Wan 2.1 1.3B shapes.

One attention layer, one session, bf16, 12 heads x 128, 1560 tokens per latent frame, 3-frame chunks (4680 tokens).
For each window:
  ring:  RingCache.begin_chunk().write(k, v)      (evict by reusing the oldest slot: O(chunk))
  roll:  RollingCache.begin_chunk().write(k, v)   (evict by shifting the window left: O(window))
  floor: one chunk's k and v written into buffers of exactly one chunk (the bytes any policy must move)
All three are jitted with the cache donated, warmed up, and timed alternately in this one process (the machines are
shared and noisy: read the ratios). Median of the timed repetitions.

    python benchmarks/cache_maintenance.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import jaxkv

TOKENS_PER_FRAME, HEADS, HEAD_DIM, CHUNK_FRAMES = 1560, 12, 128, 3
ROWS = [(6, 0), (12, 0), (21, 0), (42, 0), (18, 3)]  # (window_frames, sink_frames); 18 + 3 = Self-Forcing's 21


def _step(cache, k, v):
    return cache.begin_chunk().write(k, v)


def _floor(k_buf, v_buf, k, v, offset):
    return (
        lax.dynamic_update_slice(k_buf, k, (0, offset, 0, 0)),
        lax.dynamic_update_slice(v_buf, v, (0, offset, 0, 0)),
    )


def measure(window_frames: int, sink_frames: int, reps: int, dtype=jnp.bfloat16) -> dict:
    spec = jaxkv.RingSpec.from_frames(TOKENS_PER_FRAME, CHUNK_FRAMES, window_frames, sink_frames)
    key = jax.random.key(0)
    k = jax.random.normal(key, (1, spec.chunk, HEADS, HEAD_DIM), dtype)
    v = -k
    step = jax.jit(_step, donate_argnums=0)
    floor = jax.jit(_floor, donate_argnums=(0, 1))
    state = {
        "ring": jaxkv.RingCache.init(spec, 1, HEADS, HEAD_DIM, dtype=dtype),
        "roll": jaxkv.RollingCache.init(spec, 1, HEADS, HEAD_DIM, dtype=dtype),
        "floor": (jnp.zeros_like(k), jnp.zeros_like(v)),
    }
    offset = jnp.int32(0)

    def run(name):
        if name == "floor":
            state[name] = floor(*state[name], k, v, offset)
        else:
            state[name] = step(state[name], k, v)
        jax.block_until_ready(state[name])

    # Warm-up: compile, then stream past the first eviction so that every timed step of the rolling cache copies.
    for _ in range(spec.num_slots + 2):
        for name in state:
            run(name)
    times = {name: [] for name in state}
    for _ in range(reps):
        for name in state:
            t = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}

    # Check after timing (untimed): a window's worth of distinct chunks leaves ring and roll with the same logical
    # content, so a fast number cannot come from a step that skipped its work.
    for n in range(spec.num_slots + 1):
        marked = k + jnp.asarray(n + 1, dtype)
        for name in ("ring", "roll"):
            state[name] = step(state[name], marked, -marked)
    ring_view, roll_view = state["ring"].chronological(), state["roll"].chronological()
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(ring_view, roll_view))
    return {
        "window_frames": window_frames,
        "sink_frames": sink_frames,
        "chunk_frames": CHUNK_FRAMES,
        "ring_ms": round(ms["ring"], 3),
        "roll_ms": round(ms["roll"], 3),
        "floor_ms": round(ms["floor"], 3),
        "ring_over_floor": round(ms["ring"] / ms["floor"], 2),
        "roll_over_ring": round(ms["roll"] / ms["ring"], 1),
        "cache_mib": round(state["ring"].nbytes / 2**20, 1),
        "ring_equals_roll": same,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute on 2 cores)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per policy (default 30, quick 8)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args(argv)
    reps = args.reps or (8 if args.quick else 30)
    if reps < 1:
        parser.error("--reps must be >= 1")

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; bf16, {HEADS} heads x {HEAD_DIM}, "
        f"{TOKENS_PER_FRAME} tokens/frame, {CHUNK_FRAMES}-frame chunks, 1 layer, 1 session, {reps} reps (median)"
    )
    header = (
        f"{'window':>6} {'sink':>4} {'cache MiB':>9} {'ring ms':>8} {'roll ms':>8} {'floor ms':>8} "
        f"{'ring/floor':>10} {'roll/ring':>9} {'same content':>12}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for window_frames, sink_frames in ROWS:
        row = measure(window_frames, sink_frames, reps)
        rows.append(row)
        print(
            f"{window_frames:>6} {sink_frames:>4} {row['cache_mib']:>9} {row['ring_ms']:>8.2f} {row['roll_ms']:>8.2f} "
            f"{row['floor_ms']:>8.2f} {row['ring_over_floor']:>10.2f} {row['roll_over_ring']:>9.1f} "
            f"{'yes' if row['ring_equals_roll'] else 'NO':>12}",
            flush=True,
        )
    flat = rows[3]["ring_ms"] / rows[0]["ring_ms"]
    print(f"ring 42 vs 6 frames: {flat:.2f}x")
    if not all(row["ring_equals_roll"] for row in rows):
        print("ERROR: ring and rolling caches disagree after the run; the timings are not valid", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(row["ring_equals_roll"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
