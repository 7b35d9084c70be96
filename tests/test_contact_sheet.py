"""`jaxkv.generate.contact_sheet`: the frames chosen are evenly spaced over the whole stream (the closed form: the
smallest power-of-two stride that leaves at most slots - 1 multiples, plus the last frame), memory and image are
bounded however long the stream runs, the tiles are the frames themselves, large frames are subsampled."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.generate.contact_sheet import ContactSheet
from tests.helpers.images import read_png


def _numbered(first, n, batch=1, size=4):
    """uint8 [batch, n, size, size, 3] whose frame i (of the stream) reads (i % 256, i // 256, video)."""
    idx = np.arange(first, first + n)
    frames = np.zeros((batch, n, size, size, 3), np.uint8)
    frames[..., 0] = (idx % 256)[None, :, None, None]
    frames[..., 1] = (idx // 256)[None, :, None, None]
    frames[..., 2] = np.arange(batch)[:, None, None, None]
    return frames


def _expected(total, slots):
    stride = 1
    while len(range(0, total, stride)) > slots - 1:
        stride *= 2
    return sorted(set(range(0, total, stride)) | {total - 1})


@pytest.mark.parametrize("total,chunk", [(1, 1), (9, 3), (31, 1), (32, 4), (33, 3), (720, 3), (1001, 12)])
def test_frames_are_evenly_spaced_first_and_last_included(tmp_path, total, chunk):
    sheet = ContactSheet(str(tmp_path / "c.png"))
    seen = 0
    while seen < total:
        n = min(chunk, total - seen)
        sheet.add(_numbered(seen, n))
        seen += n
        assert len(sheet.kept) <= 31  # memory: the kept frames, plus the latest one
    shown = sheet.shown()
    assert shown == _expected(total, 32)
    assert shown[0] == 0 and shown[-1] == total - 1 and len(shown) <= 32
    if total >= 64:
        assert len(shown) >= 16  # never fewer than half the slots
        gaps = np.diff(shown[:-1])
        assert len(set(gaps)) == 1  # evenly spaced (the last frame aside)
    info = sheet.write()
    assert info["contact_sheet_frames"] == shown
    image = read_png(tmp_path / "c.png")
    cols = min(len(shown), 8)
    rows = -(-len(shown) // 8)
    assert image.shape == (rows * 5 - 1, cols * 5 - 1, 3)
    for k, i in enumerate(shown):  # each tile is the frame it names
        tile = image[(k // 8) * 5 : (k // 8) * 5 + 4, (k % 8) * 5 : (k % 8) * 5 + 4]
        assert (tile[..., 0] == i % 256).all() and (tile[..., 1] == i // 256).all()


def test_batches_device_arrays_and_large_frames(tmp_path):
    # two videos, jax arrays (kept as device slices until write), frames of 600 x 300 -> every 3rd pixel
    sheet = ContactSheet(str(tmp_path / "c.png"), columns=4, rows=2)
    for start in range(0, 40, 4):
        sheet.add(jnp.asarray(_numbered(start, 4, batch=2, size=1)).repeat(600, axis=2).repeat(300, axis=3))
    shown = sheet.shown()
    assert shown == _expected(40, 8) == [0, 8, 16, 24, 32, 39]
    sheet.write()
    image = read_png(tmp_path / "c.png")
    th, tw = 200, 100  # ceil(600 / 256) = 3
    assert image.shape == (4 * th + 3, 4 * tw + 3, 3)  # 2 videos x 2 rows of 4 tiles
    second = image[2 * (th + 1) : 2 * (th + 1) + th, 0:tw]  # video 1, its first tile
    assert (second[..., 2] == 1).all() and (second[..., 0] == 0).all()
    last = image[3 * (th + 1) : 3 * (th + 1) + th, (tw + 1) : (tw + 1) + tw]  # video 1, frame 39
    assert (last[..., 0] == 39).all()


def test_nothing_arrived_writes_nothing_and_bad_input_is_refused(tmp_path):
    sheet = ContactSheet(str(tmp_path / "c.png"))
    assert sheet.write() == {} and not (tmp_path / "c.png").exists()
    with pytest.raises(ValueError, match=r"uint8 \[batch, n, H, W, 3\]"):
        sheet.add(np.zeros((1, 2, 4, 4), np.uint8))
    with pytest.raises(ValueError, match="at least 2 slots"):
        ContactSheet(str(tmp_path / "d.png"), columns=1, rows=1)
