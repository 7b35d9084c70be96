"""Parameter shardings of the Wan DiT from ONE rule table keyed by parameter path (Megatron-style tensor parallel).

Each attention (self and cross) shards q, k, v by output columns and o by input rows, so every device holds whole
heads: its q/k/v, its slice of the KV cache and its attention are local, and the o projection ends in one
all-reduce. The FFN shards fc1 by columns and fc2 by rows: one all-reduce. Wan's q/k RMSNorm runs over the full
width, so its scale is sharded like q's columns and the partitioner adds a small all-reduce of the per-token sum of
squares ([batch, tokens] floats, negligible next to the activations). Everything else (embeddings, modulation,
norm3, head) is small and replicated. The data axis never shards a parameter: each data group holds a full copy.

Rules match the flattened path (``blocks.self_attn.q.kernel``) by regular expression, first match wins, and give the
`PartitionSpec` of the whole leaf, stacked layer axis included; a leaf that no rule matches is replicated.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.models.param_tree import flatten, unflatten
from jaxkv.parallel.mesh import MODEL

# (path pattern, spec of the stacked leaf). Kernels are [layers, in, out], biases and scales [layers, width].
RULES: tuple[tuple[str, P], ...] = (
    (r"blocks\.(self|cross)_attn\.(q|k|v)\.kernel", P(None, None, MODEL)),
    (r"blocks\.(self|cross)_attn\.(q|k|v)\.bias", P(None, MODEL)),
    (r"blocks\.(self|cross)_attn\.norm_(q|k)\.scale", P(None, MODEL)),
    (r"blocks\.(self|cross)_attn\.o\.kernel", P(None, MODEL, None)),
    (r"blocks\.ffn\.fc1\.kernel", P(None, None, MODEL)),
    (r"blocks\.ffn\.fc1\.bias", P(None, MODEL)),
    (r"blocks\.ffn\.fc2\.kernel", P(None, MODEL, None)),
)
_COMPILED = tuple((re.compile(pattern), spec) for pattern, spec in RULES)


def spec_of(path: str, shape: tuple[int, ...]) -> P:
    """The PartitionSpec of the parameter at ``path`` (flattened with '.') of ``shape``; P() when no rule matches.
    ValueError when the matching rule does not fit the leaf's rank."""
    for pattern, spec in _COMPILED:
        if pattern.fullmatch(path):
            if len(spec) != len(shape):
                raise ValueError(
                    f"sharding rule {pattern.pattern!r} has {len(spec)} axes but parameter {path} is {list(shape)}"
                )
            return spec
    return P()


def check_divisible(path: str, shape, spec: P, mesh: Mesh) -> None:
    for dim, axis in zip(shape, spec):
        if axis is not None and dim % mesh.shape[axis]:
            raise ValueError(
                f"parameter {path} {list(shape)} cannot be sharded {spec} on a mesh with {axis}="
                f"{mesh.shape[axis]}: {dim} is not divisible by {mesh.shape[axis]}"
            )


def _shape(leaf) -> tuple[int, ...]:
    return tuple(leaf) if isinstance(leaf, tuple) else tuple(np.shape(leaf))


def param_specs(params) -> dict:
    """A nested tree of `PartitionSpec` with the structure of ``params`` (arrays, ShapeDtypeStructs, or shape tuples
    as from `jaxkv.models.wan.params.param_shapes`)."""
    return unflatten({path: spec_of(path, _shape(leaf)) for path, leaf in flatten(params).items()})


def param_shardings(params, mesh: Mesh) -> dict:
    """A tree of `NamedSharding` on ``mesh`` for ``params`` (arrays or shape tuples), checked: ValueError naming the
    parameter when a sharded dimension is not divisible by its mesh axis (e.g. heads by the model size)."""
    flat = flatten(params)
    out = {}
    for path, leaf in flat.items():
        shape = _shape(leaf)
        spec = spec_of(path, shape)
        check_divisible(path, shape, spec, mesh)
        out[path] = NamedSharding(mesh, spec)
    return unflatten(out)


def put_global(value, sharding: NamedSharding) -> jax.Array:
    """A host or single-device array as a global array of ``sharding``: each process materialises only its
    addressable shards (``jax.make_array_from_callback``), so the same call works in a multi-process job as long as
    every process passes the same value."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, mesh: Mesh) -> dict:
    """``params`` placed by the rule table on ``mesh`` (see `put_global`)."""
    shardings = param_shardings(params, mesh)
    return jax.tree.map(put_global, params, shardings)


def bytes_per_device(params, mesh: Mesh) -> int:
    """Bytes of ``params`` (arrays or ShapeDtypeStructs) each device holds under the rule table."""
    total = 0
    for path, leaf in flatten(params).items():
        spec = spec_of(path, tuple(leaf.shape))
        parts = math.prod(mesh.shape[a] for a in spec if a is not None)
        total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // parts
    return total
