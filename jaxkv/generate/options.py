"""``jaxkv generate``'s command line: the argparse parser and every check that needs no model.

Everything a user can get wrong is checked here or in `resolve` before anything is compiled or written, and
reported as one `UsageError` line (exit code 2).
"""

from __future__ import annotations

import argparse

from jaxkv.cache import POLICIES as CACHE_POLICIES

POLICIES = tuple(sorted(CACHE_POLICIES))   # the cache layer's registry: name -> class
DTYPES = ("float32", "bfloat16")
FORMATS = ("npy", "safetensors")
FRAME_FORMATS = ("png", "npy")
# Seeds go to jax.random.key (a signed 64-bit int) and numpy.random.default_rng (non-negative).
SEED_MAX = 2 ** 63 - 1

DEFAULTS = dict(preset="tiny", height=16, width=16, chunk_frames=3, window_frames=9, sink_frames=3, num_chunks=8,
                steps="1000,750,500,250", shift=5.0, context_noise=0.0, seed=0, weights_seed=0, batch=1,
                policy="ring", cache_dtype="float32", param_dtype="float32", out="jaxkv_out", format="npy",
                preview_scale=4, preview_frames=12, fps=16)


class UsageError(ValueError):
    """A bad command-line argument or input file: reported as one line, exit code 2."""


def _parse_steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints like 1000,750,500,250, got {text!r}")
    if not steps:
        raise argparse.ArgumentTypeError("expected at least one denoising step")
    return steps


def _int_in(minimum: int, maximum: int | None = None):
    """argparse type: an int in [minimum, maximum]."""
    if maximum is not None:
        span = f"an int in [{minimum}, {maximum}]"
    else:
        span = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {span}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {span}, got {value}")
        return value

    parse.__name__ = "int"     # argparse names the type in its messages
    return parse


_positive = _int_in(1)
_non_negative = _int_in(0)
_seed = _int_in(0, SEED_MAX)


def _mesh(text: str) -> dict[str, int]:
    """argparse type of --mesh: 'data=2,model=4' -> {"data": 2, "model": 4}."""
    from jaxkv.parallel.mesh import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_mesh.__name__ = "mesh"


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="jaxkv generate",
        description="Stream video latents chunk by chunk with causal Wan 2.1 on a ring KV cache "
                    "(Self-Forcing sampler), writing each chunk to --out as it finishes. With no arguments: the "
                    "tiny preset with seeded random weights. Ctrl-C / SIGTERM stop after the current chunk.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", metavar="DIR", help="converted jaxkv checkpoint directory (`jaxkv convert`), "
                   "loaded as --param-dtype; default: random weights of --preset")
    m.add_argument("--preset", default=d["preset"], help="preset for random weights when no --checkpoint")
    m.add_argument("--param-dtype", choices=DTYPES, default=d["param_dtype"],
                   help="dtype the weights are held in (a checkpoint is cast to it on load). bfloat16 halves their "
                        "memory (a 14B checkpoint: ~28 GB instead of ~56 GB) and runs the matmuls in bfloat16 with "
                        "float32 accumulation; norms, modulation, RoPE and attention stay float32")
    m.add_argument("--mesh", type=_mesh, metavar="data=N,model=M",
                   help="run on a device mesh: N data groups (sessions; divides --batch) x M-way tensor parallelism "
                        "(heads and FFN; divides the model's heads). N*M must equal the device count. A checkpoint "
                        "is read straight into its shards. Default: one device")
    m.add_argument("--weights-seed", type=_seed, default=d["weights_seed"],
                   help=f"seed of the random weights, 0..{SEED_MAX}")
    t = p.add_argument_group("text")
    t.add_argument("--context", metavar="FILE", help="text embeddings [tokens, text_dim] (.npy or .safetensors); "
                   "default: a seeded stand-in")
    t.add_argument("--negative-context", metavar="FILE", help="negative text embeddings for guidance; required with "
                   "--guidance-scale when --context is given (default with the stand-in context: zeros)")
    t.add_argument("--guidance-scale", type=float, help="classifier-free guidance scale (runs the negative "
                   "context as a second session; default: no guidance)")
    t.add_argument("--prompt", metavar="TEXT", help="text prompt, encoded once by --text-encoder (default: the "
                   "embedded tiny random umT5, which only fits a model with its text_dim); not with --context")
    t.add_argument("--negative-prompt", metavar="TEXT", help="negative prompt for guidance (may be \"\"); "
                   "required with --guidance-scale and --prompt")
    t.add_argument("--text-encoder", metavar="DIR", help="converted jaxkv umT5 directory (converters.umt5)")
    t.add_argument("--offload-text-encoder", action="store_true", help="free the text encoder's device memory "
                   "after encoding, before the rollout")
    t.add_argument("--embeddings-cache", metavar="DIR", help="on-disk cache of prompt embeddings: a repeated "
                   "prompt is read, not encoded")
    v = p.add_argument_group("video and cache (frames are latent frames)")
    v.add_argument("--height", type=_positive, default=d["height"], help="latent height")
    v.add_argument("--width", type=_positive, default=d["width"], help="latent width")
    v.add_argument("--chunk-frames", type=_positive, default=d["chunk_frames"], help="frames per chunk")
    v.add_argument("--window-frames", type=_positive, default=d["window_frames"],
                   help="rolling attention window, including the current chunk")
    v.add_argument("--sink-frames", type=_non_negative, default=d["sink_frames"], help="pinned first frames")
    v.add_argument("--num-chunks", type=_positive, default=d["num_chunks"], help="chunks to generate")
    v.add_argument("--batch", type=_positive, default=d["batch"], help="independent videos (sessions)")
    v.add_argument("--policy", choices=POLICIES, default=d["policy"], help="cache policy")
    v.add_argument("--cache-dtype", choices=DTYPES, default=d["cache_dtype"])
    s = p.add_argument_group("sampler")
    s.add_argument("--steps", type=_parse_steps, default=_parse_steps(d["steps"]),
                   help="denoising steps on the 1000-step grid, comma-separated")
    s.add_argument("--shift", type=float, default=d["shift"], help="flow-matching shift")
    s.add_argument("--context-noise", type=float, default=d["context_noise"],
                   help="timestep of the pass that commits each chunk's K/V")
    s.add_argument("--seed", type=_seed, default=d["seed"],
                   help=f"seed of the noise (and of the stand-in context), 0..{SEED_MAX}")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=d["out"], metavar="DIR", help="output directory (created; an existing one must "
                   "be empty, or a previous jaxkv generate output with --overwrite)")
    o.add_argument("--overwrite", action="store_true", help="replace --out if it is a previous jaxkv generate "
                   "output (anything else is refused)")
    o.add_argument("--format", choices=FORMATS, default=d["format"], help="format of the per-chunk latents files")
    o.add_argument("--preview-scale", type=_int_in(1, 64), default=d["preview_scale"],
                   help="pixels per latent pixel in preview.png")
    o.add_argument("--preview-frames", type=_int_in(1, 1000), default=d["preview_frames"],
                   help="preview.png shows the first and the last this many frames of each video")
    o.add_argument("--vae", metavar="DIR", help="converted jaxkv Wan VAE directory: each chunk is decoded as it "
                   "arrives and appended to OUT/video.mp4 (default: a tiny random VAE, seeded)")
    o.add_argument("--fps", type=_int_in(1, 240), help=f"frames per second of the mp4 (default {d['fps']}, Wan's)")
    o.add_argument("--frames", choices=FRAME_FORMATS, help="also write the decoded frames: png = OUT/frames/"
                   "frame_VIDEO_NNNNNN.png per frame, npy = OUT/frames/chunk_NNNNNN.npy (uint8 [batch, n, H, W, 3]) "
                   "per chunk; one chunk of frames in host memory at a time, disk grows with the run")
    o.add_argument("--no-video", action="store_true", help="no mp4 (latents and preview only)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check(args: argparse.Namespace) -> None:
    """Checks the combinations argparse cannot (before any model is built). Raises UsageError."""
    if args.guidance_scale is None and args.negative_context:
        raise UsageError("--negative-context needs --guidance-scale")
    if args.guidance_scale is not None and args.context and not args.negative_context:
        raise UsageError("--guidance-scale with --context needs --negative-context FILE (the negative prompt's "
                         "embeddings, e.g. of the empty prompt); only the stand-in context has a stand-in negative")
    if args.prompt is not None and args.context:
        raise UsageError("--prompt and --context both give the text context; pass one")
    if args.prompt is None:
        for flag, value in (("--negative-prompt", args.negative_prompt), ("--text-encoder", args.text_encoder),
                            ("--embeddings-cache", args.embeddings_cache),
                            ("--offload-text-encoder", args.offload_text_encoder or None)):
            if value is not None:
                raise UsageError(f"{flag} needs --prompt")
    if args.negative_prompt is not None and args.negative_context:
        raise UsageError("--negative-prompt and --negative-context both give the negative context; pass one")
    if args.guidance_scale is None and args.negative_prompt is not None:
        raise UsageError("--negative-prompt needs --guidance-scale")
    if args.guidance_scale is not None and args.prompt is not None and args.negative_prompt is None \
            and not args.negative_context:
        raise UsageError("--guidance-scale with --prompt needs --negative-prompt TEXT (e.g. --negative-prompt \"\") "
                         "or --negative-context FILE")
    if args.no_video:
        for flag, value in (("--vae", args.vae), ("--fps", args.fps), ("--frames", args.frames)):
            if value is not None:
                raise UsageError(f"{flag} has no effect with --no-video")
    if args.checkpoint:
        for flag, name in (("--weights-seed", "weights_seed"), ("--preset", "preset")):
            if getattr(args, name) != DEFAULTS[name]:
                raise UsageError(f"{flag} chooses random weights; it has no effect with --checkpoint")
