"""`RollingCache`: the shift-by-copy baseline (today's PyTorch streaming caches).

Slots are kept in chronological order: the sink first, then the window. When a new chunk does not fit, the
retained window is shifted left by one chunk — a copy of ``window - chunk`` tokens per layer and session, every
chunk — and the new chunk takes the last slot. Attention can then use plain index order, but each chunk costs
O(window). Kept as the reference policy and the benchmark baseline; it presents the same logical content as
`RingCache`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.cache.base import ChunkCache


def _shift_window_left(x, shift, sink: int, chunk: int, axis: int):
    """Moves the window x[sink + chunk:] to x[sink:] along ``axis`` for the sessions where ``shift`` is True (the
    oldest window chunk rotates to the end, where the new chunk will be written). The sink is not touched.

    ``shift`` is bool [batch], broadcast against x with the batch axis just before ``axis``.
    """
    window = lax.slice_in_dim(x, sink, x.shape[axis], axis=axis)
    rolled = jnp.concatenate(
        [lax.slice_in_dim(window, chunk, window.shape[axis], axis=axis), lax.slice_in_dim(window, 0, chunk, axis=axis)],
        axis=axis,
    )
    mask = shift.reshape((1,) * (axis - 1) + (-1,) + (1,) * (x.ndim - axis))
    return lax.dynamic_update_slice_in_dim(x, jnp.where(mask, rolled, window), sink, axis=axis)


@struct.dataclass
class RollingCache(ChunkCache):
    """Chronological sink + window KV cache that evicts by copying (see `jaxkv.cache.base`)."""

    wraps = recaches = True  # once full a chunk's slot no longer depends on n; slots hold whole chunks

    def slot_of_chunk(self, chunk_index):
        # Once full, the newest chunk always sits in the last slot.
        return jnp.minimum(chunk_index, self.spec.num_slots - 1).astype(jnp.int32)

    def begin_chunk(self, active=None):
        """Reserves the next chunk; when the cache is full, first shifts the window left by one chunk (copy)."""
        if active is not None:
            active = self._check_session_mask("begin_chunk: active", active)
        spec = self.spec
        index = self._next_chunk_index(active)
        shift = index >= spec.num_slots
        if active is not None:
            shift &= active
        slot_axis = 1 if self.layers is None or self.is_per_layer else 2
        move = lambda x: _shift_window_left(x, shift, spec.sink, spec.chunk, slot_axis)
        k, v = (
            (tuple(map(move, self.k)), tuple(map(move, self.v))) if self.is_per_layer else (move(self.k), move(self.v))
        )
        positions = _shift_window_left(self.positions, shift, spec.sink, spec.chunk, 1)
        positions, chunk_start = self._reserve(self.slot_of_chunk(index), index, active, positions)
        return self.replace(k=k, v=v, positions=positions, chunk_start=chunk_start)
