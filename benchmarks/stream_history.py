"""Per-chunk cost of a `Stream`'s latent history (the `LatentRing` a prompt switch re-caches from).

Two streams of the same model, weights, context and key run in this one process, one keeping its history (the
default) and one built with ``history=False``; after a warm-up that compiles the step and the push and fills the
window, timed chunks alternate between the two (with, without, without, with, ...: each goes first every other
round), each waited for. The table gives the median ms per chunk of each and their difference (the ring push:
`jaxkv.recache.push_chunk`, one small program dispatched after each step), and the push alone, timed on its own.

    python benchmarks/stream_history.py [--timed N] [--json PATH]

Model: the ``tiny`` preset; 16x16 latent frames, 3-frame chunks, window 9 frames, sink 3, float32.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax

from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.stream import Stream


def _timed_next(stream) -> float:
    start = time.perf_counter()
    jax.block_until_ready(next(stream))
    return (time.perf_counter() - start) * 1e3


def measure(timed: int, warm: int = 6) -> dict:
    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))
    context = jax.random.normal(jax.random.key(1), (1, config.text_len, config.text_dim))
    rc = R.RolloutConfig(latent_height=16, latent_width=16, chunk_frames=3, window_frames=9, sink_frames=3)
    streams = {h: Stream(params, config, rc, context, key=jax.random.key(2), history=h) for h in (True, False)}
    for s in streams.values():
        for _ in range(warm):  # compiles, fills and wraps the window
            jax.block_until_ready(next(s))
    steps = compile_count(R.stream_step)
    times = {True: [], False: []}
    for i in range(timed):
        for h in (True, False) if i % 2 == 0 else (False, True):  # each goes first every other round
            times[h].append(_timed_next(streams[h]))
    s = streams[True]
    x = jax.block_until_ready(next(s))
    cache = s.state.cache  # the state after that step (the step donated the one before)
    push = []
    for _ in range(timed):
        start = time.perf_counter()
        jax.block_until_ready(RC.push_chunk(s.ring, x, cache.chunk_start, cache.spec.chunk))
        push.append((time.perf_counter() - start) * 1e3)
    with_ms, without_ms = statistics.median(times[True]), statistics.median(times[False])
    return {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "timed_chunks": timed,
        "with_history_ms": round(with_ms, 3),
        "without_history_ms": round(without_ms, 3),
        "difference_ms": round(with_ms - without_ms, 3),
        "push_alone_ms": round(statistics.median(push), 3),
        "step_compiles_while_timed": compile_count(R.stream_step) - steps,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timed", type=int, default=30, help="timed chunks per stream (default 30)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    result = measure(args.timed)
    print(f"{'device':<28}{result['device']}")
    for name in ("with_history_ms", "without_history_ms", "difference_ms", "push_alone_ms"):
        print(f"{name:<28}{result[name]:.3f}")
    print(f"{'step compiles while timed':<28}{result['step_compiles_while_timed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
