"""Memory and per-chunk time of a dilated cache against the dense window of the same horizon, on a Wan model.

For a horizon of H frames, the dense policy is a `RingCache` window of H frames; the dilated policy a
`DilatedCache` keeping every ``dilation``-th frame in ``H / dilation`` buckets (plus a one-chunk scratch), which
reaches the same H frames back. Every layer of the model uses the policy under test (a mixed model would sit
between the two rows). A chunk is what the rollout does per chunk: reserve it, then 5 forwards of
`jaxkv.models.wan.forward_chunk` (4 denoising passes and the context pass), jitted with the cache donated. Both
caches are first filled until they wrap, then timed chunks alternate (dense, dilated, dense, ...) in this one
process; the table shows medians. "frames seen" is what a chunk's queries attend to once the cache is full.

Model: 4 layers, dim 256, 4 heads of 64 (``medium`` of benchmarks/rollout.py); 16x16 latent frames (64 tokens),
3-frame chunks, float32.

    python benchmarks/retention.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.cache.dilated import DilatedCache, DilatedSpec
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig

CONFIG = WanConfig(dim=256, ffn_dim=512, num_heads=4, num_layers=4, text_dim=64, text_len=16, freq_dim=64)
LATENT_HW, CHUNK_FRAMES, PASSES = (16, 16), 3, 5


def _chunk(params, cross, cache, latents, t):
    cache = cache.begin_chunk()
    out = None
    for _ in range(PASSES):
        out, cache = wan.forward_chunk(params, CONFIG, cache, cross, latents, t, backend="xla")
    return out, cache


_chunk_jit = jax.jit(_chunk, donate_argnums=2)


def _frames_seen(cache, tokens_per_frame):
    pos = np.asarray(cache.positions[0])
    return len(set((pos[pos >= 0] // tokens_per_frame).tolist()))


def run(horizons, dilation, repeats):
    params = wan.init_params(CONFIG, jax.random.key(0))
    context = jax.random.normal(jax.random.key(1), (1, CONFIG.text_len, CONFIG.text_dim))
    cross = wan.cross_kv(params, CONFIG, context)
    t_frame = CONFIG.tokens_per_frame(*LATENT_HW)
    latents = jax.random.normal(jax.random.key(2), (1, CHUNK_FRAMES, *LATENT_HW, CONFIG.in_dim))
    t = jnp.full((1,), 500.0, jnp.float32)
    rows = []
    for horizon in horizons:
        dense = wan.init_cache(CONFIG, jaxkv.RingSpec.from_frames(t_frame, CHUNK_FRAMES, horizon), 1)
        dilated = DilatedCache.init(DilatedSpec(t_frame, CHUNK_FRAMES, dilation, horizon // dilation), 1,
                                    CONFIG.num_heads, CONFIG.head_dim, layers=CONFIG.num_layers)
        caches = {"dense": dense, "dilated": dilated}
        nbytes = {name: c.nbytes for name, c in caches.items()}
        fill = horizon // CHUNK_FRAMES + 2  # past the first wrap
        for _ in range(fill):
            for name in caches:
                _, caches[name] = _chunk_jit(params, cross, caches[name], latents, t)
        before = compile_count(_chunk_jit)
        times = {name: [] for name in caches}
        for _ in range(repeats):
            for name in caches:
                start = time.perf_counter()
                out, caches[name] = _chunk_jit(params, cross, caches[name], latents, t)
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
        rows.append(dict(
            horizon_frames=horizon, dilation=dilation, buckets=horizon // dilation,
            dense_mib=nbytes["dense"] / 2**20, dilated_mib=nbytes["dilated"] / 2**20,
            dense_ms=ms["dense"], dilated_ms=ms["dilated"],
            dense_frames_seen=_frames_seen(caches["dense"], t_frame),
            dilated_frames_seen=_frames_seen(caches["dilated"], t_frame),
            compiles_while_timed=compile_count(_chunk_jit) - before,
        ))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two horizons, 3 timed chunks each")
    parser.add_argument("--dilation", type=int, default=3)
    parser.add_argument("--json", help="write the rows and the machine description here")
    args = parser.parse_args(argv)
    horizons = (24, 48) if args.quick else (24, 48, 96)
    rows = run(horizons, args.dilation, 3 if args.quick else 7)
    print("| horizon frames | dilation x buckets | dense MiB | dilated MiB | memory dense / dilated | dense ms / chunk "
          "| dilated ms / chunk | time dense / dilated | frames seen dense / dilated | compiles while timed |")
    print("| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |")
    for r in rows:
        print(f"| {r['horizon_frames']} | {r['dilation']} x {r['buckets']} | {r['dense_mib']:.1f} | "
              f"{r['dilated_mib']:.1f} | {r['dense_mib'] / r['dilated_mib']:.2f} | {r['dense_ms']:.1f} | "
              f"{r['dilated_ms']:.1f} | {r['dense_ms'] / r['dilated_ms']:.2f} | "
              f"{r['dense_frames_seen']} / {r['dilated_frames_seen']} | {r['compiles_while_timed']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, jax=jax.__version__, backend=jax.default_backend(), machine=platform.machine(),
                           python=sys.version.split()[0]), f, indent=2)


if __name__ == "__main__":
    main()
