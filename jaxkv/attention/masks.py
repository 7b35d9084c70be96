"""Attention masks as functions of (query position, key position) — never of array indices.

A ring cache holds keys in physical slot order, so index-based masks (``is_causal``, ``local_window_size``) are
wrong on it. Every mask here takes absolute token positions; a negative key position marks an empty slot.

`visible` is the elementwise rule every attention path applies (the dense reference, the blockwise XLA path and
the Pallas kernel all call `pair_visible`); `block_may_be_visible` is its conservative lift to ranges of positions,
used to skip key blocks that no query of a tile can see.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a position mask (hashable, so it can key a jit cache).

    Attributes:
      causal: key position <= query position.
      chunk: chunk-causal with chunks of this many tokens: key chunk <= query chunk (chunk = position // chunk),
        the training mask of causal video models. Also makes `window` count from chunk starts.
      window: local window in tokens: a key is hidden when it lies `window` or more tokens behind the query
        (behind the query's chunk start when `chunk` is set), unless it is in the sink.
      sink: keys at positions < sink are never hidden by the window; sink > 0 needs a window.
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
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"{name} must be None or a positive Python int, got {value!r}")
        if not _is_int(self.sink) or self.sink < 0:
            raise ValueError(f"sink must be a non-negative Python int, got {self.sink!r}")
        if self.sink > 0 and self.window is None:
            raise ValueError(f"sink needs a window: sink={self.sink} keeps keys visible that the window would hide, "
                             f"but window is None")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def floor_div(x, d: int):
    """Floor division of an int array by a positive Python int.

    Written with `lax.div` (truncating on every backend, including Triton) and a correction for negative
    numerators, so the Pallas kernel and the XLA paths round the same way.
    """
    q = lax.div(x, jnp.asarray(d, x.dtype))
    return q - ((x < 0) & (q * d != x)).astype(x.dtype)


def pair_visible(q, k, spec: MaskSpec):
    """Elementwise mask for broadcastable int arrays of query positions `q` and key positions `k`."""
    mask = k >= 0
    if spec.causal:
        mask &= k <= q
    if spec.chunk is not None:
        qc, kc = floor_div(q, spec.chunk), floor_div(k, spec.chunk)
        mask &= kc <= qc
    if spec.window is not None:
        if spec.chunk is not None:
            q_ref, k_ref = qc * spec.chunk, kc * spec.chunk
        else:
            q_ref, k_ref = q, k
        in_window = (q_ref - k_ref) < spec.window
        if spec.sink > 0:
            in_window |= k < spec.sink
        mask &= in_window
    return mask


def visible(q_positions, kv_positions, *, causal: bool = False, chunk: int | None = None,
            window: int | None = None, sink: int = 0):
    """Boolean mask [batch, q_len, kv_len]: may query i see key j.

    Args:
      q_positions: int [batch, q_len] absolute positions of the queries.
      kv_positions: int [batch, kv_len] absolute positions of the keys; negative = empty slot (never visible).
      causal, chunk, window, sink: see `MaskSpec`.
    """
    spec = MaskSpec(causal=causal, chunk=chunk, window=window, sink=sink)
    mask = pair_visible(q_positions[:, :, None], kv_positions[:, None, :], spec)
    return jnp.broadcast_to(mask, (q_positions.shape[0], q_positions.shape[1], kv_positions.shape[1]))


def block_may_be_visible(q_lo, q_hi, k_lo, k_hi, spec: MaskSpec):
    """Conservative block test: may any query in [q_lo, q_hi] see any valid key in [k_lo, k_hi].

    `k_lo`/`k_hi` are the smallest/largest *valid* key positions of a block (k_hi < 0 for an empty block).
    Each clause is a necessary condition of `pair_visible` for some pair, so a False here proves the whole
    block is masked for the whole query tile; True may still contain masked pairs (the kernel masks those).
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
