"""``jaxkv generate``: stream video latents chunk by chunk with causal Wan 2.1 on a ring cache.

With no arguments it runs the embedded default — the ``tiny`` preset with seeded random weights and a seeded
stand-in text context — so it works on a fresh machine with nothing downloaded. ``--checkpoint DIR`` uses a
converted checkpoint (`jaxkv convert`); ``--context FILE`` reads precomputed text embeddings (with
``--guidance-scale``, pass ``--negative-context FILE`` too); ``--param-dtype bfloat16`` holds the weights in bfloat16
(half the memory of float32; matmuls in bfloat16 with float32 accumulation).

Outputs in ``--out`` (default ``jaxkv_out``):
  latents.npy / latents.safetensors   float32 [batch, frames, latent_height, latent_width, channels]
  preview.png                          the latent frames side by side (rows: batch), see `latent_to_rgb`
  summary.json                         settings and timings

The preview is a fixed linear projection of the latent channels to RGB, not a VAE decode: channel c of C adds
``cos(2*pi*(c/C + j/3)) * sqrt(2/C)`` to colour j (R, G, B: three phase-shifted cosines over the channels, so each
colour has unit gain for unit-variance latents), and a colour value y becomes the byte ``clip(127.5 + 50*y, 0, 255)``.
Each latent pixel is drawn as a ``--preview-scale`` square block; frames run left to right, 12 to a row.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

DEFAULTS = dict(preset="tiny", height=16, width=16, chunk_frames=3, window_frames=9, sink_frames=3, num_chunks=8,
                steps="1000,750,500,250", shift=5.0, context_noise=0.0, seed=0, weights_seed=0, batch=1,
                policy="ring", cache_dtype="float32", param_dtype="float32", out="jaxkv_out", format="npy", preview_scale=4)


class UsageError(ValueError):
    """A bad command-line argument: reported as one line, exit code 2."""


# ------------------------------------------------------------------------------------------------ preview


def latent_to_rgb(latents: np.ndarray) -> np.ndarray:
    """Fixed linear latent-to-RGB projection (see the module docstring).

    Args:
      latents: [..., channels] float.
    Returns:
      uint8 [..., 3].
    """
    c = latents.shape[-1]
    phase = np.arange(c)[:, None] / c + np.arange(3)[None, :] / 3.0
    projection = np.cos(2.0 * np.pi * phase) * np.sqrt(2.0 / c)         # [channels, 3]
    rgb = np.asarray(latents, np.float64) @ projection
    return np.clip(np.round(127.5 + 50.0 * rgb), 0, 255).astype(np.uint8)


def preview_image(latents: np.ndarray, scale: int = 4, gap: int = 1, columns: int = 12) -> np.ndarray:
    """[batch, frames, h, w, channels] -> uint8 [rows, cols, 3]: frames left to right in rows of ``columns``, each
    video below the previous one, each latent pixel a ``scale`` x ``scale`` block, tiles ``gap`` black pixels
    apart."""
    b, f, h, w, _ = latents.shape
    tiles = np.repeat(np.repeat(latent_to_rgb(latents), scale, axis=2), scale, axis=3)   # [b, f, H, W, 3]
    th, tw = h * scale, w * scale
    cols = min(f, columns)
    rows_per_video = -(-f // cols)
    rows = b * rows_per_video
    image = np.zeros((rows * th + (rows - 1) * gap, cols * tw + (cols - 1) * gap, 3), np.uint8)
    for i in range(b):
        for j in range(f):
            r, c = i * rows_per_video + j // cols, j % cols
            image[r * (th + gap):r * (th + gap) + th, c * (tw + gap):c * (tw + gap) + tw] = tiles[i, j]
    return image


def write_png(path: str, image: np.ndarray) -> None:
    """Writes uint8 [height, width, 3] as an 8-bit RGB PNG (no filtering, zlib-compressed)."""
    image = np.ascontiguousarray(image, np.uint8)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"write_png expects uint8 [height, width, 3], got {list(image.shape)}")
    h, w, _ = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1)   # filter byte 0 per row
    png = (b"\x89PNG\r\n\x1a\n"
           + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
           + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


# ------------------------------------------------------------------------------------------------ inputs


def load_context(path: str, text_dim: int, text_len: int) -> np.ndarray:
    """Text embeddings [tokens, text_dim] (or [1, tokens, text_dim]) from .npy or .safetensors -> float32
    [tokens, text_dim]. A .safetensors file must hold one tensor, or one named ``context`` or ``prompt_embeds``."""
    if not os.path.isfile(path):
        raise UsageError(f"context file {path!r} does not exist")
    if path.endswith(".npy"):
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise UsageError(f"cannot read {path!r} as .npy ({e})") from None
    elif path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as e:
            raise UsageError(f"cannot read {path!r} as .safetensors ({e})") from None
        names = [n for n in ("context", "prompt_embeds") if n in tensors]
        if names:
            array = tensors[names[0]]
        elif len(tensors) == 1:
            array = next(iter(tensors.values()))
        else:
            raise UsageError(f"{path!r} holds {sorted(tensors)}; expected one tensor or one named 'context' or "
                             f"'prompt_embeds'")
    else:
        raise UsageError(f"context file {path!r} must end in .npy or .safetensors")
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[1] != text_dim:
        raise UsageError(f"context in {path!r} must be [tokens, text_dim={text_dim}], got {list(array.shape)}")
    if not 1 <= array.shape[0] <= text_len:
        raise UsageError(f"context in {path!r} has {array.shape[0]} tokens; the model takes 1..{text_len}")
    if not np.issubdtype(array.dtype, np.floating):
        raise UsageError(f"context in {path!r} must be floating point, got {array.dtype}")
    return array.astype(np.float32)


def standin_context(seed: int, text_dim: int, text_len: int) -> np.ndarray:
    """A seeded stand-in for text embeddings: min(8, text_len) tokens of N(0, 1) values [tokens, text_dim]."""
    return np.random.default_rng(seed).standard_normal((min(8, text_len), text_dim)).astype(np.float32)


def _parse_steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints like 1000,750,500,250, got {text!r}")
    if not steps:
        raise argparse.ArgumentTypeError("expected at least one denoising step")
    return steps


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="jaxkv generate",
        description="Stream video latents chunk by chunk with causal Wan 2.1 on a ring KV cache "
                    "(Self-Forcing sampler). With no arguments: the tiny preset with seeded random weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", metavar="DIR", help="converted jaxkv checkpoint directory (`jaxkv convert`), "
                   "loaded as --param-dtype; default: random weights of --preset")
    m.add_argument("--preset", default=d["preset"], help="preset for random weights when no --checkpoint")
    m.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=d["param_dtype"],
                   help="dtype the weights are held in (a checkpoint is cast to it on load). bfloat16 halves their "
                        "memory (a 14B checkpoint: ~28 GB instead of ~56 GB) and runs the matmuls in bfloat16 with "
                        "float32 accumulation; norms, modulation, RoPE and attention stay float32")
    m.add_argument("--weights-seed", type=int, default=d["weights_seed"], help="seed of the random weights")
    t = p.add_argument_group("text")
    t.add_argument("--context", metavar="FILE", help="text embeddings [tokens, text_dim] (.npy or .safetensors); "
                   "default: a seeded stand-in")
    t.add_argument("--negative-context", metavar="FILE", help="negative text embeddings for guidance; required with "
                   "--guidance-scale when --context is given (default with the stand-in context: zeros)")
    t.add_argument("--guidance-scale", type=float, help="classifier-free guidance scale (runs the negative context "
                   "as a second session; default: no guidance)")
    v = p.add_argument_group("video and cache (frames are latent frames)")
    v.add_argument("--height", type=_positive, default=d["height"], help="latent height")
    v.add_argument("--width", type=_positive, default=d["width"], help="latent width")
    v.add_argument("--chunk-frames", type=_positive, default=d["chunk_frames"], help="frames per chunk")
    v.add_argument("--window-frames", type=_positive, default=d["window_frames"],
                   help="rolling attention window, including the current chunk")
    v.add_argument("--sink-frames", type=_non_negative, default=d["sink_frames"], help="pinned first frames")
    v.add_argument("--num-chunks", type=_positive, default=d["num_chunks"], help="chunks to generate")
    v.add_argument("--batch", type=_positive, default=d["batch"], help="independent videos (sessions)")
    v.add_argument("--policy", choices=("ring", "rolling"), default=d["policy"], help="cache policy")
    v.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default=d["cache_dtype"])
    s = p.add_argument_group("sampler")
    s.add_argument("--steps", type=_parse_steps, default=_parse_steps(d["steps"]),
                   help="denoising steps on the 1000-step grid, comma-separated")
    s.add_argument("--shift", type=float, default=d["shift"], help="flow-matching shift")
    s.add_argument("--context-noise", type=float, default=d["context_noise"],
                   help="timestep of the pass that commits each chunk's K/V")
    s.add_argument("--seed", type=int, default=d["seed"], help="seed of the noise (and of the stand-in context)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=d["out"], metavar="DIR", help="output directory")
    o.add_argument("--format", choices=("npy", "safetensors"), default=d["format"], help="latents file format")
    o.add_argument("--preview-scale", type=_positive, default=d["preview_scale"], help="pixels per latent pixel")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ------------------------------------------------------------------------------------------------ run


def _load_model(args):
    import jax
    import jax.numpy as jnp

    from jaxkv.models import wan

    if args.checkpoint:
        from jaxkv.models.wan.checkpoint import CheckpointError, load

        try:
            config, params = load(args.checkpoint, dtype=jnp.dtype(args.param_dtype))
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if config.in_dim != config.out_dim:
            raise UsageError(f"checkpoint {args.checkpoint} predicts {config.out_dim} channels from {config.in_dim}; "
                             f"streaming generation needs in_dim == out_dim (a text-to-video model)")
        return config, params, f"checkpoint {args.checkpoint}"
    try:
        config = wan.preset(args.preset)
    except ValueError as e:
        raise UsageError(str(e)) from None
    params = jax.jit(wan.init_params, static_argnums=(0, 2))(config, jax.random.key(args.weights_seed),
                                                             jnp.dtype(args.param_dtype))
    return config, params, f"preset {args.preset!r} with random weights (seed {args.weights_seed})"


def run(args) -> dict:
    """Runs a rollout for parsed arguments; returns the summary dict. Raises UsageError for bad settings."""
    import jax
    import jax.numpy as jnp

    from jaxkv import rollout as R
    from jaxkv.schedule import Schedule

    if args.guidance_scale is None and args.negative_context:
        raise UsageError("--negative-context needs --guidance-scale")
    if args.guidance_scale is not None and args.context and not args.negative_context:
        raise UsageError("--guidance-scale with --context needs --negative-context FILE (the negative prompt's "
                         "embeddings, e.g. of the empty prompt); only the stand-in context has a stand-in negative")
    config, params, source = _load_model(args)
    try:
        schedule = Schedule(steps=args.steps, shift=args.shift, context_noise=args.context_noise)
        rc = R.RolloutConfig(args.height, args.width, chunk_frames=args.chunk_frames,
                             window_frames=args.window_frames, sink_frames=args.sink_frames, schedule=schedule,
                             guidance_scale=args.guidance_scale, policy=args.policy, cache_dtype=args.cache_dtype)
        tpf = rc.tokens_per_frame(config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.context:
        context = load_context(args.context, config.text_dim, config.text_len)
    else:
        context = standin_context(args.seed, config.text_dim, config.text_len)
    negative = None
    if args.guidance_scale is not None:
        if args.negative_context:
            negative = load_context(args.negative_context, config.text_dim, config.text_len)
        else:   # only with the stand-in context (checked above): an empty prompt's stand-in
            negative = np.zeros((1, config.text_dim), np.float32)
        negative = jnp.broadcast_to(negative, (args.batch, *negative.shape))
    context = jnp.broadcast_to(context, (args.batch, *context.shape))

    stream = R.Stream(params, config, rc, context, num_chunks=args.num_chunks, key=jax.random.key(args.seed),
                      negative_context=negative)
    compiles_before = R.stream_step._cache_size()
    chunks, latencies = [], []
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.num_chunks, unit="chunk", desc="generate", file=sys.stderr)
    start = time.perf_counter()
    for chunk in stream:
        chunk = np.asarray(chunk)           # waits for the device
        latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        chunks.append(chunk)
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"{latencies[-1] * 1e3:.0f} ms")
    if progress is not None:
        progress.close()
    latents = np.concatenate(chunks, axis=1)

    os.makedirs(args.out, exist_ok=True)
    if args.format == "npy":
        latents_path = os.path.join(args.out, "latents.npy")
        np.save(latents_path, latents)
    else:
        from safetensors.numpy import save_file

        latents_path = os.path.join(args.out, "latents.safetensors")
        save_file({"latents": np.ascontiguousarray(latents)}, latents_path)
    preview_path = os.path.join(args.out, "preview.png")
    write_png(preview_path, preview_image(latents, args.preview_scale))

    steady = latencies[1:]
    summary = {
        "model": source,
        "param_dtype": args.param_dtype,
        "config": config.to_dict(),
        "latents": latents_path,
        "latents_shape": list(latents.shape),
        "preview": preview_path,
        "tokens_per_frame": tpf,
        "chunk_frames": rc.chunk_frames, "window_frames": rc.window_frames, "sink_frames": rc.sink_frames,
        "num_chunks": args.num_chunks, "policy": rc.policy, "steps": list(schedule.steps),
        "timesteps": [round(float(t), 3) for t in schedule.timesteps()],
        "guidance_scale": args.guidance_scale,
        "first_chunk_s": latencies[0],
        "chunk_latency_ms_median": float(np.median(steady) * 1e3) if steady else None,
        "chunk_latency_ms_mean": float(np.mean(steady) * 1e3) if steady else None,
        "compile_s_estimate": float(latencies[0] - (np.median(steady) if steady else 0.0)),
        "compilations": R.stream_step._cache_size() - compiles_before,
        "cache_bytes": int(stream.state.cache.nbytes),
        "cache_sessions": int(stream.state.cache.batch),
        "backend": jax.default_backend(),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _print_summary(s: dict) -> None:
    mib = s["cache_bytes"] / 2 ** 20
    lat = (f"{s['chunk_latency_ms_median']:.1f} ms median, {s['chunk_latency_ms_mean']:.1f} ms mean"
           if s["chunk_latency_ms_median"] is not None else "n/a (one chunk)")
    print(f"model        {s['model']}")
    print(f"video        {s['latents_shape'][1]} latent frames of {s['latents_shape'][2]}x{s['latents_shape'][3]} "
          f"({s['tokens_per_frame']} tokens/frame), batch {s['latents_shape'][0]}")
    print(f"cache        {s['policy']}: sink {s['sink_frames']} + window {s['window_frames']} frames, chunks of "
          f"{s['chunk_frames']}; {mib:.2f} MiB for {s['cache_sessions']} session(s)")
    print(f"sampler      steps {s['steps']} -> timesteps {s['timesteps']}"
          + (f", guidance {s['guidance_scale']}" if s["guidance_scale"] is not None else ""))
    print(f"compile      {s['compile_s_estimate']:.2f} s (first chunk {s['first_chunk_s']:.2f} s), "
          f"{s['compilations']} compilation(s) of the chunk step")
    print(f"per chunk    {lat} after compilation ({s['backend']})")
    print(f"wrote        {s['latents']}, {s['preview']}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:       # --help (0) or an argparse error (2, message already printed)
        return int(e.code or 0)
    try:
        summary = run(args)
    except UsageError as e:
        print(f"jaxkv generate: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"jaxkv generate: error: {e}", file=sys.stderr)
        return 1
    _print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
