"""umT5 text-encoder conversion: Wan's ``models_t5_umt5-xxl-enc-bf16.pth`` or a Hugging Face ``UMT5EncoderModel``
(config.json + safetensors, single or sharded) -> a jaxkv text-encoder directory (`jaxkv.models.umt5.checkpoint`).

Like the DiT converter it plans from headers alone (layout detected from key names, config inferred from shapes,
every key and shape checked, the tokenizer found and checked) and then streams tensor by tensor into
``params.safetensors`` (a stacked ``[L, ...]`` parameter as its L layer slices) through the DiT's writer,
`jaxkv.convert.stream.write_tensor_directory` (atomic output directory, destination rules, NaN/Inf check), hashing the
bytes as they go for the checkpoint's fingerprint. Peak memory is a few of the largest single
tensors (the 256,384 x 4,096 embedding), never the 11 GB model.

    from jaxkv.convert.umt5 import is_umt5_source, plan_umt5_conversion, write_umt5_checkpoint
    if is_umt5_source(src):
        plan = plan_umt5_conversion(src)
        write_umt5_checkpoint(plan, dst)

Layouts (the key table is in `jaxkv.models.umt5.params`): 'wan' (``token_embedding``, ``blocks.N.attn.q`` ...,
each block's ``pos_embedding``) and 'hf' (``shared`` / ``encoder.embed_tokens``, ``encoder.block.N.layer.0
.SelfAttention.q`` ...; a full encoder-decoder's ``decoder.*`` / ``lm_head`` tensors are skipped). Refused with a
ConversionError naming why: plain T5 / mT5 (one relative bias shared from layer 0), T5 v1.0's ReLU feed-forward,
a Wan DiT or anything else.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import re
import struct
from typing import Any

import numpy as np

from jaxkv import files
from jaxkv.convert.errors import ConversionError, listing
from jaxkv.convert.safetensors_io import DTYPES
from jaxkv.convert.sources import SafetensorsSource, Source, TorchSource, open_source
from jaxkv.convert.stream import Piece, WriteResult, output_dtype, source_piece, write_tensor_directory
from jaxkv.models.umt5 import checkpoint
from jaxkv.models.umt5.config import PRESETS, UMT5Config
from jaxkv.models.umt5.params import flat_param_shapes
from jaxkv.models.umt5.tokenizer import TOKENIZER_FILES, Tokenizer, TokenizerNotFound, find_tokenizer

SPIECE_TENSORS = ("spiece_model", "tokenizer.spiece_model")
PIECE_BYTES = 64 << 20  # untransposed tensors are cast and written in row blocks of about this size

# Per-block source name -> (jaxkv stacked key, transpose?). Linear weights are [out, in] in PyTorch.
_WAN_BLOCK = {
    "norm1.weight": ("blocks.norm1.scale", False),
    "norm2.weight": ("blocks.norm2.scale", False),
    "attn.q.weight": ("blocks.attn.q.kernel", True),
    "attn.k.weight": ("blocks.attn.k.kernel", True),
    "attn.v.weight": ("blocks.attn.v.kernel", True),
    "attn.o.weight": ("blocks.attn.o.kernel", True),
    "pos_embedding.embedding.weight": ("blocks.attn.rel_bias", False),
    "ffn.gate.0.weight": ("blocks.ffn.gate.kernel", True),
    "ffn.fc1.weight": ("blocks.ffn.up.kernel", True),
    "ffn.fc2.weight": ("blocks.ffn.down.kernel", True),
}
_WAN_TOP = {"token_embedding.weight": ("embedding", False), "norm.weight": ("final_norm.scale", False)}
_HF_BLOCK = {
    "layer.0.layer_norm.weight": ("blocks.norm1.scale", False),
    "layer.1.layer_norm.weight": ("blocks.norm2.scale", False),
    **{f"layer.0.SelfAttention.{p}.weight": (f"blocks.attn.{p}.kernel", True) for p in "qkvo"},
    "layer.0.SelfAttention.relative_attention_bias.weight": ("blocks.attn.rel_bias", False),
    "layer.1.DenseReluDense.wi_0.weight": ("blocks.ffn.gate.kernel", True),
    "layer.1.DenseReluDense.wi_1.weight": ("blocks.ffn.up.kernel", True),
    "layer.1.DenseReluDense.wo.weight": ("blocks.ffn.down.kernel", True),
}
_HF_TOP = {"encoder.final_layer_norm.weight": ("final_norm.scale", False)}
_HF_EMBEDDINGS = ("encoder.embed_tokens.weight", "shared.weight")
_LAYOUTS = {
    "wan": (re.compile(r"^blocks\.(\d+)\.(.+)$"), _WAN_BLOCK, _WAN_TOP),
    "hf": (re.compile(r"^encoder\.block\.(\d+)\.(.+)$"), _HF_BLOCK, _HF_TOP),
}
_DIT_MARKERS = (
    "patch_embedding.weight",
    "condition_embedder.",
    "time_projection.",
    "scale_shift_table",
    "proj_out.weight",
)


@dataclasses.dataclass
class UMT5Plan:
    """A checked conversion, ready to write.

    Attributes:
      source: the opened checkpoint.
      layout: 'wan' or 'hf'.
      config: the UMT5Config of the output.
      config_origin: how the config was obtained (for the user).
      items: {jaxkv flat key: [(source key, transpose), ...]}: one entry, or L in layer order for a stacked
        parameter; in output-file order.
      tokenizer_files: {file name: path to copy, or bytes} for the output directory.
      tokenizer_origin: where the tokenizer came from.
      skipped: source keys deliberately not converted (a decoder, an lm_head, a tokenizer tensor).
    """

    source: Source
    layout: str
    config: UMT5Config
    config_origin: str
    items: dict[str, list[tuple[str, bool]]]
    tokenizer_files: dict[str, Any]
    tokenizer_origin: str
    skipped: list[str]

    @property
    def num_tensors(self) -> int:
        return sum(len(v) for v in self.items.values())


def _resolve(src: str) -> str:
    """A Wan release directory -> its T5 .pth; anything else as given."""
    if os.path.isdir(src):
        pths = sorted(glob.glob(os.path.join(src, "models_t5*.pth")))
        if len(pths) == 1:
            return pths[0]
    return src


def _family(keys) -> str:
    """'wan', 'hf', 'dit' or 'other' from the (prefix-stripped) key names."""
    keys = set(keys)
    if "token_embedding.weight" in keys or any(k.startswith("blocks.0.attn.") for k in keys):
        return "wan"
    if any(k.startswith("encoder.block.") for k in keys):
        return "hf"
    if any(k.startswith(m) or k.endswith(m) for k in keys for m in _DIT_MARKERS):
        return "dit"
    return "other"


def is_umt5_source(path: str) -> bool:
    """True when ``path`` holds a T5-family text encoder, so `plan_umt5_conversion` rather than the DiT converter
    should take it (plain T5 included: the plan then refuses it with a clear message). Reads key names only.
    False for a DiT, for a directory that holds a DiT (a Wan release or diffusers pipeline root: pass the T5
    ``.pth`` or the ``text_encoder/`` folder itself) and for anything unreadable."""
    if os.path.isdir(path) and os.path.isdir(os.path.join(path, "transformer")):
        return False
    try:
        source = open_source(path)
    except ConversionError:
        return False
    try:
        return _family(source.shapes) in ("wan", "hf")
    finally:
        source.close()


def _check_hints(hints: dict[str, Any], where: str) -> None:
    model_type = hints.get("model_type")
    if model_type is not None and model_type != "umt5":
        raise ConversionError(
            f"{where}: config.json says model_type {model_type!r}; only umT5 (model_type 'umt5', "
            f"a relative position bias per layer) is Wan's text encoder"
        )
    proj = hints.get("feed_forward_proj")
    if proj is not None and proj != "gated-gelu":
        raise ConversionError(f"{where}: config.json says feed_forward_proj {proj!r}; umT5 uses 'gated-gelu'")


def _spiece_bytes(source: Source, key: str) -> bytes:
    """The raw bytes of a uint8 tokenizer tensor (the float-only `Source.read` refuses it)."""
    if isinstance(source, SafetensorsSource):
        path, info = source._where[source._names[key]]
        with open(path, "rb") as f:
            f.seek(info.start)
            return f.read(info.end - info.start)
    if isinstance(source, TorchSource):
        return source._tensors[key].contiguous().numpy().tobytes()
    raise ConversionError(f"cannot read tensor {key!r} from {source.description}")


def _find_tokenizer(source: Source, src: str, tokenizer: str | None):
    """-> ({file name: path or bytes}, origin, Tokenizer)."""
    if tokenizer is not None:
        path = tokenizer if os.path.isfile(tokenizer) else None
        if path is None:
            try:
                path = find_tokenizer(tokenizer)
            except TokenizerNotFound as e:
                raise ConversionError(str(e)) from None
    else:
        embedded = [k for k in SPIECE_TENSORS if k in source.shapes]
        if embedded:
            data = _spiece_bytes(source, embedded[0])
            tok = Tokenizer.from_sentencepiece(data, source=f"tensor {embedded[0]!r} of {source.description}")
            return {"spiece.model": data}, tok.source, tok
        base = src if os.path.isdir(src) else (os.path.dirname(src) or ".")
        try:
            path = find_tokenizer(base)
        except TokenizerNotFound as e:
            raise ConversionError(
                f"{e}; or pass tokenizer=PATH (a tokenizer.json / spiece.model or its directory)"
            ) from None
    try:
        tok = Tokenizer.from_file(path)
    except (ValueError, OSError, ImportError) as e:
        raise ConversionError(f"tokenizer {path} cannot be read: {e}") from None
    folder = os.path.dirname(path)
    found = {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
    return found, path, tok


def plan_umt5_conversion(
    src: str, *, tokenizer: str | None = None, text_len: int = 512, max_distance: int | None = None
) -> UMT5Plan:
    """Opens ``src`` (a .pth / .safetensors file, a shard index, a Hugging Face encoder directory, or a Wan release
    directory holding ``models_t5*.pth``), detects its layout, infers the config, checks every key and shape and
    finds the tokenizer (``tokenizer`` path, else a ``spiece_model`` tensor, else beside the weights as
    `jaxkv.models.umt5.tokenizer.find_tokenizer` looks). ``max_distance`` of the relative buckets is not stored in
    the weights: a Hugging Face config.json gives it, Wan's code fixes it at 128 (the default). Reads no weights
    (except comparing two stored copies of a tied embedding). Raises ConversionError."""
    path = _resolve(src)
    source = open_source(path)
    try:
        return _plan(source, path, tokenizer, text_len, max_distance)
    except BaseException:
        source.close()
        raise


def _plan(source: Source, src: str, tokenizer, text_len, max_distance) -> UMT5Plan:
    where = source.description
    family = _family(source.shapes)
    if family == "dit":
        raise ConversionError(
            f"{where} is a Wan DiT checkpoint, not a text encoder; convert it with the DiT converter (jaxkv convert)"
        )
    if family == "other":
        raise ConversionError(
            f"{where} is not a umT5 text encoder: no Wan (token_embedding, blocks.N.attn.*) or "
            f"Hugging Face (encoder.block.N.*) keys; found {listing(sorted(source.shapes)[:8])}"
        )
    _check_hints(source.hints, where)
    block_re, block_map, top_map = _LAYOUTS[family]
    keys = set(source.shapes)
    skipped = sorted(
        k
        for k in keys
        if k in SPIECE_TENSORS or (family == "hf" and (k.startswith("decoder.") or k.startswith("lm_head.")))
    )
    if family == "wan" and "pos_embedding.embedding.weight" in keys:
        raise ConversionError(
            f"{where} is a T5 encoder with one relative position bias shared by all layers "
            f"(top-level pos_embedding); umT5 has one per layer"
        )
    if family == "hf":
        biased = sorted(
            {
                int(m.group(1))
                for k in keys
                if (m := block_re.match(k)) and m.group(2).endswith("relative_attention_bias.weight")
            }
        )
        if biased == [0] and any(block_re.match(k) and block_re.match(k).group(1) == "1" for k in keys):
            raise ConversionError(
                f"{where} is a plain T5 / mT5 encoder: only layer 0 has a relative_attention_bias, "
                f"shared by all layers; umT5 (Wan's text encoder) has one per layer"
            )
        if any(k.endswith("DenseReluDense.wi.weight") for k in keys):
            raise ConversionError(
                f"{where} has a non-gated feed-forward (DenseReluDense.wi): T5 v1.0, not umT5's gated-GELU"
            )
    items: dict[tuple[str, int | None], tuple[str, bool]] = {}
    unexpected = []
    for key in sorted(keys):
        if key in skipped:
            continue
        m = block_re.match(key)
        if m and m.group(2) in block_map:
            target, t = block_map[m.group(2)]
            items[(target, int(m.group(1)))] = (key, t)
        elif key in top_map:
            items[(top_map[key][0], None)] = (key, top_map[key][1])
        elif family == "hf" and key in _HF_EMBEDDINGS:
            continue
        else:
            unexpected.append(key)
    if family == "hf":
        present = [k for k in _HF_EMBEDDINGS if k in keys]
        if not present:
            raise ConversionError(f"{where}: no token embedding (expected {' or '.join(_HF_EMBEDDINGS)})")
        if len(present) == 2:
            _check_same(source, *present, where)
        items[("embedding", None)] = (present[0], False)
    if unexpected:
        raise ConversionError(
            f"{where}: tensors that are not part of a umT5 encoder ({family} layout): {listing(unexpected)}"
        )
    config, origin = _infer_config(source, items, family, text_len, max_distance, where)
    expected = flat_param_shapes(config)
    plan_items: dict[str, list[tuple[str, bool]]] = {}
    problems = []
    for key in sorted(expected):
        shape = expected[key]
        stacked = key.startswith("blocks.")
        layers = range(config.num_layers) if stacked else [None]
        parts = []
        for layer in layers:
            entry = items.get((key, layer))
            if entry is None:
                problems.append(f"missing {key}" + (f" of layer {layer}" if stacked else ""))
                continue
            src_key, t = entry
            got = source.shapes[src_key]
            got = tuple(reversed(got)) if t else tuple(got)
            want = shape[1:] if stacked else shape
            if got != want:
                problems.append(
                    f"{src_key}: shape {list(source.shapes[src_key])} does not fit {key} "
                    f"{list(want)}{' (transposed)' if t else ''}"
                )
            if source.dtypes[src_key] not in DTYPES:
                problems.append(f"{src_key}: dtype {source.dtypes[src_key]} is not a float weight")
            parts.append(entry)
        plan_items[key] = parts
    if problems:
        raise ConversionError(
            f"{where} does not match the inferred umT5 config ({origin}):\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    tok_files, tok_origin, tok = _find_tokenizer(source, src, tokenizer)
    if (tok.eos_id, tok.pad_id) != (config.eos_id, config.pad_id) or tok.vocab_size > config.vocab_size:
        raise ConversionError(
            f"tokenizer {tok_origin} (eos {tok.eos_id}, pad {tok.pad_id}, {tok.vocab_size} "
            f"pieces) does not fit the encoder (eos {config.eos_id}, pad {config.pad_id}, vocab "
            f"{config.vocab_size})"
        )
    return UMT5Plan(source, family, config, origin, plan_items, tok_files, tok_origin, skipped)


def _check_same(source: Source, a: str, b: str, where: str) -> None:
    """Both tied embeddings stored: they must be equal (compared in row blocks, memory-mapped)."""
    if source.shapes[a] != source.shapes[b]:
        raise ConversionError(
            f"{where}: {a} {list(source.shapes[a])} and {b} {list(source.shapes[b])} are both "
            f"stored but differ in shape; which embedding to use is ambiguous"
        )
    x, y = source.read(a), source.read(b)
    step = max(1, (64 << 20) // max(1, x[:1].nbytes))
    for start in range(0, x.shape[0], step):
        # equal_nan: a NaN stored in both copies is the writer's to report (by name), not a disagreement
        if not np.array_equal(x[start : start + step], y[start : start + step], equal_nan=True):
            raise ConversionError(
                f"{where}: {a} and {b} are both stored but differ (rows from {start}); which "
                f"embedding to use is ambiguous"
            )
    del x, y


def _infer_config(
    source: Source, items, family: str, text_len: int, max_distance: int | None, where: str
) -> tuple[UMT5Config, str]:
    def shape(target, layer):
        entry = items.get((target, layer))
        if entry is None:
            raise ConversionError(f"{where}: cannot infer the umT5 config: {target} (layer {layer}) is missing")
        return source.shapes[entry[0]]

    vocab, dim = shape("embedding", None)
    buckets, heads = shape("blocks.attn.rel_bias", 0)
    attn_dim = shape("blocks.attn.q.kernel", 0)[0]
    ffn = shape("blocks.ffn.up.kernel", 0)[0]
    num_layers = 1 + max(layer for (_, layer) in items if layer is not None)
    hints = source.hints
    if isinstance(hints.get("num_layers"), int):
        num_layers = hints["num_layers"]  # trailing missing blocks then show as missing keys
    if attn_dim % heads:
        raise ConversionError(
            f"{where}: attention width {attn_dim} is not a multiple of the {heads} heads of the relative bias"
        )
    origin = "inferred from tensor shapes"
    if max_distance is None:
        max_distance = hints.get("relative_attention_max_distance", 128)
        origin += (
            ", max_distance from config.json"
            if "relative_attention_max_distance" in hints
            else ", max_distance 128 (Wan's value)"
        )
    fields = dict(
        vocab_size=vocab,
        dim=dim,
        ffn_dim=ffn,
        num_heads=heads,
        head_dim=attn_dim // heads,
        num_layers=num_layers,
        num_buckets=buckets,
        max_distance=max_distance,
        eps=float(hints.get("layer_norm_epsilon", 1e-6)),
        text_len=text_len,
    )
    for name, key in (("pad_id", "pad_token_id"), ("eos_id", "eos_token_id")):
        if isinstance(hints.get(key), int):
            fields[name] = hints[key]
    try:
        config = UMT5Config(**fields)
    except ValueError as e:
        raise ConversionError(f"{where}: the inferred umT5 config is invalid: {e}") from None
    for name, p in PRESETS.items():
        if p == config:
            origin += f" (= preset {name})"
    return config, origin


def replace_problem(path: str) -> str | None:
    """None if ``path`` is a jaxkv text-encoder directory (its tokenizer files included) that ``force`` may
    replace; otherwise why not."""
    return files.directory_problem(
        path,
        required=(checkpoint.CONFIG_FILE, checkpoint.PARAMS_FILE),
        optional=TOKENIZER_FILES,
        formats=(checkpoint.FORMAT,),
    )


def _pieces(source: Source, key: str, transpose: bool) -> list[Piece]:
    """The pieces of source tensor ``key``: a linear weight (at most ffn x dim) as one transposed copy; anything
    else (e.g. the 256,384-row embedding) in row blocks of about PIECE_BYTES, so a cast copy stays small."""
    if transpose:
        return [source_piece(source, key, np.transpose)]
    shape = source.shapes[key]
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * DTYPES[source.dtypes[key]].itemsize)
    rows = max(1, PIECE_BYTES // row_bytes)
    starts = range(0, max(1, shape[0]), rows)
    return [
        source_piece(
            source,
            key,
            lambda a, i=i: a[i : i + rows],
            label=key if len(starts) == 1 else f"{key} rows {i}:{min(i + rows, shape[0])}",
            release=i == starts[-1],
        )
        for i in starts
    ]


def write_umt5_checkpoint(
    plan: UMT5Plan,
    dst: str,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log=None,
) -> WriteResult:
    """Streams ``plan`` into the jaxkv text-encoder directory ``dst`` (atomically), with the tokenizer copied
    beside and the fingerprint of the written params in config.json, under the rules of
    `jaxkv.convert.stream.write_tensor_directory` (destination checks, NaN/Inf refused by name unless
    ``allow_nonfinite``; ``force`` replaces only a jaxkv text-encoder directory). ``dtype``: 'bf16' or 'f32' for
    every parameter. Returns what was written."""
    out = output_dtype(dtype)
    shapes = flat_param_shapes(plan.config)
    source = plan.source
    tensors = [
        (key, shapes[key], [p for src_key, t in parts for p in _pieces(source, src_key, t)])
        for key, parts in plan.items.items()
    ]
    metadata = {
        "format": checkpoint.FORMAT,
        "format_version": str(checkpoint.FORMAT_VERSION),
        "source": source.description,
        "source_layout": plan.layout,
    }
    data = hashlib.sha256()  # over the data region, fed piece by piece as written (no second pass over 11 GB)

    def finish(params_path: str) -> dict[str, str | bytes]:
        with open(params_path, "rb") as f:
            raw_n = f.read(8)
            header = raw_n + f.read(struct.unpack("<Q", raw_n)[0])
        fingerprint = checkpoint.combine_fingerprint(hashlib.sha256(header).digest(), data.digest())
        out: dict[str, str | bytes] = {}
        for name, content in plan.tokenizer_files.items():
            if not isinstance(content, bytes):
                with open(content, "rb") as f:
                    content = f.read()
            out[name] = content
        out[checkpoint.CONFIG_FILE] = checkpoint.config_json(
            plan.config, fingerprint, source=source.description, tokenizer=plan.tokenizer_origin
        )
        return out

    copied = [p for p in plan.tokenizer_files.values() if not isinstance(p, bytes)]
    return write_tensor_directory(
        dst,
        tensors,
        dtype=out,
        metadata=metadata,
        extra_files=finish,
        replaceable=replace_problem,
        force=force,
        sources=[*source.paths, *copied],
        allow_nonfinite=allow_nonfinite,
        progress=progress,
        log=log,
        params_file=checkpoint.PARAMS_FILE,
        on_piece=lambda values: data.update(values.reshape(-1).view(np.uint8).data),
        desc="convert umT5",
    )


def convert_umt5(
    src: str,
    dst: str,
    *,
    tokenizer: str | None = None,
    text_len: int = 512,
    max_distance: int | None = None,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
) -> UMT5Plan:
    """`plan_umt5_conversion` then `write_umt5_checkpoint`; returns the plan. Raises ConversionError."""
    plan = plan_umt5_conversion(src, tokenizer=tokenizer, text_len=text_len, max_distance=max_distance)
    try:
        write_umt5_checkpoint(plan, dst, dtype=dtype, force=force, progress=progress, allow_nonfinite=allow_nonfinite)
    finally:
        plan.source.close()
    return plan
