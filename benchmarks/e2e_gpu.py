"""Prompt -> mp4 end to end with full-size random weights: umT5-XXL encoder, Wan 2.1 1.3B DiT and the Wan VAE, all
in bfloat16, 480x832 (60x104 latents), 3-frame chunks, sink 3 + window 18 frames, 4 steps; JSON out. Sized for
< 6 minutes on one H200. Each part runs in a fresh subprocess (its own device memory and peak; a part that fails or
times out is recorded and the others still run):

1. ``offload``: the text encoder encodes the prompt and is released (`TextEncoder.release`) before the stream
   starts. Measured: the encode, the DiT's compile (first chunk), the VAE's compile (`Mp4Sink.warm_up`); then a
   fresh stream: time to the first decoded frame on the host; steady chunks as ``jaxkv generate`` runs them (chunk
   k+1 dispatched before chunk k is fetched, decoded by `Mp4Sink` and written to an mp4 by `jaxkv.video`):
   frames/s end to end until the mp4 is closed, and denoise-only frames/s from the chunks' device time
   (`jaxkv.generate.report.DeviceClock`); then the same stream's chunks alone (each waited for) and the VAE decode of
   a chunk alone (``decode_ms``, TFLOP/s from the compiled decode's cost analysis). ``overlap`` is the share of the
   decode hidden behind denoising: ``(denoise_ms + decode_ms - e2e_ms) / decode_ms`` per chunk.
2. ``keep``: the same path with the text encoder kept on the device (fewer chunks; the compiled programs come from
   a compilation cache the first part fills): its memory figures.

Device memory: ``peak_bytes`` is the process's ``memory_stats()["peak_bytes_in_use"]`` (None where the backend has
no such statistic, e.g. CPU), so it includes the encode; ``live_bytes_*`` are the bytes of live jax arrays at
points of the run (every backend).

    python benchmarks/e2e_gpu.py [--json PATH]
    python benchmarks/e2e_gpu.py --dry-run [--json PATH]   # the same code at tiny presets on CPU, in a minute or two
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

# The issue's figure for the Wan VAE decode at 480x832, used only when XLA gives no cost analysis.
ASSUMED_TFLOP_PER_LATENT_FRAME = 13.5
PARTS = ("offload", "keep")
PART_TIMEOUT = {"offload": 240, "keep": 120}  # seconds on the GPU; the dry run allows 3x
FULL = dict(
    umt5="umt5-xxl",
    wan="wan2.1-t2v-1.3b",
    vae="wan2.1-vae",
    latent=(60, 104),
    window=18,
    sink=3,
    chunks={"offload": 10, "keep": 3},
    alone=4,
)
DRY = dict(
    umt5="tiny", wan="tiny", vae="tiny", latent=(8, 8), window=6, sink=3, chunks={"offload": 5, "keep": 2}, alone=3
)
CHUNK_FRAMES, STEPS, FPS = 3, 4, 16
PROMPT = "a red fox running through fresh snow at dawn, cinematic lighting"


@functools.partial(jax.jit, static_argnums=(1, 2))
def _leaf(key, shape, dtype, scale, offset):
    """``offset + scale * N(0, 1)`` drawn directly in ``dtype`` (no float32 copy of the leaf)."""
    return (offset.astype(dtype) + scale.astype(dtype) * jax.random.normal(key, shape, dtype)).astype(dtype)


def device_params(flat_shapes: dict, unflatten, seed: int, dtype) -> dict:
    """Random params of a flat {name: shape} table made leaf by leaf on the device in ``dtype``: peak memory is the
    params plus one leaf, and nothing passes through the host. Kernels ~ N(0, 1/fan_in) (the last axis is the
    output; a stacked ``blocks.`` leaf's first axis is its layers), norm scales ~ 1 + N(0, 0.1^2), the embedding ~
    N(0, 1), the rest ~ N(0, 0.1^2)."""
    keys = jax.random.split(jax.random.key(seed), len(flat_shapes))
    out = {}
    for k, (name, shape) in zip(keys, sorted(flat_shapes.items())):
        shape = tuple(int(d) for d in shape)
        if name.endswith("kernel"):
            fan = shape[1:-1] if name.startswith("blocks.") and len(shape) > 2 else shape[:-1]
            scale, offset = float(np.prod(fan)) ** -0.5, 0.0
        elif name.endswith("scale"):
            scale, offset = 0.1, 1.0
        elif name == "embedding":
            scale, offset = 1.0, 0.0
        else:
            scale, offset = 0.1, 0.0
        out[name] = _leaf(k, shape, jnp.dtype(dtype), jnp.float32(scale), jnp.float32(offset))
    return unflatten(out)


def live_bytes() -> int:
    return int(sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted()))


def device_memory() -> dict:
    """``memory_stats()`` of the first device: peak and current bytes in use, None where there are none (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes": stats.get("peak_bytes_in_use"), "bytes_in_use": stats.get("bytes_in_use")}


def tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


class FirstFrames:
    """Wraps a `StreamDecoder` (same interface) and keeps the frames of its last call, so the caller can wait for
    the first decoded frame."""

    def __init__(self, decoder):
        self.decoder, self.last = decoder, None

    def __call__(self, latents):
        self.last = self.decoder(latents)
        return self.last

    def reset(self):
        self.decoder.reset()

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def decode_flops(params, vae_config, state, chunk_shape, dtype) -> tuple[float | None, str]:
    """FLOPs of one chunk's `decode_chunk` from XLA's cost analysis of the compiled program, with its source; the
    assumed figure when XLA gives none."""
    from jaxkv.models.wan_vae import decode_chunk

    z = jax.ShapeDtypeStruct(chunk_shape, dtype)
    try:
        cost = decode_chunk.lower(params, vae_config, state, z).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost["flops"]) if cost and cost.get("flops", 0) > 0 else None
    except Exception:  # noqa: BLE001 - any failure falls back to the stated assumption
        flops = None
    if flops is not None:
        return flops, "cost_analysis"
    return ASSUMED_TFLOP_PER_LATENT_FRAME * 1e12 * chunk_shape[1], "assumed 13.5 TFLOP per latent frame"


def pipeline(s: dict, offload: bool, out_dir: str) -> dict:
    """One part: prompt -> mp4 with the figures of the module docstring."""
    from jaxkv import rollout as R
    from jaxkv.generate.report import DeviceClock
    from jaxkv.generate.video import Mp4Sink
    from jaxkv.models import umt5, wan_vae
    from jaxkv.models.param_tree import unflatten
    from jaxkv.models.umt5.params import flat_param_shapes as umt5_shapes
    from jaxkv.models.umt5.tokenizer import tiny_tokenizer
    from jaxkv.models.wan import model as M
    from jaxkv.models.wan import preset as wan_preset
    from jaxkv.models.wan_vae import StreamDecoder
    from jaxkv.models.wan_vae.params import flat_param_shapes as vae_shapes
    from jaxkv.precision import Precision
    from jaxkv.stream import Stream

    bf16 = jnp.bfloat16
    n_chunks = s["chunks"]["offload" if offload else "keep"]
    r = {"offload_text_encoder": offload, "chunks": n_chunks}
    # 1. text: umT5 encoder (random weights; the tiny tokenizer, whose ids are valid for any umT5 vocabulary)
    t0 = time.perf_counter()
    tconfig = umt5.preset(s["umt5"])
    tparams = device_params(umt5_shapes(tconfig), unflatten, 0, bf16)
    jax.block_until_ready(tparams)
    r["text_encoder_init_s"] = time.perf_counter() - t0
    r["text_encoder_bytes"] = tree_bytes(tparams)
    encoder = umt5.TextEncoder(tconfig, tparams, tiny_tokenizer(), fingerprint="random", name=f"random {s['umt5']}")
    del tparams
    t0 = time.perf_counter()
    context = encoder.encode([PROMPT])
    r["encode_s"] = time.perf_counter() - t0  # compile + encode
    r["live_bytes_after_encode"] = live_bytes()
    if offload:
        encoder.release()
    r["live_bytes_after_release"] = live_bytes()
    # 2. DiT and VAE
    config = wan_preset(s["wan"])
    if config.text_dim != tconfig.dim:
        raise ValueError(f"{s['wan']} takes text_dim {config.text_dim}, {s['umt5']} gives {tconfig.dim}")
    context = jnp.asarray(context[:, : config.text_len], bf16)
    t0 = time.perf_counter()
    params = M.init_params(config, jax.random.key(1), dtype=bf16)
    vconfig = wan_vae.preset(s["vae"])
    vparams = device_params(vae_shapes(vconfig), unflatten, 2, bf16)
    jax.block_until_ready((params, vparams))
    r["dit_vae_init_s"] = time.perf_counter() - t0
    r["dit_bytes"], r["vae_bytes"] = tree_bytes(params), tree_bytes(vparams)
    h, w = s["latent"]
    rc = R.RolloutConfig(
        h,
        w,
        chunk_frames=CHUNK_FRAMES,
        window_frames=s["window"],
        sink_frames=s["sink"],
        precision=Precision.bf16(),
    )
    chunk_shape = rc.chunk_shape(config, 1)
    r["steps"] = list(rc.schedule.steps)
    if len(rc.schedule.steps) != STEPS:
        raise ValueError(f"the default schedule has {rc.schedule.steps}, not {STEPS} steps")
    total = 1 + n_chunks + s["alone"]

    def new_stream():
        return Stream(params, config, rc, context, num_chunks=total, key=jax.random.key(3))

    # compile: the first chunk of a throw-away stream, and the VAE's warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(next(new_stream()))
    r["compile_s"] = time.perf_counter() - t0  # the DiT chunk's compile + its first run
    decoder = FirstFrames(StreamDecoder(vparams, vconfig, latent_height=h, latent_width=w, batch=1))
    sink = Mp4Sink(out_dir, decoder, batch=1, fps=FPS)
    r["vae_compile_s"] = sink.warm_up(chunk_shape)
    stream = new_stream()
    r["cache_bytes"] = int(stream.state.cache.nbytes)
    r["live_bytes_stream_start"] = live_bytes()
    # 3. end to end: as `jaxkv generate` runs the chunks
    clock = DeviceClock()
    latencies, denoise_s = [], 0.0
    try:
        start = t_first = time.perf_counter()
        x = next(stream)
        pending = (x, clock.watch(x))
        steady_start = None
        for index in range(n_chunks):
            x, watched = pending
            if index + 1 < n_chunks:
                nxt = next(stream)
                pending = (nxt, clock.watch(nxt))
            host = np.asarray(jax.device_get(x), np.float32)
            device_s = clock.device_time(watched)
            sink.write_chunk(index, host)
            if index == 0:
                np.asarray(decoder.last[:, :1])  # the first decoded frame on the host
                r["first_frame_s"] = time.perf_counter() - t_first
                steady_start = time.perf_counter()
            else:
                denoise_s += device_s
            now = time.perf_counter()
            latencies.append(now - start)
            start = now
        summary = sink.close()
    finally:
        clock.close()
    e2e_s = sink.closed_at - steady_start
    steady = n_chunks - 1
    r["video_frames"] = summary["video_frames"]
    r["video"] = summary["video"]
    r["video_size"] = summary["video_size"]
    frames_per_chunk = 4 * CHUNK_FRAMES
    r["e2e_steady_s"] = e2e_s
    r["e2e_ms_per_chunk"] = 1e3 * e2e_s / steady if steady else None
    r["e2e_video_fps"] = steady * frames_per_chunk / e2e_s if steady else None
    r["e2e_latent_fps"] = steady * CHUNK_FRAMES / e2e_s if steady else None
    r["chunk_latency_ms"] = [1e3 * t for t in latencies]
    r["denoise_device_ms_per_chunk"] = 1e3 * denoise_s / steady if steady and denoise_s > 0 else None
    # 4. the parts alone: the stream's chunks, then the VAE decode of a chunk
    alone = []
    for _ in range(s["alone"]):
        t0 = time.perf_counter()
        x = jax.block_until_ready(next(stream))
        alone.append(time.perf_counter() - t0)
    r["denoise_ms_per_chunk"] = 1e3 * float(np.median(alone))
    r["denoise_video_fps"] = frames_per_chunk / (r["denoise_ms_per_chunk"] / 1e3)
    r["denoise_latent_fps"] = CHUNK_FRAMES / (r["denoise_ms_per_chunk"] / 1e3)
    vae = decoder.decoder
    vae.reset()
    jax.block_until_ready(vae(x))  # the stream's first (causal) chunk; time later ones
    dec = []
    for _ in range(s["alone"]):
        t0 = time.perf_counter()
        jax.block_until_ready(vae(x))
        dec.append(time.perf_counter() - t0)
    r["decode_ms_per_chunk"] = 1e3 * float(np.median(dec))
    flops, source = decode_flops(vparams, vconfig, vae.state, chunk_shape, bf16)
    r["decode_flops_per_chunk"], r["decode_flops_source"] = flops, source
    r["decode_tflop_per_latent_frame"] = flops / CHUNK_FRAMES / 1e12
    r["decode_tflops"] = flops / (r["decode_ms_per_chunk"] / 1e3) / 1e12
    # 5. overlap: how much of the decode hid behind the next chunk's denoising
    if r["e2e_ms_per_chunk"] is not None:
        parts = r["denoise_ms_per_chunk"] + r["decode_ms_per_chunk"]
        r["sum_of_parts_ms_per_chunk"] = parts
        r["overlap"] = (parts - r["e2e_ms_per_chunk"]) / r["decode_ms_per_chunk"]
        r["e2e_over_denoise"] = r["e2e_video_fps"] / r["denoise_video_fps"]
    r["live_bytes_end"] = live_bytes()
    r.update(device_memory())
    return r


def run_part(part: str, args) -> dict:
    s = DRY if args.dry_run else FULL
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    out = os.path.join(args.out_dir, part)
    os.makedirs(out, exist_ok=True)
    return pipeline(s, part == "offload", out)


def spawn_part(part: str, args, argv: list[str]) -> dict:
    """`run_part` in a fresh interpreter, bounded by `PART_TIMEOUT`; a failure or a timeout is returned as
    {"error": ...}, never raised."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "part.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--part", part, "--part-out", out]
        limit = PART_TIMEOUT[part] * (3 if args.dry_run else 1)
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


def _fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def _gib(v):
    return "n/a" if v is None else f"{v / 2**20:.1f}"


def print_table(result: dict) -> None:
    print(f"jax {result['jax']}, {result['backend']} ({result['device']}){', DRY RUN' if result['dry_run'] else ''}")
    for part, r in result["parts"].items():
        if "error" in r:
            print(f"{part:8} ERROR {r['error'][-500:]}")
            continue
        print(
            f"{part:8} compile {r['compile_s']:.1f} s (+ VAE {r['vae_compile_s']:.1f} s, encode {r['encode_s']:.1f} "
            f"s); first frame {r['first_frame_s'] * 1e3:.0f} ms; e2e {_fmt(r['e2e_video_fps'])} video fps "
            f"({_fmt(r['e2e_ms_per_chunk'], '.0f')} ms/chunk); denoise {r['denoise_video_fps']:.1f} fps "
            f"({r['denoise_ms_per_chunk']:.0f} ms/chunk, device clock {_fmt(r['denoise_device_ms_per_chunk'], '.0f')}"
            f" ms); overlap {_fmt(r.get('overlap'), '.2f')}"
        )
        print(
            f"{'':8} VAE decode {r['decode_ms_per_chunk']:.0f} ms/chunk, {r['decode_tflops']:.2f} TFLOP/s "
            f"({r['decode_tflop_per_latent_frame']:.3g} TFLOP/latent frame, {r['decode_flops_source']})"
        )
        print(
            f"{'':8} memory MiB: peak {_gib(r['peak_bytes'])}; live after encode {_gib(r['live_bytes_after_encode'])}"
            f", after release {_gib(r['live_bytes_after_release'])}, stream start "
            f"{_gib(r['live_bytes_stream_start'])}; text encoder {_gib(r['text_encoder_bytes'])}, DiT "
            f"{_gib(r['dit_bytes'])}, VAE {_gib(r['vae_bytes'])}, KV cache {_gib(r['cache_bytes'])}; "
            f"{r['video_frames']} frames in {r['video']}"
        )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on any backend (CPU), same code path")
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--out-dir", help="where the mp4s go (default: a temporary directory, removed)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    parser.add_argument("--compilation-cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        result = run_part(args.part, args)
        with open(args.part_out, "w") as f:
            json.dump(result, f)
        return 0
    parts = args.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        parser.error(f"--parts: unknown {bad}; known {list(PARTS)}")
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        print(f"no GPU (jax backend {jax.default_backend()!r}); run with --dry-run to exercise the code path")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or os.path.join(tmp, "out")
        child = ["--dry-run"] if args.dry_run else []
        child += ["--out-dir", out_dir, "--compilation-cache", os.path.join(tmp, "jit-cache")]
        result = {
            "dry_run": args.dry_run,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version(),
            "settings": {k: v for k, v in (DRY if args.dry_run else FULL).items()}
            | {"chunk_frames": CHUNK_FRAMES, "steps": STEPS, "fps": FPS, "dtype": "bfloat16"},
            "parts": {p: spawn_part(p, args, child) for p in parts},
        }
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
