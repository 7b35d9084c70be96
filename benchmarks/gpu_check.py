"""One command for a lent GPU: kernel correctness at Wan shapes, the attention kernels, the Wan 1.3B chunk per backend
and precision, a kernel-time breakdown from a device trace, and Self-Forcing's own pipeline on the same GPU; JSON out.
Sized for < 6 minutes on one H200 without ``attention_plans`` and the ``mosaic_*`` parts (those not yet timed on a
GPU; each has its own timeout, `PART_TIMEOUT`; ``--parts`` runs a subset). Every part runs in a fresh subprocess
(so each one's peak memory is its own; a part that fails or times out is recorded and the others still run):

1. ``attention``: the Pallas ring kernel and the cuDNN path (`attend(backend=...)`) against the dense reference
   (float32 math on the same bf16 inputs) on a partially filled ring and a wrapped one with a sink, Wan 1.3B's
   12 x 128 heads, a 4,680-token chunk; then 4,680 queries x 9,360 / 23,400 / 37,440 keys, full rings: ms per call
   for Pallas, cuDNN (`jaxkv.attention.cudnn`) and XLA (`jax.nn.dot_product_attention(implementation="xla")`).
2. ``attention_plans``: the cuDNN call forms of a full ring at the Wan chunk's shape (4,680 queries x 32,760 keys,
   sink 3 + window 18 frames): with key lengths, with no mask, and split-KV in 2 / 3 / 4 key parts merged by float32
   LSE, each against the dense reference and timed, plus the `SPLIT_KV` row to record
   (`jaxkv.attention.cudnn`). In a dry run a CPU stand-in takes cuDNN's place, so the plan, branch, split and
   merge logic runs at tiny shapes.
3. ``mosaic_check``: the Mosaic GPU ring kernel (`jaxkv.attention.mosaic_gpu`) compiled and compared with the dense
   reference (float32 math on the same bf16 inputs) and with its pure-JAX emulation (output and log-sum-exp) on a
   partially filled ring, a wrapped one with a sink, a filling one with a sink under a causal mask, permuted slots
   with NaN in the empty ones, and a stacked cache at a layer index; Wan's 12 x 128 heads, 4,680-token chunks.
4. ``mosaic_time``: 4,680 queries x 9,360 / 23,400 / 32,760 / 37,440 keys: ms and TFLOP/s (visible pairs) of the
   kernel, cuDNN and the Triton kernel (`attend(backend=...)`) on a full ring (cuDNN runs unmasked), a filling ring
   with a sink (cuDNN runs with key lengths) and the same under a causal mask (cuDNN falls back to a ring kernel);
   a block-size sweep of the kernel at 32,760 keys; and the entries of `mosaic_gpu.MOSAIC_OVER_CUDNN` (full ring:
   the kernel beat cuDNN) and ``MOSAIC_OVER_TRITON`` (causal: it beat Triton) that the timings support.
   In a dry run the emulation takes the kernel's place in both parts (the kernel cannot run on a CPU).
5. ``chunk:BACKEND:PRECISION`` (one part per row of ``--rows``): Wan 2.1 1.3B with random weights, 480x832 (60x104
   latents, 1,560 tokens/frame), 3-frame chunks, sink 3 + window 18 frames, 4 steps + the context pass,
   `jaxkv.stream.Stream`: ms/chunk (median after the cache has filled and wrapped), latent and video frames per
   second, first-chunk (compile) seconds, peak device memory, the KV cache's bytes. PRECISION is ``bf16``
   (`Precision.bf16()`), ``fp8`` (`Precision.fp8()`: FP8 cache + cuDNN FP8 attention) or ``bf16+fp8_kv`` (the FP8
   cache alone). The weights are held per layer (the unrolled layer loop: every weight and K/V read where it lies)
   unless the precision stores an FP8 cache, which runs the stacked layer scan (the row's ``layout`` says which),
   or the row ends in ``:stacked`` (``mosaic:bf16:stacked``: the layer scan, the Mosaic kernel reading each layer
   of the cache stack in place, no copy of the layer; compare with ``mosaic:bf16``, per layer).
6. ``trace``: the ``--trace-row`` chunk (default auto:bf16) run to its steady state, then ``--trace-chunks`` chunks
   under `jax.profiler.trace`; the trace file is parsed (`kernel_times`) into device time per chunk by kernel name,
   the top kernels and their share, and totals by kind (attention, GEMM, fusion, copy, other).
7. ``peer``: Self-Forcing's own ``CausalInferencePipeline`` on the same GPU at the same shapes
   (``benchmarks/peer_selfforcing.py --device cuda``, reading the checkout ``--sf-src`` or ``SF_SRC`` names; skipped,
   and said so, without one).

``summary`` gives the ratios: each row's ms/chunk and peak memory against auto:bf16 and against Self-Forcing's.

    python benchmarks/gpu_check.py [--json PATH] [--rows auto:bf16,auto:fp8,...] [--sf-src DIR] [--timed N]
    python benchmarks/gpu_check.py --parts mosaic_check,mosaic_time --json mosaic.json   # the Mosaic kernel only
    python benchmarks/gpu_check.py --dry-run      # every part at toy sizes on CPU (Pallas interpreted, cuDNN
                                                  # reported unavailable, FP8 attention emulated), in a few minutes
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
from jaxkv.stream import Stream

PRECISIONS = {
    "bf16": Precision.bf16(),
    "fp8": Precision.fp8(),
    "bf16+fp8_kv": dataclasses.replace(Precision.bf16(), fp8_kv=True),
}
ROWS = "auto:bf16,auto:fp8,auto:bf16+fp8_kv,pallas:bf16,mosaic:bf16,mosaic:bf16:stacked,xla:bf16"
DRY_ROWS = "auto:bf16,auto:fp8,auto:bf16+fp8_kv,xla:bf16"
# seconds a part may take before it is stopped (and recorded as timed out)
PART_TIMEOUT = {
    "attention": 120,
    "attention_plans": 120,
    "mosaic_check": 180,
    "mosaic_time": 300,
    "chunk": 110,
    "trace": 90,
    "peer": 150,
}
# Mosaic kernel tunables tried at 32,760 keys besides the default: (block_q, block_k, stages); each fits Hopper's
# 227 KiB of shared memory at head_dim 128 (block_k 128 does not: see `MosaicBlockSizes`).
MOSAIC_SWEEP = [(64, 64, 2), (64, 64, 3), (128, 64, 2), (128, 64, 3)]
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
    mosaic_keys=(9360, 23400, 32760, 37440),
    sweep_keys=32760,
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
    mosaic_keys=(128, 320),
    sweep_keys=320,
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


def _mosaic_fn(emulate: bool, mask: dict, sizes=None, layer=None):
    """The Mosaic GPU kernel (or, ``emulate``, its pure-JAX emulation) jitted: (q, k, v, qp, kp) -> (out, lse)."""
    from jaxkv.attention.mosaic_emulation import MosaicBlockSizes, emulate_mosaic
    from jaxkv.attention.mosaic_gpu import mosaic_attention

    run = emulate_mosaic if emulate else mosaic_attention
    sizes = None if sizes is None else MosaicBlockSizes(*sizes)
    return jax.jit(lambda *a: run(*a, block_sizes=sizes, layer=layer, **mask))


def mosaic_check(s: dict, emulate: bool) -> dict:
    """The kernel against the dense reference and its emulation on rings of every kind (see the module doc)."""
    from jaxkv.attention.mosaic_emulation import emulate_mosaic

    c, keys = s["chunk"], s["correctness_keys"]
    sink_mask = dict(chunk=c, window=keys - c, sink=c)
    cases = {
        "partial": dict(filled=1, sink_chunks=0, mask=dict(chunk=c)),
        "wrapped_sink": dict(filled=2 * keys // c + 1, sink_chunks=1, mask=sink_mask),
        "filling_sink_causal": dict(
            filled=keys // c // 2 + 1, sink_chunks=1, mask=dict(causal=True, window=keys - c, sink=c)
        ),
        "permuted_nan_empty": dict(filled=keys // c // 2 + 1, sink_chunks=1, mask=sink_mask, permute=True),
        "stacked_layer": dict(filled=2 * keys // c + 1, sink_chunks=1, mask=sink_mask, stacked=True),
    }
    out = {"kernel": "emulation (dry run)" if emulate else "mosaic_gpu"}
    for name, case in cases.items():
        q, k, v, qp, kp = _ring(
            jax.random.key(5), 1, keys, c, s["heads"], s["head_dim"], case["filled"], case["sink_chunks"]
        )
        if case.get("permute"):
            perm = jax.random.permutation(jax.random.key(6), keys)
            k, v, kp = k[:, perm], v[:, perm], kp[:, perm]
            k, v = (jnp.where((kp < 0)[:, :, None, None], jnp.nan, x).astype(x.dtype) for x in (k, v))
        mask = case["mask"]
        ref = jax.jit(
            lambda *a: dense_attention(
                *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a),
                **mask,  # noqa: B023 - called in the iteration that defines it
            )
        )(q, k, v, qp, kp)
        emu_out, emu_lse = jax.jit(lambda *a: emulate_mosaic(*a, **mask))(q, k, v, qp, kp)  # noqa: B023
        try:
            if case.get("stacked"):
                stack = lambda x: jnp.stack([jnp.zeros_like(x), x, -x])
                got, lse = _mosaic_fn(emulate, mask, layer=1)(q, stack(k), stack(v), qp, kp)
            else:
                got, lse = _mosaic_fn(emulate, mask)(q, k, v, qp, kp)
            got = got.astype(jnp.float32)
            finite = jnp.isfinite(emu_lse)
            row = {
                "max_abs_err": float(jnp.max(jnp.abs(got - ref))),
                "max_abs_err_vs_emulation": float(jnp.max(jnp.abs(got - emu_out.astype(jnp.float32)))),
                "lse_max_abs_err_vs_emulation": float(jnp.max(jnp.where(finite, jnp.abs(lse - emu_lse), 0.0))),
                "lse_empty_rows_match": bool(jnp.all(jnp.isinf(lse) == jnp.isinf(emu_lse))),
                "finite": bool(jnp.all(jnp.isfinite(got))),
            }
            row["ok"] = bool(
                row["finite"]
                and row["max_abs_err"] < 3e-2
                and row["max_abs_err_vs_emulation"] < 1e-2
                and row["lse_empty_rows_match"]
                and row["lse_max_abs_err_vs_emulation"] < 1e-2
            )
        except Exception as e:  # noqa: BLE001 - report and go on: one failing case must not hide the others
            row = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        out[name] = row
    return out


def mosaic_time(s: dict, emulate: bool, cudnn_ok: bool, reps: int) -> dict:
    """ms and TFLOP/s of the kernel, cuDNN and Triton per ring case and key count; the sweep; table entries."""
    from jaxkv.attention import visible

    c, heads, d = s["chunk"], s["heads"], s["head_dim"]
    rows, over_cudnn, over_triton = [], [], []
    for keys in s["mosaic_keys"]:
        cases = {
            "full": (2 * keys // c, 0, dict(chunk=c)),
            "filling_sink": (keys // c // 2 + 1, 1, dict(chunk=c, window=keys - c, sink=c)),
            "filling_sink_causal": (keys // c // 2 + 1, 1, dict(causal=True, window=keys - c, sink=c)),
        }
        for name, (filled, sink_chunks, mask) in cases.items():
            args = _ring(jax.random.key(7), 1, keys, c, heads, d, filled, sink_chunks)
            pairs = int(jnp.sum(visible(args[3], args[4], **mask)))
            fns = {
                "mosaic": _mosaic_fn(emulate, mask),
                "pallas": jax.jit(lambda *a, m=mask: attend(*a, backend="pallas", interpret=emulate, **m)),
            }
            if cudnn_ok:
                fns["cudnn"] = jax.jit(lambda *a, m=mask: attend(*a, backend="cudnn", **m))
            row = {"case": name, "queries": c, "keys": keys, "visible_pairs": pairs, "heads": heads, "head_dim": d}
            for fn_name, fn in fns.items():
                try:
                    ms = _time(fn, *args, reps=reps)
                    row[f"{fn_name}_ms"], row[f"{fn_name}_tflops"] = ms, 4 * pairs * heads * d / (ms * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - report and go on
                    row[f"{fn_name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if name == "full" and "cudnn_ms" in row and row.get("mosaic_ms", float("inf")) < row["cudnn_ms"]:
                over_cudnn.append([keys, c, d])
            if name == "filling_sink_causal" and row.get("mosaic_ms", float("inf")) < row.get("pallas_ms", 0.0):
                over_triton.append([keys, c, d])
            rows.append(row)
    sweep = []
    args = _ring(jax.random.key(8), 1, s["sweep_keys"], c, heads, d, 2 * s["sweep_keys"] // c)
    for sizes in MOSAIC_SWEEP:
        entry = {"block_q_block_k_stages": list(sizes), "keys": s["sweep_keys"]}
        try:
            entry["ms"] = _time(_mosaic_fn(emulate, dict(chunk=c), sizes), *args, reps=reps)
        except Exception as e:  # noqa: BLE001 - report and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        sweep.append(entry)
    return {
        "kernel": "emulation (dry run)" if emulate else "mosaic_gpu",
        "rows": rows,
        "sweep": sweep,
        "suggested": {"MOSAIC_OVER_CUDNN": over_cudnn, "MOSAIC_OVER_TRITON": over_triton},
    }


def wan_chunk(
    s: dict, timed: int, backend: str = "auto", precision_name: str = "bf16", trace_dir=None, layout=None
) -> dict:
    """One row: the Wan chunk under ``backend`` and ``PRECISIONS[precision_name]``; with ``trace_dir``, the
    ``timed`` chunks run under `jax.profiler.trace` into it (and the row's timing is then not representative).

    The params are held per layer (the unrolled layer loop reads every weight and K/V where it lies, no per-layer
    copies), except under an FP8 cache, which supports only the stacked layout (the layer scan), or with
    ``layout="stacked"`` (a row's ``:stacked``): the layer scan, whose cache stack backend "mosaic" reads at each
    layer in place (`jaxkv.attend`'s ``layer=``) and every other backend slices a layer out of."""
    config = wan.preset(s["wan"])
    precision = PRECISIONS[precision_name]
    params = M.init_params(config, jax.random.key(0), dtype=precision.param_dtype)
    layout = "stacked" if precision.fp8_kv else layout or "per_layer"
    if layout == "per_layer":
        params = per_layer_params(params)
    h, w = s["latent"]
    rc = R.RolloutConfig(
        latent_height=h,
        latent_width=w,
        chunk_frames=3,
        window_frames=s["window"],
        sink_frames=s["sink"],
        precision=precision,
        backend=backend,
    )
    context = jax.random.normal(jax.random.key(1), (1, config.text_len, config.text_dim), jnp.bfloat16)
    tpf = rc.tokens_per_frame(config)
    chosen = resolve_backend(
        backend,
        head_dim=config.head_dim,
        dtypes=(jnp.bfloat16,) * 3,
        rope=None,
        logits=config.num_heads * 3 * tpf * (s["window"] + s["sink"]) * tpf,
    )
    stream = Stream(params, config, rc, context, key=jax.random.key(2))
    fill = (s["window"] + s["sink"]) // 3 + 1
    t0 = time.perf_counter()
    jax.block_until_ready(next(stream))
    first = time.perf_counter() - t0
    for _ in range(fill - 1):
        jax.block_until_ready(next(stream))
    times = []

    def timed_chunks():
        for _ in range(timed):
            t0 = time.perf_counter()
            x = jax.block_until_ready(next(stream))
            times.append(time.perf_counter() - t0)
        return x

    if trace_dir is None:
        x = timed_chunks()
    else:
        with jax.profiler.trace(trace_dir):
            x = timed_chunks()
    ms = statistics.median(times) * 1e3
    stats = jax.devices()[0].memory_stats() or {}
    cache = stream.state.cache
    return {
        "model": s["wan"],
        "backend": backend,
        "precision": precision_name,
        "layout": layout,
        "precision_fields": dataclasses.asdict(precision),
        "latent_hw": [h, w],
        "tokens_per_chunk": 3 * tpf,
        "sink_frames": s["sink"],
        "window_frames": s["window"],
        "auto_backend": chosen,
        "first_chunk_s (compile)": first,
        "ms_per_chunk": ms,
        "timed_chunks": timed,
        "latent_fps": 3 / (ms / 1e3),
        "video_fps": 12 / (ms / 1e3),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "kv_cache_bytes": int(sum(a.nbytes for a in jax.tree.leaves(cache))),
        "finite": bool(jnp.all(jnp.isfinite(x))),
        "compiles": R.stream_step._cache_size(),
    }


# ------------------------------------------------------------------------------------------------ the trace

# Derived rows of a device's trace that repeat its kernels' time (module and op spans, step markers).
_SUMMARY_THREADS = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "TraceMe")
# Host-side bookkeeping spans on an XLA:CPU trace (the dry run parses one): not kernels.
_CPU_BOOKKEEPING = ("ThreadpoolListener", "ThunkExecutor", "end: ", "$")
KINDS = (
    ("attention", ("fmha", "flash", "cudnn", "attention", "mha", "fprop_kernel", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ynn_fusion", "dot")),
    ("copy", ("memcpy", "memset", "copy", "dynamic_slice", "dynamic-update-slice", "dynamic_update_slice")),
    ("fusion", ("fusion",)),
)


def kind_of(name: str) -> str:
    """A kernel's kind by its name: attention, gemm, copy, fusion or other (first match in `KINDS` order)."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_times(trace: dict) -> tuple[dict, str]:
    """Device time by kernel name from a Chrome-format trace (`jax.profiler.trace`'s ``*.trace.json.gz``).

    The kernels are the complete events (``ph == "X"``) of every process named ``/device:...`` (a GPU), on its
    stream rows (the threads named ``Stream...``; all its threads but the derived summary rows when none is so
    named). A trace without a device process (XLA:CPU) falls back to the host's XLA worker threads (thread names
    with ``XLA``), minus their bookkeeping spans: the dry run's stand-in for kernels.

    Returns ({name: {"us": total microseconds, "calls": count}}, "device" or "host").
    """
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    procs = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
    if devices:
        streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}
        if streams:
            keep = lambda e: (e["pid"], e.get("tid")) in streams
        else:
            keep = lambda e: (
                e["pid"] in devices and not threads.get((e["pid"], e.get("tid")), "").startswith(_SUMMARY_THREADS)
            )
        where = "device"
    else:
        xla = {key for key, name in threads.items() if "XLA" in name}
        keep = lambda e: (e["pid"], e.get("tid")) in xla and not e.get("name", "").startswith(_CPU_BOOKKEEPING)
        where = "host"
    out = collections.defaultdict(lambda: {"us": 0.0, "calls": 0})
    for e in events:
        if e.get("ph") == "X" and "dur" in e and keep(e):
            out[e["name"]]["us"] += float(e["dur"])
            out[e["name"]]["calls"] += 1
    return dict(out), where


def read_trace(trace_dir: str) -> dict:
    """The Chrome-format trace `jax.profiler.trace(trace_dir)` wrote (the newest ``*.trace.json.gz`` under it)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def breakdown(times: dict, chunks: int, top: int = 15) -> dict:
    """Per chunk: total kernel ms, ms by kind, and the ``top`` kernels by time (ms, calls, share of the total)."""
    total = sum(t["us"] for t in times.values())
    by_kind = collections.defaultdict(float)
    for name, t in times.items():
        by_kind[kind_of(name)] += t["us"]
    ranked = sorted(times.items(), key=lambda kv: -kv[1]["us"])[:top]
    return {
        "chunks": chunks,
        "kernel_ms_per_chunk": total / 1e3 / chunks,
        "kernels": len(times),
        "by_kind_ms_per_chunk": {k: v / 1e3 / chunks for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [
            {
                "name": name[:160],
                "kind": kind_of(name),
                "ms_per_chunk": t["us"] / 1e3 / chunks,
                "calls_per_chunk": t["calls"] / chunks,
                "share": t["us"] / total if total else 0.0,
            }
            for name, t in ranked
        ],
    }


def trace_part(s: dict, row: str, chunks: int) -> dict:
    backend, precision = parse_row(row)
    with tempfile.TemporaryDirectory() as tmp:
        result = wan_chunk(s, chunks, backend, precision, trace_dir=tmp, layout=row_layout(row))
        times, where = kernel_times(read_trace(tmp))
    return {"row": row, "events_from": where, **breakdown(times, chunks), "traced_ms_per_chunk": result["ms_per_chunk"]}


# ------------------------------------------------------------------------------------------------ Self-Forcing


def peer_part(sf_src: str | None, dry: bool, timed: int) -> dict:
    """Self-Forcing's pipeline alone on this device (`benchmarks/peer_selfforcing.py --device ...`), in this part's
    own process; its JSON row."""
    if not sf_src:
        return {"skipped": "no Self-Forcing checkout: pass --sf-src DIR or set SF_SRC"}
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        cmd = [sys.executable, os.path.join(here, "peer_selfforcing.py"), "--json", out, "--timed", str(timed)]
        cmd += ["--device", "cpu", "--rows", "window6", "--torch-only"] if dry else ["--device", "cuda"]
        proc = subprocess.run(cmd, env={**os.environ, "SF_SRC": sf_src}, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": f"rc {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}", "command": cmd}
        with open(out) as f:
            result = json.load(f)
    return {"command": " ".join(cmd[1:]), **result}


def cudnn_available() -> bool:
    try:
        f = lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
        jax.block_until_ready(jax.jit(f)(jnp.zeros((1, 16, 1, 64), jnp.bfloat16)))
        return True
    except Exception:  # noqa: BLE001 - any failure of the probe means cuDNN is not usable here
        return False


def parse_row(row: str) -> tuple[str, str]:
    """ "BACKEND:PRECISION[:stacked]" -> (backend, precision name), checked (the layout: `row_layout`)."""
    backend, _, rest = row.partition(":")
    precision, _, layout = rest.partition(":")
    known = backend in ("auto", "cudnn", "pallas", "mosaic", "xla") and precision in PRECISIONS
    if not known or layout not in ("", "stacked"):
        raise ValueError(
            f"row {row!r}: expected BACKEND:PRECISION[:stacked] with BACKEND in auto, cudnn, pallas, mosaic, xla "
            f"and PRECISION in {sorted(PRECISIONS)}"
        )
    return backend, precision


def row_layout(row: str) -> str | None:
    """ "stacked" for a row ending in ``:stacked`` (the layer scan), else None (`wan_chunk`'s default layout)."""
    return "stacked" if row.endswith(":stacked") else None


def run_part(part: str, args) -> dict:
    """One part, in this process: "attention", "attention_plans", "mosaic_check", "mosaic_time",
    "chunk:BACKEND:PRECISION", "trace" or "peer"."""
    s = DRY if args.dry_run else FULL
    on_gpu = jax.default_backend() == "gpu"
    if part == "attention":
        cudnn_ok = cudnn_available()
        return {
            "cudnn": cudnn_ok,
            "correctness": check_correctness(s, not on_gpu, cudnn_ok),
            "timing": time_attention(s, not on_gpu, cudnn_ok, 2 if args.dry_run else args.reps),
        }
    if part == "attention_plans":
        return attention_plans(s, cudnn_available(), 2 if args.dry_run else args.reps)
    if part == "mosaic_check":
        return mosaic_check(s, emulate=not on_gpu)
    if part == "mosaic_time":
        return mosaic_time(s, not on_gpu, cudnn_available(), 2 if args.dry_run else args.reps)
    if part.startswith("chunk:"):
        row = part[len("chunk:") :]
        backend, precision = parse_row(row)
        timed = 2 if args.dry_run else (max(2, args.timed // 2) if backend == "xla" else args.timed)
        return wan_chunk(s, timed, backend, precision, layout=row_layout(row))
    if part == "trace":
        return trace_part(s, args.trace_row, args.trace_chunks)
    if part == "peer":
        return peer_part(args.sf_src, args.dry_run, 1 if args.dry_run else args.timed)
    raise ValueError(f"unknown part {part!r}")


def spawn_part(part: str, args, argv: list[str]) -> dict:
    """`run_part` in a fresh interpreter (its own device memory and peak), bounded by `PART_TIMEOUT`; a failure or a
    timeout is returned as {"error": ...}, never raised."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "part.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--part", part, "--part-out", out]
        limit = PART_TIMEOUT[part.split(":")[0]] * (3 if args.dry_run else 1)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {limit} s", "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"rc {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}", "wall_s": wall}
        with open(out) as f:
            result = json.load(f)
    result["wall_s"] = wall
    return result


def summarize(result: dict) -> dict:
    """Ratios: every chunk row against auto:bf16 and against Self-Forcing's pipeline (ms and peak memory), and the
    targets (bf16 <= 330 ms, fp8 <= 260 ms, >= 1.6x Self-Forcing, peak memory <= Self-Forcing's)."""
    rows = {k[len("chunk:") :]: v for k, v in result.items() if k.startswith("chunk:") and "ms_per_chunk" in v}
    peer = result.get("peer", {})
    peer_ms, peer_peak = peer.get("torch_ms"), peer.get("peak_bytes")
    base = rows.get("auto:bf16", {}).get("ms_per_chunk")
    out = {}
    for name, row in rows.items():
        ms, peak = row["ms_per_chunk"], row.get("peak_bytes_in_use")
        entry = {"ms_per_chunk": ms, "video_fps": row["video_fps"], "peak_bytes": peak}
        if base:
            entry["vs_auto_bf16"] = ms / base
        if peer_ms:
            entry["self_forcing_over_this"] = peer_ms / ms
            entry["meets_1.6x"] = peer_ms / ms >= 1.6
        if peer_peak and peak:
            entry["peak_over_self_forcing"] = peak / peer_peak
        target = {"bf16": 330.0, "fp8": 260.0}.get(row["precision"])
        if target and row["backend"] == "auto":
            entry["target_ms"], entry["meets_target"] = target, ms <= target
        out[name] = entry
    if peer_ms:
        out["self_forcing"] = {"ms_per_chunk": peer_ms, "peak_bytes": peer_peak}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy shapes on any backend (Pallas interpreted)")
    parser.add_argument("--skip-wan", action="store_true", help="the attention parts only")
    parser.add_argument(
        "--rows", help=f"chunk rows, BACKEND:PRECISION[:stacked],... (default {ROWS}; dry run {DRY_ROWS})"
    )
    parser.add_argument("--timed", type=int, default=5, help="timed Wan chunks per row (xla rows: half)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per attention path")
    parser.add_argument("--trace-row", default="auto:bf16", help="the row the trace part runs")
    parser.add_argument("--trace-chunks", type=int, default=2, help="chunks under the profiler")
    parser.add_argument("--skip-trace", action="store_true")
    parser.add_argument("--parts", help="run only these parts, comma-separated (e.g. mosaic_check,mosaic_time)")
    parser.add_argument("--sf-src", default=os.environ.get("SF_SRC"), help="Self-Forcing checkout (default $SF_SRC)")
    parser.add_argument("--in-process", action="store_true", help="run every part in this process (tests)")
    parser.add_argument("--json", help="write the results here (also printed)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        print(f"no GPU (jax backend {jax.default_backend()!r}); run with --dry-run to exercise the code paths")
        return 2
    if args.part:  # a child: one part, JSON to --part-out
        result = run_part(args.part, args)
        with open(args.part_out, "w") as f:
            json.dump(result, f, default=str)
        return 0
    rows = (args.rows or (DRY_ROWS if args.dry_run else ROWS)).split(",")
    for row in rows + [args.trace_row]:
        try:
            parse_row(row)
        except ValueError as e:
            parser.error(str(e))
    parts = ["attention", "attention_plans", "mosaic_check", "mosaic_time"]
    if not args.skip_wan:
        parts += [f"chunk:{r}" for r in rows] + ([] if args.skip_trace else ["trace"]) + ["peer"]
    if args.parts:
        chosen = args.parts.split(",")
        known = {p.split(":")[0] for p in parts} | {"chunk"}
        unknown = [p for p in chosen if p.split(":")[0] not in known]
        if unknown:
            parser.error(f"unknown parts {unknown}; expected some of {sorted(known)}")
        parts = chosen
    child_argv = [a for a in argv if a not in ("--in-process",)]
    result = {
        "meta": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "machine": platform.platform(),
            "dry_run": args.dry_run,
            "python": sys.version.split()[0],
            "parts": parts,
            "fresh_process_per_part": not args.in_process,
        }
    }
    start = time.perf_counter()
    for part in parts:
        t0 = time.perf_counter()
        if args.in_process:
            try:
                result[part] = run_part(part, args)
            except Exception:  # noqa: BLE001 - recorded in the JSON, the other parts still run
                result[part] = {"error": traceback.format_exc(limit=4)}
        else:
            result[part] = spawn_part(part, args, child_argv)
        result["meta"][f"{part}_s"] = time.perf_counter() - t0
        print(f"{part}: {result['meta'][f'{part}_s']:.1f} s" + (" (error)" if "error" in result[part] else ""))
    result["summary"] = summarize(result)
    result["meta"]["total_s"] = time.perf_counter() - start
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    attention = result.get("attention", {})
    failed = [k for k, v in attention.get("correctness", {}).items() if isinstance(v, dict) and not v.get("ok", True)]
    plans = result.get("attention_plans", {})
    failed += [f"attention_plans/{k}" for k, v in plans.items() if isinstance(v, dict) and v.get("ok") is False]
    checks = result.get("mosaic_check", {})
    failed += [f"mosaic_check/{k}" for k, v in checks.items() if isinstance(v, dict) and v.get("ok") is False]
    errors = [k for k in parts if isinstance(result.get(k), dict) and "error" in result[k]]
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
