"""One command for a lent GPU: kernel correctness at Wan shapes, Pallas vs cuDNN vs XLA attention, and a full Wan 1.3B
chunk on the ring cache; JSON out. Sized for < 8 minutes on one H100/H200.

1. ``correctness``: the Pallas ring kernel and the cuDNN path (`attend(backend=...)`) against the dense reference
   (float32 math on the same bf16 inputs) on a partially filled ring and a wrapped one with a sink, Wan 1.3B's
   12 x 128 heads, a 4,680-token chunk.
2. ``attention``: 4,680 queries x 9,360 / 23,400 / 37,440 keys, 12 x 128, bf16, full rings (the streaming steady
   state): ms per call for the Pallas kernel, cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")` through
   `jaxkv.attention.cudnn`, including its run-time length check) and XLA (`jax.nn.dot_product_attention(
   implementation="xla")`, no mask), and pallas/cudnn (target <= 1/0.9).
3. ``attention_plans``: the cuDNN call forms of a full ring at the Wan chunk's shape (4,680 queries x 32,760 keys,
   sink 3 + window 18 frames): with key lengths, with no mask, and split-KV in 2 / 3 / 4 key parts merged by float32
   LSE, each against the dense reference and timed, plus the `SPLIT_KV` row to record
   (`jaxkv.attention.cudnn`). In a dry run a CPU stand-in takes cuDNN's place, so the plan, branch, split and
   merge logic runs at tiny shapes.
4. ``wan_chunk``: Wan 2.1 1.3B with random bf16 weights held per layer (the unrolled layer loop), 480x832 (60x104
   latents, 1,560 tokens/frame), 3-frame
   chunks, sink 3 + window 18 frames, bf16 cache, 4 steps + the context pass, `jaxkv.rollout.Stream` with
   backend "auto": ms/chunk (median after the cache has filled and wrapped), latent and video frames per second
   (a 3-latent-frame chunk decodes to 12 video frames), peak device memory, and the backend `auto` chose.

    python benchmarks/gpu_check.py [--json PATH] [--skip-wan] [--timed N]
    python benchmarks/gpu_check.py --dry-run      # the same code paths at tiny shapes on CPU (Pallas interpreted,
                                                  # cuDNN reported as unavailable), in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.attention import MaskSpec, attend, cudnn, dense_attention
from jaxkv.attention.dispatch import resolve_backend
from jaxkv.attention.xla_cpu import xla_cpu_attention
from jaxkv.models import wan
from jaxkv.models.wan import model as M
from jaxkv.models.wan.params import per_layer_params
from jaxkv.precision import Precision

FULL = dict(
    heads=12,
    head_dim=128,
    chunk=4680,
    keys=(9360, 23400, 37440),
    correctness_keys=9360,
    wan="wan2.1-t2v-1.3b",
    latent=(60, 104),
    window=18,
    sink=3,
    plan_keys=32760,
    plan_parts=(2, 3, 4),
)
DRY = dict(
    heads=2,
    head_dim=64,
    chunk=64,
    keys=(128, 320),
    correctness_keys=192,
    wan="tiny",
    latent=(8, 8),
    window=6,
    sink=3,
    plan_keys=384,
    plan_parts=(2, 3, 4),
)


def _time(fn, *args, reps: int):
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _ring(key, batch, keys, chunk, heads, head_dim, filled, sink_chunks=0):
    """bf16 q [b, chunk, h, d], k, v [b, keys, h, d] and positions of a ring with `filled` chunks written (wrapped
    when filled exceeds its capacity); the queries are the last chunk's."""
    nslots = keys // chunk
    window = nslots - sink_chunks
    pos = np.full((keys,), -1, np.int32)
    for n in range(filled):
        slot = n if n < sink_chunks else sink_chunks + (n - sink_chunks) % window
        pos[slot * chunk : (slot + 1) * chunk] = np.arange(n * chunk, (n + 1) * chunk)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, chunk, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (batch, keys, heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (batch, keys, heads, head_dim), jnp.bfloat16)
    qp = jnp.broadcast_to(jnp.arange((filled - 1) * chunk, filled * chunk, dtype=jnp.int32), (batch, chunk))
    return q, k, v, qp, jnp.broadcast_to(jnp.asarray(pos), (batch, keys))


def check_correctness(s: dict, interpret: bool, cudnn_ok: bool) -> dict:
    out = {}
    c, keys = s["chunk"], s["correctness_keys"]
    cases = {
        "partial": dict(filled=1, sink_chunks=0, mask=dict(chunk=c)),
        "wrapped_sink": dict(filled=2 * keys // c + 1, sink_chunks=1, mask=dict(chunk=c)),
    }
    for name, case in cases.items():
        q, k, v, qp, kp = _ring(
            jax.random.key(0), 1, keys, c, s["heads"], s["head_dim"], case["filled"], case["sink_chunks"]
        )
        ref = jax.jit(
            lambda *a: dense_attention(
                *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a),
                **case["mask"],  # noqa: B023 - called in the iteration that defines it
            )
        )(q, k, v, qp, kp)
        for backend in ("pallas", "cudnn"):
            if backend == "cudnn" and not cudnn_ok:
                out[f"{name}/{backend}"] = "skipped: cuDNN not available on this jaxlib"
                continue
            kw = dict(interpret=True) if backend == "pallas" and interpret else {}
            got = jax.jit(lambda *a: attend(*a, backend=backend, **case["mask"], **kw))(q, k, v, qp, kp)  # noqa: B023 - called in the iteration that defines it
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
            out[f"{name}/{backend}"] = {"max_abs_err": err, "ok": err < 3e-2}
    return out


def time_attention(s: dict, interpret: bool, cudnn_ok: bool, reps: int) -> list[dict]:
    rows = []
    c = s["chunk"]
    for keys in s["keys"]:
        q, k, v, qp, kp = _ring(jax.random.key(1), 1, keys, c, s["heads"], s["head_dim"], 2 * keys // c)
        fns = {
            "pallas": jax.jit(lambda *a: attend(*a, backend="pallas", chunk=c, interpret=interpret)),
            "xla": jax.jit(lambda q, k, v, qp, kp: jax.nn.dot_product_attention(q, k, v, implementation="xla")),
        }
        if cudnn_ok:
            fns["cudnn"] = jax.jit(lambda *a: attend(*a, backend="cudnn", chunk=c))
        row = {"queries": c, "keys": keys, "heads": s["heads"], "head_dim": s["head_dim"], "dtype": "bfloat16"}
        for name, fn in fns.items():
            try:
                row[f"{name}_ms"] = _time(fn, q, k, v, qp, kp, reps=reps)
            except Exception as e:  # noqa: BLE001 - report and go on: one failing path must not hide the others
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "pallas_ms" in row and "cudnn_ms" in row:
            row["cudnn/pallas"] = row["cudnn_ms"] / row["pallas_ms"]  # >= 0.9 is the target
        rows.append(row)
    return rows


def _cpu_cudnn_standin(q, k, v, lengths, scale, return_lse=False):
    """cuDNN's call written with the XLA:CPU path, for dry runs: slots [0, lengths[b]) (all when None), float32 LSE."""
    b, lk = k.shape[:2]
    kv_pos = jnp.zeros((b, lk), jnp.int32)
    if lengths is not None:
        kv_pos = jnp.where(jnp.arange(lk)[None, :] < lengths[:, None], 0, -1).astype(jnp.int32)
    out = xla_cpu_attention(q, k, v, jnp.zeros(q.shape[:2], jnp.int32), kv_pos, scale=scale, return_lse=return_lse)
    return out


def attention_plans(s: dict, cudnn_ok: bool, reps: int) -> dict:
    """The cuDNN call forms on a full (wrapped) ring at the chunk's shape: "lengths" (per-session key lengths, what
    a partially filled ring gets), "no_mask" (what a full ring gets), "split_<n>" (keys in n parts as batch rows
    of one call, merged by float32 LSE), each checked against the dense reference and timed; then the
    `jaxkv.attention.cudnn.SPLIT_KV` entry the timings suggest. Without cuDNN (a dry run) a CPU stand-in replaces
    the kernel: the numbers then say nothing about a GPU, only that the dispatch runs and is exact."""
    c, keys = s["chunk"], s["plan_keys"]
    kernel = cudnn.cudnn_call if cudnn_ok else _cpu_cudnn_standin
    q, k, v, qp, kp = _ring(jax.random.key(3), 1, keys, c, s["heads"], s["head_dim"], 2 * keys // c, sink_chunks=1)
    ref = jax.jit(lambda *a: dense_attention(*(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a)))(
        q, k, v, qp, kp
    )
    mask = dict(chunk=c, window=keys - c, sink=c)
    forms = {"lengths": ("lengths", 1), "no_mask": ("all", 1)}
    forms.update({f"split_{n}": ("all", n) for n in s["plan_parts"] if keys % n == 0})
    out = {"queries": c, "keys": keys, "heads": s["heads"], "head_dim": s["head_dim"], "kernel": kernel.__name__}
    plan = jax.jit(lambda qp, kp: cudnn.plan_attention(qp, kp, MaskSpec(**mask)))(qp, kp)
    out["plan_mode"] = {cudnn.FALLBACK: "fallback", cudnn.LENGTHS: "lengths", cudnn.ALL_VISIBLE: "all_visible"}[
        int(plan.mode)
    ]
    flop = 4 * q.shape[0] * s["heads"] * c * keys * s["head_dim"]
    for name, (mode, parts) in forms.items():
        forced = cudnn.Plan(jnp.int32(cudnn.LENGTHS if mode == "lengths" else cudnn.ALL_VISIBLE), plan.lengths)
        fn = jax.jit(
            lambda q, k, v, qp, kp, forced=forced, parts=parts: cudnn.cudnn_attention(
                q, k, v, qp, kp, fallback=dense_attention, plan=forced, parts=parts, kernel=kernel, **mask
            )
        )
        try:
            got = fn(q, k, v, qp, kp)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
            ms = _time(fn, q, k, v, qp, kp, reps=reps)
            out[name] = {"ms": ms, "tflops": flop / (ms * 1e-3) / 1e12, "max_abs_err": err, "ok": err < 3e-2}
        except Exception as e:  # noqa: BLE001 - report and go on: one failing form must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    timed = {n: r["ms"] for n, r in out.items() if isinstance(r, dict) and "ms" in r and n != "lengths"}
    if timed:
        best = min(timed, key=timed.get)
        out["suggested_split_kv"] = {"key": [keys, c], "parts": 1 if best == "no_mask" else int(best.split("_")[1])}
    out["table_now"] = cudnn.split_parts(keys, c)
    return out


def wan_chunk(s: dict, timed: int) -> dict:
    config = wan.preset(s["wan"])
    precision = Precision.bf16()
    # Per-layer params: the unrolled layer loop reads every weight and K/V where it lies (no per-layer copies).
    params = per_layer_params(M.init_params(config, jax.random.key(0), dtype=precision.param_dtype))
    h, w = s["latent"]
    rc = R.RolloutConfig(
        latent_height=h,
        latent_width=w,
        chunk_frames=3,
        window_frames=s["window"],
        sink_frames=s["sink"],
        precision=precision,
        backend="auto",
    )
    context = jax.random.normal(jax.random.key(1), (1, config.text_len, config.text_dim), jnp.bfloat16)
    tpf = rc.tokens_per_frame(config)
    chosen = resolve_backend(
        "auto",
        head_dim=config.head_dim,
        dtypes=(jnp.bfloat16,) * 3,
        rope=None,
        logits=config.num_heads * 3 * tpf * (s["window"] + s["sink"]) * tpf,
    )
    stream = R.Stream(params, config, rc, context, key=jax.random.key(2))
    fill = (s["window"] + s["sink"]) // 3 + 1
    t0 = time.perf_counter()
    jax.block_until_ready(next(stream))
    first = time.perf_counter() - t0
    for _ in range(fill - 1):
        jax.block_until_ready(next(stream))
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        x = jax.block_until_ready(next(stream))
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "model": s["wan"],
        "latent_hw": [h, w],
        "tokens_per_chunk": 3 * tpf,
        "sink_frames": s["sink"],
        "window_frames": s["window"],
        "precision": dataclasses.asdict(precision),
        "auto_backend": chosen,
        "first_chunk_s (compile)": first,
        "ms_per_chunk": ms,
        "latent_fps": 3 / (ms / 1e3),
        "video_fps": 12 / (ms / 1e3),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "finite": bool(jnp.all(jnp.isfinite(x))),
        "compiles": R.stream_step._cache_size(),
        "targets_ms": {"flashdreams_h100": 344, "self_forcing": 432},
    }


def cudnn_available() -> bool:
    try:
        f = lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
        jax.block_until_ready(jax.jit(f)(jnp.zeros((1, 16, 1, 64), jnp.bfloat16)))
        return True
    except Exception:  # noqa: BLE001 - any failure of the probe means cuDNN is not usable here
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on any backend (Pallas interpreted)")
    parser.add_argument("--skip-wan", action="store_true", help="attention only")
    parser.add_argument("--timed", type=int, default=5, help="timed Wan chunks")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per attention path")
    parser.add_argument("--json", help="write the results here (also printed)")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        print(f"no GPU (jax backend {jax.default_backend()!r}); run with --dry-run to exercise the code paths")
        return 2
    s = DRY if args.dry_run else FULL
    interpret = not on_gpu
    result = {
        "meta": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "machine": platform.platform(),
            "dry_run": args.dry_run,
            "python": sys.version.split()[0],
        }
    }
    start = time.perf_counter()
    cudnn_ok = cudnn_available()
    result["meta"]["cudnn"] = cudnn_ok
    for name, fn in (
        ("correctness", lambda: check_correctness(s, interpret, cudnn_ok)),
        ("attention", lambda: time_attention(s, interpret, cudnn_ok, 2 if args.dry_run else args.reps)),
        ("attention_plans", lambda: attention_plans(s, cudnn_ok, 2 if args.dry_run else args.reps)),
        ("wan_chunk", None if args.skip_wan else lambda: wan_chunk(s, 2 if args.dry_run else args.timed)),
    ):
        if fn is None:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - recorded in the JSON, the other parts still run
            result[name] = {"error": traceback.format_exc(limit=4)}
        result["meta"][f"{name}_s"] = time.perf_counter() - t0
    result["meta"]["total_s"] = time.perf_counter() - start
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    failed = [k for k, v in result.get("correctness", {}).items() if isinstance(v, dict) and not v.get("ok", True)]
    plans = result.get("attention_plans", {})
    failed += [f"attention_plans/{k}" for k, v in plans.items() if isinstance(v, dict) and v.get("ok") is False]
    errors = [
        k
        for k in ("correctness", "attention", "attention_plans", "wan_chunk")
        if isinstance(result.get(k), dict) and "error" in result[k]
    ]
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
