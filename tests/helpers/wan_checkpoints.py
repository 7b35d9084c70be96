"""Tiny Wan DiT checkpoints in PyTorch layouts: the config (`CFG`), random original-layout state dicts
(`random_original`), the diffusers names (`diffusers_name`), the params a conversion must give (`expected_params`)
and the comparisons the conversion tests share."""

from __future__ import annotations

import os
import re

import numpy as np

from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import flatten

# Asymmetric patch, in_dim != out_dim, text_dim != dim: a swapped axis cannot go unnoticed.
CFG = WanConfig(
    dim=32,
    ffn_dim=48,
    num_heads=2,
    num_layers=3,
    in_dim=4,
    out_dim=6,
    patch_size=(1, 3, 2),
    text_dim=24,
    text_len=8,
    freq_dim=16,
)


def original_wan_shapes(c: WanConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an original Wan 2.1 T2V DiT state dict, with its PyTorch shape."""
    d, f = c.dim, c.ffn_dim
    pt, ph, pw = c.patch_size
    shapes = {
        "patch_embedding.weight": (d, c.in_dim, pt, ph, pw),
        "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, c.text_dim),
        "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d),
        "text_embedding.2.bias": (d,),
        "time_embedding.0.weight": (d, c.freq_dim),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "head.head.weight": (pt * ph * pw * c.out_dim, d),
        "head.head.bias": (pt * ph * pw * c.out_dim,),
        "head.modulation": (1, 2, d),
    }
    for i in range(c.num_layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                shapes[f"blocks.{i}.{attn}.{proj}.weight"] = (d, d)
                shapes[f"blocks.{i}.{attn}.{proj}.bias"] = (d,)
            shapes[f"blocks.{i}.{attn}.norm_q.weight"] = (d,)
            shapes[f"blocks.{i}.{attn}.norm_k.weight"] = (d,)
        shapes[f"blocks.{i}.norm3.weight"] = (d,)
        shapes[f"blocks.{i}.norm3.bias"] = (d,)
        shapes[f"blocks.{i}.ffn.0.weight"] = (f, d)
        shapes[f"blocks.{i}.ffn.0.bias"] = (f,)
        shapes[f"blocks.{i}.ffn.2.weight"] = (d, f)
        shapes[f"blocks.{i}.ffn.2.bias"] = (d,)
        shapes[f"blocks.{i}.modulation"] = (1, 6, d)
    return shapes


def random_original(c: WanConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in original_wan_shapes(c).items()}


def expected_params(sd: dict[str, np.ndarray], c: WanConfig) -> dict:
    """The jaxkv params an original-layout state dict must become (params.py's documented convention)."""
    layers = range(c.num_layers)

    def lin(name):
        return {"kernel": sd[f"{name}.weight"].T, "bias": sd[f"{name}.bias"]}

    def stacked_lin(name):
        return {
            "kernel": np.stack([sd[f"blocks.{i}.{name}.weight"].T for i in layers]),
            "bias": np.stack([sd[f"blocks.{i}.{name}.bias"] for i in layers]),
        }

    def attn(kind):
        out = {p: stacked_lin(f"{kind}.{p}") for p in ("q", "k", "v", "o")}
        for n in ("norm_q", "norm_k"):
            out[n] = {"scale": np.stack([sd[f"blocks.{i}.{kind}.{n}.weight"] for i in layers])}
        return out

    return {
        "patch_embedding": {
            "kernel": sd["patch_embedding.weight"].transpose(2, 3, 4, 1, 0),
            "bias": sd["patch_embedding.bias"],
        },
        "text_embedding": {"fc1": lin("text_embedding.0"), "fc2": lin("text_embedding.2")},
        "time_embedding": {"fc1": lin("time_embedding.0"), "fc2": lin("time_embedding.2")},
        "time_projection": lin("time_projection.1"),
        "blocks": {
            "self_attn": attn("self_attn"),
            "cross_attn": attn("cross_attn"),
            "norm3": {
                "scale": np.stack([sd[f"blocks.{i}.norm3.weight"] for i in layers]),
                "bias": np.stack([sd[f"blocks.{i}.norm3.bias"] for i in layers]),
            },
            "ffn": {"fc1": stacked_lin("ffn.0"), "fc2": stacked_lin("ffn.2")},
            "modulation": np.stack([sd[f"blocks.{i}.modulation"][0] for i in layers]),
        },
        "head": {"head": lin("head.head"), "modulation": sd["head.modulation"][0]},
    }


# Original Wan module name -> diffusers WanTransformer3DModel module name (the parity tests check this table
# against diffusers' own state dict and its original->diffusers converter).
DIFFUSERS_TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
}


DIFFUSERS_BLOCK = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "norm3": "norm2",  # the affine LayerNorm before cross-attention
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "modulation": "scale_shift_table",
}


def diffusers_name(key: str) -> str:
    m = re.fullmatch(r"blocks\.(\d+)\.(.+?)(\.weight|\.bias)?", key)
    if m:
        return f"blocks.{m.group(1)}.{DIFFUSERS_BLOCK[m.group(2)]}{m.group(3) or ''}"
    m = re.fullmatch(r"(.+?)(\.weight|\.bias)?", key)
    return DIFFUSERS_TOP[m.group(1)] + (m.group(2) or "")


def assert_params_equal(got: dict, want: dict):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def leftovers(parent) -> list[str]:
    """Temporary directories a failed write may have left."""
    return [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n]
