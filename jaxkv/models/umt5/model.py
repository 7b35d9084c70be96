"""The umT5 encoder as pure functions of a params pytree (layout: `jaxkv.models.umt5.params`).

One block: ``x += attn(rms_norm1(x))`` with T5's unscaled logits plus this layer's relative position bias and the
padding keys masked, then ``x += down(gelu_tanh(gate(h)) * up(h))`` with ``h = rms_norm2(x)``; a final RMS norm.
Numerics: the residual stream and matmul inputs are in the params' dtype (bf16 for the real encoder), matmuls
accumulate in float32, RMS norms and the softmax run in float32 and are cast back, as Wan's ``T5LayerNorm`` and
``T5Attention`` do. Positions past a prompt's length still get outputs (their queries see the valid keys only);
`jaxkv.models.umt5.encoder.encode_prompts` zeroes them as Wan does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.umt5.config import UMT5Config


def relative_buckets(length: int, config: UMT5Config) -> np.ndarray:
    """Bidirectional T5 buckets of ``key - query`` for a ``length``-token sequence: int32 ``[length, length]``.

    Half the buckets for keys after the query, half for keys at or before it; in each half, offsets below
    ``max_exact = num_buckets // 4`` have their own bucket and larger ones share logarithmic bins up to
    ``max_distance``. Computed in float32 like the PyTorch references (the log bins' edges depend on it).
    """
    rel = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = config.num_buckets // 2
    max_exact = half // 2
    base = np.where(rel > 0, half, 0)
    dist = np.abs(rel)
    with np.errstate(divide="ignore"):
        ratio = (
            np.log(dist.astype(np.float32) / np.float32(max_exact))
            / np.float32(math.log(config.max_distance / max_exact))
            * np.float32(half - max_exact)
        )
    large = max_exact + np.where(dist < max_exact, 0, ratio).astype(np.int64)  # truncation, as torch's .long()
    large = np.minimum(large, half - 1)
    return (base + np.where(dist < max_exact, dist, large)).astype(np.int32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """T5 layer norm over the last axis: no mean, no shift; statistics in float32, result in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y.astype(x.dtype) * scale.astype(x.dtype)).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def _dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def _block(
    x: jax.Array, layer: dict[str, Any], buckets: jax.Array, key_mask: jax.Array, config: UMT5Config
) -> jax.Array:
    b, n, _ = x.shape
    h, hd = config.num_heads, config.head_dim
    attn = layer["attn"]
    y = rms_norm(x, layer["norm1"]["scale"], config.eps)
    q = _dense(y, attn["q"]["kernel"]).reshape(b, n, h, hd)
    k = _dense(y, attn["k"]["kernel"]).reshape(b, n, h, hd)
    v = _dense(y, attn["v"]["kernel"]).reshape(b, n, h, hd)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)  # T5: no 1/sqrt(d)
    bias = jnp.transpose(attn["rel_bias"].astype(jnp.float32)[buckets], (2, 0, 1))  # [H, q, k]
    logits = logits + bias[None]
    logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(x.dtype)
    x = x + _dense(o.reshape(b, n, h * hd), attn["o"]["kernel"])
    ffn = layer["ffn"]
    y = rms_norm(x, layer["norm2"]["scale"], config.eps)
    hidden = gelu_tanh(_dense(y, ffn["gate"]["kernel"])) * _dense(y, ffn["up"]["kernel"])
    return x + _dense(hidden, ffn["down"]["kernel"])


def encode(params: dict[str, Any], config: UMT5Config, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Runs the encoder.

    Args:
      params: the `jaxkv.models.umt5.params` layout; its embedding dtype is the compute dtype.
      config: static shape.
      ids: int ``[batch, length]`` token ids in ``[0, vocab_size)``.
      mask: ``[batch, length]`` bool/int, true for real tokens (attention masks the others as keys).

    Returns:
      ``[batch, length, dim]`` last hidden state (after the final norm) in the params' dtype.
    """
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be [batch, length], got ids {ids.shape} and mask {mask.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integer token ids, got dtype {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError("ids must hold at least one token per row, got length 0")
    emb = params["embedding"]
    if emb.shape != (config.vocab_size, config.dim):
        raise ValueError(f"params['embedding'] is {emb.shape}, the config expects {(config.vocab_size, config.dim)}")
    buckets = jnp.asarray(relative_buckets(ids.shape[1], config))
    key_mask = mask.astype(bool)
    x = jnp.take(emb, ids, axis=0)  # out-of-range ids would be clamped: callers check (see `check_ids`)

    def body(x, layer):
        return _block(x, layer, buckets, key_mask, config), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    return rms_norm(x, params["final_norm"]["scale"], config.eps)


# One compilation per (config, batch, padded length, dtype); the params are traced.
encode_jit = jax.jit(encode, static_argnames=("config",))


def check_ids(ids: np.ndarray, mask: np.ndarray, config: UMT5Config) -> None:
    """Eager checks of concrete token ids before they reach `encode` (where a gather would clamp them)."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be [batch, length], got ids {ids.shape} and mask {mask.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {config.vocab_size}), got range [{ids.min()}, {ids.max()}]; "
            f"the tokenizer does not match the encoder's vocabulary"
        )
    lengths = mask.astype(bool).sum(axis=1)
    if ids.size and lengths.min() == 0:
        raise ValueError("every row of mask must keep at least one token (an all-padding row has nothing to attend)")
