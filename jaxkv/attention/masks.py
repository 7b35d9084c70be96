"""Attention masks as functions of (query position, key position) — never of array indices.

A ring cache holds keys in physical slot order, so index-based masks (``is_causal``, ``local_window_size``) are
wrong on it. Every mask here takes absolute token positions; a negative key position marks an empty slot.
"""

from __future__ import annotations

import jax.numpy as jnp


def visible(q_positions, kv_positions, *, causal: bool = False, chunk: int | None = None,
            window: int | None = None, sink: int = 0):
    """Boolean mask [batch, q_len, kv_len]: may query i see key j.

    Args:
      q_positions: int [batch, q_len] absolute positions of the queries.
      kv_positions: int [batch, kv_len] absolute positions of the keys; negative = empty slot (never visible).
      causal: key position <= query position.
      chunk: if set, chunk-causal: key chunk <= query chunk, chunk = position // chunk (the training mask of causal
        video models). Also makes `window` count from chunk starts.
      window: if set, local window in tokens: a key is hidden when it lies `window` or more tokens behind the query
        (behind the query's chunk start when `chunk` is set), unless it is in the sink.
      sink: keys with position < sink are never hidden by the window.
    """
    q = q_positions[:, :, None]
    k = kv_positions[:, None, :]
    mask = k >= 0
    if causal:
        mask &= k <= q
    if chunk is not None:
        mask &= (k // chunk) <= (q // chunk)
    if window is not None:
        if chunk is not None:
            q_ref, k_ref = (q // chunk) * chunk, (k // chunk) * chunk
        else:
            q_ref, k_ref = q, k
        mask &= ((q_ref - k_ref) < window) | (k < sink)
    return mask
