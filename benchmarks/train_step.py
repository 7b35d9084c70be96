"""What `remat` (each DiT block under `jax.checkpoint`) does to the toy model's training steps: time, scratch memory
and the gradient, with and without it, side by side in one process.

Both training losses of `jaxkv toyworld train` are timed on one batch each (the recipe's sizes): teacher forcing
(stages 2-3: 8 clips of 9 frames, `losses.teacher_forcing_loss`) and self-forcing past the cache (stage 4: 4 clips,
the sink and one chunk committed, 4 chunks rolled out on the ring with the 4-step sampler,
`losses.self_forcing_loss` with the recipe's loss terms and weights). Each program is compiled first, then
the two variants of a loss run in turn ``--repeats`` times (so both see the same machine load); the table gives the
median seconds of a loss-and-gradient evaluation, the ratio, XLA's scratch (temp) bytes of each compiled program,
and the largest difference between the two gradients relative to the largest gradient entry (float rounding: the
recomputation may fuse differently).

    python benchmarks/train_step.py [--repeats 5] [--json PATH] [--release DIR]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed evaluations of each variant (>= 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument(
        "--release", metavar="DIR", help="toy-world release whose weights are differentiated (default: the shipped one)"
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        print("train_step.py: --repeats must be >= 1", file=sys.stderr)
        return 2

    from jaxkv.toyworld import clips as C
    from jaxkv.toyworld import losses as L
    from jaxkv.toyworld import model as toy_model
    from jaxkv.toyworld import text
    from jaxkv.toyworld import train as T

    directory = args.release or toy_model.RELEASE_DIR
    toy = toy_model.load(directory)
    settings, tc, lm = toy.settings, T.TrainConfig(), toy.latent_map
    tokenizer = text.tokenizer()
    params = {"dit": toy.params, "text": toy_model.load_text_params(directory)}
    key = jax.random.key(0)
    sf_frames = (C.context_chunks(settings) + tc.sf_chunks) * settings.chunk_frames
    tf_batch = C.batch(lm, tokenizer, settings, 0, 1, 0, tc.batch, tc.start_share, 0.0, settings.window_frames)
    sf_batch = C.batch(lm, tokenizer, settings, 0, 3, 0, tc.sf_batch, tc.start_share, 0.0, sf_frames)
    losses = {
        f"teacher forcing ({tc.batch} clips x {settings.sink_frames + settings.window_frames} frames)": lambda remat: (
            lambda prm: L.teacher_forcing_loss(
                prm, *tf_batch[:4], key, settings, tc.refine_pure_noise_share, remat, toy.config
            )
        ),
        f"self-forcing ({tc.sf_batch} clips, {tc.sf_chunks} chunks rolled out)": lambda remat: (
            lambda prm: L.self_forcing_loss(
                prm,
                *sf_batch[:4],
                key,
                settings,
                lm,
                tc.sf_colour_weight,
                remat,
                sf_batch.objects,
                tc.sf_outline_weight,
                toy.config,
            )
        ),
    }
    rows = []
    for name, make in losses.items():
        compiled, outs, times = {}, {}, {False: [], True: []}
        for remat in (False, True):
            compiled[remat] = jax.jit(jax.value_and_grad(make(remat))).lower(params).compile()
            outs[remat] = jax.block_until_ready(compiled[remat](params))
        for _ in range(args.repeats):
            for remat in (False, True):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[remat](params))
                times[remat].append(time.perf_counter() - t0)
        scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(outs[False][1]))
        diff = max(
            float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(outs[False][1]), jax.tree.leaves(outs[True][1]))
        )
        temp = {r: getattr(c.memory_analysis(), "temp_size_in_bytes", None) for r, c in compiled.items()}
        rows.append(
            {
                "loss": name,
                "seconds": statistics.median(times[False]),
                "seconds_remat": statistics.median(times[True]),
                "speedup": statistics.median(times[False]) / statistics.median(times[True]),
                "temp_bytes": temp[False],
                "temp_bytes_remat": temp[True],
                "loss_value": float(outs[False][0]),
                "loss_value_remat": float(outs[True][0]),
                "max_grad_difference_relative": diff / scale,
            }
        )

    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f}"
    print("| loss and gradient | s | s with remat | speed-up | scratch MiB | with remat | gradient difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['loss']} | {r['seconds']:.2f} | {r['seconds_remat']:.2f} | {r['speedup']:.2f}x | "
            f"{mib(r['temp_bytes'])} | {mib(r['temp_bytes_remat'])} | {r['max_grad_difference_relative']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "repeats": args.repeats,
                    "jax": jax.__version__,
                    "backend": jax.default_backend(),
                    "devices": [str(d) for d in jax.devices()],
                    "machine": platform.platform(),
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
