"""umT5 encode time and memory vs prompt length and batch, on the tiny preset and a medium encoder.

For each (model, dtype, batch, padded length) the jitted `jaxkv.models.umt5.encode` (every prompt padded to the
length, half the rows half-masked, as real prompts are) is compiled once, run once to warm up, then timed as the
median of N waited-for calls. Memory is XLA's own accounting of the compiled program
(``compile().memory_analysis()``): the params, and the temporary buffers at peak ("temp"), which is what encoding
adds on top of the weights. A last section times `TextEncoder.encode` end to end on the tiny default (tokenize,
encode, zero the padding) against the same prompts served from the on-disk embeddings cache.

Models: ``tiny`` (the preset: dim 32, 2 layers) and ``medium`` (dim 512, ffn 1280, 8 heads of 64, 6 layers, vocab
32,000: ~1/250 of umT5-XXL's matmul FLOPs per token).

    python benchmarks/text_encoder.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.umt5 import TextEncoder, UMT5Config, encode_jit, init_params, preset

MODELS = {
    "tiny": preset("tiny"),
    "medium": UMT5Config(vocab_size=32000, dim=512, ffn_dim=1280, num_heads=8, head_dim=64, num_layers=6),
}
CASES = {  # (batch, padded length)
    "tiny": [(1, 16), (4, 16), (1, 128), (1, 512), (4, 512)],
    "medium": [(1, 128), (1, 512), (4, 512)],
}
QUICK = {"tiny": [(1, 16), (1, 512)], "medium": [(1, 128), (1, 512)]}
MIB = 1 << 20


def _inputs(config: UMT5Config, batch: int, length: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, config.vocab_size, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    mask[1::2, length // 2 :] = 0  # odd rows: half padding
    return jnp.asarray(ids), jnp.asarray(mask)


def measure(name: str, config: UMT5Config, dtype, batch: int, length: int, repeats: int) -> dict:
    params = init_params(config, 0, dtype)
    ids, mask = _inputs(config, batch, length)
    t0 = time.perf_counter()
    compiled = encode_jit.lower(params, config, ids, mask).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    jax.block_until_ready(encode_jit(params, config, ids, mask))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(encode_jit(params, config, ids, mask))
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    params_mib = sum(x.nbytes for x in jax.tree.leaves(params)) / MIB
    return {
        "model": name,
        "dtype": jnp.dtype(dtype).name,
        "batch": batch,
        "length": length,
        "ms": ms,
        "ms_per_prompt": ms / batch,
        "tokens_per_s": batch * length / (ms / 1e3),
        "compile_s": compile_s,
        "params_mib": params_mib,
        "temp_mib": (mem.temp_size_in_bytes if mem else float("nan")) / MIB,
        "output_mib": (mem.output_size_in_bytes if mem else float("nan")) / MIB,
    }


def end_to_end(repeats: int) -> dict:
    prompts = [f"a red fox {i}, at dawn" for i in range(4)]  # under the tiny text_len of 16 pieces
    with tempfile.TemporaryDirectory() as cache:
        enc = TextEncoder.tiny(cache_dir=cache)
        enc.encode([f"warm up {i}" for i in range(4)])  # compiles the batch-4 program
        t0 = time.perf_counter()
        first = enc.encode(prompts)
        fresh_ms = 1e3 * (time.perf_counter() - t0)
        hits = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            again = enc.encode(prompts)
            hits.append(time.perf_counter() - t0)
        assert np.array_equal(first, again)
    return {"prompts": len(prompts), "fresh_ms": fresh_ms, "cached_ms": 1e3 * statistics.median(hits)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cases per model, 3 repeats")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    cases = QUICK if args.quick else CASES
    rows = []
    for name, config in MODELS.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            for batch, length in cases[name]:
                rows.append(measure(name, config, dtype, batch, length, repeats))
                r = rows[-1]
                print(f"  {name} {r['dtype']} batch {batch} length {length}: {r['ms']:.1f} ms", file=sys.stderr)
    e2e = end_to_end(repeats)
    real = preset("umt5-xxl")
    print(
        f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus); median of {repeats}; umt5-xxl for scale: {real.num_params() / 1e9:.2f} B params, "
        f"{real.num_params() * 2 / 1e9:.1f} GB in bf16"
    )
    print()
    print("| model | dtype | batch | length | ms | ms / prompt | tokens / s | compile s | params MiB | temp MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['length']} | {r['ms']:.2f} | {r['ms_per_prompt']:.2f} "
            f"| {r['tokens_per_s']:.0f} | {r['compile_s']:.2f} | {r['params_mib']:.1f} | {r['temp_mib']:.1f} |"
        )
    print()
    print(
        f"TextEncoder.tiny().encode of {e2e['prompts']} prompts (text_len 16): {e2e['fresh_ms']:.1f} ms encoded, "
        f"{e2e['cached_ms']:.2f} ms from the embeddings cache"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "backend": jax.default_backend(),
                    "repeats": repeats,
                    "rows": rows,
                    "end_to_end": e2e,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
