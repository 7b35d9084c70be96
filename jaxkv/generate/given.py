"""``jaxkv generate --image PATH`` / ``--video PATH``: the stream continues given frames (`jaxkv.continuation`).

The file is read and its frames mapped to the stream's frame size, cut or padded to whole chunks (rules in
`jaxkv.continuation`) before ``--out`` is touched or anything compiles: a missing, unreadable or frameless file is a
one-line UsageError. Once the model is loaded the frames are encoded (a toy world's latent map, or the Wan VAE's
encoder: ``--vae``, a release's ``vae/``, or the tiny random VAE of ``--random-weights``) and committed as the
stream's first chunks; the mp4's decoder runs over them first (their frames are not written), so the video carries on
from the given frames. ``--out`` holds the generated chunks only, numbered from 0, as a ``--resume`` run's;
``summary.json`` records ``"first_chunk"`` (the given chunks) and ``"given"``; a ``--prompt-schedule`` counts the
generated chunks. Not with ``--resume`` (the session holds its own past). With ``--mesh`` the frames are encoded on
one device and committed on the mesh (`jaxkv.parallel.MeshStream.commit`).
"""

from __future__ import annotations

import dataclasses
import os
import time

from jaxkv import continuation as C
from jaxkv.generate import inputs
from jaxkv.generate.options import UsageError


def flag(args) -> str | None:
    """``--image PATH`` / ``--video PATH`` as given (for messages), or None."""
    if getattr(args, "image", None):
        return f"--image {args.image}"
    if getattr(args, "video", None):
        return f"--video {args.video}"
    return None


def check(args) -> None:
    """The combinations (no file read): UsageError for both flags, or either with --resume."""
    given = flag(args)
    if given is None:
        return
    if getattr(args, "image", None) and getattr(args, "video", None):
        raise UsageError("--image and --video both give the frames to continue; pass one")
    if args.resume:
        raise UsageError(f"{given}: --resume continues a saved session, which holds its own past; not with {given}")


def vae_config(args, config, toy_dir, mp4_vae):
    """(the Wan VAE config whose encoder reads the frames, the directory of its params: None for the tiny random
    VAE); (None, None) for the toy world or without the flags. The VAE is the mp4's (``mp4_vae``), or, with
    --no-video, ``--vae``, a release's ``vae/`` or (``--random-weights``) the tiny random one."""
    if toy_dir or flag(args) is None:
        return None, None
    if mp4_vae is not None:
        return mp4_vae, args.vae
    vae_dir = args.vae
    if args.no_video and not args.vae:
        from jaxkv.models.release import release_parts

        parts = release_parts(args.release) if args.release else None
        if parts and "vae" in parts:
            vae_dir = parts["vae"]
        elif not args.random_weights:
            raise UsageError(
                f"{flag(args)}: the frames are encoded by the Wan VAE; with --no-video pass --vae DIR (its encoder)"
            )
    return inputs.resolve_vae(dataclasses.replace(args, no_video=False, vae=vae_dir), config), vae_dir


def read(args, rc, toy_dir, vae) -> C.Frames | None:
    """The given file's frames uint8 [T, H, W, 3] at the stream's frame size (None without the flags);
    UsageError naming the flag and the problem."""
    given = flag(args)
    if given is None:
        return None
    factor = 4 if toy_dir else vae.spatial_factor
    try:
        return C.read_frames(
            args.image or args.video, rc.latent_height * factor, rc.latent_width * factor, image=bool(args.image)
        )
    except C.ContinuationError as e:
        raise UsageError(f"{'--image' if args.image else '--video'}: {e}") from None


def encoder(args, toy_dir, vae, vae_dir, vae_params):
    """The frame encoder: the toy world's latent map, or the Wan VAE (``vae_dir``'s params, `vae_config`; or
    ``vae_params`` when the mp4 loaded them)."""
    if toy_dir:
        from jaxkv.toyworld import model as toy_model
        from jaxkv.toyworld.latents import LatentMap

        return C.ToyEncoder(LatentMap.load(os.path.join(toy_dir, toy_model.LATENT_MAP_DIR)))
    if vae_params is None:
        vae_params = inputs.load_vae(dataclasses.replace(args, vae=vae_dir), vae)
    try:
        return C.WanEncoder(vae_params, vae)
    except C.ContinuationError as e:
        raise UsageError(f"{flag(args)}: {e}") from None


def commit(args, stream, frames: C.Frames, frame_encoder, rc) -> tuple[C.Context, dict]:
    """Encodes the frames for every row and commits them as the stream's first chunks; (the `Context`, what the
    summary records)."""
    start = time.perf_counter()
    context = C.context_from_frames(frames.frames, frame_encoder, rc, batch=args.batch)
    try:
        stream.commit(context.latents)
    except ValueError as e:
        raise UsageError(f"{flag(args)}: {e}") from None
    info = {
        "path": os.path.abspath(args.image or args.video),
        "kind": "image" if args.image else "video",
        "source_size": list(frames.source_size),
        "source_frames": int(frames.frames.shape[0]),
        "frames_used": int(context.frames.shape[1]),
        "padded": context.padded,
        "dropped": context.dropped,
        "chunks": context.chunks,
        "latent_frames": int(context.latents.shape[1]),
        "encode_commit_s": round(time.perf_counter() - start, 3),
    }
    return context, info
