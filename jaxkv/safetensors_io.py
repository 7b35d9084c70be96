"""Tensor-at-a-time safetensors reading and writing, so memory never holds a whole checkpoint (used by
`wan.load`, the converters and anything else that streams weights).

The format: an 8-byte little-endian header length N, N bytes of JSON (``{key: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, offsets relative to the end of the header), then the
raw little-endian tensor bytes. Reading maps one tensor's byte range at a time (`np.memmap`), and the mapping is
released when the returned array is dropped. Writing computes the whole header from shapes and dtypes up front,
then appends each tensor's bytes — in pieces if wanted, which is how a ``[L, ...]`` stack is written one layer
slice at a time without ever being assembled in memory. `read_array` reads one tensor with plain file reads
(no mapping whose pages would stay resident), casting block by block, so a loader holds only its outputs.

Every problem with a file is a `FormatError` naming the file (the converters re-raise it as ConversionError).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

# safetensors dtype names <-> numpy dtypes (little-endian). Only floating types are model weights here.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Integer and bool dtypes are recognised so a header that holds them is not called corrupt; they are never weights.
_OTHER_ITEMSIZE = {
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER = 100 * 1024 * 1024


class FormatError(ValueError):
    """A safetensors file is missing, corrupt or truncated, or holds a tensor that is not a float weight."""


def dtype_name(dtype) -> str:
    """numpy dtype -> safetensors name ('F32', 'BF16', ...)."""
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise FormatError(f"dtype {np.dtype(dtype)} cannot be stored; expected one of {sorted(DTYPES)}") from None


class TensorInfo:
    """One header entry: dtype name, shape and absolute byte range in the file."""

    __slots__ = ("dtype", "shape", "start", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.dtype, self.shape, self.start, self.end = dtype, shape, start, end


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parses and checks a safetensors header without reading any tensor data.

    Returns ({key: TensorInfo with absolute offsets}, metadata). Raises FormatError naming the file for a file
    that is too short, a header that is not JSON or whose entries are inconsistent, and a truncated data section.
    """
    size = os.path.getsize(path)
    if size < 8:
        raise FormatError(
            f"{path} is not a safetensors file: it holds {size} bytes, fewer than the 8-byte header length"
        )
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER):
            raise FormatError(
                f"{path} is corrupt or not a safetensors file: its header claims {n} bytes but "
                f"the file holds {size} bytes"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(
            f"{path} is corrupt or not a safetensors file: its header is not a JSON object ({e})"
        ) from None
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    needed = 0
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise FormatError(
                f"{path} is corrupt: header entry {key!r} is not "
                f"{{dtype, shape, data_offsets: [begin, end]}}: {entry!r}"
            ) from None
        itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else _OTHER_ITEMSIZE.get(dtype)
        if itemsize is None:
            raise FormatError(f"{path}: tensor {key!r} has unknown dtype {dtype!r}")
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            raise FormatError(
                f"{path} is corrupt: tensor {key!r} ({dtype}, shape {list(shape)}) has byte "
                f"range [{begin}, {end}), which does not hold {math.prod(shape) * itemsize} bytes"
            )
        needed = max(needed, end)
        infos[key] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    if needed > data_len:
        raise FormatError(
            f"{path} is truncated: its header describes {needed} bytes of tensor data but the file "
            f"holds {data_len} (file size {size}); re-download or re-save it"
        )
    return infos, {str(k): str(v) for k, v in metadata.items()}


def read_tensor(path: str, info: TensorInfo) -> np.ndarray:
    """Memory-maps one tensor read-only: ``[*info.shape]`` in its stored dtype; the map closes with the array."""
    if info.dtype not in DTYPES:
        raise FormatError(
            f"{path}: tensor of dtype {info.dtype} is not a floating-point weight; expected one of {sorted(DTYPES)}"
        )
    dtype = DTYPES[info.dtype]
    if info.end == info.start:
        return np.zeros(info.shape, dtype)
    flat = np.memmap(path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.end - info.start,))
    return flat.view(dtype).reshape(info.shape)


def _read_exactly(f, path: str, buffer: np.ndarray) -> None:
    raw = buffer.reshape(-1).view(np.uint8)
    done = 0
    while done < raw.size:
        n = f.readinto(memoryview(raw[done:]))
        if not n:
            raise FormatError(f"{path} is truncated: tensor data ends early")
        done += n


def read_array(path: str, info: TensorInfo, dtype=None, *, block_bytes: int = 16 * 2**20) -> np.ndarray:
    """Reads one tensor into a new array ``[*info.shape]`` of ``dtype`` (None: the stored dtype).

    Plain reads, not a memory map: no page of the file stays mapped (and counted in the resident set) afterwards.
    A cast goes through one scratch block of about ``block_bytes``, so the only full-size array is the result.
    """
    stored = DTYPES.get(info.dtype)
    if stored is None:
        raise FormatError(
            f"{path}: tensor of dtype {info.dtype} is not a floating-point weight; expected one of {sorted(DTYPES)}"
        )
    out = np.empty(info.shape, stored if dtype is None else np.dtype(dtype))
    flat = out.reshape(-1)
    with open(path, "rb", buffering=0) as f:
        f.seek(info.start)
        if out.dtype == stored:
            _read_exactly(f, path, flat)
            return out
        step = max(1, block_bytes // stored.itemsize)
        scratch = np.empty(min(step, flat.size), stored)
        for begin in range(0, flat.size, step):
            part = scratch[: min(step, flat.size - begin)]
            _read_exactly(f, path, part)
            flat[begin : begin + part.size] = part  # the cast, one block at a time
    return out


def _slice_bounds(index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of a basic index (a tuple of step-1 slices, shorter tuples padded with ':')."""
    index = tuple(index) if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise ValueError(f"expected a tuple of at most {len(shape)} slices, got {index!r}")
    bounds = []
    for s, dim in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"slice {s!r} has step {step}; only contiguous slices are read")
        bounds.append((start, max(start, stop)))
    return bounds


def read_slice(path: str, info: TensorInfo, index, dtype=None) -> np.ndarray:
    """Reads only ``tensor[index]`` (``index``: a tuple of step-1 slices, as ``jax.make_array_from_callback``
    passes for one shard) into a new array of ``dtype`` (None: the stored dtype).

    The slice is read as its contiguous runs (the trailing dimensions it takes whole, times its extent on the
    first one it cuts) with one positioned read each, so a process reads the bytes of its shards and no more (a
    column-sharded ``[layers, in, out]`` kernel: ``layers * in`` runs of ``out / shards`` elements).
    """
    stored = DTYPES.get(info.dtype)
    if stored is None:
        raise FormatError(
            f"{path}: tensor of dtype {info.dtype} is not a floating-point weight; expected one of {sorted(DTYPES)}"
        )
    shape = info.shape
    bounds = _slice_bounds(index, shape)
    out = np.empty([stop - start for start, stop in bounds], stored)
    if out.size:
        # the first dimension from which the slice takes everything: dims >= cut form whole rows of one run
        cut = len(shape)
        while cut > 0 and bounds[cut - 1] == (0, shape[cut - 1]):
            cut -= 1
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        runs = np.zeros(1, np.int64)  # element offset of each run, in C order of the slice
        for d in range(cut - 1):
            runs = (runs[:, None] + np.arange(*bounds[d], dtype=np.int64) * strides[d]).reshape(-1)
        if cut:
            start, stop = bounds[cut - 1]
            runs, run_len = runs + start * strides[cut - 1], (stop - start) * strides[cut - 1]
        else:
            run_len = out.size
        flat = out.reshape(-1).view(np.uint8)
        nbytes = run_len * stored.itemsize
        fd = os.open(path, os.O_RDONLY)
        try:
            for n, offset in enumerate(runs.tolist()):
                view = memoryview(flat[n * nbytes : (n + 1) * nbytes])
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [view[done:]], info.start + offset * stored.itemsize + done)
                    if not got:
                        raise FormatError(f"{path} is truncated: tensor data ends early")
                    done += got
        finally:
            os.close(fd)
    return out if dtype is None or np.dtype(dtype) == stored else out.astype(dtype)


class StreamWriter:
    """Writes a safetensors file whose tensors arrive one after another, each in one or more C-ordered pieces.

    The header is fixed at construction from ``specs`` [(key, dtype, shape)] in write order, so the pieces go
    straight to disk; `write` checks that they arrive in that order with the declared dtype and sizes, and
    `close` that every byte was written (a wrong plan is a bug, and must not yield a plausible-looking file).
    """

    def __init__(
        self, path: str, specs: Iterable[tuple[str, object, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ):
        self._order: list[tuple[str, np.dtype, int]] = []
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for key, dtype, shape in specs:
            dtype = np.dtype(dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((key, dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as the reference writer does
        self.path = path
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._index, self._left = -1, 0
        self._advance()

    def _advance(self) -> None:
        # Moves past the finished tensor (and any empty ones after it).
        while self._left == 0 and self._index < len(self._order):
            self._index += 1
            self._left = self._order[self._index][2] if self._index < len(self._order) else 0

    def write(self, key: str, piece: np.ndarray) -> None:
        """Appends the next piece of tensor ``key`` (C order, the declared dtype)."""
        if self._index >= len(self._order):
            raise RuntimeError(f"write({key!r}) after every declared tensor was written")
        want_key, dtype, _ = self._order[self._index]
        if key != want_key or piece.dtype != dtype:
            raise RuntimeError(f"write({key!r}, {piece.dtype}) out of plan: expected {want_key!r} in {dtype}")
        if piece.nbytes > self._left:
            raise RuntimeError(f"{key}: {piece.nbytes} bytes written but only {self._left} remain in the tensor")
        # Raw bytes through a uint8 view: no copy for a C-ordered piece, and no buffer-protocol format for bf16.
        self._file.write(np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data)
        self._left -= piece.nbytes
        self._advance()

    def close(self) -> None:
        """Checks completeness, flushes and fsyncs."""
        try:
            if self._index < len(self._order):
                raise RuntimeError(f"tensor {self._order[self._index][0]!r} and later ones were not (fully) written")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()
