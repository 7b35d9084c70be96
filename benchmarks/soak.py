"""Soak: one long stream of the tiny model, checked for the slow failures a short test cannot see.

One `jaxkv.stream.Stream` (jitted step, cache donated) runs ``--num-chunks`` chunks (default 10,000) of the
``tiny`` preset with seeded random weights, a seeded stand-in context, 16x16 latent frames, 3-frame chunks, a 3-frame
sink + 9-frame window ring (the `jaxkv generate` defaults) and the 4-step Self-Forcing schedule. Chunk k+1 is
dispatched before chunk k is fetched, as `jaxkv generate` does. Every ``num_chunks / samples`` chunks a row records:

  rss_mib        the process's resident set (VmRSS) at the row's end: must stay flat (no leak per chunk);
  ms_median      the median wall time per chunk over the row's chunks: must stay flat (no O(chunks) work);
  mean, std      of the row's latents (all values): stable (no drift, no blow-up);
  nonfinite      NaN/Inf values among the row's latents: must be 0.

Also: the step's compilations over the whole run (must be 1: positions and slots are traced), and a resume check:
at chunk ``--resume-at`` (default the middle) the stream's session is saved to disk (`jaxkv.session.save`); after
the run it is loaded (`jaxkv.session.load`) and continued to the end with `Stream.from_session`, and every one of
those chunks must equal the uninterrupted run's bit for bit (compared by SHA-256 of its bytes, so no latents are
kept in memory).

    python benchmarks/soak.py [--num-chunks 10000] [--samples 20] [--resume-at N] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.compilation import count_compiles
from jaxkv.generate.inputs import standin_context
from jaxkv.models import wan
from jaxkv.stream import Stream

LATENT_HW = (16, 16)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@jax.jit
def _moments(x):
    """(sum, sum of squares, non-finite count) of a chunk, in float64-free form: float32 sums of one chunk."""
    finite = jnp.isfinite(x)
    xf = jnp.where(finite, x, 0.0)
    return jnp.sum(xf), jnp.sum(xf * xf), jnp.sum(~finite)


def _setup(seed: int):
    config = wan.preset("tiny")
    rc = R.RolloutConfig(*LATENT_HW, chunk_frames=3, window_frames=9, sink_frames=3)
    params = wan.init_params(config, jax.random.key(seed))
    context = jnp.asarray(standin_context(seed, config.text_dim, config.text_len))[None]
    return config, rc, params, context


def _drive(stream, count: int, on_chunk, before_dispatch=None):
    """Runs ``count`` chunks of ``stream`` pipelined (chunk k+1 dispatched before chunk k is fetched); calls
    ``on_chunk(i, host latents, moments, seconds)`` for each. ``before_dispatch(i)`` runs before chunk i is
    dispatched (the state then is the state before chunk i) and returns True when it took time that chunk's timing
    must not include."""

    def dispatch():
        x = next(stream)
        return x, _moments(x)

    before_dispatch and before_dispatch(stream.index)
    start = time.perf_counter()  # the first chunk's time includes the step's compilation
    pending = dispatch()
    for i in range(count):
        x, m = pending
        skip = False
        if i + 1 < count:
            skip = bool(before_dispatch and before_dispatch(stream.index))
            pending = dispatch()
        x, m = jax.device_get((x, m))
        now = time.perf_counter()
        on_chunk(i, x, m, None if skip else now - start)
        start = time.perf_counter() if skip else now


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-chunks", type=int, default=10_000)
    p.add_argument("--samples", type=int, default=20, help="rows of the table")
    p.add_argument("--resume-at", type=int, help="chunk whose session is saved and resumed (default: the middle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows and the verdicts here")
    args = p.parse_args(argv)
    n = args.num_chunks
    resume_at = n // 2 if args.resume_at is None else args.resume_at
    if n < 2 or not 0 < resume_at < n or args.samples < 2 or n < args.samples:
        p.error("need --num-chunks >= --samples >= 2 and 0 < --resume-at < --num-chunks")
    config, rc, params, context = _setup(args.seed)
    key = jax.random.key(args.seed)
    per_row = n // args.samples
    rows, digests = [], {}
    acc = dict(times=[], s=0.0, ss=0.0, count=0, nonfinite=0)
    tmp = tempfile.mkdtemp(prefix="jaxkv-soak-")
    session_dir = os.path.join(tmp, "session")
    first_chunk_s = None

    def on_chunk(i, x, m, seconds):
        nonlocal first_chunk_s
        if i == 0:
            first_chunk_s = seconds
        elif seconds is not None:
            acc["times"].append(seconds)
        acc["s"] += float(m[0])
        acc["ss"] += float(m[1])
        acc["count"] += x.size
        acc["nonfinite"] += int(m[2])
        if i >= resume_at:
            digests[i] = hashlib.sha256(x.tobytes()).hexdigest()
        if (i + 1) % per_row == 0 or i + 1 == n:
            mean = acc["s"] / acc["count"]
            rows.append(
                dict(
                    chunks=i + 1,
                    rss_mib=round(rss_mib(), 1),
                    ms_median=round(1e3 * statistics.median(acc["times"]), 2) if acc["times"] else None,
                    mean=mean,
                    std=max(acc["ss"] / acc["count"] - mean * mean, 0.0) ** 0.5,
                    nonfinite=acc["nonfinite"],
                )
            )
            acc.update(times=[], s=0.0, ss=0.0, count=0, nonfinite=0)
            r = rows[-1]
            print(
                f"{r['chunks']:>8} {r['rss_mib']:>9.1f} {r['ms_median'] or float('nan'):>10.2f} "
                f"{r['mean']:>+10.4f} {r['std']:>8.4f} {r['nonfinite']:>9}",
                flush=True,
            )

    def save_at(index):
        if index != resume_at:
            return False
        S.save(session_dir, stream.session())  # a copy: the stream goes on
        return True

    print(
        f"soak: {n} chunks of the tiny model ({LATENT_HW[0]}x{LATENT_HW[1]} latents, "
        f"{rc.tokens_per_frame(config) * rc.chunk_frames} tokens/chunk, sink {rc.sink_frames} + window "
        f"{rc.window_frames} frames, {rc.steps} steps), jax {jax.__version__} on {jax.default_backend()}"
    )
    print(f"{'chunks':>8} {'rss_mib':>9} {'ms_median':>10} {'mean':>10} {'std':>8} {'nonfinite':>9}")
    wall = time.perf_counter()
    stream = Stream(params, config, rc, context, num_chunks=n, key=key)
    with count_compiles(R.stream_step) as compiles:
        _drive(stream, n, on_chunk, save_at)
    run_s = time.perf_counter() - wall
    step_compiles = compiles()

    # the resume leg: load the chunk-`resume_at` session from disk, continue to the end, compare every chunk
    mismatches, checked = [], 0
    loaded = S.load(session_dir, config, rc)

    def check(i, x, m, seconds):
        nonlocal checked
        checked += 1
        if hashlib.sha256(x.tobytes()).hexdigest() != digests[resume_at + i]:
            mismatches.append(resume_at + i)

    resumed = Stream.from_session(params, config, rc, loaded, num_chunks=n - resume_at)
    with count_compiles(R.stream_step) as resume_compiles:
        _drive(resumed, n - resume_at, check)

    steady = [r for r in rows[1:] if r["ms_median"] is not None]  # the first row holds the warm-up
    rss = [r["rss_mib"] for r in rows]
    ms = [r["ms_median"] for r in steady]
    verdict = dict(
        chunks=n,
        step_compilations=step_compiles,
        resume_compilations=resume_compiles(),
        nonfinite=sum(r["nonfinite"] for r in rows),
        rss_first_row_mib=rss[0],
        rss_last_row_mib=rss[-1],
        rss_growth_after_first_row_mib=round(rss[-1] - rss[1], 1) if len(rss) > 1 else 0.0,
        rss_max_mib=max(rss),
        ms_median_steady_first=ms[0] if ms else None,
        ms_median_steady_last=ms[-1] if ms else None,
        ms_median_steady_max_over_min=round(max(ms) / min(ms), 3) if ms else None,
        latent_mean_range=[min(r["mean"] for r in rows), max(r["mean"] for r in rows)],
        latent_std_range=[min(r["std"] for r in rows), max(r["std"] for r in rows)],
        resume_at=resume_at,
        resume_chunks_checked=checked,
        resume_mismatches=mismatches[:10],
        resume_equal=checked == n - resume_at and not mismatches,
        first_chunk_s=first_chunk_s,
        run_s=round(run_s, 1),
    )
    print()
    for k, v in verdict.items():
        print(f"{k:32} {v}")
    ok = (
        step_compiles == 1
        and verdict["resume_compilations"] == 0
        and verdict["nonfinite"] == 0
        and verdict["resume_equal"]
    )
    print(
        f"{'verdict':32} {'PASS' if ok else 'FAIL'} (compilations, finiteness, resume equality; RSS and time "
        f"flatness are read from the table)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    verdict=verdict,
                    passed=ok,
                    jax=jax.__version__,
                    backend=jax.default_backend(),
                    machine=platform.machine(),
                    cpus=os.cpu_count(),
                    argv=sys.argv[1:],
                ),
                f,
                indent=2,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
