"""The jaxkv parameter layout of a Wan 2.1 DiT: one nested dict of arrays, the single contract between the
converter (which writes it), the checkpoint loader and the model (which read it).

Conventions:
  * Linear layers are ``{"kernel": [in, out], "bias": [out]}`` (PyTorch ``weight`` transposed).
  * The 30/40 transformer blocks are **stacked** on a leading layer axis ``L`` so the model scans over them. For
    inference they may instead be held **per layer** (`per_layer_params`): ``blocks`` is then a tuple of L dicts
    of the same layout without the L axis, each leaf its own buffer, and the model unrolls its layer loop and reads
    every weight where it lies (a scan over a stack copies each layer's weights out of the stack per forward).
  * ``patch_embedding.kernel`` is ``[pt, ph, pw, in_dim, dim]``: a patch flattened in (pt, ph, pw, channel) order,
    channel fastest, times ``kernel.reshape(-1, dim)`` equals the PyTorch Conv3d (weight ``[dim, in_dim, pt, ph,
    pw]`` transposed to ``(2, 3, 4, 1, 0)``).
  * ``head.head.kernel`` is ``[dim, pt*ph*pw*out_dim]`` with outputs ordered (pt, ph, pw, channel), as in Wan.
  * Norm scales are named ``scale`` (RMSNorm ``weight``; LayerNorm ``weight``) and LayerNorm shifts ``bias``.

Original Wan 2.1 key -> jaxkv path (block keys lose their index and gain the leading L axis):
  patch_embedding.{weight,bias}        -> patch_embedding.{kernel,bias}
  text_embedding.0 / .2                -> text_embedding.fc1 / fc2
  time_embedding.0 / .2                -> time_embedding.fc1 / fc2
  time_projection.1                    -> time_projection
  blocks.N.self_attn.{q,k,v,o}         -> blocks.self_attn.{q,k,v,o}
  blocks.N.self_attn.norm_{q,k}.weight -> blocks.self_attn.norm_{q,k}.scale
  blocks.N.cross_attn.*                -> blocks.cross_attn.* (same sub-layout)
  blocks.N.norm3.{weight,bias}         -> blocks.norm3.{scale,bias}
  blocks.N.ffn.0 / .2                  -> blocks.ffn.fc1 / fc2
  blocks.N.modulation [1, 6, D]        -> blocks.modulation [L, 6, D]
  head.head                            -> head.head
  head.modulation [1, 2, D]            -> head.modulation [2, D]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.models.param_tree import check_shapes, flatten, unflatten  # noqa: F401  (re-exported)
from jaxkv.models.wan.config import WanConfig


def _linear(d_in: int, d_out: int, lead: tuple[int, ...] = ()) -> dict[str, tuple[int, ...]]:
    return {"kernel": (*lead, d_in, d_out), "bias": (*lead, d_out)}


def _attention(dim: int, lead: tuple[int, ...]) -> dict[str, Any]:
    return {
        "q": _linear(dim, dim, lead),
        "k": _linear(dim, dim, lead),
        "v": _linear(dim, dim, lead),
        "o": _linear(dim, dim, lead),
        "norm_q": {"scale": (*lead, dim)},
        "norm_k": {"scale": (*lead, dim)},
    }


def param_shapes(config: WanConfig) -> dict[str, Any]:
    """Nested dict with the same structure as the params whose leaves are shape tuples."""
    d, L = config.dim, (config.num_layers,)
    pt, ph, pw = config.patch_size
    return {
        "patch_embedding": {"kernel": (pt, ph, pw, config.in_dim, d), "bias": (d,)},
        "text_embedding": {"fc1": _linear(config.text_dim, d), "fc2": _linear(d, d)},
        "time_embedding": {"fc1": _linear(config.freq_dim, d), "fc2": _linear(d, d)},
        "time_projection": _linear(d, 6 * d),
        "blocks": {
            "self_attn": _attention(d, L),
            "cross_attn": _attention(d, L),
            "norm3": {"scale": (*L, d), "bias": (*L, d)},
            "ffn": {"fc1": _linear(d, config.ffn_dim, L), "fc2": _linear(config.ffn_dim, d, L)},
            "modulation": (*L, 6, d),
        },
        "head": {"head": _linear(d, config.patch_volume * config.out_dim), "modulation": (2, d)},
    }


def flat_param_shapes(config: WanConfig) -> dict[str, tuple[int, ...]]:
    """{"blocks.self_attn.q.kernel": (L, D, D), ...} for every parameter."""
    return flatten(param_shapes(config))


def validate_params(params: dict[str, Any], config: WanConfig) -> None:
    """Raises ValueError naming every missing key, unexpected key and shape mismatch."""
    check_shapes(params, flat_param_shapes(config), "Wan")


def is_per_layer(params: dict[str, Any]) -> bool:
    """Whether ``params["blocks"]`` is held per layer (a tuple of per-layer dicts) rather than stacked."""
    return isinstance(params["blocks"], (tuple, list))


def per_layer_params(params: dict[str, Any]) -> dict[str, Any]:
    """The params with ``blocks`` as a tuple of per-layer dicts (each leaf ``stacked[layer]``, its own buffer).

    Build it once at load time and drop the stacked params: the two forms together hold the block weights twice.
    Every model function takes either form and gives the same results; `stacked_params` is the inverse (for
    `jaxkv.models.wan.save` and training code that scans over layers). A per-layer params tree is returned as it is.
    """
    if is_per_layer(params):
        return params
    blocks = params["blocks"]
    layers = {leaf.shape[0] for leaf in jax.tree.leaves(blocks)}
    if len(layers) != 1:
        raise ValueError(f"stacked blocks must share one leading layer axis, got sizes {sorted(layers)}")
    n = layers.pop()
    split = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(n)]
    return {**params, "blocks": tuple(split)}


def stacked_params(params: dict[str, Any]) -> dict[str, Any]:
    """The params with per-layer ``blocks`` stacked on a leading layer axis again (see `per_layer_params`)."""
    if not is_per_layer(params):
        return params
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}
