"""Wan 2.1's 3-D rotary position embedding, computed from absolute token positions.

Wan splits each head's ``head_dim`` d into a frame part of ``d - 4*(d//6)`` channels and height/width parts of
``2*(d//6)`` channels each, rotates consecutive channel pairs ``(x[2i], x[2i+1])`` as complex numbers, and uses base
``theta`` (10000) separately in each part. The reference builds a 1024-row table and fails beyond frame 1023; here
the angles are computed for any position, so a stream can run indefinitely.

A token's 3-D coordinate comes from its absolute position in the (frame, height, width) raster of patches:
``frame = pos // tokens_per_frame``, ``row = (pos % tokens_per_frame) // grid_w``, ``col = pos % grid_w``. The same
function therefore serves a whole sequence (positions 0..N-1) and a chunk of a stream (its absolute positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Channels of the (frame, height, width) parts of a head: (d - 4*(d//6), 2*(d//6), 2*(d//6))."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def inverse_frequencies(head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pair inverse frequencies of the three parts, float64: part of n channels has n/2 of ``theta**(-2i/n)``."""
    return tuple(1.0 / theta ** (np.arange(0, n, 2, dtype=np.float64) / n) for n in rope_split(head_dim))


def rope_angles(positions, grid_hw: tuple[int, int], head_dim: int, theta: float = 10000.0):
    """Rotation angle of every channel pair.

    Args:
      positions: int [batch, tokens] absolute token positions (any value >= 0; negatives are treated as 0).
      grid_hw: (grid_h, grid_w) patches per latent frame, static.
      head_dim: d.
    Returns:
      float32 [batch, tokens, head_dim // 2]: frame angles, then height, then width.
    """
    grid_h, grid_w = grid_hw
    tpf = grid_h * grid_w
    pos = jnp.maximum(jnp.asarray(positions, jnp.int32), 0)
    frame = pos // tpf
    within = pos % tpf
    coords = (frame, within // grid_w, within % grid_w)
    parts = []
    for coord, inv in zip(coords, inverse_frequencies(head_dim, theta)):
        parts.append(coord.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32))
    return jnp.concatenate(parts, axis=-1)


def rope_cos_sin(angles):
    """(cos, sin) of `rope_angles`, each float32 [batch, tokens, head_dim // 2].

    A forward computes them once and passes them to every layer's `apply_rope` (q and k of every layer rotate by the
    same angles), so the transcendental functions run once per forward, not twice per layer.
    """
    angles = jnp.asarray(angles, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates consecutive channel pairs of x by the angles whose cosines and sines are given, in float32.

    Args:
      x: [batch, tokens, heads, head_dim].
      cos, sin: float32 [batch, tokens, head_dim // 2] from `rope_cos_sin`.
    Returns:
      [batch, tokens, heads, head_dim] in x's dtype.
    """
    b, n, h, d = x.shape
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (b, n, d // 2):
            raise ValueError(f"apply_rope: {name} must have shape {[b, n, d // 2]}, got {list(a.shape)}")
    pairs = x.astype(jnp.float32).reshape(b, n, h, d // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(b, n, h, d).astype(x.dtype)


def sequence_positions(batch: int, tokens: int, start=0) -> jax.Array:
    """int32 [batch, tokens]: start, start+1, ... for every batch row."""
    return jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32) + jnp.asarray(start, jnp.int32), (batch, tokens))
