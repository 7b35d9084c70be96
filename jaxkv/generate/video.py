"""The mp4 output of ``jaxkv generate``: `Mp4Sink` decodes each latent chunk as it arrives and appends the frames to
``OUT/video.mp4`` (``video_B.mp4`` per video for a batch > 1) and to the bounded ``OUT/contact_sheet.png``
(`jaxkv.generate.contact_sheet`), optionally also writing them to ``OUT/frames/``.

The decoder is any object with the `jaxkv.models.wan_vae.StreamDecoder` interface: ``decoder(latents [batch, T, h,
w, C]) -> uint8 [batch, n, H, W, 3]`` (asynchronous) and ``reset()``. Two exist: the Wan VAE's `StreamDecoder`
(T latent frames give ``1 + 4 (T - 1)`` video frames for the first chunk, ``4 T`` later: the VAE's causal first
frame) and the toy world's `jaxkv.toyworld.latents.FrameDecoder` (one frame per latent frame). Given the stream the
chunks come from, the sink decodes through `jaxkv.decoding.decode`: a Wan VAE's feature caches live in the stream's
carry (``stream.carry.extras["vae_decoder"]``), as a `jaxkv.pipeline.PipelineStream`'s do, so the stream's saved
session holds them; without a stream the decoder keeps its own state.

Nothing here waits for the device: `write_chunk` dispatches the decode and hands the resulting device array to the
`VideoWriter`, whose host thread is the one that waits for and encodes it. The loop has already dispatched the next
chunk's denoising, so the decode of chunk k overlaps it where the runtime runs them concurrently. Only ``--frames``
fetches the frames on the caller's thread (one chunk at a time).
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
import numpy as np

from jaxkv import decoding, files
from jaxkv.generate.contact_sheet import FILE as CONTACT_SHEET
from jaxkv.generate.contact_sheet import ContactSheet
from jaxkv.generate.outputs import FRAMES_DIR, array_bytes
from jaxkv.generate.png import write_png
from jaxkv.video import VideoWriter


def video_names(batch: int) -> tuple[str, ...]:
    """The mp4 file names of a run of ``batch`` videos."""
    return ("video.mp4",) if batch == 1 else tuple(f"video_{b}.mp4" for b in range(batch))


class Mp4Sink:
    """Output sink: latent chunk float32 [batch, T, h, w, C] -> decoded frames -> mp4, contact sheet (and
    ``--frames``).

    Args:
      out: the output directory.
      decoder: the frame decoder (see the module docstring) of ``batch`` streams, built for the latents' channels
        and size (checked by the caller).
      batch: the stream's batch (one mp4 per video).
      fps: frames per second of the mp4.
      frames: None, "png" (``frames/frame_B_NNNNNN.png`` per video frame) or "npy" (``frames/chunk_NNNNNN.npy``,
        uint8 [batch, n, H, W, 3] per chunk).
      stream: the `jaxkv.stream.Stream` the chunks come from, whose carry holds the decoder's state (`warm_up`
        hands it over, `jaxkv.decoding`); None: the decoder keeps its own.
    """

    def __init__(self, out: str, decoder, *, batch: int, fps: int, frames: str | None = None, stream=None):
        if frames not in (None, "png", "npy"):
            raise ValueError(f"frames must be None, 'png' or 'npy', got {frames!r}")
        self.decoder, self.stream = decoder, stream
        self.paths = [os.path.join(out, n) for n in video_names(batch)]
        self.fps, self.frames, self.frames_dir = fps, frames, os.path.join(out, FRAMES_DIR)
        self.sheet = ContactSheet(os.path.join(out, CONTACT_SHEET))
        self.names = video_names(batch) + self.sheet.names + ((FRAMES_DIR,) if frames else ())
        if frames:
            os.makedirs(self.frames_dir, exist_ok=True)
        self.writers = [VideoWriter(p, fps) for p in self.paths]
        self.video_frames = 0  # per video
        self.size: tuple[int, int] | None = None
        self.closed_at: float | None = None

    def warm_up(self, chunk_shape: tuple[int, ...]) -> float:
        """Compiles the decode (one chunk of zeros, waited for, then the decoder reset) so that no chunk's timing
        carries the VAE's compilation; returns the seconds it took. The stream's carried decoder state is not
        touched."""
        start = time.perf_counter()
        np.asarray(self.decoder(jnp.zeros(chunk_shape, jnp.float32)))
        self.decoder.reset()
        return time.perf_counter() - start

    def decode(self, latents):
        """Frames uint8 [batch, n, H, W, 3] of the latents [batch, T, h, w, C], still being computed; with a stream,
        from (and back into) the decoder state it carries."""
        if self.stream is None:
            return self.decoder(jnp.asarray(latents))
        return decoding.decode(self.stream, self.decoder, jnp.asarray(latents))

    def write_chunk(self, index: int, latents: np.ndarray) -> None:
        frames = self.decode(latents)  # uint8 [batch, n, H, W, 3], still being computed
        first = self.video_frames
        self.video_frames += frames.shape[1]
        self.size = (int(frames.shape[2]), int(frames.shape[3]))
        for b, writer in enumerate(self.writers):
            writer.append(frames[b])
        self.sheet.add(frames)
        if self.frames == "npy":
            path = os.path.join(self.frames_dir, f"chunk_{index:06d}.npy")
            files.write_file(path, array_bytes(np.asarray(frames), "npy"))
        elif self.frames == "png":
            host = np.asarray(frames)
            for b in range(host.shape[0]):
                for j in range(host.shape[1]):
                    write_png(os.path.join(self.frames_dir, f"frame_{b}_{first + j:06d}.png"), host[b, j])

    def discard(self) -> None:
        """Stops the encoders and closes the mp4 files without writing anything more (the output directory is
        gone)."""
        for writer in self.writers:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the files are being abandoned
                pass

    def close(self) -> dict:
        """Finishes every mp4 (waits for the encoder threads) and writes the contact sheet; returns what the summary
        records."""
        errors = []
        for writer in self.writers:  # every file is finalised even if one encoder failed
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001 - the first is re-raised below
                errors.append(e)
        sheet = self.sheet.write()  # also when an encoder failed: the frames it shows were decoded
        self.closed_at = time.perf_counter()
        if errors:
            raise errors[0]
        summary = {
            "video": self.paths if len(self.paths) > 1 else self.paths[0],
            "video_frames": self.video_frames,
            "fps": self.fps,
            "video_size": list(self.size) if self.size else None,
            **sheet,
        }
        if self.frames:
            summary["frames_dir"] = self.frames_dir
        return summary
