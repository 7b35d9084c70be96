"""The jaxkv parameter layout of a Wan 2.1 DiT: one nested dict of arrays, the single contract between the
converter (which writes it), the checkpoint loader and the model (which read it).

Conventions:
  * Linear layers are ``{"kernel": [in, out], "bias": [out]}`` (PyTorch ``weight`` transposed).
  * The 30/40 transformer blocks are **stacked** on a leading layer axis ``L`` so the model scans over them.
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

import numpy as np

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


def flatten(tree: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a.b": x}. Used for safetensors files."""
    out: dict[str, Any] = {}

    def visit(prefix: str, node):
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{prefix}{sep}{key}" if prefix else key, value)
        else:
            out[prefix] = node

    visit("", tree)
    return out


def unflatten(flat: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """Inverse of `flatten`."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(sep)
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def flat_param_shapes(config: WanConfig) -> dict[str, tuple[int, ...]]:
    """{"blocks.self_attn.q.kernel": (L, D, D), ...} for every parameter."""
    return flatten(param_shapes(config))


def validate_params(params: dict[str, Any], config: WanConfig) -> None:
    """Raises ValueError naming every missing key, unexpected key and shape mismatch."""
    expected = flat_param_shapes(config)
    found = {k: tuple(np.shape(v)) for k, v in flatten(params).items()}
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:
        problems.append(f"unexpected keys: {unexpected}")
    for key in sorted(set(expected) & set(found)):
        if expected[key] != found[key]:
            problems.append(f"{key}: expected shape {expected[key]}, found {found[key]}")
    if problems:
        raise ValueError("params do not match the Wan config:\n  " + "\n  ".join(problems))
