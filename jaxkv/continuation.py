"""Continuation from pixels: image-to-video and video extension.

Given frames (a picture, or a video's frames) become the first chunks of a stream, committed to its cache exactly as
the stream commits the chunks it generates, and the stream generates on from them:

1. **size** (`fit_frames`, `read_frames`): every frame is mapped to the stream's frame size ``H x W`` (the latent
   size times the encoder's spatial factor: 64 x 64 for the toy world, 8 x the latent for Wan) by one rule, *scale
   to cover, then crop the centre*: the frame is scaled by ``max(H / h, W / w)`` (aspect ratio kept, area
   interpolation), so that it covers ``H x W``, and the centred ``H x W`` window is kept. A frame of the stream's
   size is taken as it is, bit for bit. Any frame of positive size maps; an alpha channel is dropped;
2. **count** (`whole_chunks`): the DiT commits whole chunks of ``chunk_frames`` latent frames, and an encoder with
   temporal factor ``f`` turns ``1 + f (L - 1)`` frames into ``L`` latent frames (Wan's causal VAE encodes its
   first frame alone, then 4 frames per latent frame; the toy world's latent map 1 frame per latent frame). So
   ``n`` chunks take ``1 + f (n * chunk_frames - 1)`` frames: 9, 21, 33 ... for Wan's 3-frame chunks, 3, 6, 9 ...
   for the toy world. Given more frames than one chunk takes, the **latest** frames that make whole chunks are
   kept (the oldest are dropped: the continuation follows the end of the video); given fewer (a picture is one
   frame), the first frame is **repeated in front** up to one chunk, so a picture is a still clip of one chunk;
3. **encode** (`ToyEncoder`, `WanEncoder`): uint8 frames -> the DiT's latents (the VAE's posterior mean,
   normalised as the DiT's latents are);
4. **commit** (`jaxkv.stream.Stream.commit`): each chunk goes through the pass at ``schedule.context_noise`` that
   commits a generated chunk, so the cache holds what a stream that had generated these latents would hold; the
   stream's next chunk is chunk ``n`` (its noise, a session saved later, ``--resume`` all count from there).

    model = jaxkv.toyworld.model.load()
    rc = model.settings.rollout_config()
    given = context_from_file("clip.mp4", ToyEncoder(model.latent_map), rc)      # Context(latents, frames, ...)
    stream = start_stream(model.params, model.config, rc, model.context([prompt]), given.latents,
                          num_chunks=8, key=jax.random.key(0))
    for chunk in stream: ...                                                      # the frames after the clip

Costs: the given frames are encoded once (the whole clip in one call: memory grows with its length) and committed
by one model pass per chunk (a generated chunk takes ``steps + 1`` passes); all of them go through the cache in
order, so a long video costs its length in passes, once.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.stream import Stream
from jaxkv.validate import check_int

__all__ = [
    "Context",
    "ContinuationError",
    "Frames",
    "ToyEncoder",
    "WanEncoder",
    "context_from_file",
    "context_from_frames",
    "fit_frames",
    "frames_for_chunks",
    "prime_decoder",
    "read_frames",
    "start_stream",
    "whole_chunks",
]

INTERPOLATION = "AREA"  # swscale's area averaging: no aliasing when shrinking, bilinear-like when enlarging


class ContinuationError(ValueError):
    """Given frames that cannot start a stream: a missing or unreadable file, no frames, a size that cannot be
    mapped. The message names the file (or the array) and what is wrong."""


# ------------------------------------------------------------------------------------------------ frames


def _cover(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The size ``h x w`` scales to so that it covers ``height x width`` with its aspect ratio kept."""
    scale = max(height / h, width / w)
    return max(height, round(h * scale)), max(width, round(w * scale))


def _fit_av(frame, height: int, width: int) -> np.ndarray:
    """A PyAV VideoFrame -> uint8 [height, width, 3] RGB by the cover-and-crop rule (module docstring)."""
    if frame.height == height and frame.width == width:
        return frame.to_ndarray(format="rgb24")
    h, w = _cover(frame.height, frame.width, height, width)
    rgb = frame.reformat(width=w, height=h, format="rgb24", interpolation=INTERPOLATION).to_ndarray()
    top, left = (h - height) // 2, (w - width) // 2
    return np.ascontiguousarray(rgb[top : top + height, left : left + width])


def fit_frames(frames, height: int, width: int) -> np.ndarray:
    """uint8 frames [T, h, w, 3] (or one frame [h, w, 3]) -> uint8 [T, height, width, 3] by the cover-and-crop rule
    (module docstring); frames already ``height x width`` come back unchanged. ContinuationError for anything
    but uint8 RGB frames of positive size."""
    import av

    height, width = check_int("height", height, minimum=1), check_int("width", width, minimum=1)
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or 0 in frames.shape:
        raise ContinuationError(
            f"frames must be uint8 RGB [frames, height, width, 3] (or one frame [height, width, 3]) with every size "
            f"positive, got {frames.dtype}{list(frames.shape)}"
        )
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack(
        [_fit_av(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24"), height, width) for f in frames]
    )


class Frames(NamedTuple):
    frames: np.ndarray  # uint8 [T, height, width, 3]: the file's frames, mapped to the stream's size
    source_size: tuple[int, int]  # (height, width) of the file's first frame


def read_frames(path: str, height: int, width: int, *, image: bool = False) -> Frames:
    """Decodes an image (PNG, JPEG, ... anything ffmpeg reads, through PyAV) or a video's frames and maps each to
    ``height x width`` (`fit_frames`' rule). ``image``: the file must hold exactly one frame.

    ContinuationError naming the file when it is missing, a directory, unreadable, not decodable, holds no video
    stream or no frame, or (``image``) more than one frame; nothing else is touched."""
    import av

    what = "image" if image else "video"
    height, width = check_int("height", height, minimum=1), check_int("width", width, minimum=1)
    if not os.path.exists(path):
        raise ContinuationError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ContinuationError(f"{path} is a directory, not an {what} file")
    if not os.access(path, os.R_OK):
        raise ContinuationError(f"{path}: permission denied (not readable)")
    if os.path.getsize(path) == 0:
        raise ContinuationError(f"{path} is empty (0 bytes)")
    frames, size = [], None
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ContinuationError(f"{path} holds no video stream (no picture to continue from)")
            for frame in container.decode(container.streams.video[0]):
                if size is None:
                    size = (frame.height, frame.width)
                if image and frames:
                    raise ContinuationError(f"{path} holds more than one frame; pass a video with --video / video=")
                frames.append(_fit_av(frame, height, width))
    except ContinuationError:
        raise
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ContinuationError(
            f"{path} is not {'an image' if image else 'a video'} that can be decoded ({type(e).__name__}: {reason})"
            + (f"; {len(frames)} frame(s) were read before the failure" if frames else "")
        ) from None
    if not frames:
        raise ContinuationError(f"{path} holds no frames")
    return Frames(np.stack(frames), size)


def frames_for_chunks(chunks: int, chunk_frames: int, temporal_factor: int) -> int:
    """Frames that encode to ``chunks`` whole chunks: ``1 + temporal_factor * (chunks * chunk_frames - 1)``."""
    return 1 + temporal_factor * (chunks * chunk_frames - 1)


class Counted(NamedTuple):
    frames: np.ndarray  # [..., T', H, W, 3] with T' = frames_for_chunks(chunks, ...)
    chunks: int
    padded: int  # copies of the first frame put in front (fewer frames than one chunk takes)
    dropped: int  # oldest frames left out (more frames than whole chunks take)


def whole_chunks(frames, chunk_frames: int, temporal_factor: int = 1) -> Counted:
    """The frames ``[..., T, H, W, 3]`` (time on axis -4) cut or padded to whole chunks (module docstring, rule 2):
    the latest frames that make whole chunks when there are enough for one, else the first frame repeated in front
    up to one chunk. ContinuationError for zero frames."""
    chunk_frames = check_int("chunk_frames", chunk_frames, minimum=1)
    temporal_factor = check_int("temporal_factor", temporal_factor, minimum=1)
    frames = np.asarray(frames)
    if frames.ndim < 4:
        raise ContinuationError(f"frames must be [..., T, H, W, 3], got {list(frames.shape)}")
    t = frames.shape[-4]
    if t == 0:
        raise ContinuationError("no frames were given (zero frames); a continuation needs at least one")
    one = frames_for_chunks(1, chunk_frames, temporal_factor)
    if t < one:
        first = frames[..., :1, :, :, :]
        pad = np.repeat(first, one - t, axis=-4)
        return Counted(np.concatenate([pad, frames], axis=-4), 1, one - t, 0)
    chunks = ((t - 1) // temporal_factor + 1) // chunk_frames
    keep = frames_for_chunks(chunks, chunk_frames, temporal_factor)
    return Counted(frames[..., t - keep :, :, :, :], chunks, 0, t - keep)


# ------------------------------------------------------------------------------------------------ encoders


class ToyEncoder:
    """The toy world's frame encoder: its `jaxkv.toyworld.latents.LatentMap` (4 x 4 pixel patches, one latent frame
    per frame). ``encoder(frames uint8 [B, T, 4h, 4w, 3])`` -> float32 [B, T, h, w, 16]."""

    spatial_factor = 4
    temporal_factor = 1

    def __init__(self, latent_map):
        from jaxkv.toyworld import latents

        if not isinstance(latent_map, latents.LatentMap):
            raise TypeError(f"ToyEncoder needs a jaxkv.toyworld.latents.LatentMap, got {type(latent_map).__name__}")
        self.latent_map = latent_map
        self.channels = latents.CHANNELS

    def __call__(self, frames) -> jax.Array:
        return jnp.asarray(self.latent_map.encode(frames))


class WanEncoder:
    """The Wan 2.1 VAE's encoder (`jaxkv.models.wan_vae.encode`): ``encoder(frames uint8 [B, 1 + 4k, 8h, 8w, 3])``
    -> the posterior mean normalised for the DiT (`jaxkv.models.wan_vae.normalize`), float32 [B, 1 + k, h, w, 16].
    The first frame is encoded alone (the VAE is causal), then 4 frames per latent frame."""

    def __init__(self, params: dict, config):
        from jaxkv.models.wan_vae.config import WanVAEConfig

        if not isinstance(config, WanVAEConfig):
            raise TypeError(f"WanEncoder needs a WanVAEConfig, got {type(config).__name__}")
        if "encoder" not in params or "quant_conv" not in params:
            raise ContinuationError("the VAE's params hold no encoder (a decoder-only VAE cannot encode frames)")
        self.params, self.config = params, config
        self.spatial_factor, self.temporal_factor = config.spatial_factor, config.temporal_factor
        self.channels = config.z_dim

    def __call__(self, frames) -> jax.Array:
        from jaxkv.models import wan_vae

        video = jnp.asarray(frames, jnp.float32) / 127.5 - 1.0
        mean, _ = wan_vae.encode(self.params, self.config, video)
        return wan_vae.normalize(self.config, mean)


# ------------------------------------------------------------------------------------------------ context


class Context(NamedTuple):
    """Given frames ready to commit (`context_from_frames`)."""

    latents: jax.Array  # float32 [batch, chunks * chunk_frames, h, w, C]: what `Stream.commit` takes
    frames: np.ndarray  # uint8 [batch, T', H, W, 3]: the frames encoded (after the count rule)
    chunks: int
    padded: int  # first-frame copies put in front
    dropped: int  # oldest frames left out
    source_size: tuple[int, int] | None = None  # the file's frame size (`context_from_file`), None for arrays


def _frame_size(encoder, rc: R.RolloutConfig) -> tuple[int, int]:
    return rc.latent_height * encoder.spatial_factor, rc.latent_width * encoder.spatial_factor


def context_from_frames(frames, encoder, rc: R.RolloutConfig, *, batch: int | None = None) -> Context:
    """Given frames -> the latents a stream under ``rc`` commits as its first chunks.

    Args:
      frames: uint8 [T, H, W, 3] (one clip; with ``batch``, the same for every row) or [batch, T, H, W, 3], H x W
        the stream's frame size (``rc.latent_height * encoder.spatial_factor`` by the same for the width; map
        other sizes with `fit_frames`); T >= 1, cut or padded to whole chunks by `whole_chunks`.
      encoder: `ToyEncoder`, `WanEncoder`, or any object with ``spatial_factor``, ``temporal_factor``,
        ``channels`` and ``__call__(uint8 [B, T, H, W, 3]) -> [B, L, h, w, channels]``.
      rc: the stream's settings (chunk_frames, latent size).
      batch: rows to repeat a [T, H, W, 3] clip over (default 1).
    Returns:
      `Context` (latents float32 [batch, n * chunk_frames, h, w, C], ...). ContinuationError before encoding when
      the frames are not uint8 RGB of the stream's size or there are none.
    """
    height, width = _frame_size(encoder, rc)
    frames = np.asarray(frames)
    if frames.ndim == 4 and batch is not None:
        frames = np.broadcast_to(frames[None], (check_int("batch", batch, minimum=1), *frames.shape))
    elif frames.ndim == 4:
        frames = frames[None]
    elif frames.ndim == 5 and batch is not None and batch != frames.shape[0]:
        raise ContinuationError(f"batch={batch} but the frames hold {frames.shape[0]} rows")
    if frames.ndim != 5 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ContinuationError(
            f"frames must be uint8 RGB [T, H, W, 3] or [batch, T, H, W, 3], got {frames.dtype}{list(frames.shape)}"
        )
    if frames.shape[2:4] != (height, width):
        raise ContinuationError(
            f"frames of {frames.shape[2]}x{frames.shape[3]} pixels; this stream's frames are {height}x{width} "
            f"(latent {rc.latent_height}x{rc.latent_width} x {encoder.spatial_factor}); map them with "
            f"jaxkv.continuation.fit_frames"
        )
    counted = whole_chunks(frames, rc.chunk_frames, encoder.temporal_factor)
    latents = jnp.asarray(encoder(counted.frames), jnp.float32)
    expected = (frames.shape[0], counted.chunks * rc.chunk_frames, rc.latent_height, rc.latent_width)
    if tuple(latents.shape[:4]) != expected:
        raise ValueError(
            f"the encoder gave latents {list(latents.shape)} for {list(counted.frames.shape)} frames; expected "
            f"{list(expected)} + [channels]"
        )
    return Context(latents, np.asarray(counted.frames), counted.chunks, counted.padded, counted.dropped)


def context_from_file(path: str, encoder, rc: R.RolloutConfig, *, image: bool = False, batch: int = 1) -> Context:
    """`read_frames` (mapped to the stream's frame size) then `context_from_frames` for ``batch`` rows; the
    `Context` records the file's own frame size. ContinuationError for a bad file (nothing is encoded)."""
    height, width = _frame_size(encoder, rc)
    read = read_frames(path, height, width, image=image)
    return context_from_frames(read.frames, encoder, rc, batch=batch)._replace(source_size=read.source_size)


# ------------------------------------------------------------------------------------------------ streams


def start_stream(
    params,
    config,
    rc: R.RolloutConfig,
    context,
    latents,
    *,
    num_chunks: int | None = None,
    key=None,
    noise=None,
    negative_context=None,
    history: bool = True,
):
    """A `jaxkv.stream.Stream` that continues ``latents`` float32 [batch, n * chunk_frames, h, w, in_dim]
    (`Context.latents`): they are committed as its chunks 0 .. n - 1 (`Stream.commit`, which keeps them in the
    stream's latent history, so a prompt switch re-caches the given frames too) and its first ``next()`` yields
    chunk n. ``num_chunks`` counts the chunks it generates; the other arguments are `Stream`'s."""
    stream = Stream(
        params,
        config,
        rc,
        context,
        num_chunks=num_chunks,
        key=key,
        noise=noise,
        negative_context=negative_context,
        history=history,
    )
    stream.commit(latents)
    return stream


def prime_decoder(decoder, latents):
    """Runs a stream decoder over the given latents [batch, n * chunk_frames, h, w, C] and returns their frames, so
    that the generated chunks it decodes next continue the given frames (Wan's `StreamDecoder` carries causal
    feature caches from chunk to chunk; the toy world's `FrameDecoder` carries nothing)."""
    return decoder(jnp.asarray(latents))
