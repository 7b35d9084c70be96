"""The small pure functions Wan 2.1 is built from: linear layers, norms, embeddings, patchify/unpatchify.

Dtypes: the residual stream, norms, modulation and the sinusoidal embedding run in float32; a linear layer
multiplies in its kernel's dtype and accumulates and returns float32. Which dtype each kernel is in for its matmul
is decided in one place, the model's `jaxkv.precision.Precision` (`jaxkv.models.wan.model._compute_params`), never
here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.models.wan.config import WanConfig


def linear(p, x):
    """x [..., in] @ kernel [in, out] + bias [out] -> float32 [..., out]."""
    kernel = p["kernel"]
    y = jnp.matmul(x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return y + p["bias"].astype(jnp.float32)


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last axis (Wan's ``WanRMSNorm``): x / sqrt(mean(x^2) + eps) * scale, float32."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x * scale.astype(jnp.float32)


def layer_norm(x, eps: float, scale=None, bias=None):
    """LayerNorm over the last axis with biased variance, float32; affine only when scale/bias are given."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        x = x * scale.astype(jnp.float32)
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    return x


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def sinusoidal_embedding(timesteps, dim: int):
    """Wan's timestep embedding: [cos(t*f), sin(t*f)] with f_i = 10000**(-i/(dim/2)), cos first.

    Args:
      timesteps: float [...] on Wan's 0..1000 scale.
    Returns:
      float32 [..., dim].
    """
    half = dim // 2
    freqs = jnp.asarray([10000.0 ** (-i / half) for i in range(half)], jnp.float32)
    args = jnp.asarray(timesteps, jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def time_embedding(params, config: WanConfig, timesteps):
    """(e, e0) from per-frame timesteps [batch, frames]: e [batch, frames, dim] (used by the head) and
    e0 [batch, frames, 6, dim] (the blocks' shift/scale/gate before adding each block's ``modulation``)."""
    e = sinusoidal_embedding(timesteps, config.freq_dim)
    e = linear(params["time_embedding"]["fc2"], jax.nn.silu(linear(params["time_embedding"]["fc1"], e)))
    e0 = linear(params["time_projection"], jax.nn.silu(e))
    return e, e0.reshape(*e0.shape[:-1], 6, config.dim)


def text_embedding(params, context):
    """[batch, text_tokens, text_dim] -> float32 [batch, text_tokens, dim] (Linear, GELU-tanh, Linear)."""
    p = params["text_embedding"]
    return linear(p["fc2"], gelu_tanh(linear(p["fc1"], context)))


def patchify(params, config: WanConfig, latents):
    """Patch embedding (Wan's Conv3d with kernel = stride = patch).

    Args:
      latents: [batch, frames, height, width, in_dim], channels last.
    Returns:
      float32 [batch, frames/pt * height/ph * width/pw, dim], tokens in (frame, row, column) raster order.
    """
    b, f, h, w, c = latents.shape
    pt, ph, pw = config.patch_size
    x = latents.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c)
    x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)
    kernel = params["patch_embedding"]["kernel"]
    return linear({"kernel": kernel.reshape(-1, kernel.shape[-1]), "bias": params["patch_embedding"]["bias"]}, x)


def unpatchify(config: WanConfig, tokens, grid: tuple[int, int, int]):
    """[batch, F*H*W, pt*ph*pw*out_dim] (outputs ordered pt, ph, pw, channel) -> [batch, F*pt, H*ph, W*pw, out_dim]."""
    gf, gh, gw = grid
    pt, ph, pw = config.patch_size
    b = tokens.shape[0]
    x = tokens.reshape(b, gf, gh, gw, pt, ph, pw, config.out_dim)
    return x.transpose(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, gf * pt, gh * ph, gw * pw, config.out_dim)


def per_frame(x, frames: int):
    """[batch, frames*T, D] -> [batch, frames, T, D] so per-frame modulation [batch, frames, 1, D] broadcasts."""
    b, n, d = x.shape
    return x.reshape(b, frames, n // frames, d)
