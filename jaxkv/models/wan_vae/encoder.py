"""The Wan 2.1 VAE encoder: video ``[B, 1 + 4k, H, W, 3]`` in [-1, 1] -> posterior ``[B, 1 + k, H/8, W/8, z]``.

Reference semantics (``WanVAE_.encode``): the video goes through in chunks of 1, 4, 4, ... frames with feature
caches, and each temporal downsampling passes the very first frame through and then runs its stride-2 time conv
over (previous chunk's last frame, this chunk). Both are exact rewrites of one whole-clip pass — causal convs with
zero front padding, and ``[x_0, timeconv_stride2(x)]`` — which is what this computes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.decoder import _Caches, _mid, _res
from jaxkv.models.wan_vae.layers import conv_time_stride2, dense, downsample2d, rms_norm

__all__ = ["encode"]


@functools.partial(jax.jit, static_argnames=("config",))
def encode(params: dict, config: WanVAEConfig, video: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Encodes a whole clip.

    Args:
      video: ``[B, 1 + temporal_factor * k, H, W, image_channels]`` in [-1, 1]; H and W multiples of
        ``spatial_factor``.

    Returns:
      (mean, log_variance), each ``[B, 1 + k, H / spatial_factor, W / spatial_factor, z_dim]``, un-normalised
      (`normalize` the mean for the DiT).
    """
    f, s = config.temporal_factor, config.spatial_factor
    if video.ndim != 5 or video.shape[-1] != config.image_channels:
        raise ValueError(
            f"video must be [batch, frames, height, width, {config.image_channels}] (channels last), "
            f"got shape {tuple(video.shape)}"
        )
    _, t, h, w, _ = video.shape
    if t < 1 or (t - 1) % f:
        raise ValueError(f"video must have 1 + {f} * k frames (1, {1 + f}, {1 + 2 * f}, ...), got {t}")
    if h % s or w % s:
        raise ValueError(f"video height and width must be multiples of {s}, got {h}x{w}")
    p = params["encoder"]
    caches = _Caches(None)
    x = caches.conv("conv_in", p["conv_in"], video.astype(p["conv_in"]["kernel"].dtype), None)
    for i in range(len(config.dim_mult)):
        stage = p["down"][str(i)]
        for j in range(config.num_res_blocks):
            x = _res(stage["res"][str(j)], x, caches, f"down.{i}.res.{j}", None)
        if "resample" in stage:
            x = downsample2d(stage["resample"]["conv"], x)
            if "time_conv" in stage["resample"]:
                x = jnp.concatenate([x[:, :1], conv_time_stride2(stage["resample"]["time_conv"], x)], axis=1)
    x = _mid(p["mid"], x, caches, "mid")
    x = caches.conv("conv_out", p["conv_out"], jax.nn.silu(rms_norm(p["norm_out"], x)), None)
    moments = dense(params["quant_conv"], x)
    return moments[..., : config.z_dim], moments[..., config.z_dim :]
