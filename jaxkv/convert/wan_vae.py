"""Wan 2.1 VAE checkpoints -> the jaxkv VAE checkpoint (`jaxkv.models.wan_vae.checkpoint`).

Two layouts are read, told apart by their key names:

* ``wan`` — the original ``Wan2.1_VAE.pth`` (a plain torch state dict, read with ``torch.load(weights_only=True)``
  only): ``encoder.conv1``, ``encoder.downsamples.{k}`` / ``decoder.upsamples.{k}`` (one flat ``nn.Sequential`` of
  residual blocks and resamplers per side), residual blocks as ``residual.{0,2,3,6}`` + ``shortcut``,
  ``middle.{0,1,2}``,
  ``head.{0,2}``, and the quant convs ``conv1`` / ``conv2``;
* ``diffusers`` — ``AutoencoderKLWan`` (``config.json`` + safetensors, or a pipeline root's ``vae/``):
  ``conv_in``, ``down_blocks.{k}`` / ``up_blocks.{i}.resnets.{j}`` + ``up_blocks.{i}.upsamplers.0``, residual
  blocks as ``norm1 conv1 norm2 conv2 conv_shortcut``, ``mid_block.{resnets,attentions}``, ``norm_out``,
  ``conv_out``, ``quant_conv`` / ``post_quant_conv``.

The config (base dim, stages, residual blocks, temporal flags) is read off the tensor shapes and checked against a
diffusers ``config.json`` when there is one; then every source tensor must map to exactly one jaxkv parameter of the
right shape, or the conversion stops before writing anything. Wan 2.2's VAE (48 latent channels, residual
resamplers, 2x2 patchified RGB) and DiT checkpoints are refused by name. Tensors are streamed one at a time into
``params.safetensors`` by `jaxkv.convert.stream.write_tensor_directory`, the DiT's writer (atomic output directory,
destination rules, NaN/Inf check). The layouts' key tables and transforms are `jaxkv.convert.vae_layouts`.

    plan = plan_vae_conversion("Wan2.1-T2V-1.3B/Wan2.1_VAE.pth")
    write_vae_checkpoint(plan, "wan-vae-jaxkv/")
    config, params = load("wan-vae-jaxkv/")
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

from jaxkv import files
from jaxkv.convert.errors import ConversionError, listing
from jaxkv.convert.sources import TORCH_SUFFIXES, Source, open_source
from jaxkv.convert.stream import WriteResult, output_dtype, source_piece, write_tensor_directory
from jaxkv.convert.vae_layouts import apply, detect_vae_naming, mapping, source_shape
from jaxkv.models.wan_vae import checkpoint
from jaxkv.models.wan_vae.checkpoint import load
from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.params import flat_param_shapes

__all__ = [
    "VAEPlan",
    "plan_vae_conversion",
    "write_vae_checkpoint",
    "convert_vae",
    "is_vae_source",
    "detect_vae_naming",
    "load",
]


# --- config inference -------------------------------------------------------------------------------------------


def _indices(keys, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pat.match(k))})


def _infer_config(shapes: dict[str, tuple[int, ...]], naming: str, hints: dict[str, Any], where: str) -> WanVAEConfig:
    """The WanVAEConfig the decoder's tensor shapes describe (the encoder is then checked key by key)."""
    keys = set(shapes)
    try:
        if naming == "wan":
            z = shapes["conv2.weight"][0]
            out = shapes["decoder.head.2.weight"]
            items = _indices(keys, "decoder.upsamples")
            resamples = [k for k in items if f"decoder.upsamples.{k}.resample.1.weight" in keys]
            per_stage = resamples[0] if resamples else len(items)  # nrb + 1 residual blocks, then a resampler
            stages = len(resamples) + 1
            first_res = [i * (per_stage + 1) for i in range(stages)]
            stage_dims = [shapes[f"decoder.upsamples.{k}.residual.6.weight"][0] for k in first_res]
            temporal = [f"decoder.upsamples.{k}.time_conv.weight" in keys for k in resamples]
        else:
            z = shapes["post_quant_conv.weight"][0]
            out = shapes["decoder.conv_out.weight"]
            stages = len(_indices(keys, "decoder.up_blocks"))
            per_stage = len(_indices(keys, "decoder.up_blocks.0.resnets"))
            stage_dims = [shapes[f"decoder.up_blocks.{i}.resnets.0.conv2.weight"][0] for i in range(stages)]
            temporal = [f"decoder.up_blocks.{i}.upsamplers.0.time_conv.weight" in keys for i in range(stages - 1)]
    except (KeyError, IndexError) as e:
        raise ConversionError(
            f"{where}: the VAE decoder is incomplete ({e} is missing), so its shape cannot be read"
        ) from None
    image_channels, base = out[0], out[1]
    if z != 16 or image_channels != 3:
        raise ConversionError(
            f"{where} is not a Wan 2.1 VAE: it has {z} latent channels and {image_channels} output channels (Wan "
            f"2.1: 16 and 3). A 48-channel VAE with 12 output channels is Wan 2.2's (TI2V-5B), which has another "
            f"architecture (residual resamplers, 2x2 patchified RGB) and is not supported"
        )
    mult = [d // base for d in reversed(stage_dims)]
    if any(d % base for d in stage_dims) or per_stage < 2:
        raise ConversionError(
            f"{where}: decoder stage widths {stage_dims} with base {base} and {per_stage} residual "
            f"blocks per stage do not describe a Wan 2.1 VAE"
        )
    fields = dict(
        base_dim=base,
        z_dim=z,
        dim_mult=tuple(mult),
        num_res_blocks=per_stage - 1,
        temporal_downsample=tuple(temporal[::-1]),
        image_channels=image_channels,
    )
    if hints:
        _check_hints(hints, fields, where)
        for name in ("latents_mean", "latents_std"):
            if hints.get(name) is not None:
                fields[name] = tuple(hints[name])
    try:
        return WanVAEConfig(**fields)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None


def _check_hints(hints: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    cls = hints.get("_class_name")
    if cls is not None and cls != "AutoencoderKLWan":
        raise ConversionError(f"{where}: config.json describes a {cls!r}, not an AutoencoderKLWan (Wan VAE)")
    if hints.get("is_residual") or hints.get("patch_size") or hints.get("z_dim", 16) != 16:
        raise ConversionError(
            f"{where}: config.json describes a Wan 2.2 VAE (is_residual="
            f"{hints.get('is_residual')}, patch_size={hints.get('patch_size')}, z_dim="
            f"{hints.get('z_dim')}); only the Wan 2.1 VAE is supported"
        )
    if hints.get("attn_scales"):
        raise ConversionError(
            f"{where}: attn_scales {hints['attn_scales']} (attention inside the stages) is not "
            f"part of the Wan 2.1 VAE and is not supported"
        )
    if hints.get("decoder_base_dim") not in (None, fields["base_dim"]):
        raise ConversionError(
            f"{where}: decoder_base_dim {hints['decoder_base_dim']} differs from base_dim; not supported"
        )
    pairs = {
        "base_dim": "base_dim",
        "z_dim": "z_dim",
        "dim_mult": "dim_mult",
        "num_res_blocks": "num_res_blocks",
        "temperal_downsample": "temporal_downsample",
    }
    wrong = []
    for hint, field in pairs.items():
        if hint in hints and hints[hint] is not None:
            want = tuple(hints[hint]) if isinstance(hints[hint], list) else hints[hint]
            if want != fields[field]:
                wrong.append(f"{hint}: config.json {hints[hint]!r}, tensors {fields[field]!r}")
    if wrong:
        raise ConversionError(f"{where}: config.json disagrees with the tensor shapes: " + "; ".join(wrong))


# --- plan and write ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class VAEPlan:
    """A checked VAE conversion, ready to write.

    Attributes:
      source: the opened checkpoint.
      naming: 'wan' (original ``.pth``) or 'diffusers'.
      config: the WanVAEConfig of the output.
      items: {jaxkv flat key: (source key, transform kind)}, in output order.
    """

    source: Source
    naming: str
    config: WanVAEConfig
    items: dict[str, tuple[str, str]]


def _resolve(src: str) -> str:
    """A diffusers pipeline root is entered at ``vae/`` (its DiT lives in ``transformer/``)."""
    if os.path.isdir(src) and os.path.isdir(os.path.join(src, "vae")):
        return os.path.join(src, "vae")
    return src


def plan_vae_conversion(src: str) -> VAEPlan:
    """Opens ``src`` (an original ``.pth``, a diffusers VAE directory / safetensors file, or a diffusers pipeline
    root) and checks it completely, from headers alone. Raises ConversionError naming every problem."""
    source = open_source(_resolve(src))
    try:
        return _plan(source)
    except BaseException:
        source.close()
        raise


def _plan(source: Source) -> VAEPlan:
    where = source.description
    naming = detect_vae_naming(source.shapes)
    if naming is None:
        if "patch_embedding.weight" in source.shapes or any(k.startswith("blocks.") for k in source.shapes):
            raise ConversionError(
                f"{where} holds a Wan DiT (patch_embedding, blocks.N...), not a VAE; convert it "
                f"with `jaxkv convert` as a DiT checkpoint"
            )
        raise ConversionError(
            f"{where} is not a Wan VAE checkpoint: expected the original keys (decoder.conv1, "
            f"decoder.upsamples.N..., conv2) or diffusers AutoencoderKLWan keys (decoder.conv_in, "
            f"post_quant_conv, ...); found {listing(sorted(source.shapes), 8)}"
        )
    config = _infer_config(source.shapes, naming, source.hints, where)
    items = mapping(config, naming)
    shapes = flat_param_shapes(config)
    wanted = {src_key: (key, kind) for key, (src_key, kind) in items.items()}
    problems = []
    missing = sorted(set(wanted) - set(source.shapes))
    unexpected = sorted(set(source.shapes) - set(wanted))
    if missing:
        problems.append(f"missing tensors: {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {listing(unexpected)}")
    for src_key in sorted(set(wanted) & set(source.shapes)):
        key, kind = wanted[src_key]
        expect = source_shape(kind, shapes[key])
        if tuple(source.shapes[src_key]) != expect:
            problems.append(f"{src_key}: expected shape {list(expect)}, found {list(source.shapes[src_key])}")
        if source.dtypes.get(src_key) not in ("F32", "F16", "BF16", "F64"):
            problems.append(f"{src_key}: dtype {source.dtypes.get(src_key)} is not a floating-point weight")
    if problems:
        raise ConversionError(
            f"{where} does not match the Wan 2.1 VAE ({naming} naming, base_dim "
            f"{config.base_dim}, dim_mult {list(config.dim_mult)}):\n  " + "\n  ".join(problems)
        )
    return VAEPlan(source, naming, config, items)


def replace_problem(path: str) -> str | None:
    """None if ``path`` is a jaxkv VAE checkpoint directory that ``force`` may replace; otherwise why not."""
    return files.directory_problem(
        path, required=(checkpoint.CONFIG_FILE, checkpoint.PARAMS_FILE), formats=(checkpoint.FORMAT,)
    )


def write_vae_checkpoint(
    plan: VAEPlan,
    dst: str,
    *,
    dtype: str = "f32",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log=None,
) -> WriteResult:
    """Streams ``plan`` into the jaxkv VAE checkpoint directory ``dst`` (atomically), one tensor at a time, under
    the rules of `jaxkv.convert.stream.write_tensor_directory` (destination checks, NaN/Inf refused by name unless
    ``allow_nonfinite``; ``force`` replaces only a jaxkv VAE directory). ``dtype``: 'f32' (default; the VAE is
    small) or 'bf16'. Returns what was written."""
    out = output_dtype(dtype)
    shapes = flat_param_shapes(plan.config)
    source = plan.source
    tensors = [
        (key, shapes[key], [source_piece(source, src_key, functools.partial(apply, kind))])
        for key, (src_key, kind) in plan.items.items()
    ]
    metadata = {
        "format": checkpoint.FORMAT,
        "format_version": str(checkpoint.FORMAT_VERSION),
        "source": source.description,
        "source_naming": plan.naming,
    }
    return write_tensor_directory(
        dst,
        tensors,
        dtype=out,
        metadata=metadata,
        extra_files={checkpoint.CONFIG_FILE: checkpoint.config_json(plan.config)},
        replaceable=replace_problem,
        force=force,
        sources=source.paths,
        allow_nonfinite=allow_nonfinite,
        progress=progress,
        log=log,
        params_file=checkpoint.PARAMS_FILE,
        desc="convert vae",
    )


def convert_vae(
    src: str,
    dst: str,
    *,
    dtype: str = "f32",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
) -> VAEPlan:
    """`plan_vae_conversion` + `write_vae_checkpoint`; returns the plan (its ``config`` is the output config)."""
    plan = plan_vae_conversion(src)
    try:
        write_vae_checkpoint(plan, dst, dtype=dtype, force=force, progress=progress, allow_nonfinite=allow_nonfinite)
    finally:
        plan.source.close()
    return plan


def is_vae_source(path: str) -> bool:
    """True when ``path`` (a file, or a directory holding one checkpoint) looks like a Wan-family VAE in either
    naming — Wan 2.2's included, so that `plan_vae_conversion` gives its clear refusal. A diffusers pipeline root is
    not a VAE source (its ``vae/`` subdirectory is). Never raises for unreadable or foreign inputs."""
    if not os.path.exists(path):
        return False
    if os.path.isfile(path) and not path.endswith((".safetensors", *TORCH_SUFFIXES)):
        return False
    try:
        source = open_source(path)
    except (ConversionError, OSError):
        return False
    try:
        return detect_vae_naming(source.shapes) is not None
    finally:
        source.close()
