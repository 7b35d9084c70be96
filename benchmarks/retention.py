"""Memory and per-chunk time of dilated and mixed retention against the dense window of the same horizon, on Wan.

For a horizon of H frames, three caches reach H frames back:
  * dense: every layer a `RingCache` window of H frames;
  * dilated: every layer a `DilatedCache` keeping every ``dilation``-th frame in ``H / dilation`` buckets (plus a
    one-chunk scratch);
  * mixed: a `MixedCache` (`RolloutConfig.dilated_every`): every ``--dilated-every``-th layer dilated as above, the
    others a dense local window of ``--local-frames`` frames.
A chunk is what the rollout does per chunk: reserve it, then 5 forwards of `jaxkv.models.wan.forward_chunk` (4
denoising passes and the context pass), jitted with the cache donated. Every cache is first filled until it wraps,
then timed chunks alternate between the policies in this one process; the table shows medians. "temp MiB" is the
compiled chunk program's ``memory_analysis().temp_size_in_bytes`` (a program that copied a cache stack would show
it here). "frames seen" is what a chunk's queries attend to once the cache is full (the mixed cache: its dilated
layers / its dense layers).

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
from jaxkv.cache import DilatedSpec, MixedSpec
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


def _frames_seen(positions, tokens_per_frame):
    pos = np.asarray(positions[0])
    return len(set((pos[pos >= 0] // tokens_per_frame).tolist()))


def _seen(name, cache, t_frame):
    if name == "mixed":
        return f"{_frames_seen(cache.dilated.positions, t_frame)}/{_frames_seen(cache.dense.positions, t_frame)}"
    return str(_frames_seen(cache.positions, t_frame))


def run(horizons, dilation, repeats, dilated_every=2, local_frames=6):
    params = wan.init_params(CONFIG, jax.random.key(0))
    context = jax.random.normal(jax.random.key(1), (1, CONFIG.text_len, CONFIG.text_dim))
    cross = wan.cross_kv(params, CONFIG, context)
    t_frame = CONFIG.tokens_per_frame(*LATENT_HW)
    latents = jax.random.normal(jax.random.key(2), (1, CHUNK_FRAMES, *LATENT_HW, CONFIG.in_dim))
    t = jnp.full((1,), 500.0, jnp.float32)
    rows = []
    for horizon in horizons:
        dilated_spec = DilatedSpec(t_frame, CHUNK_FRAMES, dilation, horizon // dilation)
        caches = {
            "dense": wan.init_cache(CONFIG, jaxkv.RingSpec.from_frames(t_frame, CHUNK_FRAMES, horizon), 1),
            "dilated": wan.init_cache(CONFIG, dilated_spec, 1, policy="dilated"),
            "mixed": wan.init_cache(
                CONFIG,
                MixedSpec(jaxkv.RingSpec.from_frames(t_frame, CHUNK_FRAMES, local_frames), dilated_spec, dilated_every),
                1,
            ),
        }
        nbytes = {name: c.nbytes for name, c in caches.items()}
        temp = {
            name: _chunk_jit.lower(params, cross, c, latents, t).compile().memory_analysis().temp_size_in_bytes
            for name, c in caches.items()
        }
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
        row = dict(
            horizon_frames=horizon,
            dilation=dilation,
            buckets=horizon // dilation,
            dilated_every=dilated_every,
            local_frames=local_frames,
            compiles_while_timed=compile_count(_chunk_jit) - before,
        )
        for name in caches:
            row[f"{name}_mib"] = nbytes[name] / 2**20
            row[f"{name}_temp_mib"] = temp[name] / 2**20
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            row[f"{name}_frames_seen"] = _seen(name, caches[name], t_frame)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two horizons, 3 timed chunks each")
    parser.add_argument("--dilation", type=int, default=3)
    parser.add_argument("--dilated-every", type=int, default=2, help="mixed: every K-th layer dilated")
    parser.add_argument("--local-frames", type=int, default=6, help="mixed: the dense layers' window in frames")
    parser.add_argument("--json", help="write the rows and the machine description here")
    args = parser.parse_args(argv)
    horizons = (24, 48) if args.quick else (24, 48, 96)
    rows = run(horizons, args.dilation, 3 if args.quick else 7, args.dilated_every, args.local_frames)
    names = ("dense", "dilated", "mixed")
    print(
        "| horizon frames | policy | cache MiB | temp MiB | ms / chunk | time / dense | frames seen | "
        "compiles while timed |"
    )
    print("| ---: | :--- | ---: | ---: | ---: | ---: | :---: | ---: |")
    for r in rows:
        for name in names:
            label = {
                "dense": f"dense window {r['horizon_frames']}",
                "dilated": f"dilated {r['dilation']} x {r['buckets']}",
                "mixed": f"mixed: 1 layer in {r['dilated_every']} dilated {r['dilation']} x {r['buckets']}, "
                f"others window {r['local_frames']}",
            }[name]
            print(
                f"| {r['horizon_frames']} | {label} | {r[name + '_mib']:.1f} | {r[name + '_temp_mib']:.1f} | "
                f"{r[name + '_ms']:.1f} | {r[name + '_ms'] / r['dense_ms']:.2f} | {r[name + '_frames_seen']} | "
                f"{r['compiles_while_timed']} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    jax=jax.__version__,
                    backend=jax.default_backend(),
                    machine=platform.machine(),
                    python=sys.version.split()[0],
                ),
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
