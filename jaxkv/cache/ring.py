"""`RingCache`: sink + window as a circular buffer of chunk slots.

Chunk n goes to slot n while the sink fills, then to ring slot ``sink_chunks + (n - sink_chunks) % window_chunks``:
the oldest non-sink chunk's slot is reused in place. A chunk costs one O(chunk) write per layer and nothing else,
whatever the window; the price is that slots are not in chronological order, so attention must mask by stored
positions (which jaxkv's attention always does) and a chronological copy exists only when asked for.
"""

from __future__ import annotations

from flax import struct

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.clock import ring_slot


@struct.dataclass
class RingCache(ChunkCache):
    """Circular sink + window KV cache (see `jaxkv.cache.base` for the layout and the shared methods)."""

    wraps = recaches = True  # chunk n's slot depends on n mod window_chunks past the sink; slots hold whole chunks

    def slot_of_chunk(self, chunk_index):
        return ring_slot(chunk_index, self.spec.sink_chunks, self.spec.window_chunks)

    def begin_chunk(self, active=None):
        """Reserves the next chunk of every session (or of those where ``active``, bool [batch], is True).

        The reserved slot is emptied (its positions set to -1: the chunk it held, if any, is evicted) and
        ``chunk_start`` advances by one chunk (to 0 for an empty session). k and v are not touched.
        """
        if active is not None:
            active = self._check_session_mask("begin_chunk: active", active)
        index = self._next_chunk_index(active)
        positions, chunk_start = self._reserve(self.slot_of_chunk(index), index, active)
        return self.replace(positions=positions, chunk_start=chunk_start)
