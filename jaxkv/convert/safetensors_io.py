"""The converters' view of `jaxkv.safetensors_io`: the same streaming reader and writer, with file problems raised
as ConversionError (so `jaxkv convert` reports them like every other conversion problem)."""

from __future__ import annotations

import numpy as np

from jaxkv import safetensors_io as _io
from jaxkv.convert.errors import ConversionError
from jaxkv.safetensors_io import DTYPES, StreamWriter, TensorInfo

__all__ = ["DTYPES", "StreamWriter", "TensorInfo", "dtype_name", "read_header", "read_tensor"]


def dtype_name(dtype) -> str:
    """numpy dtype -> safetensors name ('F32', 'BF16', ...)."""
    try:
        return _io.dtype_name(dtype)
    except _io.FormatError as e:
        raise ConversionError(str(e)) from None


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """`jaxkv.safetensors_io.read_header`, raising ConversionError."""
    try:
        return _io.read_header(path)
    except _io.FormatError as e:
        raise ConversionError(str(e)) from None


def read_tensor(path: str, info: TensorInfo) -> np.ndarray:
    """`jaxkv.safetensors_io.read_tensor` (a read-only memory map), raising ConversionError."""
    try:
        return _io.read_tensor(path, info)
    except _io.FormatError as e:
        raise ConversionError(str(e)) from None
