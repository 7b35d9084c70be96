"""``jaxkv generate``'s settings, resolved once into a frozen `Settings` that every later step reads.

Each layer overrides the ones below it:

1. defaults: `jaxkv.defaults.GENERATE` (the one table; also what ``--help`` shows);
2. release settings: a toy-world release's ``toyworld.json`` (geometry, sampler, RoPE, its default prompt and
   guidance; `jaxkv.generate.toy`, the shipped release being the default model) and a converted release's parts
   (its ``vae/`` and ``text_encoder/`` where the run needs them; `jaxkv.generate.inputs.pick_up_release`);
3. the saved session (``--resume DIR``): every setting in `options.SESSION_SETTINGS` as the session recorded it
   (a flag given with another value is refused, naming the flag; `jaxkv.generate.resume`);
4. the flags given: known from a parse with every default suppressed (`options.given_flags`), so a flag given with
   the default's own value still counts as given (``--window-frames 9`` beats a release's 6).

`resolve` runs every check that needs no model (one `UsageError` line naming the flag) before anything is loaded,
compiled or written, and returns the `Settings`; nothing changes it afterwards (frozen: an assignment raises
`dataclasses.FrozenInstanceError`). The dtype policy and the attention backend are parsed here once into
`jaxkv.run_options.RunOptions` (``settings.run``), which the rollout config and the params' loaders read. Once the
model config is known, `rollout_settings` turns them into the `Schedule` and `RolloutConfig` and `check_memory`
refuses a run that obviously cannot fit, still before anything is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from jaxkv import defaults
from jaxkv import rollout as R
from jaxkv.generate import given, inputs, memory, options, resume, toy
from jaxkv.generate.options import UsageError
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions
from jaxkv.schedule import Schedule

LAYERS = ("default", "release", "session", "flag")  # low to high: `Settings.origin` names one per setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Every setting of one ``jaxkv generate`` run, resolved (`resolve`). The fields are the flags' destinations
    (``--window-frames`` is ``window_frames``; their meaning is the flag's help) plus what resolution adds below."""

    # model
    checkpoint: str | None  # after resolution the DiT directory (a release's dit/), or None for --random-weights
    random_weights: bool
    preset: str
    precision: str  # the preset name, as recorded in sessions and summaries; parsed once into `run`
    mesh: Mapping[str, int] | None
    weights_seed: int
    # text
    context: str | None
    negative_context: str | None
    guidance_scale: float | None
    prompt: str | None
    negative_prompt: str | None
    text_encoder: str | None
    offload_text_encoder: bool
    embeddings_cache: str | None
    prompt_schedule: str | None
    switch_sink: str | None
    # video and cache (latent frames)
    height: int
    width: int
    chunk_frames: int
    window_frames: int
    sink_frames: int
    num_chunks: int
    batch: int
    policy: str
    dilated_every: int
    dilation: int | None
    buckets: int | None
    rope: str
    # sampler
    steps: tuple[int, ...]
    shift: float
    context_noise: float
    seed: int
    # output
    out: str
    overwrite: bool
    format: str
    preview_scale: int
    preview_frames: int
    vae: str | None
    fps: int | None  # None: the default (`fps_or_default`); sessions record the flag as given
    frames: str | None
    no_video: bool
    no_progress: bool
    # continuation and session
    image: str | None
    video: str | None
    save_state: str | None
    resume: str | None
    # multi-process job (`jaxkv.generate.processes`; joined before resolution)
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout: int | None
    # added by resolution
    release: str | None = None  # a converted or toy-world release's root (``--checkpoint`` as given)
    toy_dir: str | None = None  # the toy-world release (absolute), or None for a Wan model
    picked_up: str | None = None  # where a release's parts came from (for the summary)
    session_manifest: Mapping[str, Any] | None = None  # --resume: the session's manifest
    explicit_flags: frozenset[str] = frozenset()  # the destinations of the flags given
    origin: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )  # destination -> the layer (`LAYERS`) its value came from
    run: RunOptions = RunOptions(Precision())

    @property
    def fps_or_default(self) -> int:
        return self.fps or defaults.GENERATE["fps"]


_ADDED = ("release", "toy_dir", "picked_up", "session_manifest", "explicit_flags", "origin", "run")
FLAGS = tuple(f.name for f in dataclasses.fields(Settings) if f.name not in _ADDED)  # the flags' destinations


def _parser_defaults() -> dict[str, Any]:
    """Layer 1: every flag's default as the parser holds it (from `jaxkv.defaults.GENERATE`; None where a flag has
    none)."""
    values = vars(options.build_parser().parse_args([]))
    values.setdefault("switch_sink", None)  # default=SUPPRESS in the parser: "keep" unless given (with a schedule)
    return {k: values[k] for k in FLAGS}


def _make(layers: dict[str, Mapping[str, Any]], **resolved) -> Settings:
    """The `Settings` of ``layers`` (name -> {destination: value}, low to high), each value taken from the highest
    layer that holds it."""
    values, origin = {}, {}
    for name, layer in layers.items():
        for dest, value in layer.items():
            values[dest], origin[dest] = value, name
    values["steps"] = tuple(int(s) for s in values["steps"])
    if values["mesh"] is not None:
        values["mesh"] = MappingProxyType(dict(values["mesh"]))
    return Settings(**values, origin=MappingProxyType(origin), **resolved)


def resolve(flags: Mapping[str, Any], *, backend: str | None = None) -> Settings:
    """The `Settings` of the flags given, ``flags`` (destination -> parsed value, as `options.given_flags` returns
    them; every one counts as given), resolved through the layers of this module's docstring and checked.
    ``backend``: the attention backend (default `jaxkv.defaults.ROLLOUT`'s). Reads toyworld.json and a --resume
    session's manifest; loads nothing. Raises UsageError naming the flag."""
    flags = dict(flags)
    options.check_replaced(flags)
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise TypeError(f"resolve got unknown settings {unknown}; the flags' destinations are {list(FLAGS)}")
    explicit = frozenset(flags)
    layers = {"default": _parser_defaults(), "release": {}, "session": {}, "flag": flags}
    s = _make(layers, explicit_flags=explicit)
    options.check_text(s)
    given.check(s)  # --image / --video: their combinations (the file is read by the loop)
    manifest, layers["session"] = resume.session_layer(s)
    s = _make(layers, explicit_flags=explicit)
    options.check_model(s)
    toy_dir, layers["release"] = toy.release_layer(s)
    s = _make(layers, explicit_flags=explicit)
    if toy_dir:
        toy.check_prompts(s)
    options.check(s)
    # a release's parts: its dit/ is the checkpoint; its vae/ and text_encoder/ fill those the run needs and lacks
    picked, note = inputs.pick_up_release(s) if s.checkpoint else ({}, None)
    try:
        precision = Precision.named(s.precision)
    except ValueError as e:
        raise UsageError(f"--precision: {e}") from None
    return dataclasses.replace(
        s,
        **picked,
        toy_dir=toy_dir,
        picked_up=note,
        session_manifest=None if manifest is None else MappingProxyType(manifest),
        origin=MappingProxyType({**s.origin, **{k: "release" for k in picked if k in ("vae", "text_encoder")}}),
        run=RunOptions(precision, defaults.ROLLOUT["backend"] if backend is None else backend),
    )


def from_argv(argv: list[str]) -> Settings:
    """`resolve` of a command line (argparse errors exit as argparse's do)."""
    return resolve(options.given_flags(argv))


def from_namespace(args: argparse.Namespace) -> Settings:
    """`resolve` of a parsed Namespace (`options.build_parser`): the flags given are ``args.explicit_flags`` when
    set, else every destination whose value differs from its default (`options.explicit`)."""
    given_now = options.explicit(args)
    return resolve({k: v for k, v in vars(args).items() if k in given_now})


def rollout_settings(args: Settings, config):
    """(Schedule, RolloutConfig) from the settings (its dtype policy and backend: ``args.run``); UsageError for any
    inconsistency with the model."""
    try:
        schedule = Schedule(steps=args.steps, shift=args.shift, context_noise=args.context_noise)
        rc = R.RolloutConfig(
            args.height,
            args.width,
            chunk_frames=args.chunk_frames,
            window_frames=args.window_frames,
            sink_frames=args.sink_frames,
            schedule=schedule,
            guidance_scale=args.guidance_scale,
            policy=args.policy,
            precision=args.run.precision,
            backend=args.run.backend,
            dilated_every=args.dilated_every,
            dilation=args.dilation,
            buckets=args.buckets,
            rope=args.rope,
        )
        rc.cache_spec(config)  # validates the frame and layer settings against the model
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        R.check_position_room(config, rc, args.num_chunks)
    except ValueError as e:
        raise UsageError(f"--num-chunks: {e}") from None
    return schedule, rc


def check_memory(args, config, rc) -> None:
    """UsageError, with the figures, when the run obviously cannot fit in memory (`memory.check`); before anything
    is loaded or compiled."""
    devices = 1 if args.mesh is None else math.prod(args.mesh.values())
    flags = f"--height {args.height} --width {args.width} --window-frames {rc.window_frames} --batch {args.batch}"
    try:
        memory.check(
            config, rc, args.batch, f"{flags} (a {config.num_layers}-layer, dim {config.dim} model)", devices=devices
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
