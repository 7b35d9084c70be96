"""Streaming mp4 output: frames are appended as they are decoded and encoded on a host thread.

`VideoWriter` encodes H.264 with PyAV (whose wheel ships ffmpeg; no system ffmpeg needed) into a *fragmented* mp4
(``empty_moov`` + one fragment per frame, flushed to the file as it is muxed), so the file is playable at every
moment: a run stopped by an exception or Ctrl-C is finalised by `close` (use the writer as a context manager), and
even a killed process leaves an mp4 of everything appended but the last frame (whose fragment the muxer writes
when the next frame arrives). ``tune=zerolatency`` keeps the encoder from holding frames back.

`append` returns at once: the frames (numpy or jax arrays, possibly still being computed on the device) go to a
queue, and the thread that converts and encodes them is the only one that waits for them — a caller that decodes
chunk k and then dispatches the denoising of chunk k+1 is never blocked by the encoder.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np

__all__ = ["VideoWriter", "to_uint8", "read_video_info"]


def to_uint8(frames) -> Any:
    """Decoded frames in [-1, 1] (any float dtype, numpy or jax) -> uint8 in [0, 255]: ``round((x + 1) * 127.5)``,
    values outside [-1, 1] saturate. Keeps the array type (a jax array stays on its device)."""
    if isinstance(frames, np.ndarray):
        xp = np
    else:
        import jax.numpy as xp
    x = (xp.clip(frames.astype(xp.float32), -1.0, 1.0) + 1.0) * 127.5
    return xp.round(x).astype(xp.uint8)


class VideoWriter:
    """An mp4 that grows as frames are appended.

    Args:
      path: output file (.mp4); replaced if it exists.
      fps: frames per second (Wan: 16).
      crf: x264 quality (0 lossless ... 51; 18 is visually lossless).
      max_pending: appended batches that may wait for the encoder before `append` blocks (bounds host memory).

    Frames are ``uint8 [n, H, W, 3]`` RGB (see `to_uint8`); H and W even (yuv420p) and the same for every append.
    Errors in the encoder thread are raised by the next `append` or by `close`.
    """

    def __init__(self, path: str, fps: int = 16, *, crf: int = 18, max_pending: int = 4):
        import av

        from jaxkv.validate import check_int

        self.path = path
        self.fps = check_int("fps", fps, minimum=1)
        self._crf = check_int("crf", crf, minimum=0, maximum=51)
        self._av = av
        self._container = av.open(
            path,
            "w",
            format="mp4",
            options={"movflags": "frag_every_frame+empty_moov+default_base_moof"},
            container_options={"flush_packets": "1"},
        )
        self._stream = None
        self._size: tuple[int, int] | None = None
        self.frames_appended = 0
        self.frames_written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=check_int("max_pending", max_pending, minimum=1))
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxkv-video-writer", daemon=True)
        self._thread.start()

    def append(self, frames) -> None:
        """Queues ``frames uint8 [n, H, W, 3]`` (or one frame ``[H, W, 3]``) for encoding; returns at once."""
        if self._closed:
            raise ValueError(f"append to {self.path} after close()")
        self._raise_error()
        shape, dtype = tuple(frames.shape), np.dtype(frames.dtype)
        if len(shape) == 3:
            frames, shape = frames[None], (1, *shape)
        if len(shape) != 4 or shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [n, height, width, 3] RGB, got shape {shape}")
        if dtype != np.uint8:
            raise ValueError(f"frames must be uint8 (convert decoded [-1, 1] floats with to_uint8), got {dtype}")
        if shape[1] % 2 or shape[2] % 2:
            raise ValueError(f"frame height and width must be even for yuv420p H.264, got {shape[1]}x{shape[2]}")
        if self._size is None:
            self._size = (shape[1], shape[2])
        elif self._size != (shape[1], shape[2]):
            raise ValueError(
                f"frames of size {shape[1]}x{shape[2]} appended to a {self._size[0]}x{self._size[1]} video"
            )
        self.frames_appended += shape[0]
        self._queue.put(frames)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain after a failure; the error is reported to the caller
            try:
                self._encode(np.asarray(item))  # waits for a device array here, on this thread
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = e

    def _encode(self, frames: np.ndarray) -> None:
        if self._stream is None:
            stream = self._container.add_stream(
                "libx264", rate=self.fps, options={"tune": "zerolatency", "preset": "veryfast", "crf": str(self._crf)}
            )
            stream.height, stream.width = frames.shape[1], frames.shape[2]
            stream.pix_fmt = "yuv420p"
            self._stream = stream
        for frame in frames:
            video_frame = self._av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            for packet in self._stream.encode(video_frame):
                self._container.mux(packet)
            self.frames_written += 1

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, OSError):  # a full disk or a file-size limit: `jaxkv.files.WriteError`
                from jaxkv.files import write_error

                raise write_error(self.path, error) from error
            raise RuntimeError(f"encoding {self.path} failed: {error}") from error

    def close(self) -> None:
        """Encodes everything queued, flushes the encoder and finalises the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            if self._stream is not None and self._error is None:
                for packet in self._stream.encode(None):
                    self._container.mux(packet)
        finally:
            self._container.close()
        self._raise_error()

    def __enter__(self) -> "VideoWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_video_info(path: str) -> dict[str, Any]:
    """{"frames", "height", "width", "fps"} of a video file, by decoding it with PyAV (for tests and checks)."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        rate = stream.average_rate or stream.guessed_rate
        return {"frames": frames, "height": stream.height, "width": stream.width, "fps": float(rate) if rate else None}
