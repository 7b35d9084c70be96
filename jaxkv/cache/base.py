"""What the ring and the rolling cache share: the pytree layout, the chunk write, reset and the chronological view.

A cache holds one attention layer's keys and values (or a stack of layers, so that a model can scan over layers
with the whole stack in the loop carry and update ``[layer, session, slot]`` in place):

  k, v:        [batch, capacity, heads, head_dim]          (or [layers, batch, capacity, heads, head_dim])
  positions:   int32 [batch, capacity]   absolute token position held by each slot, -1 when empty
  chunk_start: int32 [batch]             absolute position of the reserved chunk, -1 when none is reserved
  writers:     bool [batch] or None      sessions whose writes land this chunk (`only_writing`); None: all

A stack of layers may instead be held **per layer** (``init(..., per_layer=True)`` or `ChunkCache.per_layer`): k and
v are then tuples of ``layers`` separate [batch, capacity, heads, head_dim] buffers, addressed by a static (Python
int) layer index. Same contract, same results; what changes is what a compiled step does with them: a kernel that
takes a whole buffer (cuDNN's fused attention, which cannot start at an offset) reads a layer where it lies, where
reading a layer out of the stack is a copy of the layer per call (a dynamic slice inside the layer scan). The
per-layer form suits a model whose layer loop is unrolled (`jaxkv.models.wan` runs one when given per-layer
params or a per-layer cache); the stacked form suits a ``lax.scan`` over layers (fast to compile).

Positions are shared by all layers: every layer processes the same chunk. The two policies differ only in which
slot a chunk goes to and in what ``begin_chunk`` does when the cache is full; both must present the same logical
content (see ``chronological``). The per-session row writes and reads underneath (in place, O(chunk), guarded)
are `jaxkv.cache.rows`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.experimental import checkify

from jaxkv.cache.rows import layer_in_range, read_chunk_rows, write_chunk_rows, write_rows_in_dtype
from jaxkv.cache.spec import RingSpec
from jaxkv.validate import is_concrete, is_int

EMPTY = -1


@struct.dataclass
class ChunkCache:
    """Base of `RingCache` and `RollingCache`. Subclasses define ``slot_of_chunk`` and ``begin_chunk``."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    chunk_start: jax.Array
    spec: RingSpec = struct.field(pytree_node=False)
    # bool [batch] or None: the sessions whose `write` lands during the reserved chunk (`only_writing`); the others'
    # writes are no-ops, so a session that sits a chunk out keeps every byte even when it holds chunks.
    writers: jax.Array | None = None

    # The type of ``spec`` that `init` takes (a class attribute, not a field).
    spec_type: ClassVar[type] = RingSpec
    # What a policy supports, read by the registries in `jaxkv.cache` (class attributes; a policy opts in):
    # ``wraps``: shifting a full stream's clock by whole windows keeps every chunk's slot (`jaxkv.cache.clock`), so
    # cache-relative RoPE streams without end; ``recaches``: its slots hold whole chunks at their positions, which
    # `jaxkv.recache.recompute_cache` re-runs from the latents of the same chunks on a prompt switch.
    wraps: ClassVar[bool] = False
    recaches: ClassVar[bool] = False

    # ---------------------------------------------------------------- construction

    @classmethod
    def init(
        cls,
        spec: RingSpec,
        batch: int,
        heads: int,
        head_dim: int,
        dtype=jnp.float32,
        layers: int | None = None,
        per_layer: bool = False,
    ):
        """An empty cache: k, v zeros [batch, capacity, heads, head_dim] (with a leading [layers] axis when
        ``layers`` is given; with ``per_layer`` as tuples of ``layers`` separate buffers instead), all positions -1,
        no chunk reserved."""
        if not isinstance(spec, RingSpec):
            raise TypeError(f"spec must be a RingSpec, got {type(spec).__name__}")
        for name, value in (("batch", batch), ("heads", heads), ("head_dim", head_dim), ("layers", layers)):
            if not (value is None and name == "layers") and not (is_int(value) and value > 0):
                raise ValueError(
                    f"{name} must be a positive int{' or None' if name == 'layers' else ''}, got {value!r}"
                )
        batch, heads, head_dim = int(batch), int(heads), int(head_dim)
        lead = () if layers is None else (int(layers),)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        if per_layer not in (True, False):
            raise ValueError(f"per_layer must be a bool, got {per_layer!r}")
        if per_layer and layers is None:
            raise ValueError("per_layer=True holds a stack of layers one buffer per layer: pass layers= too")
        shape = (*lead, batch, spec.capacity, heads, head_dim)
        if per_layer:
            one = shape[1:]
            k = tuple(jnp.zeros(one, dtype) for _ in range(layers))
            v = tuple(jnp.zeros(one, dtype) for _ in range(layers))
        else:
            k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        return cls(
            k=k,
            v=v,
            positions=jnp.full((batch, spec.capacity), EMPTY, jnp.int32),
            chunk_start=jnp.full((batch,), EMPTY, jnp.int32),
            spec=spec,
        )

    # ---------------------------------------------------------------- shape facts

    @property
    def is_per_layer(self) -> bool:
        """True when k and v are tuples of per-layer buffers (see the module docstring)."""
        return isinstance(self.k, tuple)

    @property
    def layers(self) -> int | None:
        if self.is_per_layer:
            return len(self.k)
        return self.k.shape[0] if self.k.ndim == 5 else None

    @property
    def _k0(self):
        """k, or its first layer's buffer in the per-layer form (for shape and dtype facts)."""
        return self.k[0] if self.is_per_layer else self.k

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def heads(self) -> int:
        return self._k0.shape[-2]

    @property
    def head_dim(self) -> int:
        return self._k0.shape[-1]

    @property
    def dtype(self):
        return self._k0.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by k, v and positions."""
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves((self.k, self.v, self.positions)))

    # ---------------------------------------------------------------- layouts of a stack

    def per_layer(self):
        """This stacked cache with k and v as tuples of per-layer buffers (a copy of k and v; the same contract and
        content). A per-layer cache is returned as it is."""
        if self.is_per_layer:
            return self
        if self.layers is None:
            raise ValueError("per_layer: the cache is not stacked (init without layers)")
        split = lambda x: tuple(x[i] for i in range(x.shape[0]))
        return self.replace(k=split(self.k), v=split(self.v))

    def stacked(self):
        """This cache with k and v as [layers, ...] stacks (a copy of k and v when it is per-layer)."""
        if not self.is_per_layer:
            return self
        return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    # ---------------------------------------------------------------- policy (subclasses)

    def slot_of_chunk(self, chunk_index: jax.Array) -> jax.Array:
        """Slot (in chunk units) that holds chunk ``chunk_index`` once it is reserved. int32 [batch] -> [batch]."""
        raise NotImplementedError

    def begin_chunk(self, active=None):
        raise NotImplementedError

    def only_writing(self, active=None):
        """This cache with every later `write` (until ``only_writing(None)``) limited to the sessions where
        ``active`` (bool [batch]) is True, as if each write were given ``active=``: the others' K/V and positions
        keep their bytes. A pool's step of some rows (`jaxkv.rollout.generate_chunk`'s ``active``) runs the model
        on every session and must leave the waiting ones, which may hold chunks, untouched. None: every session
        writes (the default). Only the mask changes; it is a pytree leaf, so clear it before the cache leaves a
        step whose input had none."""
        if active is not None:
            active = self._check_session_mask("only_writing: active", active)
        return self.replace(writers=active)

    # ---------------------------------------------------------------- shared transitions

    def next_chunk_index(self) -> jax.Array:
        """int32 [batch]: index of the chunk the next ``begin_chunk`` reserves (0 for an empty session), i.e. the
        number of chunks the session has reserved so far."""
        return jnp.where(self.chunk_start < 0, 0, self.chunk_start // self.spec.chunk + 1).astype(jnp.int32)

    def _next_chunk_index(self, active=None) -> jax.Array:
        """`next_chunk_index`, checked: eagerly (outside jit), raises OverflowError when an active session's next
        chunk would pass the int32 position limit (`RingSpec.max_chunks`). Under jit the positions would wrap
        silently, so callers that trace `begin_chunk` check the number of chunks up front (as `jaxkv.rollout`
        does)."""
        index = self.next_chunk_index()
        if is_concrete(index):
            over = index > self.spec.max_chunks - 1  # (max_chunks itself may not fit in int32)
            if active is not None:
                over &= active
            if bool(jnp.any(over)):
                raise OverflowError(
                    f"begin_chunk: chunk {int(jnp.max(jnp.where(over, index, 0)))} would pass the int32 position "
                    f"limit: chunks of {self.spec.chunk} tokens fit only {self.spec.max_chunks} to a stream "
                    f"(positions < 2**31); reset the session (or start a new one) before it"
                )
        return index

    def _check_session_mask(self, name: str, mask):
        mask = jnp.asarray(mask)
        if mask.shape != (self.batch,) or mask.dtype != jnp.bool_:
            raise ValueError(
                f"{name} must be a bool array of shape ({self.batch},), got {mask.dtype}{list(mask.shape)}"
            )
        return mask

    def _reserve(self, slot: jax.Array, next_index: jax.Array, active, positions=None):
        """Marks ``slot`` [batch] empty and records the reserved chunk, for active sessions only.

        Returns (positions, chunk_start). The slot is emptied with a chunk-sized write, O(chunk) like the K/V
        write, not a pass over every slot's position."""
        positions = self.positions if positions is None else positions
        c = self.spec.chunk
        offsets = (slot * c).astype(jnp.int32)
        empty = jnp.full((self.batch, c), EMPTY, jnp.int32)
        new_start = (next_index * c).astype(jnp.int32)
        if active is not None:
            empty = jnp.where(active[:, None], empty, read_chunk_rows(positions, offsets, c))
            new_start = jnp.where(active, new_start, self.chunk_start)
        return write_chunk_rows(positions, empty, offsets), new_start

    def chunk_positions(self) -> jax.Array:
        """int32 [batch, chunk]: absolute positions of the reserved chunk's tokens (-1 where none is reserved)."""
        pos = self.chunk_start[:, None] + jnp.arange(self.spec.chunk, dtype=jnp.int32)[None, :]
        return jnp.where(self.chunk_start[:, None] < 0, EMPTY, pos)

    def chunk_offsets(self) -> jax.Array:
        """int32 [batch]: token offset of the reserved chunk's slot (slot 0 where none is reserved)."""
        index = jnp.maximum(self.chunk_start, 0) // self.spec.chunk
        return (self.slot_of_chunk(index) * self.spec.chunk).astype(jnp.int32)

    def _check_write_args(self, k, v, layer, active):
        """Trace-time checks of `write`'s arguments (shared by every policy); returns ``active`` checked."""
        expected = (self.batch, self.spec.chunk, self.heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise ValueError(
                    f"write: {name} must be an array of shape [batch, chunk, heads, head_dim] = {list(expected)}, "
                    f"got {type(x).__name__}"
                )
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"write: {name} must have shape [batch, chunk, heads, head_dim] = {list(expected)}, "
                    f"got {list(x.shape)}"
                )
            if x.dtype != self.dtype:
                raise ValueError(
                    f"write: {name} must have the cache dtype {self.dtype}, got {x.dtype} (cast it explicitly)"
                )
        if self.layers is None:
            if layer is not None:
                raise ValueError("write: layer was given but the cache is not stacked (init without layers)")
        else:
            if layer is None:
                raise ValueError(f"write: the cache stacks {self.layers} layers; pass layer=")
            self._check_layer("write", layer)
        if active is not None:
            active = self._check_session_mask("write: active", active)
        if is_concrete(self.chunk_start) and not bool(jnp.any(self.chunk_start >= 0)):
            raise ValueError("write: no session has a reserved chunk; call begin_chunk() first")
        return active

    def write(self, k, v, layer=None, active=None):
        """Writes the reserved chunk's keys and values; repeatable, last write wins.

        Args:
          k, v: [batch, chunk, heads, head_dim] in the cache's dtype.
          layer: required iff the cache is stacked (``layers`` set): an int or a traced int32 scalar. Out of
            range: a ValueError when its value is known; when traced, the write writes nothing and
            `jax.experimental.checkify.checkify` reports it (see `_check_layer`). Never clamped onto another layer.
          active: optional bool [batch]; sessions not active are left untouched (default: `writers`).

        Sessions with no reserved chunk get nothing visible: their slot positions stay -1. Eagerly (outside jit)
        writing to a cache where no session has reserved a chunk raises.
        """
        active = self._check_write_args(k, v, layer, self.writers if active is None else active)

        offsets = self.chunk_offsets()
        (buf_k, buf_v), at = self._layer_buffers(layer)
        if active is not None:
            # Inactive sessions write back what they hold: an O(chunk) read, never a copy of the cache.
            old_k = read_chunk_rows(buf_k, offsets, self.spec.chunk, at)
            old_v = read_chunk_rows(buf_v, offsets, self.spec.chunk, at)
            sel = active[:, None, None, None]
            k, v = jnp.where(sel, k, old_k), jnp.where(sel, v, old_v)
        new_k, new_v = self._with_layer(
            layer, self._write_layer(buf_k, k, offsets, at), self._write_layer(buf_v, v, offsets, at)
        )

        chunk_pos = self.chunk_positions()
        if active is not None:
            old_pos = read_chunk_rows(self.positions, offsets, self.spec.chunk)
            chunk_pos = jnp.where(active[:, None], chunk_pos, old_pos)
        new_positions = write_chunk_rows(self.positions, chunk_pos, offsets, only_if=self._traced_layer_ok(layer))
        return self.replace(k=new_k, v=new_v, positions=new_positions)

    def _traced_layer_ok(self, layer):
        """None unless ``layer`` is traced; then the bool scalar 0 <= layer < layers, which the positions' writes
        take as ``only_if`` (a write to a layer out of range writes nothing: neither K/V nor positions)."""
        if layer is None or is_concrete(layer):
            return None
        return layer_in_range(layer, self.layers)

    def replace_layer(self, layer, k, v):
        """The cache with one layer's whole k, v [batch, capacity, heads, head_dim] replaced (positions untouched),
        in place in a loop carry: a dynamic update of the stack, or the per-layer buffers swapped.

        ``layer`` as in `write`: in the stacked form a traced layer out of range replaces nothing (never clamped onto
        the first or last layer; checkify reports it), in the per-layer form a Python int."""
        if self.layers is None:
            raise ValueError("replace_layer: the cache is not stacked (init without layers)")
        self._check_layer("replace_layer", layer)
        want = (self.batch, self.spec.capacity, self.heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != want or x.dtype != self.dtype:
                raise ValueError(
                    f"replace_layer: {name} must be {np.dtype(self.dtype).name}{list(want)}, "
                    f"got {np.dtype(x.dtype).name}{list(x.shape)}"
                )
        if self.is_per_layer:
            return self.replace(**dict(zip(("k", "v"), self._with_layer(layer, k, v))))
        # A whole-layer write at offset 0 of every session: `write_chunk_rows` guards a traced layer.
        start = jnp.zeros((self.batch,), jnp.int32)
        return self.replace(k=write_chunk_rows(self.k, k, start, layer), v=write_chunk_rows(self.v, v, start, layer))

    def read_positions(self) -> jax.Array:
        """int32 [batch, capacity]: the slot positions attention reads in this chunk's forward, i.e. ``positions``
        once `write` has written the reserved chunk, wherever a slot is valid (>= 0; a policy may mark invalid slots
        differently, e.g. `DilatedCache`'s pending frames). Every layer's write leaves the same positions, so an
        attention plan made from them holds for every layer and every pass of the chunk."""
        return write_chunk_rows(self.positions, self.chunk_positions(), self.chunk_offsets())

    def _layer_buffers(self, layer):
        """((k, v) buffers a write of ``layer`` updates, the layer index within them): the whole stack and
        ``layer``, or in the per-layer form that layer's own buffers and None."""
        if self.is_per_layer:
            return (self.k[layer], self.v[layer]), None
        return (self.k, self.v), layer

    def _write_layer(self, buf, update, offsets, at):
        """`write_chunk_rows` into a buffer of `_layer_buffers`. A per-layer buffer is written in its own dtype, as a
        stack is: both live in a model's loop carry (see `write_chunk_rows` on the integer view)."""
        if self.is_per_layer:
            return write_rows_in_dtype(buf, update, offsets, None)
        return write_chunk_rows(buf, update, offsets, at)

    def _with_layer(self, layer, new_k, new_v):
        """(k, v) with ``layer`` replaced by what `_layer_buffers` returned, updated."""
        if not self.is_per_layer:
            return new_k, new_v
        put = lambda bufs, new: tuple(new if i == layer else b for i, b in enumerate(bufs))
        return put(self.k, new_k), put(self.v, new_v)

    def reset(self, sessions=None):
        """Empties all sessions, or those where ``sessions`` (bool [batch]) is True; nothing is reallocated.

        k and v keep their bytes, but a slot whose position is -1 cannot influence attention on any backend: its
        keys are masked and its values are zeroed before ``p @ v``, so even NaN/Inf left by a session that
        diverged never reaches the output of the next stream."""
        if sessions is None:
            return self.replace(
                positions=jnp.full_like(self.positions, EMPTY), chunk_start=jnp.full_like(self.chunk_start, EMPTY)
            )
        sessions = self._check_session_mask("reset: sessions", sessions)
        return self.replace(
            positions=jnp.where(sessions[:, None], EMPTY, self.positions),
            chunk_start=jnp.where(sessions, EMPTY, self.chunk_start),
        )

    def _check_layer(self, where: str, layer) -> None:
        """An int or integer scalar within [0, layers).

        A known value (a Python int, a concrete array) is checked now: ValueError. A traced layer (under jit, scan,
        vmap) has no value to check here: it is checked at run time under `jax.experimental.checkify.checkify`
        (a ``debug_check``, dropped from programs that are not checkified, so it costs nothing in the hot path).
        Without checkify, `write` with a traced out-of-range layer writes nothing (neither keys, values nor
        positions; `replace_layer` likewise), and `layer_kv` reads the nearest layer (``dynamic_slice`` clamps): keep
        traced layers in range (a scan over ``arange(layers)`` does), or checkify the program to find the one that is
        not. A per-layer cache takes a Python int only (its layers are separate buffers)."""
        if not is_int(layer) and not (
            hasattr(layer, "dtype") and jnp.issubdtype(layer.dtype, jnp.integer) and jnp.ndim(layer) == 0
        ):
            raise ValueError(f"{where}: layer must be an int or an integer scalar, got {layer!r}")
        if is_concrete(layer) and not 0 <= int(layer) < self.layers:
            raise ValueError(f"{where}: layer {int(layer)} out of range [0, {self.layers})")
        if self.is_per_layer and not is_int(layer):
            raise ValueError(
                f"{where}: a per-layer cache holds each layer in its own buffer, addressed by a Python int layer "
                f"(an unrolled layer loop); got {layer!r}. Use cache.stacked() for a traced layer index"
            )
        if not is_concrete(layer):  # (stacked only: a per-layer layer is a Python int, checked above)
            checkify.debug_check(
                layer_in_range(layer, self.layers), f"{where}: layer {{}} out of range [0, {self.layers})", layer
            )

    def layer_kv(self, layer):
        """(k, v) of one layer, each [batch, capacity, heads, head_dim]; ``layer`` may be traced (stacked form) or
        is a Python int (per-layer form: the layer's own buffers, no copy)."""
        if self.layers is None:
            raise ValueError("layer_kv: the cache is not stacked (init without layers)")
        self._check_layer("layer_kv", layer)
        if self.is_per_layer:
            return self.k[layer], self.v[layer]
        return (
            lax.dynamic_index_in_dim(self.k, layer, 0, keepdims=False),
            lax.dynamic_index_in_dim(self.v, layer, 0, keepdims=False),
        )

    def chronological(self):
        """(k, v, positions) gathered into position order per session, empty slots last.

        k, v: [(layers,) batch, capacity, heads, head_dim]; positions: int32 [batch, capacity]. For inspection,
        export and tests: attention never needs it (masks come from positions).
        """
        if self.is_per_layer:
            return self.stacked().chronological()
        key = jnp.where(self.positions < 0, jnp.iinfo(jnp.int32).max, self.positions)
        order = jnp.argsort(key, axis=1, stable=True)
        positions = jnp.take_along_axis(self.positions, order, axis=1)
        idx = order[:, :, None, None]
        if self.layers is None:
            gather = lambda x: jnp.take_along_axis(x, idx, axis=1)
        else:
            gather = lambda x: jnp.take_along_axis(x, idx[None], axis=2)
        return gather(self.k), gather(self.v), positions
