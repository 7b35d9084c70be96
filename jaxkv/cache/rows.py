"""Per-session row writes and reads of a cache buffer: the O(chunk), in-place update every cache policy uses.

A buffer is [batch, capacity, ...] or a layer stack [layers, batch, capacity, ...]; each session b writes (or reads)
its own ``chunk`` rows at its own token offset. How a write stays in place depends on the platform and the dtype
(see `write_chunk_rows`); a write may be guarded (``only_if``, a traced layer out of range) so that it writes nothing,
decided on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.validate import is_concrete


def _unsigned_like(dtype) -> np.dtype:
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def write_chunk_rows(
    buf: jax.Array, update: jax.Array, offsets: jax.Array, layer=None, only_if: jax.Array | None = None
) -> jax.Array:
    """Writes update[b] into buf[(layer,) b, offsets[b]:offsets[b] + chunk] for every session b.

    Args:
      buf: [batch, capacity, ...] or, with ``layer``, [layers, batch, capacity, ...].
      update: [batch, chunk, ...] of buf's dtype.
      offsets: int32 [batch] token offsets (traced).
      layer: None, or an int32 scalar (traced or not) selecting the layer. A concrete layer must be in range
        (callers check it); a traced one out of range writes nothing (never clamped onto the first or last layer,
        as a bare ``dynamic_update_slice`` would).
      only_if: None, or a bool scalar (traced): when False nothing is written and ``buf`` comes back as it was.

    One ``dynamic_update_slice`` per session (sessions are few: cond/uncond or a handful of streams), so XLA keeps
    every write in place and O(chunk). (A vmapped update over the session axis of a layer stack transposes the
    buffer instead, copying it whole.)

    16-bit floats on a single-layer cache are written through an unsigned integer view: XLA:CPU wraps a bfloat16
    dynamic_update_slice in a whole-buffer bf16->f32->bf16 conversion (O(capacity) per write: 11.3 ms vs 1.0 ms at
    a 42-frame Wan window), while on integer bits the update stays in place. A layer stack is written in its own
    dtype: it lives in a model's scan carry, where XLA:CPU materialises the integer view as a copy of the whole
    stack per write (a 512-frame bf16 Wan step: 35.5 ms with the view, 13.5 ms without, as in float32). Known
    limit: on XLA:CPU a bf16 layer stack therefore still pays the in-place conversion, O(capacity) time with no
    extra memory; float32 stacks, and bf16 on GPU (native bf16 updates), are O(chunk).
    """
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
        if not is_concrete(layer):  # (a known index was checked by the caller: `ChunkCache._check_layer`)
            in_range = layer_in_range(layer, buf.shape[0])
            only_if = in_range if only_if is None else in_range & only_if
    if only_if is None:
        return _write_unguarded(buf, update, offsets, layer)
    return _write_rows_only_if(buf, update, offsets, layer, jnp.asarray(only_if, bool))


def layer_in_range(layer, layers: int) -> jax.Array:
    """bool scalar: 0 <= layer < layers (``layer`` may be traced)."""
    layer = jnp.asarray(layer, jnp.int32)
    return (layer >= 0) & (layer < layers)


def _write_unguarded(buf, update, offsets, layer):
    if layer is None and np.dtype(buf.dtype).itemsize == 2:
        return _write_rows_as_bits(buf, update, offsets)
    return write_rows_in_dtype(buf, update, offsets, layer)


def _write_rows_only_if(buf, update, offsets, layer, only_if):
    """`write_chunk_rows` when ``only_if`` (a traced bool scalar, false also for a traced layer out of range), else
    ``buf`` unchanged: a write that may write nothing, decided on the device with no host sync.

    Two programs, one per platform, each in place and O(chunk) with a donated buffer:
      * XLA:CPU: a ``cond`` around the in-place write (there a dropping scatter of a bf16 stack converts the whole
        stack to float32, and selecting between new and old rows copies the buffer).
      * elsewhere: one scatter per session in FILL_OR_DROP mode, whose index is out of bounds (dropped on the
        device) unless ``only_if``; no conditional (a GPU conditional waits on the host for its predicate).
    """

    return lax.platform_dependent(
        buf, update, offsets, layer, only_if, cpu=_only_if_by_cond, default=_only_if_by_scatter
    )


def _only_if_by_cond(buf, update, offsets, layer, only_if):
    """`_write_rows_only_if` on XLA:CPU."""
    write = lambda b: _write_unguarded(b, update, offsets, layer)
    return lax.cond(only_if, write, lambda b: b, buf)


def _only_if_by_scatter(buf, update, offsets, layer, only_if):
    """`_write_rows_only_if` elsewhere (GPU, TPU)."""
    capacity = buf.shape[1 if layer is None else 2]
    return _scatter_rows_or_drop(buf, update, jnp.where(only_if, offsets, capacity), layer)


def _scatter_rows_or_drop(buf, update, offsets, layer=None):
    """buf[(layer,) b, offsets[b]:offsets[b] + chunk] = update[b] for every session b; a session whose window
    (layer or offset) lies out of bounds writes nothing. buf [(layers,) batch, capacity, ...], update
    [batch, chunk, ...]."""
    lead = 0 if layer is None else 1
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, update.ndim)),  # the chunk and trailing axes of each session's update
        inserted_window_dims=tuple(range(lead + 1)),  # (layer,) session
        scatter_dims_to_operand_dims=tuple(range(lead + 2)),  # (layer,) session, token
    )
    for b in range(update.shape[0]):
        index = [jnp.int32(b), offsets[b].astype(jnp.int32)]
        if layer is not None:
            index.insert(0, jnp.asarray(layer, jnp.int32))
        buf = lax.scatter(
            buf,
            jnp.stack(index)[None],
            update[b : b + 1],
            dims,
            indices_are_sorted=True,
            unique_indices=True,
            mode=lax.GatherScatterMode.FILL_OR_DROP,
        )
    return buf


def write_rows_in_dtype(buf, update, offsets, layer):
    """`write_chunk_rows` unguarded and in ``buf``'s own dtype (no integer view): one ``dynamic_update_slice`` per
    session."""
    trailing = (0,) * (update.ndim - 2)
    lead = () if layer is None else (layer,)
    for b in range(update.shape[0]):
        row = update[b : b + 1] if layer is None else update[None, b : b + 1]
        buf = lax.dynamic_update_slice(buf, row, (*lead, b, offsets[b], *trailing))
    return buf


# The integer view has no derivative: without this rule jax.grad through a write would be silently zero. The write
# is linear in (buf, update), so its tangent is the same write on the tangents, done on floats.
@jax.custom_jvp
def _write_rows_as_bits(buf, update, offsets):
    bits = _unsigned_like(buf.dtype)
    as_bits = lambda x: lax.bitcast_convert_type(x, bits)
    out = write_rows_in_dtype(as_bits(buf), as_bits(update), offsets, None)
    return lax.bitcast_convert_type(out, buf.dtype)


@_write_rows_as_bits.defjvp
def _write_rows_as_bits_jvp(primals, tangents):
    buf, update, offsets = primals
    return _write_rows_as_bits(*primals), write_rows_in_dtype(tangents[0], tangents[1], offsets, None)


def read_chunk_rows(buf: jax.Array, offsets: jax.Array, chunk: int, layer=None) -> jax.Array:
    """Inverse of `write_chunk_rows`: [batch, chunk, ...] read from buf at per-session offsets."""
    batch = offsets.shape[0]
    trailing = (0,) * (buf.ndim - (3 if layer is not None else 2))
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    size = (*(1,) * len(lead), 1, chunk, *buf.shape[len(lead) + 2 :])
    rows = [
        lax.dynamic_slice(buf, (*lead, b, offsets[b], *trailing), size).reshape(size[len(lead) :]) for b in range(batch)
    ]
    return jnp.concatenate(rows, axis=0)
