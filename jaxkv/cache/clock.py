"""A stream's chunk clock: which slot chunk n takes, how far int32 positions reach, and the wrapped clock.

Chunk n of a stream starts at token position ``n * chunk`` (int32), so a stream holds at most `RingSpec.max_chunks`
chunks (`check_chunk_room`). With cache-relative RoPE only differences of positions matter, and `wrap_clock` moves
a full stream's clock back by `wrap_period` chunks before it would pass the limit: a period that keeps every
chunk's slot and every kept frame's rule, so nothing the model sees changes. The policies say so with the class
attribute ``wraps`` (`jaxkv.cache.WRAPPING_POLICIES` names them):

* the ring (`ring_slot`): chunk n's slot depends on n modulo the window once past the sink; the rolling cache's
  not at all once full: the period is a whole number of windows;
* a dilated layer (`DilatedCache`): frame f is kept iff f % dilation == 0, in slot ceil(f / dilation) % buckets:
  the period moves frames by a multiple of dilation * buckets;
* a `MixedCache`: both stacks move together by one period that is both;
* and, for a prompt switch's replay of dilated layers, the latent history's ring (`history_chunks` slots past
  the sink, `jaxkv.recache_dilated`) keeps its slots too: the period is a multiple of its window.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.dilated import DilatedSpec
from jaxkv.cache.spec import RingSpec
from jaxkv.validate import is_concrete


def _is_mixed(x) -> bool:
    """A `jaxkv.cache.MixedSpec` / `MixedCache`, known by its two parts (mixed.py imports the ring, which imports
    this module)."""
    return hasattr(x, "dense") and hasattr(x, "dilated")


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


def history_chunks(spec) -> int:
    """Non-sink chunks back whose clean latents a prompt switch may need (the latent history's window): a ring's
    window; with dilated layers enough for their horizon (after chunk n - 1, kept frames back to about frame
    n * chunk_frames - (buckets + 1) * dilation are held), or the dense window if longer.
    ``spec``: a `RingSpec`, `DilatedSpec` or `MixedSpec`."""
    if isinstance(spec, RingSpec):
        return spec.window_chunks
    dilated = spec.dilated if _is_mixed(spec) else spec
    c, d, b = dilated.chunk_frames, dilated.dilation, dilated.buckets
    reach = -(-(b + 1) * d // c) + 1
    return max(spec.dense.window_chunks, reach) if _is_mixed(spec) else reach


def _wrap_layout(spec) -> tuple[int, int, int, int]:
    """(unit: chunks the period is a multiple of, the last chunk index before the clock is due, chunks back the
    cache or its history hold, sink chunks never moved) of a `RingSpec`, `DilatedSpec` or `MixedSpec`."""
    if isinstance(spec, RingSpec):
        return spec.window_chunks, spec.max_chunks - 1, spec.window_chunks, spec.sink_chunks
    dilated = spec.dilated if _is_mixed(spec) else spec
    c, span = dilated.chunk_frames, dilated.dilation * dilated.buckets
    history = history_chunks(spec)
    unit = math.lcm(span // math.gcd(c, span), history)  # frames move by a multiple of dilation * buckets
    sink = 0
    if _is_mixed(spec):
        unit, sink = math.lcm(unit, spec.dense.window_chunks), spec.dense.sink_chunks
    # one chunk early: a pending frame stores -(position) - 2, which must stay within int32 too
    return unit, spec.max_chunks - 2, history, sink


def wrap_period(spec) -> int:
    """Chunks the wrapped clock moves back by (`wrap_clock`): a whole number of the spec's unit (windows; with
    dilated layers also dilation * buckets frames and the history's window), about half the int32 range, so a
    stream's positions equal its absolute positions for its first `RingSpec.max_chunks` chunks (one fewer with
    dilated layers). ``spec``: a `RingSpec`, `DilatedSpec` or `MixedSpec`."""
    unit, last, held, sink = _wrap_layout(spec)
    period = unit * (((last + 1) // 2) // unit)
    # after the shift the oldest chunk held, last - (held - 1) - period, must stay past the sink
    if period < unit or last + 1 - held - period < sink:
        raise ValueError(
            f"chunks of {spec.chunk} tokens with a {unit}-chunk wrap unit leave no room for a wrapped clock "
            f"within int32 positions"
        )
    return period


def wrap_clock(cache, active=None):
    """Moves a session's clock back by `wrap_period` chunks when its next chunk would pass the int32 positions.

    For cache-relative RoPE only differences of positions matter: ranks (their order), the chunk-causal and window
    clauses (differences of chunk starts), and the sink (positions below ``spec.sink``, never moved). Shifting every
    non-sink position and the reserved chunk by `wrap_period` chunks therefore changes nothing the model sees, and
    keeps every chunk's slot and every dilated frame's (`WRAPPING_POLICIES`). A session whose reserved chunk is the
    last that fits (``chunk_start >= last * chunk``, `_wrap_layout`) is shifted; others are returned as they are.
    A `MixedCache` moves both stacks by the same shift (they hold the same chunk). O(capacity) int32 work per call,
    no K/V touched. Call it before ``begin_chunk``. ``active`` (optional bool [batch]): only these sessions may
    move (as ``begin_chunk(active)``: a session that sits the chunk out keeps its clock until its own next chunk).
    """
    spec = cache.spec
    _, last, _, _ = _wrap_layout(spec)
    shift_tokens = wrap_period(spec) * spec.chunk  # <= 2**30: no overflow
    due = cache.chunk_start >= last * spec.chunk
    if active is not None:
        due &= active
    shift = jnp.where(due, shift_tokens, 0).astype(jnp.int32)
    if _is_mixed(cache):
        return cache.replace(dense=_shifted(cache.dense, shift), dilated=_shifted(cache.dilated, shift))
    return _shifted(cache, shift)


def _shifted(cache: ChunkCache, shift) -> ChunkCache:
    """``cache`` with its positions and reserved chunk moved back by ``shift`` int32 [batch] tokens: a sink +
    window cache's window slots (the sink and empty slots stay); a dilated cache's visible slots, and its pending
    ones (-(p) - 2, moved up so that they still encode p - shift)."""
    pos, s = cache.positions, shift[:, None]
    if isinstance(cache.spec, DilatedSpec):
        positions = jnp.where(pos >= 0, pos - s, jnp.where(pos <= -2, pos + s, pos))
    else:
        positions = jnp.where(pos >= cache.spec.sink, pos - s, pos)
    return cache.replace(
        positions=positions,
        chunk_start=jnp.where(cache.chunk_start >= 0, cache.chunk_start - shift, cache.chunk_start),
    )
