"""The small pure functions Wan 2.1 is built from: linear layers, norms, embeddings, patchify/unpatchify.

Dtypes: a linear layer multiplies in its kernel's dtype, accumulates in float32 and returns ``dtype`` (float32
unless told); its bias is added in that dtype, so with a bf16 ``dtype`` the GEMM emits bf16 and the bias (and a
following GELU) fuse into its epilogue. Norms compute their statistics in float32 and write ``dtype`` (float32
unless told). Which dtype each kernel and activation is in is decided in one place, the model's
`jaxkv.precision.Precision` (`jaxkv.models.wan.dtypes`), never here; with the float32 defaults every function is
exactly the float32 computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.models.wan.config import WanConfig


def linear(p, x, dtype=jnp.float32):
    """x [..., in] @ kernel [in, out] + bias [out] -> ``dtype`` [..., out].

    x is cast to the kernel's dtype; the product accumulates in float32 and comes out in ``dtype``
    (``preferred_element_type``: a bf16 GEMM with float32 accumulation writes bf16), the bias is added in ``dtype``.
    """
    kernel = p["kernel"]
    y = jnp.matmul(x.astype(kernel.dtype), kernel, preferred_element_type=dtype)
    return y + p["bias"].astype(dtype)


def rms_norm(x, scale, eps: float, dtype=jnp.float32):
    """RMSNorm over the last axis (Wan's ``WanRMSNorm``): x / sqrt(mean(x^2) + eps) * scale, computed in float32,
    written in ``dtype``."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return (x * scale.astype(jnp.float32)).astype(dtype)


def layer_norm(x, eps: float, scale=None, bias=None, dtype=jnp.float32):
    """LayerNorm over the last axis with biased variance, computed in float32 and written in ``dtype``; affine only
    when scale/bias are given."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        x = x * scale.astype(jnp.float32)
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    return x.astype(dtype)


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


def text_embedding(params, context, dtype=jnp.float32):
    """[batch, text_tokens, text_dim] -> ``dtype`` [batch, text_tokens, dim] (Linear, GELU-tanh, Linear; every
    activation in ``dtype``)."""
    p = params["text_embedding"]
    return linear(p["fc2"], gelu_tanh(linear(p["fc1"], context, dtype)), dtype)


def patchify(params, config: WanConfig, latents, dtype=jnp.float32):
    """Patch embedding (Wan's Conv3d with kernel = stride = patch).

    Args:
      latents: [batch, frames, height, width, in_dim], channels last.
    Returns:
      ``dtype`` [batch, frames/pt * height/ph * width/pw, dim], tokens in (frame, row, column) raster order.
    """
    b, f, h, w, c = latents.shape
    pt, ph, pw = config.patch_size
    x = latents.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c)
    x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)
    kernel = params["patch_embedding"]["kernel"]
    return linear({"kernel": kernel.reshape(-1, kernel.shape[-1]), "bias": params["patch_embedding"]["bias"]}, x, dtype)


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
