"""Readers for the checkpoint files people have: safetensors (one file, or shards with an index) and PyTorch
``.pt`` training checkpoints. A reader lists every tensor's shape from headers alone and reads one tensor at a
time, memory-mapped, so a conversion never holds the checkpoint.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import pickle
import re
from typing import Any

import ml_dtypes
import numpy as np

from jaxkv.convert.errors import ConversionError, listing
from jaxkv.convert.layouts import strip_prefixes
from jaxkv.convert.safetensors_io import TensorInfo, read_header, read_tensor

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# Entries of a training checkpoint that may hold the DiT's state dict, in order of preference.
_EMA_ENTRY, _RAW_ENTRIES = "generator_ema", ("generator", "model", "state_dict")


class Source:
    """A checkpoint opened for streaming.

    Attributes:
      description: what was opened ("diffusers safetensors, 2 shards in ...").
      shapes: {prefix-stripped key: shape}.
      dtypes: {key: dtype name}.
      hints: config values stored beside the weights (a config.json), possibly empty.
      paths: every file this source reads (an output must never replace one of them).
    """

    description: str
    paths: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    hints: dict[str, Any]

    def read(self, key: str) -> np.ndarray:
        """``[*shapes[key]]`` in its stored floating dtype, memory-mapped where the format allows."""
        raise NotImplementedError

    def release(self, key: str) -> None:
        """Called once ``key`` has been converted and written: lets the reader drop its pages."""

    def close(self) -> None:
        pass


def _strip_all(keys, where: str) -> dict[str, str]:
    """{stripped key: original key}; two originals colliding on one name is an error."""
    out: dict[str, str] = {}
    for key in keys:
        short = strip_prefixes(key)
        if short in out:
            raise ConversionError(
                f"{where}: keys {out[short]!r} and {key!r} both name tensor {short!r} once wrapper prefixes are removed"
            )
        out[short] = key
    return out


class SafetensorsSource(Source):
    def __init__(
        self,
        files: list[str],
        description: str,
        hints: dict[str, Any] | None = None,
        weight_map: dict[str, str] | None = None,
        extra_paths: list[str] = (),
    ):
        self.description, self.hints = description, hints or {}
        self.paths = [*files, *extra_paths]
        self._where: dict[str, tuple[str, TensorInfo]] = {}
        for path in files:
            infos, _ = read_header(path)
            for key, info in infos.items():
                if key in self._where:
                    raise ConversionError(f"tensor {key!r} appears in both {self._where[key][0]} and {path}")
                self._where[key] = (path, info)
        if weight_map is not None:
            # The index must describe the shards exactly, or one of them is stale or missing.
            for key, fname in sorted(weight_map.items()):
                if key not in self._where:
                    raise ConversionError(f"the shard index lists tensor {key!r} in {fname}, but no shard holds it")
            extra = sorted(set(self._where) - set(weight_map))
            if extra:
                raise ConversionError(f"shards hold tensors the index does not list: {listing(extra)}")
        self._names = _strip_all(self._where, description)
        self.shapes = {k: self._where[o][1].shape for k, o in self._names.items()}
        self.dtypes = {k: self._where[o][1].dtype for k, o in self._names.items()}

    def read(self, key: str) -> np.ndarray:
        path, info = self._where[self._names[key]]
        return read_tensor(path, info)


class TorchSource(Source):
    """A ``.pt`` file via ``torch.load(weights_only=True, mmap=True)``: tensors stay on disk until read."""

    def __init__(self, path: str, ema: bool | None):
        try:
            import torch
        except ImportError:
            raise ConversionError(
                f"{path} is a PyTorch checkpoint; reading it needs torch (pip install "
                f"'jaxkv[torch]'), which is not installed"
            ) from None
        self._torch = torch
        self.paths = [path]
        obj = _torch_load(torch, path)
        state, entry = _select_state_dict(torch, obj, path, ema)
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            raise ConversionError(f"{path}: {entry or 'the file'} holds no tensors")
        self.entry = entry
        self.description = f"PyTorch checkpoint {path}" + (f" (entry {entry!r})" if entry else "")
        self.hints = {}
        self._names = _strip_all(tensors, path)
        self._tensors = {k: tensors[o] for k, o in self._names.items()}
        self.shapes = {k: tuple(t.shape) for k, t in self._tensors.items()}
        names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
        self.dtypes = {k: names.get(t.dtype, str(t.dtype)) for k, t in self._tensors.items()}
        self._mapped = _file_mappings(path)

    def release(self, key: str) -> None:
        # torch maps the whole file once; pages read stay resident (clean, reclaimable page cache, but counted in
        # RSS and growing to the checkpoint's size). Drop the pages of a tensor once it is written. Only ranges
        # inside this file's own private mapping are dropped: there, a later access re-reads the file, whereas
        # dropping anonymous memory would zero it.
        if not self._mapped or key not in self._tensors:
            return
        storage = self._tensors[key].untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        for lo, hi in self._mapped:
            if lo <= start and start + size <= hi:
                page = _PAGE
                a, b = max(lo, start - start % page), min(hi, -(-(start + size) // page) * page)
                if b > a:
                    _madvise_dontneed(a, b - a)
                return

    def read(self, key: str) -> np.ndarray:
        torch, t = self._torch, self._tensors[key]
        if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits, still without a copy
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype not in (torch.float32, torch.float16, torch.float64):
            raise ConversionError(f"tensor {key!r} has dtype {t.dtype}; expected a floating-point weight")
        return t.numpy()

    def close(self) -> None:
        self._tensors = {}


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (Linux /proc/self/maps; empty elsewhere)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        return []
    return ranges


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _madvise_dontneed(address: int, length: int) -> None:
    import ctypes

    libc = _libc()
    if libc is not None and hasattr(libc, "madvise"):
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), 4)  # MADV_DONTNEED (Linux)


# torch.save writes a zip archive since torch 1.6; before, a pickle stream that starts with this magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _container(path: str) -> str:
    """'zip', 'legacy' or 'other', from the file's first bytes (nothing is unpickled)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head:
        return "legacy"
    return "other"


def _refusal(text: str) -> str:
    """The reason inside torch's weights_only refusal: which global it met and why it was blocked."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    glob_name = re.search(r"GLOBAL ([\w.]+)", text)
    why = ""
    blocked = re.search(r"whose module ([\w.]+) is blocked", text)
    if blocked:
        why = f", from module {blocked.group(1)}, which the weights-only loader blocks"
    elif "not an allowed global" in text:
        why = ", which is not an allowed global"
    if glob_name:
        return f"it references the Python object {glob_name.group(1)}{why}"
    return "it holds: " + " ".join(text.split())[:300]


def _torch_load(torch, path: str):
    kind = _container(path)
    if kind == "legacy":
        raise ConversionError(
            f"{path} uses the legacy (pre-1.6) torch.save format, which cannot be memory-mapped; "
            f"re-save it with a current torch.save"
        )
    if kind == "other":
        with open(path, "rb") as f:
            head = f.read(8)
        raise ConversionError(
            f"{path} is not a PyTorch checkpoint: torch.save files are zip archives (or, before "
            f"torch 1.6, a pickle starting with torch's magic number), but this file starts with "
            f"bytes {head!r}"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ConversionError(
            f"{path} was refused by torch.load(weights_only=True): {_refusal(str(e))}. Loading it without "
            f"weights_only would import and call that object, i.e. execute code stored in the file, so jaxkv does "
            f"not; if you trust the file, re-save just the state dict (torch.save({{'generator': "
            f"model.state_dict()}}, path)) from trusted code and convert that"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        msg = " ".join(str(e).split())
        msg = msg if len(msg) <= 200 else msg[:200] + "..."
        raise ConversionError(f"{path} is truncated or corrupt: torch.load could not read it ({msg})") from None


def _select_state_dict(torch, obj, path: str, ema: bool | None) -> tuple[dict, str | None]:
    """Picks the DiT state dict out of a training checkpoint: generator_ema / generator / model, or the file
    itself when it is a bare state dict. ``ema`` True/False demands generator_ema / the raw weights; None prefers
    generator_ema."""
    if not isinstance(obj, dict):
        raise ConversionError(
            f"{path}: expected a dict (a state dict or a training checkpoint), found {type(obj).__name__}"
        )
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        if ema:
            raise ConversionError(f"{path} is a bare state dict with no 'generator_ema' entry; drop --ema")
        return obj, None
    available = sorted(k for k, v in obj.items() if isinstance(v, dict))
    if ema is True:
        order = (_EMA_ENTRY,)
    elif ema is False:
        order = _RAW_ENTRIES
    else:
        order = (_EMA_ENTRY, *_RAW_ENTRIES)
    for name in order:
        if isinstance(obj.get(name), dict):
            return obj[name], name
    raise ConversionError(
        f"{path}: no {' / '.join(repr(n) for n in order)} entry to convert; the file holds "
        f"dict entries {available} and other entries "
        f"{sorted(k for k in obj if k not in available)}"
    )


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def open_source(src: str, ema: bool | None = None) -> Source:
    """Opens a checkpoint for streaming, detecting its container:

    * ``*.pt`` / ``.pth`` / ``.ckpt`` / ``.bin``: a PyTorch (training) checkpoint;
    * ``*.safetensors``: one safetensors file;
    * a directory: ``*.safetensors.index.json`` + shards, else its single ``*.safetensors`` file, else its single
      ``.pt`` file; a diffusers pipeline directory is entered at ``transformer/``. A ``config.json`` beside the
      weights is kept as hints (it holds the head count, which tensors cannot tell).
    """
    if not os.path.exists(src):
        raise ConversionError(f"{src} does not exist")
    if os.path.isfile(src):
        if src.endswith(TORCH_SUFFIXES):
            return TorchSource(src, ema)
        if src.endswith(".safetensors"):
            hints_path = os.path.join(os.path.dirname(src) or ".", "config.json")
            hints = _read_json(hints_path) if os.path.isfile(hints_path) else {}
            return SafetensorsSource([src], f"safetensors file {src}", hints, extra_paths=[hints_path] if hints else [])
        if src.endswith(".index.json"):
            return _sharded(src)
        raise ConversionError(
            f"{src}: unknown checkpoint format; expected a .safetensors file, a "
            f"*.safetensors.index.json, a PyTorch .pt/.pth/.ckpt file or a directory holding one"
        )
    if os.path.isdir(os.path.join(src, "transformer")) and not glob.glob(os.path.join(src, "*.safetensors")):
        src = os.path.join(src, "transformer")  # diffusers pipeline root: the DiT lives in transformer/
    indexes = sorted(glob.glob(os.path.join(src, "*.safetensors.index.json")))
    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    torch_files = sorted(f for f in glob.glob(os.path.join(src, "*")) if f.endswith(TORCH_SUFFIXES))
    if len(indexes) > 1:
        raise ConversionError(
            f"{src} holds several shard indexes {[os.path.basename(i) for i in indexes]}; pass the one to convert"
        )
    if indexes:
        return _sharded(indexes[0])
    if len(files) == 1:
        hints_path = os.path.join(src, "config.json")
        hints = _read_json(hints_path) if os.path.isfile(hints_path) else {}
        return SafetensorsSource(files, f"safetensors file {files[0]}", hints, extra_paths=[src])
    if len(files) > 1:
        raise ConversionError(
            f"{src} holds {len(files)} .safetensors files but no *.safetensors.index.json to say "
            f"how they fit together; pass the file to convert"
        )
    if len(torch_files) == 1:
        return TorchSource(torch_files[0], ema)
    raise ConversionError(
        f"{src}: unknown checkpoint format; the directory holds no .safetensors file, shard index "
        f"or single .pt file (found {sorted(os.listdir(src))[:10]})"
    )


def _sharded(index_path: str) -> Source:
    index = _read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{index_path}: expected a 'weight_map' of tensor name -> shard file")
    folder = os.path.dirname(index_path) or "."
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise ConversionError(f"{index_path} names shard files that are missing: {listing(missing)}")
    hints_path = os.path.join(folder, "config.json")
    hints = _read_json(hints_path) if os.path.isfile(hints_path) else {}
    return SafetensorsSource(
        [os.path.join(folder, s) for s in shards],
        f"sharded safetensors ({len(shards)} shards, index {index_path})",
        hints,
        weight_map,
        extra_paths=[index_path, hints_path] if hints else [index_path],
    )
