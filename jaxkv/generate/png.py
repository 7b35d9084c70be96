"""A minimal PNG writer for 8-bit RGB images (the preview), so the core package needs no image library.

Kept hand-written on purpose: it is a dozen lines of the PNG spec (signature, IHDR, one zlib IDAT with filter 0,
IEND), tested against an independent reader and Pillow when present, while Pillow/imageio are not dependencies of
jaxkv. Should the mp4 output add imageio as a dependency, this can become ``imageio.v3.imwrite``.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from jaxkv import files


def write_png(path: str, image: np.ndarray) -> None:
    """Writes uint8 [height, width, 3] as an 8-bit RGB PNG (no filtering, zlib-compressed), atomically: into a
    temporary file beside ``path`` that is renamed onto it when complete (`jaxkv.files.write_file`: a failed write
    leaves no temporary and raises `jaxkv.files.WriteError` naming ``path``)."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise ValueError(
            f"write_png expects uint8 [height, width, 3] with height, width >= 1, got {image.dtype}{list(image.shape)}"
        )
    image = np.ascontiguousarray(image)
    h, w, _ = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1)  # filter byte 0 per row
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )
    files.write_file(path, png)
