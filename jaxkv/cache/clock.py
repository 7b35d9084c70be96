"""A stream's chunk clock: which slot chunk n takes, how far int32 positions reach, and the wrapped clock.

Chunk n of a stream starts at token position ``n * chunk`` (int32), so a stream holds at most `RingSpec.max_chunks`
chunks (`check_chunk_room`). With cache-relative RoPE only differences of positions matter, and `wrap_clock` moves
a full stream's clock back by `wrap_period` chunks (a whole number of windows) before it would pass the limit: the
policies whose slot of chunk n depends on n only modulo the window once past the sink (`ring_slot`, the ring) or
not at all once full (the rolling cache) keep every chunk's slot under that shift. Those policies say so with the
class attribute ``wraps`` (`jaxkv.cache.WRAPPING_POLICIES` names them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.spec import RingSpec
from jaxkv.validate import is_concrete


def ring_slot(chunk_index, sink_chunks: int, window_chunks: int) -> jax.Array:
    """int32 [...]: the ring rule's slot of chunk ``chunk_index`` int [...] (traced or not): sink chunk n in slot
    n, later chunks in ``sink_chunks + (n - sink_chunks) % window_chunks``. `jaxkv.cache.RingCache` places its K/V
    by it and `jaxkv.recache.LatentRing` its clean latents, so both hold chunk n in the same slot."""
    s, w = sink_chunks, window_chunks
    ring = s + jnp.mod(chunk_index - s, w)
    return jnp.where(chunk_index < s, chunk_index, ring).astype(jnp.int32)


def check_chunk_room(spec: RingSpec, num_chunks: int, cache: ChunkCache | None = None) -> None:
    """ValueError when ``num_chunks`` more chunks would pass the int32 token positions of ``spec``
    (`RingSpec.max_chunks` chunks to a stream). The chunks already in ``cache`` count when its positions are
    concrete (a traced cache counts as empty: its own `begin_chunk` check covers eager steps)."""
    limit = spec.max_chunks
    done = 0
    if cache is not None and is_concrete(cache.chunk_start):
        done = int(jnp.max(cache.next_chunk_index()))
    if done + num_chunks > limit:
        raise ValueError(
            f"num_chunks={num_chunks} after {done} chunks would pass the int32 position limit: chunks of "
            f"{spec.chunk} tokens fit {limit} to a stream; generate at most "
            f"{limit - done} more (or start a new stream)"
        )


def wrap_period(spec: RingSpec) -> int:
    """Chunks the wrapped clock moves back by (`wrap_clock`): a whole number of windows, about half the int32 range,
    so a stream's positions equal its absolute positions for its first `RingSpec.max_chunks` chunks."""
    period = spec.window_chunks * ((spec.max_chunks // 2) // spec.window_chunks)
    # after the shift the oldest window chunk, (max_chunks - 1) - (window_chunks - 1) - period, must stay past the sink
    if period < spec.window_chunks or spec.max_chunks - spec.window_chunks - period < spec.sink_chunks:
        raise ValueError(
            f"chunks of {spec.chunk} tokens with a {spec.window_chunks}-chunk window leave no room for "
            f"a wrapped clock within int32 positions"
        )
    return period


def wrap_clock(cache: ChunkCache) -> ChunkCache:
    """Moves a session's clock back by `wrap_period` chunks when its next chunk would pass the int32 positions.

    For cache-relative RoPE only differences of positions matter: ranks (their order), the chunk-causal and window
    clauses (differences of chunk starts), and the sink (positions below ``spec.sink``, never moved). Shifting every
    non-sink position and the reserved chunk by a whole number of windows therefore changes nothing the model
    sees, and keeps every chunk's slot (`WRAPPING_POLICIES`). A session whose reserved chunk is the last that fits
    (``chunk_start >= (max_chunks - 1) * chunk``) is shifted; others are returned as they are. O(capacity) int32
    work per call, no K/V touched. Call it before ``begin_chunk``.
    """
    spec = cache.spec
    shift_tokens = wrap_period(spec) * spec.chunk  # <= 2**30: no overflow
    due = cache.chunk_start >= (spec.max_chunks - 1) * spec.chunk
    shift = jnp.where(due, shift_tokens, 0).astype(jnp.int32)
    moved = cache.positions >= spec.sink  # window slots (the sink and empty slots stay)
    return cache.replace(
        positions=jnp.where(moved, cache.positions - shift[:, None], cache.positions),
        chunk_start=jnp.where(cache.chunk_start >= 0, cache.chunk_start - shift, cache.chunk_start),
    )
