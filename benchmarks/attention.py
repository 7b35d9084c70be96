"""Attention over a ring cache in physical order vs copy-then-attend, on Wan 2.1 1.3B shapes.

One attention layer, one session, 12 heads x 128, 3-frame chunks; the ring has streamed past several evictions, so
it is wrapped and every slot is filled. The queries are the chunk being denoised (already written to the ring);
with a full ring every cached key is visible to them, so both approaches compute the same attention.

  ring       `jaxkv.attend` over the ring as it lies in memory, masks from positions (no gather)
  copy+sdpa  gather the ring into chronological order (`cache.chronological()`), then `jax.nn.dot_product_attention`
             (what a shift-by-copy cache hands to SDPA)

CPU part (always): float32, tokens per frame scaled down from 1,560 so it fits a small machine; ring paths are the
blockwise XLA path (block = chunk, so wrap-invariant) and the dense XLA path.
GPU part (only when a GPU is present): full Wan 1.3B shapes, bf16 — queries 4,680, keys up to 32,760 + 4,680 —
the Pallas kernel on the ring vs `jax.nn.dot_product_attention(implementation="cudnn")` on the same K/V, and vs
gather + cuDNN. Each row also reports the largest difference between the ring result and the cuDNN result (CPU
rows: of each ring path, blockwise and dense, against copy+sdpa). Then the per-backend rows (`backend_rows`):
ms and TFLOP/s (over the visible pairs) of `attend` with backend "pallas" (Triton), "mosaic" (the Mosaic GPU
kernel), "cudnn" and "xla_blockwise" at 9,360 / 23,400 / 32,760 / 37,440 keys, on a full (wrapped) ring and a
filling one (half the chunks written; with a sink where the row has one), and on a dilated cache (every 2nd frame
kept, 18 frame buckets + its scratch chunk: 32,760 keys), each path's largest difference to "xla_blockwise".

Variants are jitted, warmed up, and timed alternately in this one process (the machines are shared and noisy: read
the ratios). Median of the timed repetitions.

    python benchmarks/attention.py [--quick] [--json PATH] [--reps N] [--tokens-per-frame T] [--no-gpu] [--no-cpu]

On a GPU machine, first the compiled kernel is checked against the dense reference (several masks, RoPE styles,
dtypes and head dims; rows with part "gpu_check"), then timed. One prepared command for a lent GPU:

    python benchmarks/attention.py --no-cpu --json bench_results/attention_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv.attention import BlockSizes, attend
from jaxkv.attention.blockwise import choose_block

WAN_TOKENS_PER_FRAME, HEADS, HEAD_DIM, CHUNK_FRAMES = 1560, 12, 128, 3
CPU_ROWS = [(6, 0), (12, 0), (18, 3)]  # (window_frames, sink_frames), window including the chunk being denoised
GPU_ROWS = [(6, 0), (12, 0), (21, 3)]  # (21, 3): 32,760 window + 4,680 sink keys = 37,440
# Per-backend rows: (window_frames, sink_frames) -> 9,360 / 23,400 / 32,760 / 37,440 keys of 1,560-token frames.
BACKEND_ROWS = [(6, 0), (15, 0), (18, 3), (21, 3)]
BACKENDS = ("pallas", "mosaic", "cudnn", "xla_blockwise")
DILATED_BUCKETS = 18  # frame slots of the dilated cache's ring: + a 3-frame scratch chunk = 21 frames of keys
# Kernel tunables tried at the largest GPU row besides the default (block_q, block_k, num_warps, num_stages).
GPU_SWEEP = [(64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2)]


def filled_ring(spec: jaxkv.RingSpec, dtype, head_dim: int = HEAD_DIM, heads: int = HEADS, seed: int = 0):
    """A one-session ring that has streamed num_slots + 2 chunks (wrapped, full), and queries for its last chunk."""
    cache = jaxkv.RingCache.init(spec, 1, heads, head_dim, dtype=dtype)
    step = jax.jit(lambda c, k, v: c.begin_chunk().write(k, v), donate_argnums=0)
    key = jax.random.key(seed)
    for _ in range(spec.num_slots + 2):
        key, kk, kv = jax.random.split(key, 3)
        shape = (1, spec.chunk, heads, head_dim)
        cache = step(cache, jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))
    q = jax.random.normal(key, (1, spec.chunk, heads, head_dim), dtype)
    return cache, q


def _copy_then_sdpa(cache, q, implementation=None):
    k, v, _ = cache.chronological()
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def _time(variants: dict, args, reps: int):
    """Median milliseconds per variant, each jitted and warmed up, timed alternately. A variant that fails to
    compile or run (e.g. no cuDNN) gets NaN and its error in `errors`, so one run still reports the others."""
    outs, errors = {}, {}
    for name, fn in list(variants.items()):
        try:
            outs[name] = jax.block_until_ready(fn(*args))  # compile + warm
            jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"  {name} failed: {errors[name]}", file=sys.stderr)
    times = {name: [] for name in outs}
    for _ in range(reps):
        for name in outs:
            t = time.perf_counter()
            jax.block_until_ready(variants[name](*args))
            times[name].append(time.perf_counter() - t)
    ms = {name: 1e3 * statistics.median(times[name]) if name in times else float("nan") for name in variants}
    return ms, outs, errors


def _max_diff(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b == b and b > 0 else float("nan")


def _ring_case(window_frames, sink_frames, tokens_per_frame, dtype, head_dim, heads):
    """(spec, filled cache, queries, the sink + window mask, the row's shape fields)."""
    spec = jaxkv.RingSpec.from_frames(tokens_per_frame, CHUNK_FRAMES, window_frames, sink_frames)
    cache, q = filled_ring(spec, dtype, head_dim, heads)
    mask = spec.mask()
    shape = {
        "dtype": jnp.dtype(dtype).name,
        "tokens_per_frame": tokens_per_frame,
        "window_frames": window_frames,
        "sink_frames": sink_frames,
        "queries": spec.chunk,
        "keys": spec.capacity,
        "heads": heads,
        "head_dim": head_dim,
    }
    return spec, cache, q, mask, shape


def measure_cpu(
    window_frames: int, sink_frames: int, tokens_per_frame: int, reps: int, head_dim: int = HEAD_DIM, heads: int = HEADS
) -> dict:
    spec, cache, q, mask, shape = _ring_case(window_frames, sink_frames, tokens_per_frame, jnp.float32, head_dim, heads)
    block_k = choose_block(spec.chunk, 512) or spec.chunk
    ring = lambda backend: jax.jit(
        lambda c, q: attend(q, c.k, c.v, c.chunk_positions(), c.positions, backend=backend, block_k=block_k, mask=mask)
    )
    variants = {
        "ring_blockwise": ring("xla_blockwise"),
        "ring_dense": ring("xla_dense"),
        "copy_sdpa": jax.jit(_copy_then_sdpa),
    }
    ms, outs, errors = _time(variants, (cache, q), reps)
    return {
        "part": "cpu",
        **shape,
        "block_k": block_k,
        "ring_blockwise_ms": round(ms["ring_blockwise"], 2),
        "ring_dense_ms": round(ms["ring_dense"], 2),
        "copy_sdpa_ms": round(ms["copy_sdpa"], 2),
        "copy_over_ring_blockwise": _ratio(ms["copy_sdpa"], ms["ring_blockwise"]),
        "copy_over_ring_dense": _ratio(ms["copy_sdpa"], ms["ring_dense"]),
        "max_abs_diff": _max_diff(outs.get("ring_blockwise"), outs.get("copy_sdpa")),
        "ring_dense_max_abs_diff": _max_diff(outs.get("ring_dense"), outs.get("copy_sdpa")),
        "errors": errors,
    }


def measure_gpu(
    window_frames: int,
    sink_frames: int,
    tokens_per_frame: int,
    reps: int,
    *,
    dtype=jnp.bfloat16,
    head_dim: int = HEAD_DIM,
    heads: int = HEADS,
    implementation: str = "cudnn",
    interpret: bool = False,
    block_sizes: BlockSizes | None = None,
) -> dict:
    """Pallas on the ring vs SDPA (cuDNN) on the same K/V and vs gather + SDPA. `implementation="xla"` and
    `interpret=True` run the same code on CPU (tests)."""
    spec, cache, q, mask, shape = _ring_case(window_frames, sink_frames, tokens_per_frame, dtype, head_dim, heads)
    pallas = jax.jit(
        lambda c, q: attend(
            q,
            c.k,
            c.v,
            c.chunk_positions(),
            c.positions,
            backend="pallas",
            block_sizes=block_sizes,
            interpret=interpret,
            mask=mask,
        )
    )
    # A full ring: every key is visible to the chunk, so unmasked SDPA over the slots in physical order is exact.
    same_kv = jax.jit(lambda c, q: jax.nn.dot_product_attention(q, c.k, c.v, implementation=implementation))
    copy = jax.jit(functools.partial(_copy_then_sdpa, implementation=implementation))
    ms, outs, errors = _time({"pallas": pallas, "sdpa": same_kv, "copy_sdpa": copy}, (cache, q), reps)
    flops = 4 * spec.chunk * spec.capacity * heads * head_dim
    return {
        "part": "gpu",
        "device": str(jax.devices()[0].device_kind),
        **shape,
        "implementation": implementation,
        "block_sizes": None if block_sizes is None else dataclasses.astuple(block_sizes),
        "pallas_ms": round(ms["pallas"], 3),
        "sdpa_ms": round(ms["sdpa"], 3),
        "copy_sdpa_ms": round(ms["copy_sdpa"], 3),
        "pallas_over_sdpa": _ratio(ms["pallas"], ms["sdpa"]),
        "pallas_tflops": round(flops / ms["pallas"] / 1e9, 1),
        "sdpa_tflops": round(flops / ms["sdpa"] / 1e9, 1),
        "max_abs_diff": _max_diff(outs.get("pallas"), outs.get("sdpa")),
        "errors": errors,
    }


def _backend_cases(window_frames: int, sink_frames: int, tokens_per_frame: int, dtype, head_dim: int, heads: int):
    """(name, (q, k, v, q_positions, kv_positions), mask) of a full (wrapped) ring and a filling one."""
    spec = jaxkv.RingSpec.from_frames(tokens_per_frame, CHUNK_FRAMES, window_frames, sink_frames)
    full, q = filled_ring(spec, dtype, head_dim, heads)
    cache = jaxkv.RingCache.init(spec, 1, heads, head_dim, dtype=dtype)
    step = jax.jit(lambda c, k, v: c.begin_chunk().write(k, v))
    key = jax.random.key(1)
    for _ in range(max(1, (spec.num_slots + 1) // 2)):
        key, kk, kv = jax.random.split(key, 3)
        shape = (1, spec.chunk, heads, head_dim)
        cache = step(cache, jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))
    ring = lambda c: (c.k, c.v, c.chunk_positions(), c.positions)
    return [
        ("full", (q, *ring(full)), spec.mask()),
        ("filling", (q, *ring(cache)), spec.mask()),
    ]


def _dilated_case(tokens_per_frame: int, dtype, head_dim: int, heads: int, buckets: int = DILATED_BUCKETS):
    """A `DilatedCache` (every 2nd frame kept in ``buckets`` frame slots, plus the scratch chunk) streamed until its
    ring has wrapped, and queries for the chunk in its scratch."""
    spec = jaxkv.cache.DilatedSpec(tokens_per_frame, CHUNK_FRAMES, dilation=2, buckets=buckets)
    cache = jaxkv.cache.DilatedCache.init(spec, 1, heads, head_dim, dtype=dtype)
    step = jax.jit(lambda c, k, v: c.begin_chunk().write(k, v))
    key = jax.random.key(2)
    for _ in range(buckets + 2):  # 1.5 kept frames per 3-frame chunk: wrapped
        key, kk, kv = jax.random.split(key, 3)
        shape = (1, spec.chunk, heads, head_dim)
        cache = step(cache, jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))
    q = jax.random.normal(key, (1, spec.chunk, heads, head_dim), dtype)
    return "dilated", (q, cache.k, cache.v, cache.chunk_positions(), cache.positions), spec.mask()


def _attend_fn(backend: str, mask, interpret: bool):
    from jaxkv.attention.mosaic_emulation import MosaicBlockSizes

    sizes = MosaicBlockSizes() if backend == "mosaic" else None
    return jax.jit(lambda *a: attend(*a, backend=backend, mask=mask, interpret=interpret, block_sizes=sizes))


def backend_rows(
    tokens_per_frame: int,
    reps: int,
    *,
    rows=BACKEND_ROWS,
    dtype=jnp.bfloat16,
    head_dim: int = HEAD_DIM,
    heads: int = HEADS,
    backends=BACKENDS,
    interpret: bool = False,
    dilated_buckets: int = DILATED_BUCKETS,
) -> list[dict]:
    """ms and TFLOP/s per `attend` backend on full / filling rings and a dilated cache. TFLOP/s count the visible
    (query, key) pairs only (4 * pairs * heads * head_dim flops). ``interpret``: the Triton kernel interpreted and
    the Mosaic GPU kernel emulated (CPU tests; cuDNN then fails and is reported in ``errors``)."""
    from jaxkv.attention import visible

    cases = [c for w, s in rows for c in _backend_cases(w, s, tokens_per_frame, dtype, head_dim, heads)]
    cases.append(_dilated_case(tokens_per_frame, dtype, head_dim, heads, dilated_buckets))
    out = []
    for name, args, mask in cases:
        variants = {b: _attend_fn(b, mask, interpret) for b in backends}
        ms, outs, errors = _time(variants, args, reps)
        pairs = int(jnp.sum(visible(args[3], args[4], mask)))
        row = {
            "part": "gpu_backends",
            "case": name,
            "dtype": jnp.dtype(dtype).name,
            "queries": args[0].shape[1],
            "keys": args[1].shape[1],
            "visible_fraction": round(pairs / (args[0].shape[1] * args[1].shape[1]), 4),
            "heads": heads,
            "head_dim": head_dim,
            "mask": dataclasses.asdict(mask),
            "errors": errors,
        }
        base = outs.get("xla_blockwise")
        for b in backends:
            row[f"{b}_ms"] = round(ms[b], 3)
            row[f"{b}_tflops"] = round(4 * pairs * heads * head_dim / ms[b] / 1e9, 1) if ms[b] == ms[b] else ms[b]
            if b != "xla_blockwise":
                row[f"{b}_max_abs_diff"] = _max_diff(outs.get(b), base)
        out.append(row)
    return out


GPU_CHECKS = [  # (head_dim, dtype, mask, rope): compiled kernel vs the dense XLA reference on the device
    (128, "bfloat16", dict(), None),
    (128, "bfloat16", dict(chunk=60, window=120, sink=60), None),
    (64, "float32", dict(causal=True, window=100, sink=60), None),
    (64, "bfloat16", dict(chunk=60), "half"),
    (128, "float32", dict(chunk=60, window=120, sink=60), "interleaved"),
]


def gpu_checks(interpret: bool = False, block_sizes: BlockSizes | None = None, checks=GPU_CHECKS) -> list[dict]:
    """Correctness of the compiled kernel on this device: a wrapped ring with a sink (60-token chunks, not a
    multiple of the block sizes) and a second session holding one chunk, every query of the last chunk."""
    from jaxkv.attention import CacheRope, dense_attention

    rows = []
    for head_dim, dtype, mask, style in checks:
        spec = jaxkv.RingSpec(chunk=60, window=180, sink=60)
        cache = jaxkv.RingCache.init(spec, 2, 2, head_dim, dtype=jnp.dtype(dtype))
        key = jax.random.key(head_dim)
        for n in range(6):
            key, kk, kv = jax.random.split(key, 3)
            active = jnp.array([True, n == 0])
            shape = (2, spec.chunk, 2, head_dim)
            cache = cache.begin_chunk(active=active).write(
                jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype), active=active
            )
        q = jax.random.normal(key, (2, spec.chunk, 4, head_dim), dtype)
        rope = None if style is None else CacheRope(style=style)
        args = (q, cache.k, cache.v, cache.chunk_positions(), cache.positions)
        row = {"part": "gpu_check", "head_dim": head_dim, "dtype": dtype, "mask": mask, "rope": style}
        try:
            got = jax.jit(
                lambda *a: attend(*a, backend="pallas", rope=rope, interpret=interpret, block_sizes=block_sizes, **mask)  # noqa: B023 - called in the iteration that defines it
            )(*args)
            want = dense_attention(*args, rope=rope, **mask)
            row["max_abs_diff"] = _max_diff(got, want)
            row["ok"] = bool(row["max_abs_diff"] < (2e-2 if dtype == "bfloat16" else 2e-3))
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            row["max_abs_diff"], row["ok"] = float("nan"), False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
    return rows


def _header(columns) -> str:
    line = " ".join(f"{name:>{width}}" for name, _, width in columns)
    return f"{line}\n{'-' * len(line)}"


def _line(row, columns) -> str:
    fmt = lambda key, x: f"{x:.1e}" if key.endswith("max_abs_diff") else str(x)
    return " ".join(f"{fmt(key, row[key]):>{width}}" for _, key, width in columns)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller CPU shapes, fewer reps (under a minute)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10, quick 3)")
    parser.add_argument(
        "--tokens-per-frame",
        type=int,
        default=None,
        help="CPU tokens per latent frame (default 260 = 1560 / 6; quick 156)",
    )
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part even when a GPU is present")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU part (on a GPU machine)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 10)
    tpf = args.tokens_per_frame or (156 if args.quick else 260)
    if reps < 1 or tpf < 1:
        parser.error("--reps and --tokens-per-frame must be >= 1")

    rows = []
    print(
        f"jax {jax.__version__}; CPU part: float32, {HEADS} heads x {HEAD_DIM}, {tpf} tokens/frame "
        f"(Wan: {WAN_TOKENS_PER_FRAME}), {CHUNK_FRAMES}-frame chunks, wrapped full ring, {reps} reps (median)"
    )
    cpu_cols = [
        ("window", "window_frames", 6),
        ("sink", "sink_frames", 4),
        ("queries", "queries", 7),
        ("keys", "keys", 6),
        ("ring blk ms", "ring_blockwise_ms", 11),
        ("ring dense ms", "ring_dense_ms", 13),
        ("copy+sdpa ms", "copy_sdpa_ms", 12),
        ("copy/blk", "copy_over_ring_blockwise", 8),
        ("copy/dense", "copy_over_ring_dense", 10),
        ("blk max|diff|", "max_abs_diff", 13),
        ("dense max|diff|", "ring_dense_max_abs_diff", 15),
    ]
    if not args.no_cpu:
        print(_header(cpu_cols))
        with jax.default_device(jax.devices("cpu")[0]):
            for window_frames, sink_frames in CPU_ROWS:
                rows.append(measure_cpu(window_frames, sink_frames, tpf, reps))
                print(_line(rows[-1], cpu_cols), flush=True)

    if not args.no_gpu and jax.default_backend() == "gpu":
        print(
            f"\nGPU part: {jax.devices()[0].device_kind}, bf16, full Wan 1.3B shapes "
            f"({WAN_TOKENS_PER_FRAME} tokens/frame), {reps} reps (median)"
        )
        gpu_cols = [
            ("window", "window_frames", 6),
            ("sink", "sink_frames", 4),
            ("queries", "queries", 7),
            ("keys", "keys", 6),
            ("pallas ms", "pallas_ms", 9),
            ("cudnn ms", "sdpa_ms", 8),
            ("copy+cudnn ms", "copy_sdpa_ms", 13),
            ("pallas/cudnn", "pallas_over_sdpa", 12),
            ("pallas TF/s", "pallas_tflops", 11),
            ("cudnn TF/s", "sdpa_tflops", 10),
            ("max|diff|", "max_abs_diff", 9),
        ]
        for check in gpu_checks():
            rows.append(check)
            print(
                f"check head_dim {check['head_dim']} {check['dtype']} mask {check['mask']} rope {check['rope']}: "
                f"max|diff| {check['max_abs_diff']:.1e} {'ok' if check['ok'] else 'FAIL ' + check.get('error', '')}",
                flush=True,
            )
        print(_header(gpu_cols))
        for window_frames, sink_frames in GPU_ROWS:
            rows.append(measure_gpu(window_frames, sink_frames, WAN_TOKENS_PER_FRAME, reps))
            print(_line(rows[-1], gpu_cols), flush=True)
        print("block-size sweep at the largest row (block_q, block_k, num_warps, num_stages):")
        for sizes in GPU_SWEEP:
            rows.append(measure_gpu(*GPU_ROWS[-1], WAN_TOKENS_PER_FRAME, reps, block_sizes=BlockSizes(*sizes)))
            print(f"{str(sizes):>20} " + _line(rows[-1], gpu_cols), flush=True)
        print("\nTFLOP/s per backend (visible pairs only); max|diff| against xla_blockwise:")
        backend_cols = [("case", "case", 8), ("keys", "keys", 6), ("visible", "visible_fraction", 7)]
        backend_cols += [(f"{b[:6]} TF/s", f"{b}_tflops", 11) for b in BACKENDS]
        backend_cols += [(f"{b[:6]} diff", f"{b}_max_abs_diff", 11) for b in BACKENDS[:-1]]
        print(_header(backend_cols))
        for row in backend_rows(WAN_TOKENS_PER_FRAME, reps):
            rows.append(row)
            print(_line(row, backend_cols) + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
    else:
        print("\nGPU part skipped (no GPU" + (", --no-gpu" if args.no_gpu else "") + ")")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
