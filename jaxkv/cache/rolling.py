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

from jaxkv.cache.base import ChunkCache


def _shift_window_left(x, sink: int, chunk: int, axis: int):
    """Moves the window [sink + chunk:] to [sink:] along ``axis``; the oldest window chunk goes to the end."""
    head = x.take(jnp.arange(0, sink), axis=axis) if sink else None
    window = x.take(jnp.arange(sink, x.shape[axis]), axis=axis)
    rolled = jnp.concatenate([window.take(jnp.arange(chunk, window.shape[axis]), axis=axis),
                              window.take(jnp.arange(0, chunk), axis=axis)], axis=axis)
    return rolled if head is None else jnp.concatenate([head, rolled], axis=axis)


@struct.dataclass
class RollingCache(ChunkCache):
    """Chronological sink + window KV cache that evicts by copying (see `jaxkv.cache.base`)."""

    def slot_of_chunk(self, chunk_index):
        # Once full, the newest chunk always sits in the last slot.
        return jnp.minimum(chunk_index, self.spec.num_slots - 1).astype(jnp.int32)

    def begin_chunk(self, active=None):
        """Reserves the next chunk; when the cache is full, first shifts the window left by one chunk (copy)."""
        if active is not None:
            active = self._check_session_mask("begin_chunk: active", active)
        spec = self.spec
        index = self._next_chunk_index()
        shift = index >= spec.num_slots
        if active is not None:
            shift &= active
        batch_axis = 0 if self.layers is None else 1
        bshape = lambda x: shift.reshape((1,) * batch_axis + (-1,) + (1,) * (x.ndim - batch_axis - 1))
        k = jnp.where(bshape(self.k), _shift_window_left(self.k, spec.sink, spec.chunk, batch_axis + 1), self.k)
        v = jnp.where(bshape(self.v), _shift_window_left(self.v, spec.sink, spec.chunk, batch_axis + 1), self.v)
        positions = jnp.where(shift[:, None], _shift_window_left(self.positions, spec.sink, spec.chunk, 1),
                              self.positions)
        positions, chunk_start = self._reserve(self.slot_of_chunk(index), index, active, positions)
        return self.replace(k=k, v=v, positions=positions, chunk_start=chunk_start)
