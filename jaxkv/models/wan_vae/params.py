"""The jaxkv parameter layout of the Wan 2.1 VAE: one nested dict of arrays, the contract between the converter,
the checkpoint loader and the model. Channels last throughout.

Conventions:
  * A causal 3-D conv is ``{"kernel": [kt, kh, kw, in, out], "bias": [out]}`` (PyTorch Conv3d weight
    ``[out, in, kt, kh, kw]`` transposed ``(2, 3, 4, 1, 0)``); a 2-D conv ``{"kernel": [kh, kw, in, out], ...}``.
  * 1x1(x1) convs (residual shortcuts, attention projections, the quant convs) are dense ``{"kernel": [in, out]}``.
  * RMS norms are ``{"scale": [C]}`` (PyTorch ``gamma`` of shape ``[C, 1, 1(, 1)]``).
  * Stages and blocks are dicts keyed "0", "1", ... so a checkpoint flattens to ``decoder.up.1.res.0.conv1.kernel``.

Tree::

    encoder: conv_in, down.{i}.res.{j}, down.{i}.resample (not in the last stage), mid, norm_out, conv_out
    quant_conv       [2z, 2z]   (the original's ``conv1``)
    post_quant_conv  [z, z]     (the original's ``conv2``)
    decoder: conv_in, mid, up.{i}.res.{j}, up.{i}.resample (not in the last stage), norm_out, conv_out
    mid: res0, attn {norm, qkv [C, 3C], proj [C, C]}, res1
    res block: norm1, conv1 (3x3x3), norm2, conv2 (3x3x3), shortcut [in, out] (only when in != out)
    resample: conv (2-D 3x3), time_conv ([3, 1, 1, C, 2C] up / [3, 1, 1, C, C] down; temporal stages only)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxkv.models.param_tree import check_shapes, flatten, unflatten
from jaxkv.models.wan_vae.config import WanVAEConfig

__all__ = ["param_shapes", "flat_param_shapes", "init_params", "validate_params", "flatten", "unflatten", "num_params"]


def _conv3d(c_in: int, c_out: int, kt: int = 3, k: int = 3) -> dict:
    return {"kernel": (kt, k, k, c_in, c_out), "bias": (c_out,)}


def _conv2d(c_in: int, c_out: int) -> dict:
    return {"kernel": (3, 3, c_in, c_out), "bias": (c_out,)}


def _dense(c_in: int, c_out: int) -> dict:
    return {"kernel": (c_in, c_out), "bias": (c_out,)}


def _res(c_in: int, c_out: int) -> dict:
    block = {
        "norm1": {"scale": (c_in,)},
        "conv1": _conv3d(c_in, c_out),
        "norm2": {"scale": (c_out,)},
        "conv2": _conv3d(c_out, c_out),
    }
    if c_in != c_out:
        block["shortcut"] = _dense(c_in, c_out)
    return block


def _mid(c: int) -> dict:
    return {
        "res0": _res(c, c),
        "attn": {"norm": {"scale": (c,)}, "qkv": _dense(c, 3 * c), "proj": _dense(c, c)},
        "res1": _res(c, c),
    }


def encoder_shapes(config: WanVAEConfig) -> dict[str, Any]:
    dims = config.encoder_dims
    down = {}
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:])):
        stage: dict[str, Any] = {"res": {}}
        for j in range(config.num_res_blocks):
            stage["res"][str(j)] = _res(c_in if j == 0 else c_out, c_out)
        if i != len(config.dim_mult) - 1:
            stage["resample"] = {"conv": _conv2d(c_out, c_out)}
            if config.temporal_downsample[i]:
                stage["resample"]["time_conv"] = _conv3d(c_out, c_out, kt=3, k=1)
        down[str(i)] = stage
    c = dims[-1]
    return {
        "conv_in": _conv3d(config.image_channels, dims[0]),
        "down": down,
        "mid": _mid(c),
        "norm_out": {"scale": (c,)},
        "conv_out": _conv3d(c, 2 * config.z_dim),
    }


def decoder_shapes(config: WanVAEConfig) -> dict[str, Any]:
    dims = config.decoder_dims
    up = {}
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:])):
        if i > 0:
            c_in //= 2  # the previous stage's upsampling conv halved the channels
        stage: dict[str, Any] = {"res": {}}
        for j in range(config.num_res_blocks + 1):
            stage["res"][str(j)] = _res(c_in if j == 0 else c_out, c_out)
        if i != len(config.dim_mult) - 1:
            stage["resample"] = {"conv": _conv2d(c_out, c_out // 2)}
            if config.temporal_upsample[i]:
                stage["resample"]["time_conv"] = _conv3d(c_out, 2 * c_out, kt=3, k=1)
        up[str(i)] = stage
    c = dims[-1]
    return {
        "conv_in": _conv3d(config.z_dim, dims[0]),
        "mid": _mid(dims[0]),
        "up": up,
        "norm_out": {"scale": (c,)},
        "conv_out": _conv3d(c, config.image_channels),
    }


def param_shapes(config: WanVAEConfig) -> dict[str, Any]:
    """Nested dict with the structure of the params whose leaves are shape tuples."""
    z = config.z_dim
    return {
        "encoder": encoder_shapes(config),
        "quant_conv": _dense(2 * z, 2 * z),
        "post_quant_conv": _dense(z, z),
        "decoder": decoder_shapes(config),
    }


def flat_param_shapes(config: WanVAEConfig) -> dict[str, tuple[int, ...]]:
    """{"decoder.conv_in.kernel": (3, 3, 3, 16, 384), ...} for every parameter."""
    return flatten(param_shapes(config))


def num_params(config: WanVAEConfig, part: str | None = None) -> int:
    """Parameter count of the whole VAE, or of ``part`` ("encoder" / "decoder")."""
    flat = flat_param_shapes(config)
    return sum(int(np.prod(s)) for k, s in flat.items() if part is None or k.startswith(part + "."))


def init_params(seed: int, config: WanVAEConfig, dtype=jnp.float32) -> dict[str, Any]:
    """Random params (kernels ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm scales ~ 1 + N(0, 0.1^2)) from the
    integer ``seed``: a VAE that decodes to frames of order 1, for tests and the embedded default; not a trained
    model. Drawn with NumPy on the host: one JAX random call per parameter shape would compile ~100 programs."""
    from jaxkv.validate import check_int

    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    out = {}
    for name, shape in sorted(flat_param_shapes(config).items()):
        if name.endswith(".kernel"):
            value = rng.standard_normal(shape) / np.sqrt(int(np.prod(shape[:-1])))
        elif name.endswith(".scale"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        out[name] = jnp.asarray(value.astype(np.float32), dtype=dtype)
    return unflatten(out)


def validate_params(params: dict[str, Any], config: WanVAEConfig, part: str | None = None) -> None:
    """Raises ValueError naming every missing key, unexpected key and shape mismatch. ``part`` ("encoder" /
    "decoder") checks only that sub-tree (a decode-only caller may hold just the decoder)."""
    prefixes = (
        None
        if part is None
        else (("decoder.", "post_quant_conv.") if part == "decoder" else ("encoder.", "quant_conv."))
    )
    check_shapes(params, flat_param_shapes(config), "Wan VAE", prefixes)
