"""``jaxkv generate``'s default model, the toy world (`jaxkv.toyworld`): choosing it, its release's settings (the layer
of `jaxkv.generate.settings` that fills the flags not given), checking its prompts, and its frame decoder for the mp4.

A toy-world release (``DIR/{dit,text_encoder,latent_map}/`` + ``toyworld.json``, `jaxkv.toyworld.model`) is read
through the converted-release path (`inputs.pick_up_release`): the DiT and the text encoder load like any Wan
release's, and the latent map takes the VAE's place. What differs is settled here, before anything is loaded:

- the model: ``--checkpoint DIR`` when DIR is a toy-world release, or no ``--checkpoint`` and no
  ``--random-weights`` (the release shipped in the package, `jaxkv.toyworld.model.RELEASE_DIR`);
- the geometry: ``--height``/``--width`` (the 16 x 16 latent), ``--chunk-frames``, ``--window-frames``,
  ``--sink-frames``, ``--steps``, ``--shift`` and ``--rope`` the model was trained for, each unless passed (a flag
  passed keeps its value, so ``--window-frames 12`` still runs the model on another window); ``--prompt`` its
  default prompt unless the text is given (``--prompt``, ``--context`` or ``--prompt-schedule``); and, for a model
  whose settings name a guidance scale, ``--guidance-scale`` and ``--negative-prompt`` unless passed (not with
  ``--context``: precomputed text has no negative to go with it). A resumed session keeps its own;
- the text: every prompt (``--prompt``, ``--negative-prompt``, the schedule's) must parse as a toy-world prompt
  (`jaxkv.toyworld.world.parse_prompt`), a UsageError naming the vocabulary otherwise; the negative prompt may
  also be empty;
- the video: one frame per latent frame, decoded by the release's `LatentMap` (`FrameDecoder`); ``--vae`` is refused.
"""

from __future__ import annotations

import os

from jaxkv.generate import options
from jaxkv.generate.options import UsageError
from jaxkv.toyworld import model, world
from jaxkv.validate import shorten


def _geometry(settings: model.Settings) -> dict:
    """The flag destinations a toy model's settings fill, with their values."""
    return {
        "height": model.LATENT_SIZE,
        "width": model.LATENT_SIZE,
        "chunk_frames": settings.chunk_frames,
        "window_frames": settings.window_frames,
        "sink_frames": settings.sink_frames,
        "steps": tuple(settings.steps),
        "shift": float(settings.shift),
        "rope": settings.rope,
    }


def release_layer(args) -> tuple[str | None, dict]:
    """The release-settings layer of `jaxkv.generate.settings` for the model ``args`` chooses (after
    `options.check_model`; ``args``: the defaults, session and flags resolved so far): (the toy-world release
    directory, absolute, and the settings it gives), or (None, {}) for ``--random-weights`` and for a Wan
    ``--checkpoint``. Without either the model is the shipped release (its ``checkpoint``). Only settings no flag
    gave are in the layer (a resumed session holds its own, a layer above). Reads toyworld.json only. UsageError
    for a toy-world release with ``--vae``, a bad toyworld.json, or a missing shipped release."""
    if args.random_weights:
        return None, {}
    layer = {}
    if args.checkpoint is None:
        if not model.is_release(model.RELEASE_DIR):
            raise UsageError(
                f"the toy-world release shipped in the package is missing ({model.RELEASE_DIR} has no "
                f"{model.SETTINGS_FILE}: an install without its package data?); reinstall jaxkv, train "
                f"one with `python -m jaxkv.toyworld train --out DIR` and pass --checkpoint DIR, or "
                f"pass --random-weights"
            )
        layer["checkpoint"] = model.RELEASE_DIR
    checkpoint = layer.get("checkpoint", args.checkpoint)
    if not model.is_release(checkpoint):
        return None, layer
    directory = os.path.abspath(checkpoint)
    try:
        settings = model.read_settings(directory)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--checkpoint {directory}: {e}") from None
    if args.vae:
        raise UsageError(
            f"--vae: the toy-world model {directory} decodes its frames with its own latent map "
            f"({model.LATENT_MAP_DIR}/); --vae is for Wan models"
        )
    given = options.explicit(args)
    layer.update({dest: value for dest, value in _geometry(settings).items() if dest not in given})
    if args.prompt is None and not args.context and not args.prompt_schedule:
        layer["prompt"] = settings.prompt
    # a model trained for guidance streams with it, against its negative prompt, when the text is prompts
    if settings.guidance_scale is not None and "guidance_scale" not in given and not args.context:
        layer["guidance_scale"] = settings.guidance_scale
        if args.negative_prompt is None and not args.negative_context:
            layer["negative_prompt"] = settings.negative_prompt
    return directory, layer


def check_prompts(args) -> None:
    """UsageError unless ``args``' --prompt and --negative-prompt are toy-world prompts (the negative may be "")."""
    for flag, text in (("--prompt", args.prompt), ("--negative-prompt", args.negative_prompt)):
        if text is not None and not (flag == "--negative-prompt" and text == ""):  # "": the empty prompt
            check_prompt(text, flag)


def check_prompt(text: str, where: str) -> None:
    """UsageError unless ``text`` is a toy-world prompt (the message names the vocabulary)."""
    try:
        world.parse_prompt(text)
    except ValueError as e:
        raise UsageError(
            f"{where} {shorten(text)} is not a toy-world prompt: {e}. The toy world's words are "
            f"{', '.join(world.VOCABULARY)}; a prompt names 1..{world.MAX_OBJECTS} shapes of distinct "
            f"colours and a speed, e.g. 'a red circle and a blue square, fast'"
        ) from None


def check_schedule(entries) -> None:
    """Every prompt of a ``--prompt-schedule`` (`prompts.Entry` list) is a toy-world prompt."""
    for i, entry in enumerate(entries):
        if entry.prompt is not None:
            check_prompt(entry.prompt, f"--prompt-schedule entry {i}: prompt")


def frame_decoder(directory: str):
    """The release's `FrameDecoder` (its latent map): ``latents [B, T, h, w, 16]`` -> uint8 ``[B, T, 4h, 4w, 3]``."""
    from jaxkv.toyworld.latents import FrameDecoder, LatentMap

    try:
        return FrameDecoder(LatentMap.load(os.path.join(directory, model.LATENT_MAP_DIR)))
    except (OSError, ValueError) as e:
        raise UsageError(f"--checkpoint {directory}: {e}") from None
