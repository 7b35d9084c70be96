"""Cache-relative RoPE (StreamingLLM, flashdreams' "rerope" presets), computed from positions.

In this mode keys are cached *unrotated*. At read time every cached key is rotated by its **rank** among the valid
cached positions (0 for the oldest key in the cache, 1 for the next, ...), and every query by the number of valid
cached positions below its own, so a query attending to its own key sees distance 0 and the model never sees a
position beyond the cache size, however long the stream runs.

Ranks are computed from the position array alone — sort the int positions once per batch row (`rope_ranks` gives
the query and key ranks from that one sort), then a binary search per slot — so the cache's K/V are never gathered into
chronological order: they are rotated where they lie.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_EMPTY_KEY = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class CacheRope:
    """Rotary embedding applied at read time by rank in the cache.

    Attributes:
      theta: RoPE base (10000 in most models).
      style: "half" rotates pairs (x[i], x[i + d/2]) (GPT-NeoX / Llama layout); "interleaved" rotates pairs
        (x[2i], x[2i + 1]) (the complex-number layout of Wan and the original RoFormer).
    """

    theta: float = 10000.0
    style: str = "half"

    def __post_init__(self):
        if self.style not in ("half", "interleaved"):
            raise ValueError(f"CacheRope.style must be 'half' or 'interleaved', got {self.style!r}")
        if not self.theta > 0:
            raise ValueError(f"CacheRope.theta must be positive, got {self.theta!r}")

    def inv_freq(self, head_dim: int):
        """float32 [head_dim // 2]: theta ** (-2i / head_dim)."""
        return self.theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)

    def rotate(self, x, ranks):
        """Rotate x [batch, tokens, heads, head_dim] by integer ranks [batch, tokens]; float32 result.

        head_dim must be even (the rotation acts on pairs of lanes).
        """
        d = x.shape[-1]
        if d % 2:
            raise ValueError(f"RoPE rotates pairs of lanes and needs an even head_dim, got x of shape {x.shape}")
        angle = ranks.astype(jnp.float32)[:, :, None, None] * self.inv_freq(d)  # [b, t, 1, d/2]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        x = x.astype(jnp.float32)
        if self.style == "half":
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def _sorted_valid(kv_positions):
    return jnp.sort(jnp.where(kv_positions >= 0, kv_positions, _EMPTY_KEY), axis=-1)


def _count_below(sorted_positions, positions):
    return jax.vmap(lambda s, p: jnp.searchsorted(s, p, side="left"))(sorted_positions, positions).astype(jnp.int32)


def rope_ranks(q_positions, kv_positions):
    """(query_ranks int32 [batch, q_len], cache_ranks int32 [batch, kv_len]) with one sort of kv_positions.

    Args:
      q_positions: int [batch, q_len] absolute query positions.
      kv_positions: int [batch, kv_len] absolute key positions, negative = empty slot.
    Returns:
      the two rank arrays of `query_ranks` and `cache_ranks` (what the attention paths rotate q and k by).
    """
    sorted_positions = _sorted_valid(kv_positions)
    return _count_below(sorted_positions, q_positions), _slot_ranks(sorted_positions, kv_positions)


def _slot_ranks(sorted_positions, kv_positions):
    return jnp.where(kv_positions >= 0, _count_below(sorted_positions, kv_positions), 0)


def cache_ranks(kv_positions):
    """int32 [batch, kv_len]: rank of each slot among the valid cached positions (0 = oldest); 0 for empty slots.

    rank(j) = #{valid i : positions[i] < positions[j]} — a function of the positions only, whatever the slot order.
    """
    return _slot_ranks(_sorted_valid(kv_positions), kv_positions)


def query_ranks(q_positions, kv_positions):
    """int32 [batch, q_len]: number of valid cached positions below each query position.

    A query whose own key is in the cache gets that key's rank (relative distance 0 to itself).
    """
    return _count_below(_sorted_valid(kv_positions), q_positions)
