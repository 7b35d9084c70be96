"""Random Wan parameters following `jaxkv.models.wan.params.param_shapes` exactly (`init_params`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import param_shapes


def init_params(config: WanConfig, key, dtype=jnp.float32):
    """Random parameters following `param_shapes(config)` exactly, created directly in ``dtype``.

    Nothing is zero: kernels ~ N(0, 1/fan_in), biases ~ N(0, 0.02^2), norm scales ~ 1 + N(0, 0.1^2), LayerNorm
    shifts ~ N(0, 0.1^2), modulation tables ~ N(0, 1/dim) (as Wan initialises them), so every parameter changes the
    output and a test that drops or permutes one fails.

    Leaf ``i`` of the flattened tree draws from ``split(key, leaves)[i]``; a stacked block leaf ``[layers, ...]``
    draws layer ``l`` from ``split(leaf_key, layers)[l]``. Each leaf is one small jitted program that writes its
    values in ``dtype`` layer by layer, so peak memory is the params plus one layer of one leaf in float32 (a
    whole-tree program held every leaf's float32 noise at once: 16.9 GB for the 1.3B preset in bfloat16).
    """
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys):
        scale, offset = _init_scale_offset(config, path, shape)
        stacked = str(path[0].key) == "blocks"
        out.append(_init_leaf(k, jnp.float32(scale), jnp.float32(offset), tuple(shape), stacked, dtype))
    return jax.tree.unflatten(treedef, out)


def _init_scale_offset(config: WanConfig, path, shape) -> tuple[float, float]:
    """Leaf ``path`` of ``shape`` is ``offset + scale * N(0, 1)`` (the distributions of `init_params`)."""
    name = str(path[-1].key)
    parent = str(path[-2].key) if len(path) > 1 else ""
    if name == "kernel":
        fan_in = math.prod(shape[:-1])
        if parent != "patch_embedding" and len(shape) >= 2:
            fan_in = shape[-2]
        return 1.0 / math.sqrt(fan_in), 0.0
    if name == "bias":
        return (0.1 if parent.startswith("norm") else 0.02), 0.0
    if name == "scale":
        return 0.1, 1.0
    if name == "modulation":
        return 1.0 / math.sqrt(config.dim), 0.0
    raise AssertionError(f"unhandled parameter {jax.tree_util.keystr(path)}")


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _init_leaf(key, scale, offset, shape: tuple[int, ...], stacked: bool, dtype):
    """One leaf ``offset + scale * N(0, 1)`` in ``dtype``; a stacked leaf is drawn layer by layer. Scale and offset
    are traced, so leaves of one shape share a program."""

    def draw(k, leaf_shape):
        return (offset + scale * jax.random.normal(k, leaf_shape, jnp.float32)).astype(dtype)

    if not stacked:
        return draw(key, shape)
    # lax.map writes each layer's slice into the stacked output: only one layer's float32 temporaries are live
    return lax.map(lambda k: draw(k, shape[1:]), jax.random.split(key, shape[0]))
