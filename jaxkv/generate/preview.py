"""The preview: a fixed linear latent-to-RGB projection of the latent frames, laid out as a bounded contact sheet.

The projection is not a VAE decode: channel c of C adds ``cos(2*pi*(c/C + j/3)) * sqrt(2/C)`` to colour j (R, G,
B: three phase-shifted cosines over the channels, so each colour has unit gain for unit-variance latents), and a
colour value y becomes the byte ``clip(127.5 + 50*y, 0, 255)``. Each latent pixel is drawn as a ``scale`` square
block; frames run left to right, ``columns`` to a row, each video below the previous one.

`PreviewSink` keeps only the first and the last ``frames`` frames of each video, so the image (and the memory held
for it) is bounded however many chunks are generated.
"""

from __future__ import annotations

import collections

import numpy as np

from jaxkv.generate.png import write_png
from jaxkv.validate import check_int


def latent_to_rgb(latents: np.ndarray) -> np.ndarray:
    """Fixed linear latent-to-RGB projection (see the module docstring).

    Args:
      latents: [..., channels] float.
    Returns:
      uint8 [..., 3].
    """
    c = latents.shape[-1]
    phase = np.arange(c)[:, None] / c + np.arange(3)[None, :] / 3.0
    projection = np.cos(2.0 * np.pi * phase) * np.sqrt(2.0 / c)  # [channels, 3]
    rgb = np.asarray(latents, np.float64) @ projection
    return np.clip(np.round(127.5 + 50.0 * rgb), 0, 255).astype(np.uint8)


def preview_image(latents: np.ndarray, scale: int = 4, gap: int = 1, columns: int = 12) -> np.ndarray:
    """[batch, frames, h, w, channels] -> uint8 [rows, cols, 3]: frames left to right in rows of ``columns``, each
    video below the previous one, each latent pixel a ``scale`` x ``scale`` block, tiles ``gap`` black pixels
    apart."""
    tiles = np.repeat(np.repeat(latent_to_rgb(latents), scale, axis=2), scale, axis=3)  # [b, f, H, W, 3]
    return tile_grid(tiles, columns, gap)


def tile_grid(tiles: np.ndarray, columns: int, gap: int = 1) -> np.ndarray:
    """uint8 [batch, frames, H, W, 3] -> uint8 [rows, cols, 3]: frames left to right in rows of ``columns`` (fewer
    when there are fewer frames), each video's rows below the previous video's, tiles ``gap`` black pixels apart.
    Shared by the preview and the contact sheet (`jaxkv.generate.contact_sheet`)."""
    b, f, th, tw, _ = tiles.shape
    cols = min(f, columns)
    rows_per_video = -(-f // cols)
    rows = b * rows_per_video
    image = np.zeros((rows * th + (rows - 1) * gap, cols * tw + (cols - 1) * gap, 3), np.uint8)
    for i in range(b):
        for j in range(f):
            r, c = i * rows_per_video + j // cols, j % cols
            image[r * (th + gap) : r * (th + gap) + th, c * (tw + gap) : c * (tw + gap) + tw] = tiles[i, j]
    return image


class PreviewSink:
    """Output sink for ``preview.png``: the first ``frames`` and the last ``frames`` frames of each video.

    With at most ``2 * frames`` frames in all it shows every frame (rows of ``frames``); beyond that, row one holds
    frames ``0 .. frames-1`` and row two the latest ``frames`` frames. Memory: at most ``2 * frames`` latent frames.
    The image is written on `close` (also after an interrupted run).
    """

    def __init__(self, path: str, frames: int, scale: int):
        self.path = path
        self.frames, self.scale = check_int("frames", frames, minimum=1), check_int("scale", scale, minimum=1)
        self.head: list[np.ndarray] = []  # each [batch, h, w, channels]
        self.tail: collections.deque = collections.deque(maxlen=frames)
        self.total = 0

    @property
    def names(self) -> tuple[str, ...]:
        """The entries of the output directory this sink writes."""
        return ("preview.png",)

    def write_chunk(self, index: int, latents: np.ndarray) -> None:
        """latents: float32 [batch, chunk_frames, h, w, channels] of chunk ``index`` (chunks arrive in order)."""
        for j in range(latents.shape[1]):
            frame = np.array(latents[:, j])
            (self.head if len(self.head) < self.frames else self.tail).append(frame)
            self.total += 1

    def shown(self) -> list[int]:
        """Indices of the frames the preview shows, in order."""
        return list(range(len(self.head))) + list(range(self.total - len(self.tail), self.total))

    def close(self) -> dict:
        """Writes the PNG (nothing when no frame arrived); returns what the summary records."""
        if not self.total:
            return {}
        latents = np.stack(self.head + list(self.tail), axis=1)  # [batch, shown, h, w, channels]
        write_png(self.path, preview_image(latents, self.scale, columns=self.frames))
        return {"preview": self.path, "preview_frames": self.shown()}
