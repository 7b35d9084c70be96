"""The Wan 2.1 VAE decoder as a streaming function over an immutable feature-cache state.

Reference semantics (Wan 2.1 ``WanVAE_.decode``, diffusers ``AutoencoderKLWan._decode``): latent frames are fed
one at a time through the decoder with a cache per causal conv (the last 2 frames it saw, zero padding before the
stream). Each temporal upsampling doubles time, except on the stream's very first latent frame, which it passes
through once (a "first call" marker) — so T latent frames become ``1 + 4 (T - 1)`` video frames.

Here a chunk of any number of latent frames goes through in one call, with fixed shapes, so that one compiled
program serves every chunk of that length, the first included:

* the state (`DecoderState`) is the 32 caches of the real decoder (`[B, 2, h, w, C]` each, at the resolution of
  its conv) plus a traced boolean ``first``; it starts as zeros with ``first=True``;
* every temporal upsampling always emits 2 frames per input frame. On the first chunk the marker frame's pair is
  (padding, frame) instead of the time conv's pair, and padding frames are zeroed at the input of every later
  causal conv — zero history is exactly what the reference's zero padding is — so the real frames come out as the
  reference computes them. The first chunk's output therefore starts with ``config.first_chunk_padding`` (3)
  padding frames (zeros), every later chunk's output is all video: ``[B, 4 T, H, W, 3]`` always.

So chunked decoding equals whole-clip decoding (and the reference's frame-by-frame loop) for any chunk schedule, up
to float rounding. Self-Forcing's demo instead decodes the first chunk with an ordinary zero cache and drops 3
frames, which is *not* the reference decode.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.layers import attention, conv3d_causal, dense, rms_norm, upsample2d
from jaxkv.models.wan_vae.params import param_shapes

__all__ = ["DecoderState", "init_decoder_state", "decode_chunk", "decode", "cache_bytes"]


class DecoderState(NamedTuple):
    """Streaming decoder state (a pytree; donate it to `decode_chunk`).

    Attributes:
      caches: {conv name: [B, 2, h_l, w_l, C_l]} the last 2 inputs of every causal conv with temporal kernel 3
        ("conv_in", "mid.res0.conv1", ..., "up.0.resample.time_conv", ..., "conv_out").
      first: bool [] — True until the stream's first chunk has been decoded.
    """

    caches: dict[str, jax.Array]
    first: jax.Array


class _Caches:
    """Threads the feature caches through one trace: reads the old state (zeros when there is none) and collects
    the new one. Mutable only while tracing; the jitted function stays pure."""

    def __init__(self, old: dict[str, jax.Array] | None):
        self.old, self.new = old, {}

    def conv(self, name: str, p: dict, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        if keep is not None:  # padding frames of a first chunk: zero, as the reference's zero padding
            x = jnp.where(keep[None, :, None, None, None], x, jnp.zeros((), x.dtype))
        y, self.new[name] = conv3d_causal(p, x, None if self.old is None else self.old[name])
        return y


def _res(p: dict, x, caches: _Caches, name: str, keep):
    h = dense(p["shortcut"], x) if "shortcut" in p else x
    y = caches.conv(f"{name}.conv1", p["conv1"], jax.nn.silu(rms_norm(p["norm1"], x)), keep)
    y = caches.conv(f"{name}.conv2", p["conv2"], jax.nn.silu(rms_norm(p["norm2"], y)), keep)
    return y + h


def _mid(p: dict, x, caches: _Caches, name: str):
    x = _res(p["res0"], x, caches, f"{name}.res0", None)
    x = attention(p["attn"], x)
    return _res(p["res1"], x, caches, f"{name}.res1", None)


def _keep(first, frames: int, pad: int):
    """[frames] bool: False on the ``pad`` leading padding frames of a first chunk; None when there are none."""
    if pad == 0:
        return None
    return jnp.logical_or(jnp.logical_not(first), jnp.arange(frames) >= pad)


def _time_upsample(p: dict, x, caches: _Caches, name: str, first, pad: int):
    """Temporal 2x: ``[B, T, H, W, C]`` -> ``[B, 2T, H, W, C]``. Frame t becomes the pair of halves of the time
    conv's 2C channels. On a first chunk the real first frame (index ``pad``) is the reference's marker: it is not
    fed to the time conv (whose history starts at the next frame) and its pair is (padding, the frame itself)."""
    b, t, h, w, c = x.shape
    idx = jnp.arange(t)
    fed = jnp.logical_or(jnp.logical_not(first), idx > pad)
    y = caches.conv(name, p, x, fed)
    y = y.reshape(b, t, h, w, 2, c).transpose(0, 1, 4, 2, 3, 5)  # [B, T, 2, H, W, C]
    marker = jnp.stack([jnp.zeros_like(x), x], axis=2)
    y = jnp.where(jnp.logical_and(first, idx == pad)[None, :, None, None, None, None], marker, y)
    y = jnp.where(jnp.logical_and(first, idx < pad)[None, :, None, None, None, None], jnp.zeros((), y.dtype), y)
    return y.reshape(b, 2 * t, h, w, c)


def _decode(params: dict, config: WanVAEConfig, caches: _Caches, first, latents):
    """latents [B, T, h, w, z] (un-normalised) -> (frames [B, 4T, 8h, 8w, 3] unclamped, new caches)."""
    p = params["decoder"]
    x = dense(params["post_quant_conv"], latents.astype(params["post_quant_conv"]["kernel"].dtype))
    x = caches.conv("conv_in", p["conv_in"], x, None)
    x = _mid(p["mid"], x, caches, "mid")
    pad = 0  # leading padding frames of a first chunk at the current time resolution
    for i in range(len(config.dim_mult)):
        stage = p["up"][str(i)]
        keep = _keep(first, x.shape[1], pad)
        for j in range(config.num_res_blocks + 1):
            x = _res(stage["res"][str(j)], x, caches, f"up.{i}.res.{j}", keep)
        if "resample" in stage:
            if "time_conv" in stage["resample"]:
                x = _time_upsample(stage["resample"]["time_conv"], x, caches, f"up.{i}.resample.time_conv", first, pad)
                pad = 2 * pad + 1
            x = upsample2d(stage["resample"]["conv"], x)
    keep = _keep(first, x.shape[1], pad)
    x = caches.conv("conv_out", p["conv_out"], jax.nn.silu(rms_norm(p["norm_out"], x)), keep)
    if keep is not None:
        x = jnp.where(keep[None, :, None, None, None], x, jnp.zeros((), x.dtype))
    return x


def _param_structs(config: WanVAEConfig, dtype) -> dict[str, Any]:
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)
    )


@functools.lru_cache(maxsize=64)
def _cache_shapes(config: WanVAEConfig, batch: int, height: int, width: int, dtype) -> dict[str, tuple]:
    def trace(params, z):
        caches = _Caches(None)
        _decode(params, config, caches, jnp.asarray(True), z)
        return caches.new

    z = jax.ShapeDtypeStruct((batch, 1, height, width, config.z_dim), dtype)
    out = jax.eval_shape(trace, _param_structs(config, dtype), z)
    return {k: tuple(v.shape) for k, v in out.items()}


def init_decoder_state(
    config: WanVAEConfig, batch: int, latent_height: int, latent_width: int, dtype=jnp.float32
) -> DecoderState:
    """A fresh stream: zero caches for latents ``[batch, T, latent_height, latent_width, z_dim]`` and
    ``first=True``. ``dtype`` is the activation dtype (the params' dtype)."""
    from jaxkv.validate import check_int

    batch = check_int("batch", batch, minimum=1)
    latent_height = check_int("latent_height", latent_height, minimum=1)
    latent_width = check_int("latent_width", latent_width, minimum=1)
    dtype = jnp.dtype(dtype)
    shapes = _cache_shapes(config, batch, latent_height, latent_width, dtype)
    return DecoderState({k: jnp.zeros(s, dtype) for k, s in shapes.items()}, jnp.asarray(True))


def cache_bytes(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the decoder's feature caches for one stream geometry, computed from shapes (nothing allocated)."""
    shapes = _cache_shapes(config, batch, latent_height, latent_width, jnp.dtype(dtype))
    return sum(int(np.prod(s)) for s in shapes.values()) * jnp.dtype(dtype).itemsize


def _check(config: WanVAEConfig, state: DecoderState, latents) -> None:
    if latents.ndim != 5 or latents.shape[-1] != config.z_dim:
        raise ValueError(
            f"latents must be [batch, frames, height, width, {config.z_dim}] (channels last), got "
            f"shape {tuple(latents.shape)}"
        )
    if latents.shape[1] < 1:
        raise ValueError("latents must hold at least one frame")
    if not isinstance(state, DecoderState) or "conv_in" not in state.caches:
        raise ValueError(f"state must be a DecoderState from init_decoder_state, got {type(state).__name__}")
    b, _, h, w, _ = state.caches["conv_in"].shape
    if (latents.shape[0], latents.shape[2], latents.shape[3]) != (b, h, w):
        raise ValueError(
            f"latents of batch {latents.shape[0]} and size {latents.shape[2]}x{latents.shape[3]} do "
            f"not match the decoder state, made for batch {b} and latent size {h}x{w}"
        )


@functools.partial(jax.jit, static_argnames=("config", "clamp"), donate_argnames=("state",))
def decode_chunk(
    params: dict, config: WanVAEConfig, state: DecoderState, latents: jax.Array, *, clamp: bool = True
) -> tuple[jax.Array, DecoderState]:
    """Decodes the next chunk of a stream.

    Args:
      params: the VAE params (`jaxkv.models.wan_vae.params`; only ``decoder`` and ``post_quant_conv`` are read).
      config: the static `WanVAEConfig`.
      state: the stream's `DecoderState` — **donated**: use the returned one, not this one, afterwards.
      latents: ``[B, T, h, w, z_dim]`` un-normalised latents (`denormalize` the DiT's output first), any T >= 1.
      clamp: clip the frames to [-1, 1] as the reference decode does.

    Returns:
      (frames ``[B, temporal_factor * T, 8h, 8w, 3]`` in [-1, 1], the new state). On the stream's first chunk the
      first ``config.first_chunk_padding`` frames are padding (zeros), not video: drop them.
      Compiles once per (T, geometry, dtype); ``state.first`` is traced.
    """
    _check(config, state, latents)
    caches = _Caches(state.caches)
    frames = _decode(params, config, caches, state.first, latents)
    if clamp:
        frames = jnp.clip(frames, -1.0, 1.0)
    new = DecoderState({k: v.astype(state.caches[k].dtype) for k, v in caches.new.items()}, jnp.zeros_like(state.first))
    return frames, new


@functools.partial(jax.jit, static_argnames=("config", "clamp"))
def decode(params: dict, config: WanVAEConfig, latents: jax.Array, *, clamp: bool = True) -> jax.Array:
    """Whole-clip decode: ``latents [B, T, h, w, z_dim]`` (un-normalised) -> frames
    ``[B, 1 + temporal_factor * (T - 1), 8h, 8w, 3]`` in [-1, 1] (with ``clamp``)."""
    if latents.ndim != 5:
        raise ValueError(f"latents must be [batch, frames, height, width, {config.z_dim}], got {latents.shape}")
    if latents.shape[-1] != config.z_dim or latents.shape[1] < 1:
        raise ValueError(
            f"latents must be [batch, frames >= 1, height, width, {config.z_dim}] (channels last), got "
            f"shape {tuple(latents.shape)}"
        )
    frames = _decode(params, config, _Caches(None), jnp.asarray(True), latents)
    if clamp:
        frames = jnp.clip(frames, -1.0, 1.0)
    return frames[:, config.first_chunk_padding :]
