"""``OUT/contact_sheet.png``: decoded frames spread evenly over the whole stream, in a grid, bounded however long the
stream runs.

The stream's length is not known in advance (a signal may stop it; a resumed session continues it), so the frames
are chosen as they arrive: frame i is kept while ``i % stride == 0``, and whenever the kept frames would exceed
``slots - 1`` the stride doubles and the kept frames off the new stride are dropped. The latest frame is kept
besides, so the sheet always ends with the stream's last frame. After N frames it shows frames 0, s, 2s, ... (the
largest power-of-two s that leaves at most ``slots - 1`` of them) and frame N - 1: between ``slots / 2`` and
``slots`` frames, evenly spaced, first and last included. Memory: at most ``slots`` frames per video, each
subsampled (every k-th pixel) to at most ``max_tile`` pixels a side; the PNG is bounded the same way.

Frames stay device arrays until `write` (a slice of a chunk still being decoded does not wait for it), so keeping
them never blocks the loop that dispatches the next chunk.
"""

from __future__ import annotations

import os

import numpy as np

from jaxkv.generate.png import write_png
from jaxkv.generate.preview import tile_grid
from jaxkv.validate import check_int

FILE = "contact_sheet.png"
COLUMNS = 8
ROWS = 4
MAX_TILE = 256  # pixels a side of a tile, at most: frames larger than this are subsampled


class ContactSheet:
    """Chooses and lays out the frames of ``contact_sheet.png`` (see the module docstring).

    Args:
      path: the PNG to write.
      columns, rows: the grid of each video (``slots = columns * rows`` frames at most).
      max_tile: larger frames are subsampled by ``ceil(max(H, W) / max_tile)``.
    """

    def __init__(self, path: str, columns: int = COLUMNS, rows: int = ROWS, max_tile: int = MAX_TILE):
        self.path = path
        self.columns = check_int("columns", columns, minimum=1)
        self.slots = self.columns * check_int("rows", rows, minimum=1)
        if self.slots < 2:
            raise ValueError(
                f"a contact sheet needs at least 2 slots (the first and the last frame), got {columns} x {rows}"
            )
        self.max_tile = check_int("max_tile", max_tile, minimum=1)
        self.stride = 1
        self.kept: dict[int, object] = {}  # frame index -> [batch, h, w, 3] (device or host array)
        self.last: tuple[int, object] | None = None
        self.total = 0

    @property
    def names(self) -> tuple[str, ...]:
        return (os.path.basename(self.path),)

    def add(self, frames) -> None:
        """The next decoded frames of the stream: uint8 [batch, n, H, W, 3] (numpy or jax)."""
        if frames.ndim != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [batch, n, H, W, 3], got {list(frames.shape)}")
        n = frames.shape[1]
        if n == 0:
            return
        k = -(-max(frames.shape[2], frames.shape[3]) // self.max_tile)
        for j in range(n):
            index = self.total + j
            if index % self.stride:
                continue
            self.kept[index] = frames[:, j, ::k, ::k]
            while len(self.kept) > self.slots - 1:
                self.stride *= 2
                self.kept = {i: f for i, f in self.kept.items() if i % self.stride == 0}
        self.total += n
        self.last = (self.total - 1, frames[:, n - 1, ::k, ::k])

    def shown(self) -> list[int]:
        """The indices of the frames the sheet shows, in order."""
        if self.last is None:
            return []
        return sorted(set(self.kept) | {self.last[0]})

    def write(self) -> dict:
        """Writes the PNG atomically (nothing when no frame arrived); returns what the summary records."""
        if self.last is None:
            return {}
        chosen = {**self.kept, self.last[0]: self.last[1]}
        indices = self.shown()
        tiles = np.stack([np.asarray(chosen[i]) for i in indices], axis=1)  # [batch, shown, h, w, 3]
        write_png(self.path, tile_grid(tiles, self.columns))
        return {"contact_sheet": self.path, "contact_sheet_frames": indices}
