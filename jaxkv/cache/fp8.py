"""`Fp8Cache`: a ring cache whose keys and values are stored in FP8 (e4m3), half the bytes of bfloat16.

It wraps a `RingCache` holding ``float8_e4m3fn`` K/V and keeps one float32 scale per (layer, session, chunk slot,
head) for K and one for V beside it:

  inner:          RingCache, k, v float8_e4m3fn [(layers,) batch, capacity, heads, head_dim]
  k_scale, v_scale: float32 [(layers,) batch, num_slots, heads]   the scale of each slot's chunk, per head

A stack of layers may be held per layer (`per_layer`, for the unrolled layer loop of per-layer params): the inner
ring's k and v and both scales are then tuples of ``layers`` buffers, [batch, ...] each, addressed by a Python int
layer; the same bytes and scales as the stacked form (`stacked` converts back).

`write` takes K/V in the read dtype (the policy's ``cache_dtype``, e.g. bfloat16), takes each head's amax over the
written chunk (its tokens and head_dim) as that chunk's scale (`jaxkv.fp8`: ``amax / 448``), and stores the
quantized chunk and its scales in the reserved slot, both O(chunk). `layer_kv` dequantizes a layer on read (``x8 *
scale``, in the read dtype), so every attention path that reads `layer_kv` runs unchanged on an FP8 cache;
`layer_fp8` hands out the raw FP8 buffers and scales for a kernel that reads FP8 itself. Per-chunk scales follow the
activations as a stream moves on (a chunk's scale is fixed when it is written, never rescaled by a later chunk), and
per-head scales keep one loud head from flattening the others. That rule lives in one place, `quantize_slots`: a
prompt switch's re-cache (`jaxkv.recache.recompute`) runs on `dequantized` (the ring this cache reads as) and
writes back through `requantized`, each re-run chunk quantized as a step's `write` quantizes it.

Cost: K/V bytes halve against bfloat16 (a quarter of float32); the scales add ``2 * 4 * heads`` bytes per slot and
layer (for Wan 1.3B's 12 heads and 4,680-token chunks: 96 bytes beside 2.9 MB of FP8 K/V). Only the ring policy is
wrapped: the rolling cache shifts its buffers and would have to shift the scales with them, and dilated/mixed caches
keep other layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv import fp8
from jaxkv.cache.ring import RingCache
from jaxkv.cache.rows import read_chunk_rows, write_chunk_rows
from jaxkv.cache.spec import RingSpec

_READ_DTYPES = ("float32", "bfloat16", "float16")


@jax.tree_util.register_pytree_node_class
class Fp8Cache:
    """FP8 K/V ring cache with per-(slot, head) float32 scales; reads dequantize to ``read_dtype``.

    It offers what a model's layer loop uses of a `RingCache` (`begin_chunk`, `write`, `layer_kv`, `reset`,
    `positions`, `chunk_positions`, `replace` of positions/chunk_start, the shape facts); ``dtype`` is the read dtype,
    the dtype `write` takes and `layer_kv` returns.
    """

    def __init__(self, inner: RingCache, k_scale, v_scale, read_dtype: str):
        self.inner, self.k_scale, self.v_scale, self.read_dtype = inner, k_scale, v_scale, read_dtype

    # ---------------------------------------------------------------- pytree

    def tree_flatten(self):
        return (self.inner, self.k_scale, self.v_scale), self.read_dtype

    @classmethod
    def tree_unflatten(cls, read_dtype, children):
        return cls(*children, read_dtype)

    # ---------------------------------------------------------------- construction

    @classmethod
    def init(
        cls,
        spec: RingSpec,
        batch: int,
        heads: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        layers: int | None = None,
        per_layer: bool = False,
    ):
        """An empty FP8 cache: k, v float8_e4m3fn zeros [(layers,) batch, capacity, heads, head_dim], scales 1,
        every position -1; ``dtype`` is the read dtype (float32, bfloat16 or float16). ``per_layer``: held as
        tuples of ``layers`` buffers (see the module docstring)."""
        name = jnp.dtype(dtype).name
        if name not in _READ_DTYPES:
            raise ValueError(f"Fp8Cache: the read dtype must be one of {_READ_DTYPES}, got {name}")
        inner = RingCache.init(spec, batch, heads, head_dim, dtype=fp8.FP8, layers=layers)
        lead = () if layers is None else (int(layers),)
        ones = jnp.ones((*lead, int(batch), spec.num_slots, int(heads)), jnp.float32)
        if per_layer not in (True, False):
            raise ValueError(f"per_layer must be a bool, got {per_layer!r}")
        cache = cls(inner, ones, ones, name)
        return cache.per_layer() if per_layer else cache  # (per_layer raises for an unstacked cache)

    def replace(self, **changes) -> "Fp8Cache":
        """A copy with fields replaced: ``inner``, ``k_scale``, ``v_scale`` here; ``positions`` and ``chunk_start``
        go to the inner cache. K/V bytes cannot be replaced (they would bypass quantization): write them."""
        own = {f: changes.pop(f) for f in ("inner", "k_scale", "v_scale") if f in changes}
        unknown = set(changes) - {"positions", "chunk_start"}
        if unknown:
            raise ValueError(f"Fp8Cache.replace: cannot replace {sorted(unknown)}; K/V go through write()")
        inner = own.pop("inner", self.inner)
        if changes:
            inner = inner.replace(**changes)
        return Fp8Cache(inner, own.get("k_scale", self.k_scale), own.get("v_scale", self.v_scale), self.read_dtype)

    # ---------------------------------------------------------------- shape facts (the inner cache's)

    spec = property(lambda self: self.inner.spec)
    layers = property(lambda self: self.inner.layers)
    batch = property(lambda self: self.inner.batch)
    heads = property(lambda self: self.inner.heads)
    head_dim = property(lambda self: self.inner.head_dim)
    positions = property(lambda self: self.inner.positions)
    chunk_start = property(lambda self: self.inner.chunk_start)
    k = property(lambda self: self.inner.k, doc="The stored FP8 keys (raw, not dequantized).")
    v = property(lambda self: self.inner.v, doc="The stored FP8 values (raw, not dequantized).")

    @property
    def dtype(self):
        """The read dtype: what `write` takes and `layer_kv` returns."""
        return jnp.dtype(self.read_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held: FP8 k and v, positions and both scale arrays."""
        scales = jax.tree.leaves((self.k_scale, self.v_scale))
        return self.inner.nbytes + sum(int(np.prod(s.shape)) * 4 for s in scales)

    @property
    def is_per_layer(self) -> bool:
        """True when K/V and scales are tuples of per-layer buffers (the unrolled layer loop's layout)."""
        return self.inner.is_per_layer

    def per_layer(self) -> "Fp8Cache":
        """This stacked cache with K/V and scales as tuples of per-layer buffers (a copy; the same bytes and
        scales). A per-layer cache is returned as it is."""
        if self.is_per_layer:
            return self
        inner = self.inner.per_layer()  # raises for an unstacked cache
        split = lambda x: tuple(x[i] for i in range(x.shape[0]))
        return Fp8Cache(inner, split(self.k_scale), split(self.v_scale), self.read_dtype)

    def stacked(self) -> "Fp8Cache":
        """This cache with K/V and scales as [layers, ...] stacks (a copy when it is per-layer)."""
        if not self.is_per_layer:
            return self
        return Fp8Cache(self.inner.stacked(), jnp.stack(self.k_scale), jnp.stack(self.v_scale), self.read_dtype)

    def chunk_positions(self):
        return self.inner.chunk_positions()

    def read_positions(self):
        """The slot positions attention reads in this chunk's forward (`jaxkv.cache.ChunkCache.read_positions`)."""
        return self.inner.read_positions()

    def chunk_offsets(self):
        return self.inner.chunk_offsets()

    def next_chunk_index(self):
        return self.inner.next_chunk_index()

    # ---------------------------------------------------------------- transitions

    def begin_chunk(self, active=None) -> "Fp8Cache":
        """`RingCache.begin_chunk`; the reserved slot's old scales stay until the chunk is written (its positions
        are -1 meanwhile, so nothing reads them)."""
        return self.replace(inner=self.inner.begin_chunk(active))

    def only_writing(self, active=None) -> "Fp8Cache":
        """`ChunkCache.only_writing`: later writes (bytes and scales) land only in the sessions where ``active``."""
        return self.replace(inner=self.inner.only_writing(active))

    def reset(self, sessions=None) -> "Fp8Cache":
        return self.replace(inner=self.inner.reset(sessions))

    def write(self, k, v, layer=None, active=None) -> "Fp8Cache":
        """Quantizes k, v [batch, chunk, heads, head_dim] (in the read dtype) with one scale per session and head
        (amax over the chunk's tokens and head_dim / 448) and writes them and their scales into the reserved slot.
        ``layer`` and ``active`` as `RingCache.write` (default: the inner cache's `writers`); inactive sessions keep
        their bytes and scales."""
        if active is None:
            active = self.inner.writers
        for name, x in (("k", k), ("v", v)):
            if getattr(x, "dtype", None) != self.dtype:
                raise ValueError(
                    f"Fp8Cache.write: {name} must be in the cache's read dtype {self.read_dtype}, got "
                    f"{getattr(x, 'dtype', type(x).__name__)} (cast it explicitly)"
                )
        (k8, k_s), (v8, v_s) = quantize_slots(k, 1), quantize_slots(v, 1)
        k_s, v_s = k_s[:, 0], v_s[:, 0]  # [batch, heads]
        inner = self.inner.write(k8, v8, layer=layer, active=active)  # checks shapes, layer, active, reservation
        slot = (self.inner.chunk_offsets() // self.spec.chunk).astype(jnp.int32)
        scales = []
        for bufs, new in ((self.k_scale, k_s), (self.v_scale, v_s)):
            # per layer: that layer's own [batch, num_slots, heads] buffer (layer is a Python int, checked above)
            buf, at = (bufs[layer], None) if self.is_per_layer else (bufs, layer)
            if active is not None:
                old = read_chunk_rows(buf, slot, 1, at)[:, 0]
                new = jnp.where(jnp.asarray(active)[:, None], new, old)
            buf = write_chunk_rows(buf, new[:, None, :], slot, at)
            scales.append(tuple(buf if i == layer else b for i, b in enumerate(bufs)) if self.is_per_layer else buf)
        return Fp8Cache(inner, *scales, self.read_dtype)

    def requantized(self, dense: RingCache, keep=None) -> "Fp8Cache":
        """This cache holding ``dense``'s K/V (a `RingCache` in the read dtype with this cache's spec, sessions and
        layers, e.g. `dequantized` re-computed by a re-cache), each slot's chunk quantized with its own per-head
        scales by the rule `write` uses (`quantize_slots`); positions and the reserved chunk stay this cache's.
        ``keep`` bool [batch, num_slots]: slots whose FP8 bytes and scales stay as they are (not re-rounded)."""
        here = self.stacked()
        dense = dense.stacked()
        if dense.k.shape != here.k.shape or dense.dtype != self.dtype:
            raise ValueError(
                f"Fp8Cache.requantized: the K/V must be {self.read_dtype}{list(here.k.shape)}, got "
                f"{dense.dtype}{list(dense.k.shape)}"
            )
        slots = self.spec.num_slots
        k8, k_s = quantize_slots(dense.k, slots)
        v8, v_s = quantize_slots(dense.v, slots)
        if keep is not None:
            keep = jnp.asarray(keep, bool)
            if keep.shape != (self.batch, slots):
                raise ValueError(f"Fp8Cache.requantized: keep must be bool [{self.batch}, {slots}], got {keep.shape}")
            tokens = jnp.repeat(keep, self.spec.chunk, axis=1)[:, :, None, None]  # [batch, capacity, 1, 1]
            k8, v8 = jnp.where(tokens, here.k, k8), jnp.where(tokens, here.v, v8)
            k_s, v_s = jnp.where(keep[..., None], here.k_scale, k_s), jnp.where(keep[..., None], here.v_scale, v_s)
        out = Fp8Cache(here.inner.replace(k=k8, v=v8), k_s, v_s, self.read_dtype)
        return out.per_layer() if self.is_per_layer else out

    def dequantized(self) -> RingCache:
        """The `RingCache` in the read dtype that this cache reads as (every layer's `layer_kv`, stacked or per
        layer as this cache is); positions and the reserved chunk as here."""
        here = self.stacked()
        k = dequantize_slots(here.inner.k, here.k_scale, self.dtype)
        v = dequantize_slots(here.inner.v, here.v_scale, self.dtype)
        dense = here.inner.replace(k=k, v=v)
        return dense.per_layer() if self.is_per_layer else dense

    # ---------------------------------------------------------------- reads

    def layer_fp8(self, layer=None):
        """(k8, v8 float8_e4m3fn [batch, capacity, heads, head_dim], k_scale, v_scale float32 [batch, num_slots,
        heads]) of one layer (``layer`` None for an unstacked cache; may be traced when stacked; a Python int when
        per layer: the layer's own buffers, no copy)."""
        if self.layers is None:
            if layer is not None:
                raise ValueError("layer_fp8: layer was given but the cache is not stacked")
            return self.inner.k, self.inner.v, self.k_scale, self.v_scale
        k8, v8 = self.inner.layer_kv(layer)  # checks the layer (a Python int per layer)
        if self.is_per_layer:
            return k8, v8, self.k_scale[layer], self.v_scale[layer]
        take = lambda s: lax.dynamic_index_in_dim(s, layer, 0, keepdims=False)
        return k8, v8, take(self.k_scale), take(self.v_scale)

    def layer_kv(self, layer=None):
        """(k, v) of one layer dequantized to the read dtype, each [batch, capacity, heads, head_dim]."""
        k8, v8, k_s, v_s = self.layer_fp8(layer)
        return dequantize_slots(k8, k_s, self.dtype), dequantize_slots(v8, v_s, self.dtype)


def quantize_slots(x, slots: int):
    """The one FP8 rule of the cache: x [..., batch, slots * chunk, heads, head_dim] (in the read dtype) quantized
    with one scale per (slot, head), the amax over that slot's tokens and head_dim / 448 (`jaxkv.fp8`). Returns
    (x8 float8_e4m3fn, x's shape; scale float32 [..., batch, slots, heads]). `Fp8Cache.write` runs it on one chunk,
    `Fp8Cache.requantized` on a whole re-cached buffer."""
    *lead, n, h, d = x.shape
    blocks = x.reshape(*lead, slots, n // slots, h, d)
    scale = fp8.scale_of(blocks, axis=(-3, -1))  # [..., slots, heads]
    return fp8.quantize(blocks, scale[..., None, :, None]).reshape(x.shape), scale


def dequantize_slots(x8, scale, dtype):
    """x8 float8 [..., batch, capacity, heads, head_dim] times its per-(slot, head) scale [..., batch, num_slots,
    heads], in ``dtype`` (capacity = num_slots * chunk)."""
    *lead, n, h, d = x8.shape
    slots = scale.shape[-2]
    blocks = x8.reshape(*lead, slots, n // slots, h, d)
    return fp8.dequantize(blocks, scale[..., None, :, None], dtype).reshape(x8.shape)
