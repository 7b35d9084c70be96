"""Latent chunk -> uint8 video frames, for a sink that writes a video while the DiT runs (`jaxkv.video`).

    decoder = StreamDecoder(params, config, latent_height=60, latent_width=104)
    with VideoWriter("out.mp4", fps=16) as video:
        for chunk in chunks:                   # [1, 3, 60, 104, 16] normalised DiT latents
            video.append(decoder(chunk)[0])    # uint8 [9 or 12, 480, 832, 3]; nothing waits here

Everything `__call__` does is dispatched asynchronously (JAX), so the decode of chunk k runs while the caller goes
on to dispatch the denoising of chunk k+1; only the writer's thread waits for the frames.
"""

from __future__ import annotations

import functools

import jax

from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.decoder import decode_chunk, init_decoder_state
from jaxkv.models.wan_vae.latents import denormalize
from jaxkv.video import to_uint8

__all__ = ["StreamDecoder"]


@functools.partial(jax.jit, static_argnames=("config",))
def _prepare(config: WanVAEConfig, latents, dtype_like):
    return denormalize(config, latents).astype(dtype_like.dtype)


class StreamDecoder:
    """Owns one stream's decoder state and turns each latent chunk into displayable frames.

    Args:
      params, config: the VAE (`jaxkv.models.wan_vae.checkpoint.load`).
      latent_height, latent_width: latent size of the stream (video size / 8).
      batch: streams decoded together.
      normalized: the chunks are DiT latents ``(z - mean) / std`` (True, what the DiT produces) or raw VAE latents.

    Calling it with ``latents [batch, T, h, w, z_dim]`` returns ``uint8 [batch, n, 8h, 8w, 3]`` with
    ``n = 1 + 4 (T - 1)`` for the stream's first chunk and ``4 T`` afterwards: the first chunk's padding frames
    (`decode_chunk`) are dropped here. `reset` starts a new stream without recompiling.
    """

    def __init__(
        self,
        params: dict,
        config: WanVAEConfig,
        *,
        latent_height: int,
        latent_width: int,
        batch: int = 1,
        normalized: bool = True,
    ):
        self.params, self.config, self.normalized = params, config, normalized
        self._dtype = params["post_quant_conv"]["kernel"]
        self._geometry = (batch, latent_height, latent_width)
        self.reset()

    def reset(self) -> None:
        """Back to the start of a stream (zero caches, next chunk is a first chunk)."""
        self.state = init_decoder_state(self.config, *self._geometry, self._dtype.dtype)
        self.first = True
        self.frames_out = 0

    def __call__(self, latents: jax.Array) -> jax.Array:
        z = _prepare(self.config, latents, self._dtype) if self.normalized else latents
        frames, self.state = decode_chunk(self.params, self.config, self.state, z)
        if self.first:
            frames = frames[:, self.config.first_chunk_padding :]
            self.first = False
        self.frames_out += frames.shape[1]
        return to_uint8(frames)
