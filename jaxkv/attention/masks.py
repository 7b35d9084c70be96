"""Attention masks as functions of (query position, key position) — never of array indices.

A ring cache holds keys in physical slot order, so index-based masks (``is_causal``, ``local_window_size``) are
wrong on it. Every mask here takes absolute token positions; a negative key position marks an empty slot.

`MaskSpec` is the one description of a mask that every path takes. Its rule is written once, in
`block_may_be_visible`, over ranges of positions: "may some query in [q_lo, q_hi] see some key in [k_lo, k_hi]".
Each clause is monotone in the range ends, so with one query and one key (q_lo = q_hi, k_lo = k_hi) it is the exact
per-pair rule `pair_visible`, and over a tile of queries and a block of keys it is a conservative test that lets the
blockwise path and the Pallas kernel skip key blocks no query of a tile can see.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxkv.validate import check_int


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a position mask (hashable, so it can key a jit cache).

    Query position q may see key position k (k < 0: an empty slot, never visible) when every set clause holds:

      causal: k <= q.
      chunk: chunk-causal with chunks of this many tokens: k // chunk <= q // chunk, the training mask of causal
        video models (a chunk sees itself whole and every earlier chunk).
      window: local window in tokens. With `chunk`, measured chunk start to chunk start: k's chunk starts less
        than `window` tokens before q's chunk, i.e. q sees its own chunk and the `window // chunk - 1` chunks before
        it; the window must then be a whole number of chunks. Without `chunk`, token to token: q - k < window.
      sink: keys at positions < sink are exempt from the window (a pinned sink); the causal and chunk clauses
        still apply to them. sink > 0 needs a window.
    """

    causal: bool = False
    chunk: int | None = None
    window: int | None = None
    sink: int = 0

    def __post_init__(self):
        if not isinstance(self.causal, (bool, jnp.bool_)):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        for name in ("chunk", "window"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(name, value, minimum=1))
        object.__setattr__(self, "sink", check_int("sink", self.sink, minimum=0))
        if self.sink > 0 and self.window is None:
            raise ValueError(
                f"sink needs a window: sink={self.sink} keeps keys visible that the window would hide, "
                f"but window is None"
            )
        if self.chunk is not None and self.window is not None and self.window % self.chunk:
            raise ValueError(
                f"window ({self.window} tokens) must be a whole number of chunks of {self.chunk} "
                f"tokens: with chunk set it is measured from chunk start to chunk start"
            )


def as_mask(mask: MaskSpec | None = None, *, causal=False, chunk=None, window=None, sink=0) -> MaskSpec:
    """The `MaskSpec` of a call: ``mask`` itself, or one built from the keyword arguments (sugar) — not both."""
    if mask is None:
        return MaskSpec(causal=causal, chunk=chunk, window=window, sink=sink)
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask must be None or a jaxkv.attention.MaskSpec, got {mask!r}")
    if (causal, chunk, window, sink) != (False, None, None, 0):
        raise ValueError(f"pass the mask either as mask={mask} or as causal/chunk/window/sink keywords, not both")
    return mask


def floor_div(x, d: int):
    """Floor division of an int array by a positive Python int.

    Written with `lax.div` (truncating on every backend, including Triton) and a correction for negative
    numerators, so the Pallas kernel and the XLA paths round the same way.
    """
    q = lax.div(x, jnp.asarray(d, x.dtype))
    return q - ((x < 0) & (q * d != x)).astype(x.dtype)


def block_may_be_visible(q_lo, q_hi, k_lo, k_hi, spec: MaskSpec):
    """May some query in [q_lo, q_hi] see some valid key in [k_lo, k_hi] (broadcastable int arrays).

    For blocks, `k_lo`/`k_hi` are the smallest/largest *valid* key positions (k_hi < 0 for an empty block): False
    proves the whole block masked for the whole query tile; True may still contain masked pairs. For one pair
    (q_lo = q_hi, k_lo = k_hi) it is exact: see `pair_visible`.
    """
    may = k_hi >= 0
    if spec.causal:
        may &= k_lo <= q_hi
    if spec.chunk is not None:
        may &= floor_div(k_lo, spec.chunk) <= floor_div(q_hi, spec.chunk)
    if spec.window is not None:
        if spec.chunk is not None:
            q_ref = floor_div(q_lo, spec.chunk) * spec.chunk
            k_ref = floor_div(k_hi, spec.chunk) * spec.chunk
        else:
            q_ref, k_ref = q_lo, k_hi
        near = (q_ref - k_ref) < spec.window
        if spec.sink > 0:
            near |= k_lo < spec.sink
        may &= near
    return may


def block_all_visible(q_lo, q_hi, k_min, k_lo, k_hi, spec: MaskSpec):
    """Does every query in [q_lo, q_hi] see every key of a block (a sufficient test; True proves the mask all ones).

    k_min: the block's smallest position including empty slots (< 0 if any slot is empty); k_lo/k_hi: smallest and
    largest valid positions. It is `block_may_be_visible` at the block's least favourable pair (latest key, earliest
    query for causal/chunk; earliest key, latest query for the window), so the two block tests and `pair_visible`
    are one set of clauses.
    """
    return (k_min >= 0) & block_may_be_visible(q_hi, q_lo, k_hi, k_lo, spec)


def pair_visible(q, k, spec: MaskSpec):
    """Elementwise mask for broadcastable int arrays of query positions `q` and key positions `k`."""
    return block_may_be_visible(q, q, k, k, spec)


def visible(
    q_positions,
    kv_positions,
    mask: MaskSpec | None = None,
    *,
    causal: bool = False,
    chunk: int | None = None,
    window: int | None = None,
    sink: int = 0,
):
    """Boolean mask [batch, q_len, kv_len]: may query i see key j.

    Args:
      q_positions: int [batch, q_len] absolute positions of the queries.
      kv_positions: int [batch, kv_len] absolute positions of the keys; negative = empty slot (never visible).
      mask: a `MaskSpec`, or its fields as keywords (causal, chunk, window, sink).
    """
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    out = pair_visible(q_positions[:, :, None], kv_positions[:, None, :], spec)
    return jnp.broadcast_to(out, (q_positions.shape[0], q_positions.shape[1], kv_positions.shape[1]))
