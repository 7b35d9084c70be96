"""One Wan block (modulated self-attention, cross-attention and FFN around the float32 residual stream) and the
output head."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.models.wan import layers as L
from jaxkv.models.wan.attention import _cross_attention
from jaxkv.models.wan.config import WanConfig
from jaxkv.run_options import RunOptions


def _block(p, x, e0, ck, cv, frames: int, self_attention, config: WanConfig, run: RunOptions, act=jnp.float32):
    """One Wan block on x float32 [batch, tokens, dim] with per-frame e0 [batch, frames, 6, dim].

    ``self_attention(p_self_attn, h) -> (y, aux)`` computes the self-attention output [batch, tokens, dim] (and any
    state it updates, e.g. the cache). ``act``: the dtype of every activation between the residual stream and a
    GEMM (`_activation_dtype`): the norms + modulation write it, the projections and the FFN emit it, and each
    branch's output is gated and added to the float32 residual in float32.
    """
    b, n, d = x.shape
    mod = p["modulation"].astype(jnp.float32)[None, None] + e0  # [batch, frames, 6, dim]
    m = [mod[:, :, i, None, :] for i in range(6)]  # each [batch, frames, 1, dim]
    shift1, scale1, gate1, shift2, scale2, gate2 = m
    flat = lambda y: y.reshape(b, n, d)

    h = flat(L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale1) + shift1).astype(act)
    y, aux = self_attention(p["self_attn"], h)
    x = x + flat(L.per_frame(y.astype(jnp.float32), frames) * gate1)

    norm3 = L.layer_norm(x, config.eps, p["norm3"]["scale"], p["norm3"]["bias"], act)
    x = x + _cross_attention(p["cross_attn"], norm3, ck, cv, config, run, act).astype(jnp.float32)

    h = flat(L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale2) + shift2).astype(act)
    y = L.linear(p["ffn"]["fc2"], L.gelu_tanh(L.linear(p["ffn"]["fc1"], h, act)), act)
    return x + flat(L.per_frame(y.astype(jnp.float32), frames) * gate2), aux


def _head(params, config: WanConfig, x, e, frames: int):
    """Output head: per-frame modulated LayerNorm, then the linear to pt*ph*pw*out_dim. e [batch, frames, dim]."""
    b, n, d = x.shape
    mod = params["head"]["modulation"].astype(jnp.float32)[None, None] + e[:, :, None, :]  # [b, frames, 2, dim]
    shift, scale = mod[:, :, 0:1], mod[:, :, 1:2]
    h = (L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale) + shift).reshape(b, n, d)
    return L.linear(params["head"]["head"], h)
