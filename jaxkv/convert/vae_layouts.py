"""Key names of the two Wan 2.1 VAE layouts (``wan``, the original ``Wan2.1_VAE.pth``; ``diffusers``,
``AutoencoderKLWan``), how each tensor becomes a jaxkv VAE parameter, and how a state dict's layout is told apart by
its key names (`detect_vae_naming`). As `jaxkv.convert.layouts` is for the DiT: `jaxkv.convert.wan_vae` plans and
writes the conversion with these tables.

`mapping` gives {jaxkv flat key: (source key, transform kind)} for a config; the target layout is
`jaxkv.models.wan_vae.params`. Transforms are pure axis/shape changes (`apply`), never arithmetic.
"""

from __future__ import annotations

import numpy as np

from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.params import flat_param_shapes

# Transform kinds: torch tensor -> jaxkv array (pure axis/shape changes).
CONV3D = "conv3d"  # [out, in, kt, kh, kw] -> [kt, kh, kw, in, out]
CONV2D = "conv2d"  # [out, in, kh, kw] -> [kh, kw, in, out]
DENSE3 = "dense3"  # 1x1x1 Conv3d [out, in, 1, 1, 1] -> [in, out]
DENSE2 = "dense2"  # 1x1 Conv2d [out, in, 1, 1] -> [in, out]
NORM3 = "norm3"  # RMS_norm(images=False) gamma [C, 1, 1, 1] -> [C]
NORM2 = "norm2"  # RMS_norm(images=True) gamma [C, 1, 1] -> [C]
COPY = "copy"  # biases


def source_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape that becomes the jaxkv ``shape`` under ``kind``."""
    if kind == CONV3D:
        kt, kh, kw, i, o = shape
        return (o, i, kt, kh, kw)
    if kind == CONV2D:
        kh, kw, i, o = shape
        return (o, i, kh, kw)
    if kind in (DENSE3, DENSE2):
        i, o = shape
        return (o, i, 1, 1, 1) if kind == DENSE3 else (o, i, 1, 1)
    if kind in (NORM3, NORM2):
        return (shape[0], 1, 1, 1) if kind == NORM3 else (shape[0], 1, 1)
    return shape


def apply(kind: str, a: np.ndarray) -> np.ndarray:
    """One source tensor in the jaxkv layout (a view where possible)."""
    if kind == CONV3D:
        return a.transpose(2, 3, 4, 1, 0)
    if kind == CONV2D:
        return a.transpose(2, 3, 1, 0)
    if kind in (DENSE3, DENSE2):
        return a.reshape(a.shape[:2]).T
    if kind in (NORM3, NORM2):
        return a.reshape(a.shape[0])
    return a


# --- naming tables: jaxkv flat key -> (source key, kind) --------------------------------------------------------


def _conv(dst: str, src: str, kind: str = CONV3D) -> dict[str, tuple[str, str]]:
    return {f"{dst}.kernel": (f"{src}.weight", kind), f"{dst}.bias": (f"{src}.bias", COPY)}


def _res(dst: str, src: str, has_shortcut: bool, naming: str) -> dict:
    if naming == "wan":
        names = {
            "norm1": "residual.0",
            "conv1": "residual.2",
            "norm2": "residual.3",
            "conv2": "residual.6",
            "shortcut": "shortcut",
        }
    else:
        names = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "shortcut": "conv_shortcut"}
    table = {
        f"{dst}.norm1.scale": (f"{src}.{names['norm1']}.gamma", NORM3),
        **_conv(f"{dst}.conv1", f"{src}.{names['conv1']}"),
        f"{dst}.norm2.scale": (f"{src}.{names['norm2']}.gamma", NORM3),
        **_conv(f"{dst}.conv2", f"{src}.{names['conv2']}"),
    }
    if has_shortcut:
        table.update(_conv(f"{dst}.shortcut", f"{src}.{names['shortcut']}", DENSE3))
    return table


def _mid(dst: str, src: str, naming: str) -> dict:
    if naming == "wan":
        res0, attn, res1 = f"{src}.middle.0", f"{src}.middle.1", f"{src}.middle.2"
    else:
        res0, attn, res1 = f"{src}.mid_block.resnets.0", f"{src}.mid_block.attentions.0", f"{src}.mid_block.resnets.1"
    return {
        **_res(f"{dst}.mid.res0", res0, False, naming),
        **_res(f"{dst}.mid.res1", res1, False, naming),
        f"{dst}.mid.attn.norm.scale": (f"{attn}.norm.gamma", NORM2),
        **_conv(f"{dst}.mid.attn.qkv", f"{attn}.to_qkv", DENSE2),
        **_conv(f"{dst}.mid.attn.proj", f"{attn}.proj", DENSE2),
    }


def mapping(config: WanVAEConfig, naming: str) -> dict[str, tuple[str, str]]:
    """{jaxkv flat key: (source key, transform kind)} for every parameter of ``config`` in ``naming``."""
    shapes = flat_param_shapes(config)
    has = lambda key: key in shapes
    nrb, stages = config.num_res_blocks, len(config.dim_mult)
    wan = naming == "wan"
    t: dict[str, tuple[str, str]] = {}
    # Encoder: residual blocks and resamplers in one flat list, stage i starting at i * (nrb + 1).
    t.update(_conv("encoder.conv_in", "encoder.conv1" if wan else "encoder.conv_in"))
    down = "encoder.downsamples" if wan else "encoder.down_blocks"
    for i in range(stages):
        for j in range(nrb):
            dst = f"encoder.down.{i}.res.{j}"
            t.update(_res(dst, f"{down}.{i * (nrb + 1) + j}", has(f"{dst}.shortcut.kernel"), naming))
        if i != stages - 1:
            src = f"{down}.{i * (nrb + 1) + nrb}"
            t.update(_conv(f"encoder.down.{i}.resample.conv", f"{src}.resample.1", CONV2D))
            if config.temporal_downsample[i]:
                t.update(_conv(f"encoder.down.{i}.resample.time_conv", f"{src}.time_conv"))
    t.update(_mid("encoder", "encoder", naming))
    t["encoder.norm_out.scale"] = ("encoder.head.0.gamma" if wan else "encoder.norm_out.gamma", NORM3)
    t.update(_conv("encoder.conv_out", "encoder.head.2" if wan else "encoder.conv_out"))
    t.update(_conv("quant_conv", "conv1" if wan else "quant_conv", DENSE3))
    t.update(_conv("post_quant_conv", "conv2" if wan else "post_quant_conv", DENSE3))
    # Decoder: the original keeps one flat list (stage i at i * (nrb + 2)); diffusers nests it per stage.
    t.update(_conv("decoder.conv_in", "decoder.conv1" if wan else "decoder.conv_in"))
    t.update(_mid("decoder", "decoder", naming))
    for i in range(stages):
        for j in range(nrb + 1):
            dst = f"decoder.up.{i}.res.{j}"
            src = f"decoder.upsamples.{i * (nrb + 2) + j}" if wan else f"decoder.up_blocks.{i}.resnets.{j}"
            t.update(_res(dst, src, has(f"{dst}.shortcut.kernel"), naming))
        if i != stages - 1:
            src = f"decoder.upsamples.{i * (nrb + 2) + nrb + 1}" if wan else f"decoder.up_blocks.{i}.upsamplers.0"
            t.update(_conv(f"decoder.up.{i}.resample.conv", f"{src}.resample.1", CONV2D))
            if config.temporal_upsample[i]:
                t.update(_conv(f"decoder.up.{i}.resample.time_conv", f"{src}.time_conv"))
    t["decoder.norm_out.scale"] = ("decoder.head.0.gamma" if wan else "decoder.norm_out.gamma", NORM3)
    t.update(_conv("decoder.conv_out", "decoder.head.2" if wan else "decoder.conv_out"))
    if set(t) != set(shapes):  # the table and the params layout are two descriptions of one tree
        raise AssertionError(f"VAE mapping out of sync with the params layout: {sorted(set(t) ^ set(shapes))[:8]}")
    return {k: t[k] for k in sorted(shapes)}


def detect_vae_naming(keys) -> str | None:
    """'wan' / 'diffusers' when ``keys`` look like a Wan-family VAE state dict, else None."""
    keys = set(keys)
    if "post_quant_conv.weight" in keys and "decoder.conv_in.weight" in keys:
        return "diffusers"
    if (
        "conv2.weight" in keys
        and "decoder.conv1.weight" in keys
        and any(k.startswith("decoder.upsamples.") for k in keys)
    ):
        return "wan"
    return None
