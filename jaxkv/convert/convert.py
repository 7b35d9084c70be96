"""Checkpoint conversion: plan from headers alone (format, config, every key and shape checked), then stream.

`plan_conversion` opens the source, detects its naming, infers or takes the config, and maps every source tensor
to its place in the jaxkv layout — reading no tensor data, so every missing / unexpected key and shape mismatch is
reported before anything is written. `write_checkpoint` then streams: each source tensor is memory-mapped,
transposed/cast into one contiguous piece and appended to the output file (a stacked ``[L, ...]`` parameter is
written as its L layer slices in order), so peak memory is a few of the largest single tensors, never the model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxkv import files
from jaxkv.convert.errors import ConversionError, listing
from jaxkv.convert.layouts import apply, detect_naming, map_key, source_keys, source_shape, target_shape
from jaxkv.convert.safetensors_io import DTYPES
from jaxkv.convert.sources import Source, TorchSource, open_source
from jaxkv.convert.stream import WriteResult, output_dtype, source_piece, write_tensor_directory
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan.config import PRESETS, WanConfig
from jaxkv.models.wan.config import preset as get_preset
from jaxkv.models.wan.params import flat_param_shapes

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
      defaulted: {config field: where its value came from} for each value neither the tensors, a config.json
        beside them nor an option gave (e.g. text_len of a diffusers checkpoint).
    """

    source: Source
    naming: str
    config: WanConfig
    config_origin: str
    items: dict[str, list[tuple[str, str]]]
    defaulted: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_tensors(self) -> int:
        return sum(len(v) for v in self.items.values())


def _evidence() -> dict[str, tuple]:
    """Which config field each axis of a jaxkv parameter (one layer's slice for ``blocks.*``) shows: a field
    name, ``(field, k)`` for an axis of k times the field, or a constant. Tests check it against params.py."""
    ev = {
        "patch_embedding.kernel": ("pt", "ph", "pw", "in_dim", "dim"),
        "patch_embedding.bias": ("dim",),
        "text_embedding.fc1.kernel": ("text_dim", "dim"),
        "text_embedding.fc1.bias": ("dim",),
        "text_embedding.fc2.kernel": ("dim", "dim"),
        "text_embedding.fc2.bias": ("dim",),
        "time_embedding.fc1.kernel": ("freq_dim", "dim"),
        "time_embedding.fc1.bias": ("dim",),
        "time_embedding.fc2.kernel": ("dim", "dim"),
        "time_embedding.fc2.bias": ("dim",),
        "time_projection.kernel": ("dim", ("dim", 6)),
        "time_projection.bias": (("dim", 6),),
        "head.head.kernel": ("dim", "head_out"),
        "head.head.bias": ("head_out",),
        "head.modulation": (2, "dim"),
        "blocks.norm3.scale": ("dim",),
        "blocks.norm3.bias": ("dim",),
        "blocks.ffn.fc1.kernel": ("dim", "ffn_dim"),
        "blocks.ffn.fc1.bias": ("ffn_dim",),
        "blocks.ffn.fc2.kernel": ("ffn_dim", "dim"),
        "blocks.ffn.fc2.bias": ("dim",),
        "blocks.modulation": (6, "dim"),
    }
    for attn in ("self_attn", "cross_attn"):
        for proj in "qkvo":
            ev[f"blocks.{attn}.{proj}.kernel"], ev[f"blocks.{attn}.{proj}.bias"] = ("dim", "dim"), ("dim",)
        ev[f"blocks.{attn}.norm_q.scale"] = ev[f"blocks.{attn}.norm_k.scale"] = ("dim",)
    return ev


EVIDENCE = _evidence()
_WIDTHS = ("dim", "ffn_dim", "in_dim", "pt", "ph", "pw", "text_dim", "freq_dim", "head_out")


def _vote_widths(
    mapped: dict[tuple[str, int | None], tuple[str, str]], shapes: dict[str, tuple[int, ...]], where: str
) -> dict[str, int]:
    """Every width from every tensor that shows it, by majority: one mis-shaped tensor is outvoted by the many
    correct ones (and then reported as the mismatch), instead of fixing a wrong width that blames correct tensors.
    A width no tensor shows, or two values with equal support, is an error naming the tensors involved."""
    votes: dict[str, dict[int, list[str]]] = {f: {} for f in _WIDTHS}
    for (dst, _layer), (key, kind) in mapped.items():
        template, found = EVIDENCE.get(dst), target_shape(kind, shapes[key])
        if template is None or found is None or len(found) != len(template):
            continue  # a wrong rank shows no width; the shape check reports it
        for axis, size in zip(template, found):
            field, k = (axis, 1) if isinstance(axis, str) else axis if isinstance(axis, tuple) else (None, 1)
            if field is not None and size % k == 0:
                votes[field].setdefault(size // k, []).append(key)
    widths = {}
    for field, by_value in votes.items():
        if not by_value:
            shown = sorted(
                {
                    key
                    for (dst, _), (key, _) in mapped.items()
                    if any(field in (a, a[0] if isinstance(a, tuple) else None) for a in EVIDENCE.get(dst, ()))
                },
                key=_natural,
            )
            why = (
                f"the tensors that show it have an unexpected rank: {listing(shown)}"
                if shown
                else "the tensors that show it are missing"
            )
            raise ConversionError(
                f"{where}: cannot infer the model config: no tensor shows {field} ({why}); pass "
                f"--preset or --config to check the checkpoint against a known config"
            )
        ranked = sorted(by_value.items(), key=lambda kv: -len(kv[1]))
        if len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1]):
            sides = "; ".join(f"{v} from {listing(sorted(keys, key=_natural), 4)}" for v, keys in ranked[:2])
            raise ConversionError(
                f"{where}: the tensors disagree on {field} with equal support ({sides}); one "
                f"side is mis-shaped; pass --preset or --config to say which is right"
            )
        widths[field] = ranked[0][0]
    return widths


def _num_layers(mapped, hints) -> int:
    """Blocks in the checkpoint: a config.json's num_layers if present (so trailing missing blocks are reported),
    else one past the last block index holding at least half of a block's tensors (a stray key further on is then
    reported as unexpected rather than inventing a block)."""
    if isinstance(hints.get("num_layers"), int):
        return hints["num_layers"]
    per_block = sum(1 for k in EVIDENCE if k.startswith("blocks."))
    counts: dict[int, int] = {}
    for _, layer in mapped:
        if layer is not None:
            counts[layer] = counts.get(layer, 0) + 1
    full = [layer for layer, n in counts.items() if 2 * n >= per_block]
    return 1 + max(full or counts or [0])


# Config values no tensor shows, and where a config.json beside the weights keeps them.
_UNSEEN = {
    "num_heads": ("num_heads", "num_attention_heads"),
    "text_len": ("text_len",),
    "eps": ("eps",),
    "rope_theta": ("rope_theta",),
}


def _infer_config(
    mapped, shapes, hints: dict[str, Any], num_heads: int | None, where: str
) -> tuple[WanConfig, str, dict[str, str]]:
    """Config from the tensors' shapes (by majority, `_vote_widths`) plus stored hints; returns (config, origin,
    {field: where its value came from} for every value that was defaulted rather than read)."""
    w = _vote_widths(mapped, shapes, where)
    patch = (w["pt"], w["ph"], w["pw"])
    volume = patch[0] * patch[1] * patch[2]
    if w["head_out"] % volume:
        raise ConversionError(
            f"{where}: head output width {w['head_out']} is not a multiple of the patch volume {volume} (patch {patch})"
        )
    shape = dict(
        dim=w["dim"],
        ffn_dim=w["ffn_dim"],
        num_layers=_num_layers(mapped, hints),
        in_dim=w["in_dim"],
        out_dim=w["head_out"] // volume,
        patch_size=patch,
        text_dim=w["text_dim"],
        freq_dim=w["freq_dim"],
    )
    # A preset with the same widths fixes what tensors cannot show (heads, text_len, eps).
    match = next(
        (
            name
            for name, p in PRESETS.items()
            if (p.dim, p.ffn_dim, p.in_dim, p.text_dim, p.freq_dim)
            == (w["dim"], w["ffn_dim"], w["in_dim"], w["text_dim"], w["freq_dim"])
        ),
        None,
    )
    base = PRESETS[match] if match else None
    unseen, defaulted, heads_origin = {}, {}, None
    for field, names in _UNSEEN.items():
        if field == "num_heads" and num_heads is not None:
            unseen[field], heads_origin = num_heads, "--num-heads"
            continue
        stored = next((n for n in names if n in hints and not isinstance(hints[n], bool)), None)
        if stored is not None:
            unseen[field] = hints[stored]
            heads_origin = heads_origin or (f"config.json {stored!r}" if field == "num_heads" else None)
        elif base is not None:
            unseen[field] = getattr(base, field)
            defaulted[field] = f"preset {match!r}"
            heads_origin = heads_origin or (f"preset {match!r}" if field == "num_heads" else None)
        elif field != "num_heads":
            defaulted[field] = "jaxkv default"
    if "num_heads" not in unseen:
        raise ConversionError(
            f"{where}: the number of attention heads cannot be inferred from tensors (dim "
            f"{w['dim']}, ffn_dim {w['ffn_dim']}, no config.json with num_heads, no preset with "
            f"these widths); pass --num-heads N or --preset NAME (known: {sorted(PRESETS)})"
        )
    head_dim, heads = hints.get("attention_head_dim"), unseen["num_heads"]
    if heads_origin.startswith("config.json") and isinstance(head_dim, int) and head_dim * heads != w["dim"]:
        raise ConversionError(
            f"{where}: config.json says {unseen['num_heads']} heads of {head_dim} channels, but "
            f"the tensors have dim {w['dim']}"
        )
    try:
        config = WanConfig(**shape, **unseen)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: the inferred config is invalid: {e}") from None
    described = f"inferred from tensors, heads from {heads_origin}"
    if match and config == PRESETS[match]:
        described += f" (equals preset {match!r})"
    return config, described, defaulted


def plan_conversion(
    src: str,
    *,
    preset: str | None = None,
    config: WanConfig | str | None = None,
    num_heads: int | None = None,
    text_len: int | None = None,
    ema: bool | None = None,
) -> Plan:
    """Opens ``src`` and checks it completely against the output config, reading headers only.

    Args:
      src: a checkpoint file or directory (see `jaxkv.convert.sources.open_source`).
      preset: name of a WanConfig preset the checkpoint must match.
      config: a WanConfig, or a path to a JSON file of WanConfig fields (a jaxkv config.json also works).
      num_heads: attention heads (overrides the preset/config/inferred value; tensors cannot show it).
      text_len: text tokens the model was trained with (overrides; tensors cannot show it, and diffusers configs
        do not store it).
      ema: for training checkpoints: True = generator_ema, False = generator, None = generator_ema if present.

    Raises ConversionError naming every problem found.
    """
    if preset is not None and config is not None:
        raise ConversionError("pass either a preset or a config, not both")
    source = open_source(src, ema)
    try:
        if ema is not None and not isinstance(source, TorchSource):
            raise ConversionError(
                f"--ema/--no-ema choose an entry of a PyTorch training checkpoint; {src} is {source.description}"
            )
        return _plan(source, preset, config, num_heads, text_len)
    except BaseException:
        source.close()
        raise


def _plan(source: Source, preset, config, num_heads, text_len) -> Plan:
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

    defaulted: dict[str, str] = {}
    if config is not None:
        config = _config_from(config) if not isinstance(config, WanConfig) else config
        origin = "given"
    elif preset is not None:
        try:
            config, origin = get_preset(preset), f"preset {preset!r}"
        except ValueError as e:
            raise ConversionError(str(e)) from None
    else:
        config, origin, defaulted = _infer_config(mapped, source.shapes, source.hints, num_heads, where)
        num_heads = None
    for field, value in (("num_heads", num_heads), ("text_len", text_len)):
        if value is None:
            continue
        try:
            config = dataclasses.replace(config, **{field: value})
        except ValueError as e:
            raise ConversionError(str(e)) from None
        origin += f", {field}={value}"
        defaulted.pop(field, None)

    expected_names = source_keys(naming, config.num_layers)
    shapes = flat_param_shapes(config)
    missing = sorted((name for dst, name in expected_names.items() if dst not in mapped), key=_natural)
    unexpected = sorted(unknown + [key for dst, (key, _) in mapped.items() if dst not in expected_names], key=_natural)
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
        raise ConversionError(
            f"{where} ({naming} naming) does not match the Wan config ({origin}: dim "
            f"{config.dim}, ffn_dim {config.ffn_dim}, {config.num_layers} layers, patch "
            f"{list(config.patch_size)}, in/out {config.in_dim}/{config.out_dim}, text_dim "
            f"{config.text_dim}); " + "; ".join(parts)
        )

    items: dict[str, list[tuple[str, str]]] = {}
    for key in shapes:
        if key.startswith("blocks."):
            items[key] = [mapped[(key, layer)] for layer in range(config.num_layers)]
        else:
            items[key] = [mapped[(key, None)]]
    return Plan(source, naming, config, origin, items, defaulted)


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


def check_output(src: str, dst: str, *, force: bool = False) -> None:
    """ConversionError unless converting ``src`` into ``dst`` is safe (`jaxkv.files.check_destination` with the
    Wan checkpoint's replace rule); cheap, so callers run it before the slow planning."""
    try:
        files.check_destination(dst, sources=[src], force=force, replaceable=checkpoint.replace_problem)
    except files.DestinationError as e:
        raise ConversionError(str(e)) from None


def write_checkpoint(
    plan: Plan,
    dst: str,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = True,
    allow_nonfinite: bool = False,
    log=None,
) -> WriteResult:
    """Streams ``plan`` into the jaxkv checkpoint directory ``dst`` (atomically); returns what was written.

    ``dtype``: 'bf16' or 'f32' for every parameter (rounded to nearest even when narrowing). ``force`` replaces an
    existing ``dst`` only if it is a jaxkv Wan checkpoint directory; ``dst`` may never be, contain or lie inside the
    source. A NaN/Inf tensor stops the conversion (ConversionError naming it) unless ``allow_nonfinite``.
    ``log`` receives one-line notes (stale temporaries of killed conversions removed). See
    `jaxkv.convert.stream.write_tensor_directory` for the rules.
    """
    out = output_dtype(dtype)
    shapes = flat_param_shapes(plan.config)
    source = plan.source
    tensors = [
        (key, shapes[key], [source_piece(source, k, functools.partial(apply, kind)) for k, kind in parts])
        for key, parts in plan.items.items()
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
        replaceable=checkpoint.replace_problem,
        force=force,
        sources=source.paths,
        allow_nonfinite=allow_nonfinite,
        progress=progress,
        log=log,
        params_file=checkpoint.PARAMS_FILE,
    )


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    preset: str | None = None,
    config: WanConfig | str | None = None,
    num_heads: int | None = None,
    text_len: int | None = None,
    ema: bool | None = None,
    dtype: str = "bf16",
    force: bool = False,
    allow_nonfinite: bool = False,
    progress: bool = False,
    log=None,
) -> Plan:
    """Converts the Wan 2.1 checkpoint ``src`` into the jaxkv checkpoint directory ``dst``; returns the plan
    (its ``config`` is the output config). See `plan_conversion` and `write_checkpoint` for the options; raises
    ConversionError. The destination is checked before the source is opened."""
    check_output(src, dst, force=force)
    plan = plan_conversion(src, preset=preset, config=config, num_heads=num_heads, text_len=text_len, ema=ema)
    try:
        write_checkpoint(
            plan, dst, dtype=dtype, force=force, progress=progress, allow_nonfinite=allow_nonfinite, log=log
        )
    finally:
        plan.source.close()
    return plan
