"""The streaming mp4 writer: frames read back with PyAV's reader (count, size, fps, content), a killed writer
process still leaves a playable file, and bad input is refused before anything is queued."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("av")

from jaxkv.video import VideoWriter, read_video_info, to_uint8


def _frames(n, h=32, w=48, start=0):
    # Flat grey levels, one per frame: survive H.264 almost exactly, so content can be checked.
    return np.stack([np.full((h, w, 3), (40 + 20 * (start + i)) % 256, np.uint8) for i in range(n)])


def _decoded_means(path):
    import av

    with av.open(path) as c:
        return [float(f.to_ndarray(format="rgb24").mean()) for f in c.decode(video=0)]


def test_write_and_read_back(tmp_path):
    path = str(tmp_path / "a.mp4")
    with VideoWriter(path, fps=16) as video:
        video.append(_frames(1))
        video.append(_frames(4, start=1))
        video.append(_frames(4, start=5)[0])  # a single [H, W, 3] frame
    assert video.frames_written == video.frames_appended == 6
    assert read_video_info(path) == {"frames": 6, "height": 32, "width": 48, "fps": 16.0}
    np.testing.assert_allclose(_decoded_means(path), [40 + 20 * i for i in range(6)], atol=2)


def test_close_early_keeps_what_was_appended(tmp_path):
    path = str(tmp_path / "b.mp4")
    video = VideoWriter(path, fps=8)
    video.append(_frames(5))
    video.close()
    video.close()  # idempotent
    assert read_video_info(path)["frames"] == 5
    with pytest.raises(ValueError, match="after close"):
        video.append(_frames(1))


def test_killed_process_leaves_a_playable_file(tmp_path):
    """SIGKILL right after 9 frames were encoded: the fragmented mp4 on disk decodes, with at least 8 of them
    (the muxer writes a frame's fragment when the next one arrives)."""
    path = str(tmp_path / "killed.mp4")
    script = textwrap.dedent(f"""
        import os, signal, time
        import numpy as np
        from jaxkv.video import VideoWriter
        w = VideoWriter({path!r}, fps=16)
        w.append(np.full((1, 32, 48, 3), 40, np.uint8))
        w.append(np.full((8, 32, 48, 3), 120, np.uint8))
        while w.frames_written < 9:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    info = read_video_info(path)
    assert 8 <= info["frames"] <= 9 and (info["height"], info["width"], info["fps"]) == (32, 48, 16.0)


def test_bad_frames_are_refused(tmp_path):
    with VideoWriter(str(tmp_path / "c.mp4")) as video:
        with pytest.raises(ValueError, match="uint8"):
            video.append(np.zeros((1, 32, 48, 3), np.float32))
        with pytest.raises(ValueError, match=r"\[n, height, width, 3\]"):
            video.append(np.zeros((1, 32, 48, 4), np.uint8))
        with pytest.raises(ValueError, match="even"):
            video.append(np.zeros((1, 31, 48, 3), np.uint8))
        video.append(_frames(2))
        with pytest.raises(ValueError, match="16x48 appended to a 32x48 video"):
            video.append(_frames(1, h=16))
    assert read_video_info(str(tmp_path / "c.mp4"))["frames"] == 2
    with pytest.raises(ValueError, match="fps must be >= 1"):
        VideoWriter(str(tmp_path / "d.mp4"), fps=0)


def test_to_uint8():
    x = np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0], np.float32)
    np.testing.assert_array_equal(to_uint8(x), [0, 0, 128, 191, 255, 255])  # round((x + 1) * 127.5), saturating
    import jax.numpy as jnp

    np.testing.assert_array_equal(np.asarray(to_uint8(jnp.asarray(x))), to_uint8(x))
