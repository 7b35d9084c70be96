"""A tiny Wan VAE in PyTorch layouts: its config (`CONFIG`), the same config as diffusers writes it to config.json
(`DIFFUSERS_CONFIG`), and `torch_layout`, jaxkv params written back as the original or diffusers tensors."""

from __future__ import annotations

import numpy as np

from jaxkv.convert.vae_layouts import mapping, source_shape
from jaxkv.models.wan_vae import preset

CONFIG = preset("tiny")

# CONFIG in the keys of diffusers' AutoencoderKLWan config.json (its spelling "temperal" included).
DIFFUSERS_CONFIG = {
    "_class_name": "AutoencoderKLWan",
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "attn_scales": [],
    "is_residual": False,
}


def torch_layout(flat: dict, naming: str) -> dict:
    """jaxkv params -> source tensors, by undoing each transform with plain numpy (the parity tests check the
    names against diffusers and the original code independently)."""
    out = {}
    for key, (src, kind) in mapping(CONFIG, naming).items():
        a = np.asarray(flat[key])
        if kind == "conv3d":
            a = a.transpose(4, 3, 0, 1, 2)
        elif kind == "conv2d":
            a = a.transpose(3, 2, 0, 1)
        elif kind in ("dense3", "dense2"):
            a = a.T.reshape(source_shape(kind, a.shape))
        elif kind in ("norm3", "norm2"):
            a = a.reshape(source_shape(kind, a.shape))
        assert a.shape == source_shape(kind, flat[key].shape)
        out[src] = np.ascontiguousarray(a)
    return out
