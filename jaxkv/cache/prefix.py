"""The protected prefix: the head of a stream that eviction never touches, and the epoch that says when it changed.

One mechanism, the sink. A `RingSpec` with ``sink = S`` tokens pins the first ``S / chunk`` chunks of a stream in
slots [0, S) of `RingCache` and `RollingCache` (both keep them there, in order); `begin_chunk` never reserves those
slots again, so nothing evicts them. Whatever those first chunks carry is the protected prefix: the first video
frames (StreamingLLM's attention sink, LongLive's frame sink) or a conditioning block (an image's K/V, a text K/V
block) written as the stream's first chunks. A `WindowSchedule`'s ``prefix_units`` is the same prefix in units:
never in a released span.

What the sink alone lacked is a rebuild. LongLive's prompt switch re-encodes the retained frames under the new
prompt and keeps the sink, so the sink's K/V must be replaced in place (same positions). `rewrite_prefix` does that
and bumps ``prefix_epoch``, an int32 [batch] counter kept beside the cache in `PrefixEpoch`: anything derived from
the prefix (a precomputed attention partial over the sink, a copy for a dense fast path) records the epoch it was
built at and is stale when `PrefixEpoch.is_stale` says so. Resetting a session also changes its prefix: bump its
epoch (``epoch.bump(sessions)``) beside ``cache.reset(sessions)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.spec import RingSpec
from jaxkv.validate import check_int, is_concrete


@struct.dataclass
class PrefixEpoch:
    """``epoch``: int32 [batch], how many times each session's protected prefix has been rebuilt (or reset)."""

    epoch: jax.Array

    @classmethod
    def init(cls, batch: int) -> "PrefixEpoch":
        return cls(epoch=jnp.zeros((check_int("batch", batch, minimum=1),), jnp.int32))

    def bump(self, sessions=None) -> "PrefixEpoch":
        """+1 for every session, or for those where ``sessions`` (bool [batch]) is True."""
        if sessions is None:
            return self.replace(epoch=self.epoch + 1)
        sessions = _session_mask("PrefixEpoch.bump: sessions", sessions, self.epoch.shape[0])
        return self.replace(epoch=self.epoch + sessions.astype(jnp.int32))

    def is_stale(self, seen) -> jax.Array:
        """bool [batch]: True where ``seen`` (int [batch], the epoch a derived value was built at) is not current."""
        seen = jnp.asarray(seen)
        if seen.shape != self.epoch.shape or not jnp.issubdtype(seen.dtype, jnp.integer):
            raise ValueError(
                f"is_stale: seen must be an int array of shape {tuple(self.epoch.shape)}, got "
                f"{seen.dtype}{list(seen.shape)}"
            )
        return seen != self.epoch


def _session_mask(name, mask, batch):
    mask = jnp.asarray(mask)
    if mask.shape != (batch,) or mask.dtype != jnp.bool_:
        raise ValueError(f"{name} must be a bool array of shape ({batch},), got {mask.dtype}{list(mask.shape)}")
    return mask


def prefix_complete(cache: ChunkCache) -> jax.Array:
    """bool [batch]: sessions whose protected prefix (every sink chunk) has been reserved."""
    spec = cache.spec
    return cache.chunk_start >= spec.sink - spec.chunk


def rewrite_prefix(cache: ChunkCache, epoch: PrefixEpoch, k, v, *, sessions=None):
    """Replaces the protected prefix's keys and values in place and bumps the epoch of the sessions rewritten.

    Args:
      cache: a `RingCache` or `RollingCache` whose spec has a sink (S = spec.sink tokens > 0).
      epoch: the cache's `PrefixEpoch`.
      k, v: [batch, S, heads, head_dim] ([layers, batch, S, heads, head_dim] for a stacked cache), the cache dtype.
      sessions: optional bool [batch]; only those sessions are rewritten.
    Returns:
      (cache, epoch). Positions are unchanged (the prefix keeps its positions [0, S)). Only sessions whose prefix
      is complete (`prefix_complete`) are rewritten and bumped: eagerly, asking for another raises; under jit such
      a session is left as it is and its epoch does not move, so the epoch always tells what happened.
    """
    spec = cache.spec
    if not isinstance(spec, RingSpec) or spec.sink == 0:
        raise ValueError(f"rewrite_prefix needs a cache with a sink (the protected prefix); got spec {spec!r}")
    if not isinstance(epoch, PrefixEpoch) or epoch.epoch.shape != (cache.batch,):
        raise ValueError(f"epoch must be a PrefixEpoch of {cache.batch} sessions, got {epoch!r}")
    lead = () if cache.layers is None else (cache.layers,)
    expected = (*lead, cache.batch, spec.sink, cache.heads, cache.head_dim)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != expected or x.dtype != cache.dtype:
            raise ValueError(
                f"rewrite_prefix: {name} must be {cache.dtype}{list(expected)} "
                f"([{'layers, ' if lead else ''}batch, sink, heads, head_dim]), got {x.dtype}"
                f"{list(x.shape)}"
            )
    chosen = (
        jnp.ones((cache.batch,), bool)
        if sessions is None
        else _session_mask("rewrite_prefix: sessions", sessions, cache.batch)
    )
    ready = prefix_complete(cache)
    if is_concrete(ready) and is_concrete(chosen) and bool(jnp.any(chosen & ~ready)):
        raise ValueError(
            f"rewrite_prefix: sessions {jnp.flatnonzero(chosen & ~ready).tolist()} have not reserved "
            f"all {spec.sink_chunks} sink chunks yet (chunk_start {cache.chunk_start.tolist()}); "
            f"a later begin_chunk would evict a prefix written now"
        )
    chosen = chosen & ready
    axis = len(lead)  # the session axis of k / v

    def replace(buf, new):
        old = lax.slice_in_dim(buf, 0, spec.sink, axis=axis + 1)
        sel = chosen.reshape((1,) * axis + (-1, 1, 1, 1))
        return lax.dynamic_update_slice_in_dim(buf, jnp.where(sel, new, old), 0, axis=axis + 1)

    cache = cache.replace(k=replace(cache.k, k), v=replace(cache.v, v))
    return cache, epoch.replace(epoch=epoch.epoch + chosen.astype(jnp.int32))


def release(cache: ChunkCache, stop, *, sessions=None) -> ChunkCache:
    """Evicts every held token at positions [sink, stop): what a `WindowSchedule` frees after a window
    (``released_span``); the protected prefix (positions < spec.sink) is never touched.

    Args:
      cache: a `RingCache` or `RollingCache` (stacked or not).
      stop: int or int32 scalar (may be traced), a token position; tokens at positions >= stop are kept.
      sessions: optional bool [batch]; only those sessions release.
    Returns:
      the cache with those slots' positions set to -1 (empty: invisible to every attention path). k and v are not
      touched and nothing moves, so a `RingCache` keeps reusing its slots in its own order; evicting early never
      lets a later chunk see more than it would have.
    """
    spec = cache.spec
    if not isinstance(spec, RingSpec):
        raise ValueError(f"release needs a sink + window cache (RingSpec), got spec {spec!r}")
    if isinstance(stop, (bool,)) or not (
        isinstance(stop, int)
        or (hasattr(stop, "dtype") and jnp.ndim(stop) == 0 and jnp.issubdtype(stop.dtype, jnp.integer))
    ):
        raise ValueError(f"release: stop must be an int or an integer scalar (a token position), got {stop!r}")
    if is_concrete(stop) and int(stop) < 0:
        raise ValueError(f"release: stop must be >= 0, got {int(stop)}")
    chosen = (
        jnp.ones((cache.batch,), bool)
        if sessions is None
        else _session_mask("release: sessions", sessions, cache.batch)
    )
    pos = cache.positions
    freed = (pos >= spec.sink) & (pos < jnp.asarray(stop, jnp.int32)) & chosen[:, None]
    return cache.replace(positions=jnp.where(freed, -1, pos).astype(jnp.int32))
