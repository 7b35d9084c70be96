"""Wan 2.1 VAE decode: per-chunk time vs chunk length, feature-cache bytes, streaming vs whole-clip.

    PYTHONPATH=. python benchmarks/vae_decode.py                 # tiny + mid on this machine, f32
    PYTHONPATH=. python benchmarks/vae_decode.py --dtype bf16 --json out.json

For each config: steady-state `decode_chunk` time (a later chunk, the state donated) for chunks of 1 and 3 latent
frames, the compiled program's aliased (donated, updated in place) and temporary bytes, and the time of a 7-latent
clip decoded whole vs streamed as 1 + 3 + 3 — measured side by side in one process. The real size (480x832,
``wan2.1-vae``) is not run on CPU: its cache bytes come from the state's shapes and its FLOPs per latent frame from
XLA's cost analysis of the lowered program (nothing is compiled or allocated).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jaxkv.models.wan_vae import (
    WanVAEConfig,
    cache_bytes,
    decode,
    decode_chunk,
    init_decoder_state,
    init_params,
    preset,
)
from jaxkv.models.wan_vae.decoder import _param_structs

CONFIGS = {
    "tiny": (preset("tiny"), 4, 6),
    # The real architecture at a third of the width and a 64x96 video: big enough for convolutions to dominate.
    "mid": (WanVAEConfig(base_dim=32), 8, 12),
}


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def bench(name: str, config: WanVAEConfig, h: int, w: int, dtype, repeats: int) -> dict:
    params = init_params(0, config, dtype)
    z = jax.random.normal(jax.random.key(0), (1, 7, h, w, config.z_dim)).astype(dtype)
    row = {
        "config": name,
        "latent": f"{h}x{w}",
        "video": f"{8 * h}x{8 * w}",
        "dtype": jnp.dtype(dtype).name,
        "cache_bytes": cache_bytes(config, 1, h, w, dtype),
    }
    state = init_decoder_state(config, 1, h, w, dtype)
    stats = decode_chunk.lower(params, config, state, z[:, :3]).compile().memory_analysis()
    row["alias_bytes"], row["temp_bytes"] = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    for t in (1, 3):
        holder = {"state": init_decoder_state(config, 1, h, w, dtype)}
        _, holder["state"] = decode_chunk(params, config, holder["state"], z[:, :t])  # compile + first chunk

        def step(t=t):
            frames, holder["state"] = decode_chunk(params, config, holder["state"], z[:, :t])  # noqa: B023 - called in the iteration that defines it
            return frames

        step()
        row[f"chunk{t}_ms"] = 1e3 * _time(step, repeats)
        row[f"chunk{t}_ms_per_latent"] = row[f"chunk{t}_ms"] / t

    def whole():
        return decode(params, config, z)

    def streamed():
        state = init_decoder_state(config, 1, h, w, dtype)
        out = []
        for a, b in ((0, 1), (1, 4), (4, 7)):
            frames, state = decode_chunk(params, config, state, z[:, a:b])
            out.append(frames)
        return out

    whole(), streamed()
    row["whole7_ms"], row["stream_1_3_3_ms"] = 1e3 * _time(whole, repeats), 1e3 * _time(streamed, repeats)
    return row


def real_size(dtype) -> dict:
    config = preset("wan2.1-vae")
    params = _param_structs(config, dtype)
    state = jax.eval_shape(lambda: init_decoder_state(config, 1, 60, 104, dtype))
    z = jax.ShapeDtypeStruct((1, 3, 60, 104, 16), dtype)
    flops = decode_chunk.lower(params, config, state, z).cost_analysis()["flops"] / 3
    return {
        "config": "wan2.1-vae",
        "latent": "60x104",
        "video": "480x832",
        "dtype": jnp.dtype(dtype).name,
        "cache_bytes": cache_bytes(config, 1, 60, 104, dtype),
        "tflop_per_latent_frame": flops / 1e12,
        "caches": len(state.caches),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="weights, activations and caches (norms and softmax stay f32)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    rows = [bench(n, *CONFIGS[n], dtype, args.repeats) for n in args.configs]
    real = real_size(jnp.bfloat16)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.dtype}; best of {args.repeats}")
    print(
        f"{'config':8} {'video':>8} {'cache MiB':>10} {'alias MiB':>10} {'temp MiB':>9} {'1-frame ms':>11} "
        f"{'3-frame ms':>11} {'ms/latent (3)':>14} {'whole 7 ms':>11} {'1+3+3 ms':>9}"
    )
    for r in rows:
        print(
            f"{r['config']:8} {r['video']:>8} {r['cache_bytes'] / 2**20:10.2f} {r['alias_bytes'] / 2**20:10.2f} "
            f"{r['temp_bytes'] / 2**20:9.2f} {r['chunk1_ms']:11.1f} {r['chunk3_ms']:11.1f} "
            f"{r['chunk3_ms_per_latent']:14.1f} {r['whole7_ms']:11.1f} {r['stream_1_3_3_ms']:9.1f}"
        )
    print(
        f"wan2.1-vae at 480x832 (bf16, from shapes): {real['caches']} caches, "
        f"{real['cache_bytes'] / 2**30:.2f} GiB per stream, {real['tflop_per_latent_frame']:.2f} TFLOP per latent "
        f"frame"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "real_size": real, "jax": jax.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
