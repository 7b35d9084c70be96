"""`DilatedCache`: keep every d-th frame in a ring of frame slots, plus a scratch chunk for uncommitted writes.

A dense window keeps the last W frames: W frames of memory for a horizon of W frames. A dilated layer keeps only
every ``dilation``-th frame in a ring of ``buckets`` frame slots, so it reaches about ``dilation * buckets`` frames
back for the memory of ``buckets`` frames (plus one chunk of scratch). It suits "global" layers of a model whose
other layers keep a dense local window. The price: frames between kept ones are seen only by their own chunk.

Frames and chunks. A frame is ``tokens_per_frame`` (T) tokens; frame f holds positions [f*T, (f+1)*T). A chunk is
``chunk_frames`` (c) consecutive frames: chunk n = frames [n*c, (n+1)*c), positions [n*c*T, (n+1)*c*T). The chunk
is the unit of `begin_chunk` and `write` (as for `RingCache`), the frame is the unit of retention.

Layout, per session (token slots):

  [0, buckets*T)                  the ring: frame slot s at [s*T, (s+1)*T)
  [buckets*T, (buckets + c)*T)    the scratch: frame i of the current chunk at buckets*T + i*T

The rule, pinned from the seed's per-layer ring (``upsert``) and tested against a chronological model in
tests/test_cache_dilated.py:

* bucket(f) = (f + d - 1) // d and slot(f) = bucket(f) % buckets; a frame is **kept** iff f % d == 0 (then
  bucket(f) = f / d). Only kept frames ever enter the ring; the bucket of a frame that is not kept is never used.
* Every `write` puts the whole chunk in the scratch: the current chunk sees its own latest write of every frame.
* ``write(..., commit=True)`` also copies each kept frame into its ring slot, where it is **pending**: stored but
  invisible until the next `begin_chunk`, because the scratch already shows it (the seed hides the current frame's
  ring slot from its own query for the same reason). Committing on every denoising pass is therefore the same as
  committing on the last one only: the last committed write of the chunk is what the ring keeps.
* `begin_chunk` of chunk n, in order: publishes the pending frames of chunk n-1 (they become visible); empties the
  scratch (an uncommitted write is visible to its own chunk only, never later); reserves the ring slots of chunk
  n's kept frames (evicting what they held: kept frame f - buckets*d, the oldest); advances the chunk.

So a query of chunk n sees its own chunk (scratch) and every committed kept frame of earlier chunks that fewer than
``buckets`` newer kept frames have displaced: a kept frame stays for ``buckets * d`` frames (`horizon_frames`).

One deliberate difference from the seed: reserving evicts. The seed only hides the slot a kept frame will commit
to while that frame is current, so a kept frame that is never committed lets the frame it would have replaced
reappear afterwards (a frame ``buckets * d`` behind, outside the horizon). Here, as in `RingCache`, reservation
evicts, so what a query sees never depends on whether an earlier frame was committed beyond the frame itself.

Visibility lives in the positions, as for every jaxkv cache: pending ring slots store ``-(position) - 2`` and an
emptied scratch stores -1, so every attention path (which treats negative positions as empty) reads the cache in
physical order with no extra mask clause and no gather. The current chunk's frames are all in the scratch at
contiguous offsets, so attention with ``chunk=spec.chunk`` (chunk-causal) or no mask at all is exact.

Costs: a `write` is one chunk-sized update of the scratch plus, when committing, one frame-sized update per frame
of the chunk (kept frames to their ring slot; the others redirected onto their own scratch rows, which hold the
same bytes: no read, no branch). `begin_chunk` rewrites the int32 positions row, [batch, capacity] once per chunk
for all layers; K/V are never copied.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.attention.masks import MaskSpec
from jaxkv.cache.base import EMPTY, ChunkCache
from jaxkv.cache.rows import read_chunk_rows, write_chunk_rows
from jaxkv.cache.spec import POSITION_LIMIT
from jaxkv.validate import check_int


@dataclasses.dataclass(frozen=True)
class DilatedSpec:
    """Static sizes of a `DilatedCache`.

    Attributes:
      tokens_per_frame: T > 0 tokens per frame (Wan 2.1 at 480p: 1560).
      chunk_frames: c > 0 frames per chunk (Self-Forcing: 3); the scratch holds one chunk.
      dilation: d >= 1: frames f with f % d == 0 are kept (d = 1 keeps every frame).
      buckets: ring frame slots, >= ceil(c / d) so that the kept frames of one chunk never evict each other.
    """

    tokens_per_frame: int
    chunk_frames: int
    dilation: int
    buckets: int

    def __post_init__(self):
        t = check_int("tokens_per_frame", self.tokens_per_frame, minimum=1)
        c = check_int("chunk_frames", self.chunk_frames, minimum=1)
        d = check_int("dilation", self.dilation, minimum=1)
        b = check_int("buckets", self.buckets, minimum=1)
        per_chunk = -(-c // d)
        if b < per_chunk:
            raise ValueError(
                f"buckets ({b}) must be >= ceil(chunk_frames / dilation) = {per_chunk}: a chunk of {c} "
                f"frames keeps up to {per_chunk} frames at dilation {d}, and each needs its own slot"
            )
        for name, value in (("tokens_per_frame", t), ("chunk_frames", c), ("dilation", d), ("buckets", b)):
            object.__setattr__(self, name, value)

    @property
    def chunk(self) -> int:
        """Tokens per chunk: chunk_frames * tokens_per_frame (the `write` unit)."""
        return self.chunk_frames * self.tokens_per_frame

    @property
    def max_chunks(self) -> int:
        """Chunks a stream can hold before its int32 positions overflow (as `RingSpec.max_chunks`)."""
        return POSITION_LIMIT // self.chunk

    def mask(self) -> MaskSpec:
        """The attention mask of what this cache holds: chunk-causal only. Which frames are visible (kept ring
        frames, this chunk's scratch) is carried by the stored positions: empty and pending slots are negative."""
        return MaskSpec(chunk=self.chunk)

    @property
    def ring_tokens(self) -> int:
        """Tokens of the ring: buckets * tokens_per_frame; the scratch starts here."""
        return self.buckets * self.tokens_per_frame

    @property
    def capacity(self) -> int:
        """Token slots per session: ring + one chunk of scratch."""
        return self.ring_tokens + self.chunk

    @property
    def horizon_frames(self) -> int:
        """Frames a kept frame stays visible: buckets * dilation (it is evicted when frame f + buckets*d is
        reserved). A dense window with the same reach holds this many frames."""
        return self.buckets * self.dilation

    def kept(self, frame):
        """Whether frame(s) ``frame`` (int array) enter the ring: frame % dilation == 0."""
        return frame % self.dilation == 0

    def slot(self, frame):
        """Ring frame slot of frame(s) ``frame``: ((frame + d - 1) // d) % buckets (meaningful for kept frames)."""
        d = self.dilation
        return ((frame + d - 1) // d) % self.buckets


def stored_positions(positions):
    """The position each slot stores, visible or pending (a pending -(p) - 2 read as p); -1 where empty. What a
    re-cache rebuilds (`jaxkv.recache_dilated`): a pending frame is held, it only becomes visible later."""
    return jnp.where(positions <= -2, -positions - 2, positions)


def _pending(positions):
    """Visible positions -> the pending encoding -(p) - 2 (<= -2, so invisible); empty (-1) stays -1."""
    return jnp.where(positions < 0, EMPTY, -positions - 2)


@struct.dataclass
class DilatedCache(ChunkCache):
    """Dilated ring of kept frames + a scratch chunk (see the module docstring for the exact rule).

    Layout as `ChunkCache`: k, v [(layers,) batch, capacity, heads, head_dim] with capacity = (buckets +
    chunk_frames) * tokens_per_frame; positions int32 [batch, capacity] (-1 empty, <= -2 pending, else the absolute
    token position); chunk_start int32 [batch]. ``spec`` is a `DilatedSpec`.
    """

    spec_type: ClassVar[type] = DilatedSpec
    wraps = True  # a wrap period moving frames by a multiple of dilation * buckets keeps every frame's rule

    @classmethod
    def init(
        cls, spec: DilatedSpec, batch: int, heads: int, head_dim: int, dtype=jnp.float32, layers: int | None = None
    ):
        """An empty cache: k, v zeros [(layers,) batch, capacity, heads, head_dim], all positions -1."""
        if not isinstance(spec, DilatedSpec):
            raise TypeError(f"spec must be a DilatedSpec, got {type(spec).__name__}")
        batch = check_int("batch", batch, minimum=1)
        heads = check_int("heads", heads, minimum=1)
        head_dim = check_int("head_dim", head_dim, minimum=1)
        if layers is not None:
            layers = check_int("layers", layers, minimum=1)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        lead = () if layers is None else (layers,)
        shape = (*lead, batch, spec.capacity, heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            positions=jnp.full((batch, spec.capacity), EMPTY, jnp.int32),
            chunk_start=jnp.full((batch,), EMPTY, jnp.int32),
            spec=spec,
        )

    def slot_of_chunk(self, chunk_index):
        raise NotImplementedError(
            "a DilatedCache chunk has no single slot: its frames are written to the scratch "
            "and its kept frames to their own ring slots (see chunk_offsets / spec.slot)"
        )

    def chunk_offsets(self):
        """int32 [batch]: token offset where every write of the reserved chunk lands (the scratch)."""
        return jnp.full((self.batch,), self.spec.ring_tokens, jnp.int32)

    def _chunk_frames(self):
        """int32 [batch, chunk_frames]: absolute frame indices of the reserved chunk (of chunk 0 where none)."""
        spec = self.spec
        index = jnp.maximum(self.chunk_start, 0) // spec.chunk
        return index[:, None] * spec.chunk_frames + jnp.arange(spec.chunk_frames, dtype=jnp.int32)[None, :]

    def begin_chunk(self, active=None):
        """Reserves the next chunk of every session (or of those where ``active``, bool [batch], is True).

        For those sessions: publishes the previous chunk's committed kept frames, empties the scratch, evicts the
        ring slots of the new chunk's kept frames and advances ``chunk_start``. k and v are not touched.
        """
        if active is not None:
            active = self._check_session_mask("begin_chunk: active", active)
        act = jnp.ones((self.batch,), bool) if active is None else active
        spec = self.spec
        t, ring_len = spec.tokens_per_frame, spec.ring_tokens
        index = self._next_chunk_index()
        ring, scratch = self.positions[:, :ring_len], self.positions[:, ring_len:]

        ring = jnp.where(act[:, None] & (ring <= -2), -ring - 2, ring)  # publish chunk n-1's commits
        frames = index[:, None] * spec.chunk_frames + jnp.arange(spec.chunk_frames, dtype=jnp.int32)[None, :]
        hit = spec.kept(frames)[:, :, None] & (
            spec.slot(frames)[:, :, None] == jnp.arange(spec.buckets, dtype=jnp.int32)[None, None, :]
        )
        reserved = jnp.any(hit, axis=1) & act[:, None]  # [batch, buckets]
        ring = jnp.where(jnp.repeat(reserved, t, axis=1), EMPTY, ring)  # evict the oldest kept frames
        scratch = jnp.where(act[:, None], EMPTY, scratch)  # uncommitted writes vanish

        chunk_start = jnp.where(act, index * spec.chunk, self.chunk_start).astype(jnp.int32)
        return self.replace(positions=jnp.concatenate([ring, scratch], axis=1), chunk_start=chunk_start)

    def release(self, start, stop):
        """Evicts every held frame (visible or pending) at token positions [start, stop): what a windowed
        generation frees after a window (`jaxkv.windowed`). ``start``/``stop``: ints or int32 scalars (may be
        traced). Only positions change (set to -1, invisible); k and v stay, and the slots keep their rule."""
        pos = stored_positions(self.positions)
        freed = (pos >= start) & (pos < jnp.asarray(stop, jnp.int32))
        return self.replace(positions=jnp.where(freed, EMPTY, self.positions).astype(jnp.int32))

    def per_layer(self):
        """Not available: a dilated cache stays stacked (its writes address the stack)."""
        raise ValueError("per_layer: a DilatedCache is kept stacked; per-layer buffers are for sink + window caches")

    def write(self, k, v, layer=None, active=None, commit: bool = True):
        """Writes the reserved chunk's keys and values; repeatable, last write wins.

        Args:
          k, v: [batch, chunk, heads, head_dim] (chunk = chunk_frames * tokens_per_frame) in the cache's dtype.
          layer: required iff the cache is stacked: an int or a traced int32 scalar (out of range: as in
            `ChunkCache.write`, a ValueError when known, nothing written when traced).
          active: optional bool [batch]; sessions not active are left untouched (default: `writers`).
          commit: static bool. False: the chunk goes to the scratch only (visible to this chunk, gone at the next
            `begin_chunk`). True: also copies the kept frames to their ring slots (visible from the next chunk on).

        Sessions with no reserved chunk get nothing visible. Eagerly writing to a cache where no session has
        reserved a chunk raises.
        """
        if not isinstance(commit, (bool, np.bool_)):
            raise ValueError(f"write: commit must be a Python bool (it selects the program), got {commit!r}")
        active = self._check_write_args(k, v, layer, self.writers if active is None else active)
        spec = self.spec
        t, c = spec.tokens_per_frame, spec.chunk
        scratch = self.chunk_offsets()
        pos = self.chunk_positions()
        if active is not None:
            # Inactive sessions write back what their scratch holds: an O(chunk) read, never a copy of the cache.
            sel = active[:, None, None, None]
            k = jnp.where(sel, k, read_chunk_rows(self.k, scratch, c, layer))
            v = jnp.where(sel, v, read_chunk_rows(self.v, scratch, c, layer))
            pos = jnp.where(active[:, None], pos, read_chunk_rows(self.positions, scratch, c))
        layer_ok = self._traced_layer_ok(layer)  # None unless traced: then every positions write is guarded by it
        new_k = write_chunk_rows(self.k, k, scratch, layer)
        new_v = write_chunk_rows(self.v, v, scratch, layer)
        new_pos = write_chunk_rows(self.positions, pos, scratch, only_if=layer_ok)
        if commit:
            frames = self._chunk_frames()
            keep = spec.kept(frames) & (self.chunk_start >= 0)[:, None]
            if active is not None:
                keep &= active[:, None]
            ring_off = (spec.slot(frames) * t).astype(jnp.int32)
            for i in range(spec.chunk_frames):
                # A frame that is not kept is redirected onto its own scratch rows, which hold the same bytes.
                off = jnp.where(keep[:, i], ring_off[:, i], spec.ring_tokens + i * t)
                rows = slice(i * t, (i + 1) * t)
                new_k = write_chunk_rows(new_k, k[:, rows], off, layer)
                new_v = write_chunk_rows(new_v, v[:, rows], off, layer)
                new_pos = write_chunk_rows(
                    new_pos, jnp.where(keep[:, i, None], _pending(pos[:, rows]), pos[:, rows]), off, only_if=layer_ok
                )
        return self.replace(k=new_k, v=new_v, positions=new_pos)
