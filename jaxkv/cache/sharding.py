"""Placing a cache on a device mesh with `jax.sharding`.

Attention heads are independent, so the cache shards on the kv-head axis (over one mesh axis or several, e.g.
``("model", "seq")`` for tensor x sequence parallel); sessions (batch rows) are independent, so it shards on a data
axis too. Slots are never sharded. A `DilatedCache` has the same fields and the same
layout (its ring and scratch are slots); a `MixedCache` is two such stacks, each sharded the same way; an `Fp8Cache`
is its FP8 ring sharded so, with its per-(slot, head) scales split like the heads they scale. These are
ordinary `NamedSharding`s / `PartitionSpec`s:

* heads only: pass `cache_shardings` to ``jax.jit(in_shardings=..., out_shardings=..., donate_argnums=...)``; the
  SPMD partitioner keeps every chunk write local and in place.
* sessions (and heads): run the step under ``jax.shard_map`` with `cache_partition_specs` as in/out specs, so each
  device writes its own sessions. (Under plain ``jit`` the partitioner turns a write into a session row of a
  batch-sharded buffer into a select over the whole shard, i.e. a copy of the cache per chunk; a batched scatter
  avoids that but XLA:CPU runs it in O(window).)
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.cache.mixed import MixedCache

Axis = str | tuple[str, ...] | None


def cache_shardings(
    cache: ChunkCache | MixedCache | Fp8Cache, mesh: Mesh, *, data_axis: Axis = "data", head_axis: Axis = "model"
):
    """A pytree of `NamedSharding` with the structure of ``cache``.

    k, v [(layers,) batch, capacity, heads, head_dim] -> P((None,) data_axis, None, head_axis, None);
    positions [batch, capacity] -> P(data_axis, None); chunk_start [batch] -> P(data_axis); an `Fp8Cache`'s
    k_scale, v_scale [(layers,) batch, num_slots, heads] -> P((None,) data_axis, None, head_axis).
    Pass ``None`` for an axis to replicate along it, a tuple of mesh axes to split over their product. Raises
    ValueError when a mesh axis is unknown or does not divide the dimension it shards.
    """
    for name, axis, size in (("data_axis", data_axis, cache.batch), ("head_axis", head_axis, cache.heads)):
        if axis is None:
            continue
        names = axis if isinstance(axis, tuple) else (axis,)
        unknown = [a for a in names if a not in mesh.shape]
        if unknown:
            raise ValueError(f"{name}={axis!r}: {unknown[0]!r} is not an axis of the mesh {dict(mesh.shape)}")
        parts = math.prod(mesh.shape[a] for a in names)
        if size % parts:
            what = "batch (sessions)" if name == "data_axis" else "heads"
            raise ValueError(f"{what} = {size} is not divisible by mesh axis {axis!r} of size {parts}")
    specs = cache_partition_specs(cache, data_axis=data_axis, head_axis=head_axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def shard_cache(
    cache: ChunkCache | MixedCache | Fp8Cache, mesh: Mesh, *, data_axis: Axis = "data", head_axis: Axis = "model"
):
    """``cache`` placed on ``mesh`` (see `cache_shardings`)."""
    return jax.device_put(cache, cache_shardings(cache, mesh, data_axis=data_axis, head_axis=head_axis))


def cache_partition_specs(
    cache: ChunkCache | MixedCache | Fp8Cache, *, data_axis: Axis = "data", head_axis: Axis = "model"
):
    """The `PartitionSpec`s of `cache_shardings` without a mesh, for ``jax.shard_map`` in_specs / out_specs (a
    `MixedCache`: its dense and its dilated stack each as a `ChunkCache`; an `Fp8Cache`: its inner ring so, and its
    scales by session and head)."""
    if getattr(cache, "is_per_layer", False):
        raise ValueError("cache_partition_specs: a per-layer cache is not sharded; stack it first (cache.stacked())")
    if isinstance(cache, Fp8Cache):
        lead = (None,) if cache.layers is not None else ()
        scale = P(*lead, data_axis, None, head_axis)
        inner = cache_partition_specs(cache.inner, data_axis=data_axis, head_axis=head_axis)
        return cache.replace(inner=inner, k_scale=scale, v_scale=scale)
    if isinstance(cache, MixedCache):
        kw = dict(data_axis=data_axis, head_axis=head_axis)
        return cache.replace(
            dense=cache_partition_specs(cache.dense, **kw), dilated=cache_partition_specs(cache.dilated, **kw)
        )
    lead = (None,) if cache.layers is not None else ()
    kv = P(*lead, data_axis, None, head_axis, None)
    return cache.replace(k=kv, v=kv, positions=P(data_axis, None), chunk_start=P(data_axis))
