"""Checkpoint conversion: plan from headers alone (format, config, every key and shape checked), then stream.

`plan_conversion` opens the source, detects its naming, infers or takes the config, and maps every source tensor
to its place in the jaxkv layout — reading no tensor data, so every missing / unexpected key and shape mismatch is
reported before anything is written. `write_checkpoint` then streams: each source tensor is memory-mapped,
transposed/cast into one contiguous piece and appended to the output file (a stacked ``[L, ...]`` parameter is
written as its L layer slices in order), so peak memory is a few of the largest single tensors, never the model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_dtypes
import numpy as np

from converters.errors import ConversionError, listing
from converters.layouts import apply, detect_naming, map_key, source_keys, source_shape, target_shape
from converters.safetensors_io import DTYPES, StreamWriter
from converters.sources import Source, TorchSource, open_source
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan.config import PRESETS, WanConfig, preset as get_preset
from jaxkv.models.wan.params import flat_param_shapes

OUTPUT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
_FLOAT_NAMES = set(DTYPES)


@dataclasses.dataclass
class Plan:
    """A checked conversion, ready to write.

    Attributes:
      source: the opened checkpoint.
      naming: 'wan' or 'diffusers'.
      config: the WanConfig of the output.
      config_origin: how the config was obtained (for the user).
      items: {jaxkv flat key: [(source key, transform), ...]}: one entry, or L entries in layer order for a
        stacked block parameter; in the output file's order.
    """

    source: Source
    naming: str
    config: WanConfig
    config_origin: str
    items: dict[str, list[tuple[str, str]]]

    @property
    def num_tensors(self) -> int:
        return sum(len(v) for v in self.items.values())


def _infer_config(targets: dict[tuple[str, int | None], tuple[int, ...]], hints: dict[str, Any],
                  num_heads: int | None, where: str) -> tuple[WanConfig, str]:
    """Config from jaxkv-layout shapes (``targets[(key, layer)]``) plus stored hints; heads need a hint."""
    anchors = {
        "patch_embedding.kernel": None, "text_embedding.fc1.kernel": None, "time_embedding.fc1.kernel": None,
        "head.head.kernel": None, "blocks.ffn.fc1.kernel": 0,
    }
    absent = [k for k, layer in anchors.items() if targets.get((k, layer)) is None]
    if absent:
        raise ConversionError(f"{where}: cannot infer the model config because these parameters are missing or "
                              f"have an unexpected rank: {absent} (jaxkv names); pass --preset or --config to "
                              f"check the checkpoint against a known config")
    pt, ph, pw, in_dim, dim = targets[("patch_embedding.kernel", None)]
    text_dim = targets[("text_embedding.fc1.kernel", None)][0]
    freq_dim = targets[("time_embedding.fc1.kernel", None)][0]
    ffn_dim = targets[("blocks.ffn.fc1.kernel", 0)][1]
    head_out = targets[("head.head.kernel", None)][1]
    num_layers = 1 + max(layer for (_, layer) in targets if layer is not None)
    if isinstance(hints.get("num_layers"), int):
        # A config.json beside the weights says how many blocks there should be: trailing missing blocks are then
        # reported as missing keys rather than silently giving a shallower model.
        num_layers = hints["num_layers"]
    if head_out % (pt * ph * pw):
        raise ConversionError(f"{where}: head output width {head_out} is not a multiple of the patch volume "
                              f"{pt * ph * pw} (patch {(pt, ph, pw)})")
    shape = dict(dim=dim, ffn_dim=ffn_dim, num_layers=num_layers, in_dim=in_dim, out_dim=head_out // (pt * ph * pw),
                 patch_size=(pt, ph, pw), text_dim=text_dim, freq_dim=freq_dim)
    # A preset with the same widths fixes what tensors cannot show (heads, text_len, eps).
    match = next((name for name, p in PRESETS.items()
                  if (p.dim, p.ffn_dim, p.in_dim, p.text_dim, p.freq_dim) == (dim, ffn_dim, in_dim, text_dim,
                                                                                freq_dim)), None)
    base = PRESETS[match] if match else None
    heads, origin = num_heads, "--num-heads"
    if heads is None:
        for field in ("num_heads", "num_attention_heads"):  # original Wan config.json / diffusers config.json
            if isinstance(hints.get(field), int):
                heads, origin = hints[field], f"config.json {field!r}"
                break
    if heads is None and base is not None:
        heads, origin = base.num_heads, f"preset {match!r}"
    if heads is None:
        raise ConversionError(f"{where}: the number of attention heads cannot be inferred from tensors (dim {dim}, "
                              f"ffn_dim {ffn_dim}, no config.json with num_heads, no preset with these widths); "
                              f"pass --num-heads N or --preset NAME (known: {sorted(PRESETS)})")
    head_dim = hints.get("attention_head_dim")
    if origin.startswith("config.json") and isinstance(head_dim, int) and head_dim * heads != dim:
        raise ConversionError(f"{where}: config.json says {heads} heads of {head_dim} channels, but the tensors have "
                              f"dim {dim}")
    extra = {}
    for field in ("text_len", "eps"):
        if field in hints:
            extra[field] = hints[field]
        elif base is not None:
            extra[field] = getattr(base, field)
    try:
        config = WanConfig(num_heads=heads, **shape, **extra)
    except ValueError as e:
        raise ConversionError(f"{where}: the inferred config is invalid: {e}") from None
    described = f"inferred from tensors, heads from {origin}"
    if match and config == PRESETS[match]:
        described += f" (equals preset {match!r})"
    return config, described


def plan_conversion(src: str, *, preset: str | None = None, config: WanConfig | str | None = None,
                    num_heads: int | None = None, ema: bool | None = None) -> Plan:
    """Opens ``src`` and checks it completely against the output config, reading headers only.

    Args:
      src: a checkpoint file or directory (see `converters.sources.open_source`).
      preset: name of a WanConfig preset the checkpoint must match.
      config: a WanConfig, or a path to a JSON file of WanConfig fields (a jaxkv config.json also works).
      num_heads: attention heads (overrides the preset/config/inferred value; tensors cannot show it).
      ema: for training checkpoints: True = generator_ema, False = generator, None = generator_ema if present.

    Raises ConversionError naming every problem found.
    """
    if preset is not None and config is not None:
        raise ConversionError("pass either a preset or a config, not both")
    source = open_source(src, ema)
    try:
        if ema is not None and not isinstance(source, TorchSource):
            raise ConversionError(f"--ema/--no-ema choose an entry of a PyTorch training checkpoint; {src} is "
                                  f"{source.description}")
        return _plan(source, preset, config, num_heads)
    except BaseException:
        source.close()
        raise


def _plan(source: Source, preset, config, num_heads) -> Plan:
    where = source.description
    naming = detect_naming(source.shapes)
    mapped: dict[tuple[str, int | None], tuple[str, str]] = {}
    unknown = []
    for key in source.shapes:
        hit = map_key(key, naming)
        if hit is None:
            unknown.append(key)
        else:
            mapped[(hit[0], hit[1])] = (key, hit[2])

    if config is not None:
        config = _config_from(config) if not isinstance(config, WanConfig) else config
        origin = "given"
    elif preset is not None:
        try:
            config, origin = get_preset(preset), f"preset {preset!r}"
        except ValueError as e:
            raise ConversionError(str(e)) from None
    else:
        targets = {dst: target_shape(kind, source.shapes[key]) for dst, (key, kind) in mapped.items()}
        config, origin = _infer_config(targets, source.hints, num_heads, where)
        num_heads = None
    if num_heads is not None:
        try:
            config = dataclasses.replace(config, num_heads=num_heads)
        except ValueError as e:
            raise ConversionError(str(e)) from None
        origin += f", num_heads={num_heads}"

    expected_names = source_keys(naming, config.num_layers)
    shapes = flat_param_shapes(config)
    missing = sorted((name for dst, name in expected_names.items() if dst not in mapped), key=_natural)
    unexpected = sorted(unknown + [key for dst, (key, _) in mapped.items() if dst not in expected_names],
                        key=_natural)
    mismatched, bad_dtype = [], []
    for dst in expected_names:  # top-level tensors first: they show a width mismatch most plainly
        if dst not in mapped:
            continue
        key, kind = mapped[dst]
        want = shapes[dst[0]][1:] if dst[1] is not None else shapes[dst[0]]
        found = source.shapes[key]
        if target_shape(kind, found) != tuple(want):
            mismatched.append(f"{key}: expected {list(source_shape(kind, tuple(want)))}, found {list(found)}")
        if source.dtypes[key] not in _FLOAT_NAMES:
            bad_dtype.append(f"{key} ({source.dtypes[key]})")
    if missing or unexpected or mismatched or bad_dtype:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {listing(missing)}")
        if unexpected:
            hint = ""
            if any(s in k for k in unexpected for s in ("img", "image_embedder", "add_k_proj", "vace")):
                hint = " (these look like image-to-video or VACE weights; jaxkv ports the text-to-video Wan 2.1 DiT)"
            parts.append(f"unexpected keys ({len(unexpected)}): {listing(unexpected)}{hint}")
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}): {listing(mismatched, 8)}")
        if bad_dtype:
            parts.append(f"non-floating tensors: {listing(bad_dtype)}")
        raise ConversionError(f"{where} ({naming} naming) does not match the Wan config ({origin}: dim "
                              f"{config.dim}, ffn_dim {config.ffn_dim}, {config.num_layers} layers, patch "
                              f"{list(config.patch_size)}, in/out {config.in_dim}/{config.out_dim}, text_dim "
                              f"{config.text_dim}); " + "; ".join(parts))

    items: dict[str, list[tuple[str, str]]] = {}
    for key in shapes:
        if key.startswith("blocks."):
            items[key] = [mapped[(key, layer)] for layer in range(config.num_layers)]
        else:
            items[key] = [mapped[(key, None)]]
    return Plan(source, naming, config, origin, items)


def _natural(key: str):
    """Sort key that puts blocks.2 before blocks.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def _config_from(path: str) -> WanConfig:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        data = {k: v for k, v in data.items() if k not in ("format", "format_version")}
        return WanConfig.from_dict(data)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ConversionError(f"--config {path}: expected a JSON object of WanConfig fields ({e})") from None


def write_checkpoint(plan: Plan, dst: str, *, dtype: str = "bf16", force: bool = False,
                     progress: bool = True) -> int:
    """Streams ``plan`` into the jaxkv checkpoint directory ``dst`` (atomically). Returns the bytes written.

    ``dtype``: 'bf16' or 'f32' for every parameter (rounded to nearest even when narrowing).
    """
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"output dtype {dtype!r} is not supported; expected one of {sorted(OUTPUT_DTYPES)}")
    if os.path.lexists(dst) and not force:
        raise ConversionError(f"{dst} already exists; pass --force to replace it")
    out = OUTPUT_DTYPES[dtype]
    shapes = flat_param_shapes(plan.config)
    metadata = {"format": checkpoint.FORMAT, "format_version": str(checkpoint.FORMAT_VERSION),
                "source": plan.source.description, "source_naming": plan.naming}
    from tqdm import tqdm

    with checkpoint.atomic_directory(dst, force=force) as tmp:
        params_path = os.path.join(tmp, checkpoint.PARAMS_FILE)
        writer = StreamWriter(params_path, [(k, out, shapes[k]) for k in plan.items], metadata)
        try:
            with tqdm(total=plan.num_tensors, unit="tensor", desc="convert", disable=not progress,
                      dynamic_ncols=True) as bar:
                for key, parts in plan.items.items():
                    for src_key, kind in parts:
                        # One source tensor at a time: a mapped view, one contiguous cast copy, appended.
                        piece = np.ascontiguousarray(apply(kind, plan.source.read(src_key)), dtype=out)
                        writer.write(key, piece)
                        del piece
                        plan.source.release(src_key)
                        bar.update(1)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        with open(os.path.join(tmp, checkpoint.CONFIG_FILE), "w") as f:
            f.write(checkpoint.config_json(plan.config))
        size = os.path.getsize(params_path)
    return size


def convert_checkpoint(src: str, dst: str, *, preset: str | None = None, config: WanConfig | str | None = None,
                       num_heads: int | None = None, ema: bool | None = None, dtype: str = "bf16",
                       force: bool = False, progress: bool = False) -> Plan:
    """Converts the Wan 2.1 checkpoint ``src`` into the jaxkv checkpoint directory ``dst``; returns the plan
    (its ``config`` is the output config). See `plan_conversion` for the options; raises ConversionError."""
    plan = plan_conversion(src, preset=preset, config=config, num_heads=num_heads, ema=ema)
    try:
        write_checkpoint(plan, dst, dtype=dtype, force=force, progress=progress)
    finally:
        plan.source.close()
    return plan
