"""What ``jaxkv generate`` reads: the model (config first, cheaply; params later; a converted release's three parts
picked up from ``--checkpoint DST``) and the text context, each checked for shapes and for non-finite numbers before
anything is generated."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import parallel as PL
from jaxkv.generate.options import UsageError
from jaxkv.models import wan
from jaxkv.models.checkpoint_dir import CONFIG_FILE
from jaxkv.models.release import PARTS, release_parts
from jaxkv.models.wan.checkpoint import CheckpointError, load, read_config


def pick_up_release(args) -> tuple[dict, str | None]:
    """When ``--checkpoint`` is a converted release (`jaxkv.models.release`: ``DST/{dit,vae,text_encoder}``): (the
    settings it gives: ``checkpoint`` its DiT, ``release`` its root, and ``vae`` / ``text_encoder`` its parts where
    the run needs them and has none (the VAE only when a video is written, the text encoder only with ``--prompt``
    or ``--prompt-schedule``); where each part came from, for the summary). A toy-world release
    (`jaxkv.toyworld.model`) is one with ``latent_map/`` in place of ``vae/``: its frames are decoded by
    `jaxkv.generate.toy`, so no VAE is looked for. For anything else ({}, None). UsageError for a directory that
    is neither a DiT checkpoint nor a release, and for a release that lacks a part the run needs."""
    from jaxkv.toyworld import model as toy_model

    path = args.checkpoint
    parts = release_parts(path)
    if parts is None:
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, CONFIG_FILE)):
            raise UsageError(
                f"--checkpoint {path} is neither a jaxkv DiT checkpoint ({CONFIG_FILE} + params."
                f"safetensors) nor a converted release ({', '.join(p + '/' for p in PARTS.values())}); "
                f"convert a checkpoint or a Wan release with `jaxkv convert`"
            )
        return {}, None
    toy = toy_model.is_release(path)
    picked = {"checkpoint": parts["dit"], "release": os.path.abspath(path)}
    taken = [f"DiT from {parts['dit']}"]
    if toy:
        taken.append(
            f"latent map from {os.path.join(path, toy_model.LATENT_MAP_DIR)}"
            if not args.no_video
            else "latent map not used (--no-video)"
        )
    needs_text = args.prompt is not None or bool(args.prompt_schedule)
    for family, name, flag, attr, needed, unused in (
        *(() if toy else (("vae", "VAE", "--vae", "vae", not args.no_video, "--no-video"),)),
        ("umt5", "text encoder", "--text-encoder", "text_encoder", needs_text, "no --prompt"),
    ):
        if not needed:
            taken.append(f"{name} not used ({unused})")
        elif getattr(args, attr):
            taken.append(f"{name} from {flag} {getattr(args, attr)}")
        elif family in parts:
            picked[attr] = parts[family]
            taken.append(f"{name} from {parts[family]}")
        else:
            raise UsageError(
                f"--checkpoint {path} is a converted release without {PARTS[family]}/; pass {flag} DIR"
                + (" or --no-video" if family == "vae" else "")
            )
    return picked, f"{'toy-world release' if toy else 'release'} {path}: " + ", ".join(taken)


def resolve_config(args):
    """(WanConfig, description) from ``--checkpoint`` (reads only its config.json; a converted release's DiT, as
    `jaxkv.generate.settings` resolved it with `pick_up_release`) or ``--preset``."""
    if args.checkpoint:
        release = args.picked_up
        try:
            config = read_config(args.checkpoint)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if config.in_dim != config.out_dim:
            raise UsageError(
                f"checkpoint {args.checkpoint} predicts {config.out_dim} channels from {config.in_dim}; "
                f"streaming generation needs in_dim == out_dim (a text-to-video model)"
            )
        return config, f"checkpoint {args.checkpoint}" + (f" ({release})" if release else "")
    try:
        config = wan.preset(args.preset)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return config, f"preset {args.preset!r} with random weights (seed {args.weights_seed})"


def load_params(args, config):
    """The params in ``--precision``'s param_dtype: the checkpoint's, or random ones of the preset. Every parameter
    must be finite (checked once, on device)."""
    dtype = jnp.dtype(args.run.precision.param_dtype)
    if args.checkpoint:
        try:
            loaded, params = load(args.checkpoint, dtype=dtype)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if loaded != config:
            raise UsageError(f"checkpoint {args.checkpoint} changed while it was read; run again")
    else:
        params = wan.init_params(config, jax.random.key(args.weights_seed), dtype)
    bad = nonfinite_leaves(params)
    if bad:
        where = f"checkpoint {args.checkpoint}" if args.checkpoint else "the random weights"
        raise UsageError(f"{where} hold NaN or Inf values in {', '.join(bad)}; refusing to generate from them")
    return params


def load_mesh_params(args, config, mesh):
    """The params on ``mesh``: a checkpoint read straight into its shards, or the random weights placed by the
    rule table; finite, as `load_params` checks."""
    dtype = jnp.dtype(args.run.precision.param_dtype)
    if not args.checkpoint:
        return PL.shard_params(load_params(args, config), mesh)
    try:
        loaded, params = PL.load_sharded(args.checkpoint, mesh, dtype)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if loaded != config:
        raise UsageError(f"checkpoint {args.checkpoint} changed while it was read; run again")
    bad = nonfinite_leaves(params)
    if bad:
        raise UsageError(
            f"checkpoint {args.checkpoint} holds NaN or Inf values in {', '.join(bad)}; refusing to generate from them"
        )
    return params


def nonfinite_leaves(params) -> list[str]:
    """Names ("blocks.ffn.fc1.kernel") of the parameter leaves holding NaN or Inf; one fused check on device
    for all leaves, and a per-leaf look only when it fails."""
    if bool(_all_finite(jax.tree.leaves(params))):
        return []
    named = jax.tree.flatten_with_path(params)[0]
    return [
        jax.tree_util.keystr(path, simple=True, separator=".") for path, x in named if not bool(jnp.isfinite(x).all())
    ]


@jax.jit
def _all_finite(leaves) -> jax.Array:
    """bool []: every element of every array in ``leaves`` is finite."""
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def load_context(path: str, text_dim: int, text_len: int, flag: str = "--context") -> np.ndarray:
    """Text embeddings [tokens, text_dim] (or [1, tokens, text_dim]) from .npy or .safetensors -> float32
    [tokens, text_dim]. A .safetensors file must hold one tensor, or one named ``context`` or ``prompt_embeds``.
    NaN or Inf anywhere is a UsageError naming the file and the first bad position."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} file {path!r} does not exist")
    if path.endswith(".npy"):
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            if "pickled" in str(e):  # numpy's reading of anything without an array header, a text file included
                raise UsageError(
                    f"{flag} file {path!r} is not a .npy array file (no NumPy array header; NumPy would read it as "
                    f"pickled objects, which are never loaded)"
                ) from None
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
            raise UsageError(
                f"{path!r} holds {sorted(tensors)}; expected one tensor or one named 'context' or 'prompt_embeds'"
            )
    else:
        raise UsageError(f"{flag} file {path!r} must end in .npy or .safetensors")
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[1] != text_dim:
        raise UsageError(f"{flag} in {path!r} must be [tokens, text_dim={text_dim}], got {list(array.shape)}")
    if not 1 <= array.shape[0] <= text_len:
        raise UsageError(f"{flag} in {path!r} has {array.shape[0]} tokens; the model takes 1..{text_len}")
    if not np.issubdtype(array.dtype, np.floating):
        raise UsageError(f"{flag} in {path!r} must be floating point, got {array.dtype}")
    array = array.astype(np.float32)
    finite = np.isfinite(array)
    if not finite.all():
        token, channel = np.argwhere(~finite)[0]
        raise UsageError(
            f"{flag} in {path!r} holds {int((~finite).sum())} NaN/Inf value(s), the first at token "
            f"{token}, channel {channel} ({array[token, channel]})"
        )
    return array


def standin_context(seed: int, text_dim: int, text_len: int) -> np.ndarray:
    """A seeded stand-in for text embeddings: min(8, text_len) tokens of N(0, 1) values [tokens, text_dim]."""
    return np.random.default_rng(seed).standard_normal((min(8, text_len), text_dim)).astype(np.float32)


def text_encoder(args, config):
    """The `TextEncoder` for ``--prompt``: ``--text-encoder DIR`` or the embedded tiny one, checked to produce the
    model's context (dim == text_dim, at most text_len tokens). UsageError otherwise."""
    from jaxkv.models.umt5 import TextEncoder, TokenizerNotFound

    try:
        if args.text_encoder:
            encoder = TextEncoder.load(args.text_encoder, cache_dir=args.embeddings_cache)
        else:
            encoder = TextEncoder.tiny(cache_dir=args.embeddings_cache)
    except (CheckpointError, TokenizerNotFound, ValueError) as e:
        raise UsageError(f"--text-encoder: {e}") from None
    where = f"--text-encoder {args.text_encoder}" if args.text_encoder else "the embedded tiny text encoder"
    if encoder.config.dim != config.text_dim or encoder.config.text_len > config.text_len:
        raise UsageError(
            f"{where} gives [{encoder.config.text_len}, {encoder.config.dim}] contexts; the model takes "
            f"text_dim {config.text_dim} and at most {config.text_len} tokens"
            + ("" if args.text_encoder else "; pass --text-encoder DIR of the model's encoder")
        )
    return encoder


def encode_prompts(args, config) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """(context [tokens, text_dim], negative or None, summary entries) for ``--prompt``: one ``encode`` call for
    the prompt and the negative prompt; the encoder is released afterwards with ``--offload-text-encoder``."""
    encoder = text_encoder(args, config)
    prompts = [args.prompt] + ([args.negative_prompt] if args.negative_prompt is not None else [])
    encoded = encoder.encode(prompts)
    if args.offload_text_encoder:
        encoder.release()
    info = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "text_encoder": encoder.name,
        "text_encoder_released": encoder.released,
    }
    return encoded[0], (encoded[1] if len(prompts) > 1 else None), info


def contexts(args, config) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """(context float32 [batch, tokens, text_dim], negative context likewise or None without guidance, summary
    entries about the text)."""
    info, negative = {}, None
    if args.prompt is not None:
        context, negative, info = encode_prompts(args, config)
    elif args.context:
        context = load_context(args.context, config.text_dim, config.text_len)
    else:
        context = standin_context(args.seed, config.text_dim, config.text_len)
    if args.guidance_scale is not None:
        if negative is not None:
            pass
        elif args.negative_context:
            negative = load_context(args.negative_context, config.text_dim, config.text_len, "--negative-context")
        else:  # only with the stand-in context (options.check): an empty prompt's stand-in
            negative = np.zeros((1, config.text_dim), np.float32)
        negative = np.broadcast_to(negative, (args.batch, *negative.shape))
    return np.broadcast_to(context, (args.batch, *context.shape)), negative, info


def resolve_vae(args, config):
    """The VAE config for the mp4 (``--vae DIR``'s config.json, or the tiny preset), or None with --no-video.
    Its latent channels must be the model's output channels."""
    if args.no_video:
        return None
    from jaxkv.models import wan_vae
    from jaxkv.models.wan_vae.checkpoint import read_config as read_vae_config

    if args.vae:
        try:
            vae = read_vae_config(args.vae)
        except CheckpointError as e:
            raise UsageError(f"--vae: {e}") from None
    else:
        vae = wan_vae.preset("tiny")
    if vae.z_dim != config.out_dim:
        raise UsageError(
            f"{'--vae ' + args.vae if args.vae else 'the tiny VAE'} decodes {vae.z_dim}-channel latents; "
            f"the model makes {config.out_dim} (another model family?); pass a matching --vae or "
            f"--no-video"
        )
    return vae


def load_vae(args, vae_config) -> dict:
    """The VAE params (float32): ``--vae``'s, or the tiny preset's seeded random ones; checked finite."""
    from jaxkv.models import wan_vae

    if args.vae:
        try:
            loaded, params = wan_vae.load(args.vae, dtype=jnp.float32)
        except CheckpointError as e:
            raise UsageError(f"--vae: {e}") from None
        if loaded != vae_config:
            raise UsageError(f"--vae {args.vae} changed while it was read; run again")
    else:
        params = wan_vae.init_params(DEFAULT_VAE_SEED, vae_config, jnp.float32)
    bad = nonfinite_leaves(params)
    if bad:
        raise UsageError(f"--vae {args.vae} holds NaN or Inf values in {', '.join(bad)}")
    return params


# The embedded default's random VAE (it only has to show the full path; its pictures mean nothing).
DEFAULT_VAE_SEED = 0


def source_paths(args, entries=None) -> list[str]:
    """Every file or directory the run reads (its release, checkpoint, contexts, VAE, text encoder, embeddings
    cache, prompt schedule and the contexts it names, session, given image / video): what ``--out`` must not
    overwrite or hold (`jaxkv.generate.outputs.prepare_output_dir`)."""
    flags = (
        args.release,
        args.checkpoint,
        args.context,
        args.negative_context,
        args.vae,
        args.text_encoder,
        args.embeddings_cache,
        args.prompt_schedule,
        args.resume,
    )
    paths = [p for p in flags if p]
    paths += [e.context for e in entries or () if e.context]
    return paths + [p for p in (args.image, args.video) if p]
