"""``jaxkv generate --save-state DIR`` / ``--resume DIR``: the generate command's side of `jaxkv.session`.

A saved session records, besides the stream state, the generate settings it was made under (``metadata["generate"]``:
every flag in `options.SESSION_SETTINGS`, paths made absolute). ``--resume`` takes those settings from the session;
a flag passed with another value is refused with one line naming each difference (a flag passed with the same value,
or not passed, is fine). ``--num-chunks`` then counts the chunks of the continuation.

What a continuation writes: ``--out`` holds its own chunks, numbered from 0 in ``latents/`` as for any run (so
`jaxkv.generate.load_latents` reads it alone), and ``summary.json`` records ``"first_chunk"`` (the stream index of
its first chunk) and ``"resumed_from"``. The runs' latents concatenated in order are the uninterrupted stream's, bit
for bit. With video, the VAE decoder's feature caches are part of the session, so the continuation's mp4 carries on
where the previous one stopped (4 frames per latent frame, no new first frame): the mp4 files played in order are
the uninterrupted video. A toy-world video (`jaxkv.generate.toy`) decodes each latent frame alone, so its session
holds no decoder state and its continuation's mp4 carries on all the same. A ``--mesh`` run's session is written
shard by shard (`jaxkv.parallel.checkpoint`) and resumes with or without ``--mesh``, on any mesh shape.
"""

from __future__ import annotations

import functools
import os

from jaxkv import decoding, files, recache
from jaxkv import session as S
from jaxkv.generate import options, processes
from jaxkv.generate.options import UsageError
from jaxkv.parallel import checkpoint as CK

_PATHS = ("checkpoint", "context", "negative_context", "text_encoder", "vae")


def _norm(dest: str, value):
    if value is None:
        return None
    if dest in _PATHS:
        return os.path.abspath(value)
    if dest == "steps":
        return [int(s) for s in value]
    return value


def _effective(dest: str, value):
    """A setting as the run uses it: a flag left at None means its default (the mp4's --fps)."""
    if value is None and dest in options.DEFAULTS:
        return options.DEFAULTS[dest]
    return value


def recorded_settings(args) -> dict:
    """The settings a session of this run continues under (JSON-able). The checkpoint is the directory the run
    was given: a release's root (``args.release``, set by `inputs.pick_up_release`), not its dit/ part, so that a
    toy-world session resumes as one (its latent map and settings are found from the root)."""
    recorded = {dest: _norm(dest, getattr(args, dest)) for dest in options.SESSION_SETTINGS}
    if getattr(args, "release", None):
        recorded["checkpoint"] = _norm("checkpoint", args.release)
    return recorded


def session_layer(args) -> tuple[dict | None, dict]:
    """The saved-session layer of `jaxkv.generate.settings`: with ``--resume DIR``, (the session's manifest, every
    setting of `options.SESSION_SETTINGS` as the session recorded it); without it, (None, {}). UsageError naming
    every flag given with another value than the session's, or for a DIR that is no session saved by jaxkv
    generate. Reads only the manifest."""
    if not args.resume:
        return None, {}
    try:
        manifest = CK.read_manifest(args.resume)  # a single-device or a sharded (mesh) session
    except S.SessionError as e:
        raise UsageError(f"--resume: {e}") from None
    recorded = manifest.get("metadata", {}).get("generate")
    if isinstance(recorded, dict):
        recorded = {**dict.fromkeys(options.LATER_SESSION_SETTINGS), **recorded}
    if not isinstance(recorded, dict) or set(recorded) != set(options.SESSION_SETTINGS):
        raise UsageError(
            f"--resume {args.resume} is a jaxkv session but not one saved by this jaxkv generate (its "
            f"recorded settings are missing or of another version); continue it from Python with "
            f"jaxkv.stream.Stream.from_session"
        )
    explicit = options.explicit(args)
    conflicts = []
    for dest in options.SESSION_SETTINGS:
        saved, now = recorded[dest], _norm(dest, getattr(args, dest))
        if dest in explicit and _effective(dest, now) != _effective(dest, saved):
            conflicts.append(f"{options.flag_name(dest)} {now!r} (the session's: {_effective(dest, saved)!r})")
    if conflicts:
        raise UsageError(
            f"--resume {args.resume} continues under the session's own settings, but "
            f"{'; '.join(conflicts)}; drop these flags (or pass the session's values)"
        )
    return manifest, {dest: tuple(v) if dest == "steps" else v for dest, v in recorded.items()}


def check_save_state(args, sources) -> None:
    """UsageError unless ``--save-state`` may be written: not an input, not inside / around ``--out`` or an input,
    and an existing directory only with --overwrite and only if it is a jaxkv session. Touches nothing."""
    if not args.save_state:
        return
    try:
        files.check_destination(
            args.save_state,
            sources=[*sources, args.out, *([args.resume] if args.resume else [])],
            force=args.overwrite,
            flag="--overwrite",
            replaceable=CK.session_dir_problem,
        )
    except files.DestinationError as e:
        raise UsageError(f"--save-state: {e}; nothing was touched") from None


def load(args, config, rc, *, schedule: bool = False, mesh=None) -> S.Session:
    """The ``--resume`` session (saved on one device or on a mesh of any shape), checked against the settings
    (UsageError naming any difference); with ``mesh`` laid out on it (`jaxkv.parallel.checkpoint.load`). With
    ``schedule`` (a --prompt-schedule) it must hold the latent ring a prompt switch re-caches from."""
    try:
        session = CK.load(args.resume, config, rc, mesh=mesh)
    except S.SessionError as e:
        raise UsageError(f"--resume: {e}") from None
    if schedule and recache.RING_EXTRA not in session.extras:
        raise UsageError(
            f"--resume {args.resume} with --prompt-schedule: the session holds no latent ring (the clean latents a "
            f"prompt switch re-caches from; sessions saved by an older jaxkv, or of a cache prompt switching does "
            f"not support, lack it); resume without --prompt-schedule"
        )
    return session


def text_of(args, manifest: dict | None) -> dict | None:
    """What the next chunk is drawn under, as a session records it (metadata ``"text_now"``): {"prompt": text},
    {"context": absolute path}, {"stand_in": seed} (the seed's stand-in context), or a schedule's first entry;
    for a resumed run the session's record (None when an older session has none)."""
    if manifest is not None:
        return manifest.get("metadata", {}).get("text_now")
    if args.prompt_schedule:
        return None  # the loop sets the first entry's once the schedule is read
    if args.prompt is not None:
        return {"prompt": args.prompt}
    if args.context:
        return {"context": os.path.abspath(args.context)}
    return {"stand_in": args.seed}


def keeps_ring(args, rc) -> bool:
    """Whether a run keeps the latent ring (clean latents of the retained chunks) to save with its session, so
    that the session can be resumed with a --prompt-schedule: with --save-state, on the caches prompt switching
    supports."""
    return bool(args.save_state) and rc.policy in recache.RECACHE_POLICIES


def continue_video(stream, decoder, *, resumed: bool) -> None:
    """Hands the mp4 decoder the decoder state ``stream`` carries (`jaxkv.decoding.adopt`, after the decoder's
    warm-up reset): a resumed session's VAE feature caches, or a new stream's fresh state. A toy-world
    `FrameDecoder` carries nothing. UsageError for a resumed session without VAE caches or with ones that do not
    fit."""
    if resumed and decoding.stateful(decoder) and S.VAE_DECODER not in stream.carry.extras:
        raise UsageError(
            "--resume: the session holds no VAE decoder state, so a video cannot continue seamlessly; "
            "the session was made with --no-video, pass it again"
        )
    try:
        decoding.adopt(stream, decoder)
    except ValueError:
        raise UsageError("--resume: the session's VAE decoder caches do not fit this VAE and video size") from None


def save(args, stream, chunks_written: int, *, text: dict | None = None) -> str:
    """Writes the stream's session (what it carries: with video the VAE decoder's caches and, for a stream that
    keeps one, its latent ring too: `jaxkv.stream.Stream.session`) to ``--save-state``; returns its path. ``text``:
    what the next chunk is drawn under (`text_of`). The stream must not step or decode again before this returns
    (the session shares its buffers)."""
    session = stream.session(copy=False)
    if processes.multi():  # process 0 alone decodes, so only its carry holds the decoder's caches: all save those
        carried = {S.VAE_DECODER: session.extras[S.VAE_DECODER]} if S.VAE_DECODER in session.extras else {}
        session = session.replace(extras={**session.extras, **processes.from_lead(carried)})
    mesh = getattr(stream, "mesh", None)  # a mesh stream's session is written shard by shard
    save = S.save if mesh is None else functools.partial(CK.save, mesh=mesh)
    return save(
        args.save_state,
        session,
        force=args.overwrite,
        metadata={
            "generate": recorded_settings(args),
            "chunks_written_by_this_run": chunks_written,
            "text_now": text,
        },
    )
