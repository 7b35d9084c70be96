"""``jaxkv generate``'s command line: the argparse parser and every check that needs no model.

Everything a user can get wrong is checked here or in `resolve` before anything is compiled or written, and
reported as one `UsageError` line (exit code 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from jaxkv import defaults
from jaxkv.argparsing import Parser
from jaxkv.cache import WINDOW_POLICIES
from jaxkv.models.wan.model import ROPE_MODES  # "absolute", "cache-relative"
from jaxkv.precision import PRESETS as PRECISION_PRESETS
from jaxkv.validate import shorten, utf8_problem

POLICIES = WINDOW_POLICIES  # the cache layer's sink + window policies (dilated layers: --dilated-every)
PRECISIONS = tuple(PRECISION_PRESETS)  # jaxkv.precision presets: "float32", "bfloat16", "fp8"
# Flags --precision replaced (each set one dtype of what is now one policy): refused with the migration.
REPLACED_FLAGS = ("--param-dtype", "--cache-dtype")
REPLACED_DESTS = tuple(flag[2:].replace("-", "_") for flag in REPLACED_FLAGS)
SWITCH_SINK = ("keep", "recompute")
FORMATS = ("npy", "safetensors")
FRAME_FORMATS = ("png", "npy")
# Seeds go to jax.random.key (a signed 64-bit int) and numpy.random.default_rng (non-negative).
SEED_MAX = 2**63 - 1

# The flags' defaults: `jaxkv.defaults.GENERATE`, the one table (also `RolloutConfig`'s). They are those of
# --random-weights and of a Wan --checkpoint; a toy-world model's release settings replace them for every flag not
# given (`jaxkv.generate.settings` resolves the layers).
DEFAULTS = defaults.GENERATE
DEFAULT_NUM_CHUNKS = DEFAULTS["num_chunks"]


class UsageError(ValueError):
    """A bad command-line argument or input file: reported as one line, exit code 2."""


def parse_steps(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated denoising steps ("1000,750,500,250"), as --steps takes them."""
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints like 1000,750,500,250, got {text!r}") from None
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

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


_positive = _int_in(1)
_non_negative = _int_in(0)
_seed = _int_in(0, SEED_MAX)


def _mesh(text: str) -> dict[str, int]:
    """argparse type of --mesh: 'data=2,model=4' -> {"data": 2, "seq": 1, "model": 4}."""
    from jaxkv.parallel.mesh import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_mesh.__name__ = "mesh"


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = Parser(
        prog="jaxkv generate",
        description="Stream video chunk by chunk with causal Wan 2.1 on a ring KV cache (Self-Forcing sampler), "
        "writing each chunk to --out as it finishes. With no arguments: the toy world shipped in the "
        "package (a tiny causal Wan trained in this repository on coloured shapes bouncing in a box) "
        "streams its default prompt to OUT/video.mp4 and OUT/contact_sheet.png, with the chunk, window, "
        "sink, steps and shift it was trained for. Ctrl-C / SIGTERM stop after the current chunk.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="converted jaxkv checkpoint or release directory (`jaxkv "
        "convert`), or a toy-world release (`python -m jaxkv.toyworld train --out DIR`: its settings are "
        "the defaults of the video, cache and sampler flags, and its latent map decodes the mp4), loaded "
        "in --precision's weight dtype; default: the toy-world release shipped in the package",
    )
    m.add_argument(
        "--random-weights",
        action="store_true",
        help="seeded random weights of --preset instead of a "
        "trained model, with a seeded stand-in context and a tiny random VAE (pictures of noise: for "
        "tests and timing); not with --checkpoint",
    )
    m.add_argument("--preset", default=d["preset"], help="Wan preset of --random-weights (needs it)")
    m.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=d["precision"],
        help="dtype policy (jaxkv.precision.Precision): float32 everywhere; bfloat16 = Self-Forcing's "
        "inference: weights (a checkpoint is cast on load; a 14B one takes ~28 GB instead of ~56 GB), "
        "matmuls and their activations, KV cache and cross-attention K/V in bfloat16; accumulation, softmax, "
        "norm statistics, the residual stream, time embedding and head stay float32; fp8 = bfloat16 with an "
        "FP8 (e4m3) KV cache (half the bytes; ring policy only) and FP8 self-attention (cuDNN on a GPU, "
        "emulated on CPU)",
    )
    for flag in REPLACED_FLAGS:
        m.add_argument(flag, dest=flag[2:].replace("-", "_"), help=argparse.SUPPRESS)
    m.add_argument(
        "--mesh",
        type=_mesh,
        metavar="data=N,model=M,seq=S",
        help="run on a device mesh: N data groups (sessions; divides --batch) x M-way tensor parallelism "
        "(heads and FFN) x S-way Ulysses sequence parallelism (a chunk's tokens; divides them); M*S divides the "
        "model's heads. N*M*S must equal the device count. A checkpoint is read straight into its shards. "
        "Default: one device",
    )
    m.add_argument(
        "--weights-seed",
        type=_seed,
        default=d["weights_seed"],
        help=f"seed of --random-weights (needs it), 0..{SEED_MAX}",
    )
    t = p.add_argument_group("text")
    t.add_argument(
        "--context",
        metavar="FILE",
        help="text embeddings [tokens, text_dim] (.npy or .safetensors); default: a seeded stand-in",
    )
    t.add_argument(
        "--negative-context",
        metavar="FILE",
        help="negative text embeddings for guidance; required with "
        "--guidance-scale when --context is given (default with the stand-in context: zeros)",
    )
    t.add_argument(
        "--guidance-scale",
        type=float,
        help="classifier-free guidance scale (runs the negative context as a second session; default: no guidance)",
    )
    t.add_argument(
        "--prompt",
        metavar="TEXT",
        help="text prompt, encoded once by --text-encoder (default: a "
        "release's own encoder, else the embedded tiny random umT5, which only fits a model with its "
        "text_dim); not with --context. A toy-world model takes toy-world prompts (e.g. 'a red circle "
        "and a blue square, fast'; default: its release's prompt)",
    )
    t.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        help='negative prompt for guidance (may be ""); required with --guidance-scale and --prompt',
    )
    t.add_argument("--text-encoder", metavar="DIR", help="converted jaxkv umT5 directory (jaxkv.convert.umt5)")
    t.add_argument(
        "--offload-text-encoder",
        action="store_true",
        help="free the text encoder's device memory after encoding, before the rollout",
    )
    t.add_argument(
        "--embeddings-cache",
        metavar="DIR",
        help="on-disk cache of prompt embeddings: a repeated prompt is read, not encoded",
    )
    t.add_argument(
        "--prompt-schedule",
        metavar="FILE",
        help="JSON list switching prompts mid-stream, e.g. "
        '[{"chunk": 0, "prompt": "a cat"}, {"chunk": 8, "context": "dog.npy"}]: each entry gives the '
        "first chunk it drives and a prompt (encoded by --text-encoder) or a context file; later "
        "entries switch with KV re-cache (jaxkv.recache). Not with --prompt or --context. With --resume its "
        "chunks count the resumed run's",
    )
    t.add_argument(
        "--switch-sink",
        choices=SWITCH_SINK,
        default=argparse.SUPPRESS,
        help="at a prompt switch, "
        "keep the sink's K/V (default: keep; LongLive's global sink) or recompute them under the new "
        "prompt",
    )
    toy_note = (
        "the defaults shown are those of --random-weights and Wan checkpoints; a toy-world model's settings "
        "replace those of --height, --width, --chunk-frames, --window-frames, --sink-frames, --rope, --steps "
        "and --shift for each one not passed (the shipped toy world: 8x8, 3, 6, 3, cache-relative, "
        "1000,750,500,100, 3.0)"
    )
    v = p.add_argument_group("video and cache (frames are latent frames)", toy_note)
    v.add_argument("--height", type=_positive, default=d["height"], help="latent height")
    v.add_argument("--width", type=_positive, default=d["width"], help="latent width")
    v.add_argument("--chunk-frames", type=_positive, default=d["chunk_frames"], help="frames per chunk")
    v.add_argument(
        "--window-frames",
        type=_positive,
        default=d["window_frames"],
        help="rolling attention window, including the current chunk",
    )
    v.add_argument("--sink-frames", type=_non_negative, default=d["sink_frames"], help="pinned first frames")
    v.add_argument(
        "--num-chunks",
        type=_positive,
        default=d["num_chunks"],
        help="chunks to generate (the default is 37.5 s of toy-world video at 16 fps)",
    )
    v.add_argument("--batch", type=_positive, default=d["batch"], help="independent videos (sessions)")
    v.add_argument("--policy", choices=POLICIES, default=d["policy"], help="cache policy")
    v.add_argument(
        "--dilated-every",
        type=_non_negative,
        default=d["dilated_every"],
        metavar="K",
        help="make every K-th layer a dilated long-range layer (K=1: every layer; num_layers must be a "
        "multiple of K); 0: none. Needs --dilation and --buckets",
    )
    v.add_argument("--dilation", type=_positive, help="dilated layers keep every D-th frame")
    v.add_argument(
        "--buckets",
        type=_positive,
        help="frame slots of a dilated layer: it reaches dilation x buckets "
        "frames back for the memory of buckets frames (+ one chunk of scratch)",
    )
    v.add_argument(
        "--rope",
        choices=ROPE_MODES,
        default=d["rope"],
        help="absolute: keys rotated at their "
        "absolute frame (Self-Forcing); cache-relative: keys cached unrotated and rotated by their rank "
        "in the cache, so frame indices stay within the cache however long the stream (no int32 "
        "limit on --num-chunks)",
    )
    s = p.add_argument_group("sampler", toy_note)
    s.add_argument(
        "--steps",
        type=parse_steps,
        default=parse_steps(d["steps"]),
        help="denoising steps on the 1000-step grid, comma-separated",
    )
    s.add_argument("--shift", type=float, default=d["shift"], help="flow-matching shift")
    s.add_argument(
        "--context-noise",
        type=float,
        default=d["context_noise"],
        help="timestep of the pass that commits each chunk's K/V",
    )
    s.add_argument(
        "--seed", type=_seed, default=d["seed"], help=f"seed of the noise (and of the stand-in context), 0..{SEED_MAX}"
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default=d["out"],
        metavar="DIR",
        help="output directory (created; an existing one must "
        "be empty, or a previous jaxkv generate output with --overwrite)",
    )
    o.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out if it is a previous jaxkv generate output (anything else is refused)",
    )
    o.add_argument("--format", choices=FORMATS, default=d["format"], help="format of the per-chunk latents files")
    o.add_argument(
        "--preview-scale",
        type=_int_in(1, 64),
        default=d["preview_scale"],
        help="pixels per latent pixel in preview.png",
    )
    o.add_argument(
        "--preview-frames",
        type=_int_in(1, 1000),
        default=d["preview_frames"],
        help="preview.png shows the first and the last this many frames of each video",
    )
    o.add_argument(
        "--vae",
        metavar="DIR",
        help="converted jaxkv Wan VAE directory: each chunk is decoded as it "
        "arrives and appended to OUT/video.mp4 (default: a release's own VAE, else a tiny random VAE, "
        "seeded); not with a toy-world model, which decodes with its latent map. Any run with video also "
        "writes OUT/contact_sheet.png (evenly spaced decoded frames, the last included)",
    )
    o.add_argument("--fps", type=_int_in(1, 240), help=f"frames per second of the mp4 (default {d['fps']}, Wan's)")
    o.add_argument(
        "--frames",
        choices=FRAME_FORMATS,
        help="also write the decoded frames: png = OUT/frames/"
        "frame_VIDEO_NNNNNN.png per frame, npy = OUT/frames/chunk_NNNNNN.npy (uint8 [batch, n, H, W, 3]) "
        "per chunk; one chunk of frames in host memory at a time, disk grows with the run",
    )
    o.add_argument("--no-video", action="store_true", help="no mp4 and no contact sheet (latents and preview only)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("continuation (jaxkv.continuation)")
    g.add_argument(
        "--image",
        metavar="PATH",
        help="start from a picture (PNG, JPEG, ...): it is scaled to cover the stream's frame size and "
        "centre-cropped, repeated to one chunk, encoded (the toy world's latent map or the Wan VAE) and committed "
        "as the stream's first chunk, which the generated chunks continue (image-to-video)",
    )
    g.add_argument(
        "--video",
        metavar="PATH",
        help="continue a video (any file PyAV reads): its frames are mapped like --image's, the latest that make "
        "whole chunks kept (the first repeated in front when fewer than one chunk), encoded and committed as the "
        "stream's first chunks; --out gets the frames after them (video extension)",
    )
    r = p.add_argument_group("session (jaxkv.session)")
    r.add_argument(
        "--save-state",
        metavar="DIR",
        help="after the last chunk (or when stopped by a signal) save the "
        "stream's session to DIR, to continue it later with --resume DIR (an existing DIR is replaced "
        "only with --overwrite, and only if it is a jaxkv session)",
    )
    r.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the session saved in DIR by --save-state for "
        "--num-chunks more chunks: the model, text, video, cache and sampler settings (and --seed) are "
        "the session's; passing one of them with another value is an error. --out gets the new chunks, "
        "numbered from 0 (summary.json records the stream's first_chunk)",
    )
    j = p.add_argument_group(
        "multi-process job (jaxkv.generate.processes)",
        "every process runs the same command; process 0 writes the outputs, each process its own --save-state "
        "shards; --out, --save-state and --resume must be on a file system every process sees",
    )
    j.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a multi-process JAX job (jax.distributed.initialize) whose process 0 listens at HOST:PORT; "
        "'auto' lets JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU). Needs --mesh, which then "
        "spans every process's devices",
    )
    j.add_argument("--num-processes", type=_positive, metavar="N", help="the job's process count (with --coordinator)")
    j.add_argument(
        "--process-id", type=_non_negative, metavar="I", help="this process's index, 0..N-1 (with --coordinator)"
    )
    j.add_argument(
        "--heartbeat-timeout",
        type=_positive,
        metavar="SECONDS",
        help="how long the job waits for a process that stopped answering (killed, its machine lost) before "
        "ending every process (with --coordinator; default JAX's, 100)",
    )
    return p


# The settings a session continues under: --resume takes them from the session, and refuses other values.
SESSION_SETTINGS = (
    "checkpoint",
    "random_weights",
    "preset",
    "precision",
    "weights_seed",
    "context",
    "negative_context",
    "guidance_scale",
    "prompt",
    "negative_prompt",
    "text_encoder",
    "height",
    "width",
    "chunk_frames",
    "window_frames",
    "sink_frames",
    "batch",
    "policy",
    "dilated_every",
    "dilation",
    "buckets",
    "rope",
    "steps",
    "shift",
    "context_noise",
    "seed",
    "vae",
    "no_video",
    "fps",
)
# Settings a session saved before they were recorded may lack (taken as not passed: their defaults).
LATER_SESSION_SETTINGS = ("fps",)


def given_flags(argv: list[str]) -> dict[str, Any]:
    """The flags ``argv`` actually gives, by destination, with their parsed values: a parse with every default
    suppressed, so a flag given with its default's own value is still given."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return vars(p.parse_args(argv))


def explicit_flags(argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` actually passes (not left at their defaults)."""
    return set(given_flags(argv))


def explicit(args) -> set[str]:
    """The destinations the user passed: ``args.explicit_flags`` (a `jaxkv.generate.settings.Settings`' flags
    given, or set on a Namespace), or, for a Namespace parsed without it (e.g. from Python), every setting that
    differs from its default."""
    given = getattr(args, "explicit_flags", None)
    if given is not None:
        return set(given)
    defaults = vars(build_parser().parse_args([]))
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def check_text(args: argparse.Namespace) -> None:
    """UsageError for a --prompt / --negative-prompt that is not valid UTF-8 (bytes Python could not decode from
    the command line): checked first, so no message or file ever carries the undecodable characters."""
    for flag, text in (("--prompt", args.prompt), ("--negative-prompt", args.negative_prompt)):
        problem = None if text is None else utf8_problem(text)
        if problem:
            raise UsageError(f"{flag} {shorten(text.encode('utf-8', 'replace').decode())}: {problem}")


def check_model(args: argparse.Namespace) -> None:
    """The model choice: ``--random-weights`` (with ``--preset`` / ``--weights-seed``), or ``--checkpoint DIR``
    (default: the shipped toy world). Raises UsageError for flags of the other choice."""
    if args.random_weights and args.checkpoint:
        raise UsageError("--random-weights and --checkpoint both choose the weights; pass one")
    if not args.random_weights:
        given = explicit(args)
        for flag, name in (("--preset", "preset"), ("--weights-seed", "weights_seed")):
            if name in given:
                raise UsageError(
                    f"{flag} chooses random weights: add --random-weights (without it the model is "
                    f"--checkpoint DIR, by default the toy world shipped in the package)"
                )


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_replaced(flags: Mapping[str, Any]) -> None:
    """UsageError for a flag --precision replaced (``flags``: the flags given, by destination)."""
    for flag, dest in zip(REPLACED_FLAGS, REPLACED_DESTS):
        if flags.get(dest) is not None:
            raise UsageError(
                f"{flag} was replaced by --precision {'|'.join(PRECISIONS)} (one policy for the "
                f"weights, matmuls and caches)"
            )


def check(args) -> None:
    """Checks the combinations argparse cannot (before any model is built). Raises UsageError."""
    if args.guidance_scale is None and args.negative_context:
        raise UsageError("--negative-context needs --guidance-scale")
    if args.guidance_scale is not None and args.context and not args.negative_context:
        raise UsageError(
            "--guidance-scale with --context needs --negative-context FILE (the negative prompt's "
            "embeddings, e.g. of the empty prompt); only the stand-in context has a stand-in negative"
        )
    if args.prompt is not None and args.context:
        raise UsageError("--prompt and --context both give the text context; pass one")
    given_text = args.prompt is not None or args.context
    if args.resume:  # the session's own --prompt / --context are filled in: only the flags passed conflict
        given_text = given_text and bool({"prompt", "context"} & explicit(args))
    if args.prompt_schedule and given_text:
        raise UsageError(
            f"--prompt-schedule gives the text context; not with "
            f"{'--prompt' if args.prompt is not None else '--context'}"
        )
    if getattr(args, "switch_sink", None) is not None and not args.prompt_schedule:
        raise UsageError("--switch-sink needs --prompt-schedule")
    if args.prompt_schedule:
        if args.guidance_scale is not None and args.negative_prompt is None and not args.negative_context:
            raise UsageError(
                "--guidance-scale with --prompt-schedule needs --negative-prompt TEXT or --negative-context FILE"
            )
    elif args.prompt is None:
        for flag, value in (
            ("--negative-prompt", args.negative_prompt),
            ("--text-encoder", args.text_encoder),
            ("--embeddings-cache", args.embeddings_cache),
            ("--offload-text-encoder", args.offload_text_encoder or None),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --prompt")
    if args.negative_prompt is not None and args.negative_context:
        raise UsageError("--negative-prompt and --negative-context both give the negative context; pass one")
    if args.guidance_scale is None and args.negative_prompt is not None:
        raise UsageError("--negative-prompt needs --guidance-scale")
    if (
        args.guidance_scale is not None
        and args.prompt is not None
        and args.negative_prompt is None
        and not args.negative_context
    ):
        raise UsageError(
            '--guidance-scale with --prompt needs --negative-prompt TEXT (e.g. --negative-prompt "") '
            "or --negative-context FILE"
        )
    if not args.dilated_every:
        for flag, value in (("--dilation", args.dilation), ("--buckets", args.buckets)):
            if value is not None:
                raise UsageError(f"{flag} needs --dilated-every K (which layers are dilated)")
    elif args.dilation is None or args.buckets is None:
        raise UsageError("--dilated-every needs --dilation and --buckets")
    if args.no_video:
        for flag, value in (("--vae", args.vae), ("--fps", args.fps), ("--frames", args.frames)):
            if value is not None:
                raise UsageError(f"{flag} has no effect with --no-video")
    if args.save_state and os.path.abspath(args.save_state) == os.path.abspath(args.out):
        raise UsageError(
            f"--save-state {args.save_state} is the --out directory; the session goes in a directory of its own"
        )
    if args.save_state and args.resume and os.path.abspath(args.save_state) == os.path.abspath(args.resume):
        raise UsageError("--save-state is the --resume directory; save the continued session to another directory")
