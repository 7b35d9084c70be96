"""Tile plans: which key blocks each query tile visits, in what order, and how (shared by the GPU kernels).

A flash kernel gives one program a tile of queries and walks key blocks. From positions alone, before the kernel,
XLA classifies every (query tile, key block) pair with the block tests of `jaxkv.attention.masks`:

  skip     no query of the tile may see a key of the block (`block_may_be_visible` is False), or the block holds
           no valid key: the block is not visited at all;
  FULL     every query of the tile sees every key of the block (`block_all_visible`): the kernel runs the unmasked
           inner loop (no positions loaded, no mask computed);
  PARTIAL  some pairs may be masked: the pair rule (`pair_visible`) is applied per (query, key);
  PARTIAL_EMPTY  PARTIAL, and some in-bounds slot of the block is empty (negative position): its values may be
           anything (NaN, stale), so a kernel that cannot mask its loads zeroes them before ``p @ v``.

The visited blocks are listed in chronological order (sorted by their oldest valid position; a wrapped ring's two
runs come out in time order), so the softmax recurrence sees keys in the same order whatever the slot layout.

Ragged edges: positions are padded here (small int arrays; the caller's K/V are never padded) — queries by
repeating the last one (no new range), keys with -1 (empty) — so a block that runs past the last slot is never
FULL and its out-of-bounds pairs are masked by the pair rule.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkv.attention.masks import MaskSpec, block_all_visible, block_may_be_visible

_INT_MAX = jnp.iinfo(jnp.int32).max

# Kinds of a visited block (the entries of `TilePlan.kind` past `count` are SKIP).
SKIP, PARTIAL, FULL, PARTIAL_EMPTY = -1, 0, 1, 2


class TilePlan(NamedTuple):
    """Per query tile, the key blocks to visit.

    count: int32 [batch, n_q_tiles]: how many blocks the tile visits.
    order: int32 [batch, n_q_tiles, n_k_blocks]: the visited block indices first, in chronological order; the
      entries past ``count`` are the unvisited blocks (unused).
    kind: int32 [batch, n_q_tiles, n_k_blocks]: FULL, PARTIAL or PARTIAL_EMPTY of ``order``'s entry; SKIP past
      ``count``.
    q_positions: int32 [batch, n_q_tiles * block_q]: the query positions padded by repeating the last one.
    kv_positions: int32 [batch, n_k_blocks * block_k]: the key positions padded with -1 (empty).
    """

    count: object
    order: object
    kind: object
    q_positions: object
    kv_positions: object


def tile_plan(q_positions, kv_positions, spec: MaskSpec, block_q: int, block_k: int) -> TilePlan:
    """The `TilePlan` of int [batch, q_len] query and int [batch, kv_len] key positions under ``spec``, for query
    tiles of ``block_q`` rows and key blocks of ``block_k`` slots (any positive sizes; lengths need not divide)."""
    b, lq = q_positions.shape
    lk = kv_positions.shape[1]
    nq, nk = pl.cdiv(lq, block_q), pl.cdiv(lk, block_k)
    qp = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, nq * block_q - lq)), mode="edge")
    kp = jnp.pad(kv_positions.astype(jnp.int32), ((0, 0), (0, nk * block_k - lk)), constant_values=-1)
    qt, kt = qp.reshape(b, nq, block_q), kp.reshape(b, nk, block_k)
    q_lo, q_hi = jnp.min(qt, axis=-1)[:, :, None], jnp.max(qt, axis=-1)[:, :, None]
    valid = kt >= 0
    k_min = jnp.min(kt, axis=-1)[:, None, :]  # < 0 when any slot (or padding) of the block is empty
    k_lo = jnp.min(jnp.where(valid, kt, _INT_MAX), axis=-1)[:, None, :]
    k_hi = jnp.max(jnp.where(valid, kt, -1), axis=-1)[:, None, :]
    may = jnp.broadcast_to(block_may_be_visible(q_lo, q_hi, k_lo, k_hi, spec), (b, nq, nk))
    full = jnp.broadcast_to(block_all_visible(q_lo, q_hi, k_min, k_lo, k_hi, spec), (b, nq, nk))
    # Empty slots inside the caller's buffer (not the padding past its end, which a TMA load fills with zeros).
    empty = jnp.any(jnp.pad(kv_positions < 0, ((0, 0), (0, nk * block_k - lk))).reshape(b, nk, block_k), axis=-1)
    kind = jnp.where(full, FULL, jnp.where(empty[:, None, :], PARTIAL_EMPTY, PARTIAL))
    kind = jnp.where(may, kind, SKIP).astype(jnp.int32)
    order = jnp.argsort(jnp.where(may, k_lo, _INT_MAX), axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(may, axis=-1, dtype=jnp.int32)
    return TilePlan(count, order, jnp.take_along_axis(kind, order, axis=-1), qp, kp)


def visit_lists(q_positions, kv_positions, spec: MaskSpec, block_q: int, block_k: int):
    """int32 [batch, n_q_blocks, 1 + n_k_blocks]: per query tile, the number of key blocks to visit, then their
    indices in chronological order (blocks that no query of the tile can see come after the count, unused): the
    Triton kernel's form of `tile_plan`."""
    plan = tile_plan(q_positions, kv_positions, spec, block_q, block_k)
    return jnp.concatenate([plan.count[..., None], plan.order], axis=-1)
