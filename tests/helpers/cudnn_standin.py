"""A stand-in for `jaxkv.attention.cudnn.cudnn_call` on CPU (the real call refuses to trace on a CPU-only jaxlib)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def standin(q, k, v, lengths, scale, return_lse=False):
    """What cuDNN computes, written independently: softmax over slots [0, length) (every slot when lengths is None)
    in float32; with return_lse also the natural-log LSE of the scaled logits."""
    b, lq, hq, d = q.shape
    g = hq // k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scale
    if lengths is not None:
        keep = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
        s = jnp.where(keep[:, None, None], s, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vf).astype(q.dtype)
    if not return_lse:
        return out
    return out, jnp.transpose(jax.scipy.special.logsumexp(s, axis=-1), (0, 2, 1))
