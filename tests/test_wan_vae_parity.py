"""Parity of the JAX Wan 2.1 VAE with diffusers' AutoencoderKLWan (f32, small random config, every parameter
re-randomised), through both converter layouts: diffusers (config.json + safetensors) and the original Wan 2.1
state dict, whose key names this file writes out itself from the original ``wan/modules/vae.py`` (not from the
converter's table)."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import jax
import jax.numpy as jnp

from jaxkv.convert.errors import ConversionError
from jaxkv.convert.wan_vae import convert_vae, is_vae_source, load, plan_vae_conversion
from jaxkv.models.wan_vae import decode, decode_chunk, encode, init_decoder_state, preset

pytestmark = pytest.mark.torch

BASE, MULT, NRB = 8, [1, 2, 2, 2], 1
TOL = 1e-4


def _randomise(module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


@pytest.fixture(scope="module")
def vae():
    model = diffusers.AutoencoderKLWan(
        base_dim=BASE, z_dim=16, dim_mult=MULT, num_res_blocks=NRB, temperal_downsample=[False, True, True]
    ).eval()
    _randomise(model, 0)
    return model


def _original_name(key: str) -> str:
    """diffusers AutoencoderKLWan key -> original Wan 2.1 WanVAE_ key (as in wan/modules/vae.py: Encoder3d /
    Decoder3d keep one flat nn.Sequential `downsamples` / `upsamples`; ResidualBlock is
    residual = [RMS_norm, SiLU, CausalConv3d, RMS_norm, SiLU, Dropout, CausalConv3d] + shortcut; `middle` is
    [ResidualBlock, AttentionBlock, ResidualBlock]; `head` is [RMS_norm, SiLU, CausalConv3d]; the quant convs
    are WanVAE_.conv1 / conv2)."""
    top = {
        "quant_conv.weight": "conv1.weight",
        "quant_conv.bias": "conv1.bias",
        "post_quant_conv.weight": "conv2.weight",
        "post_quant_conv.bias": "conv2.bias",
    }
    if key in top:
        return top[key]
    side, rest = key.split(".", 1)
    rest = re.sub(r"^conv_in\.", "conv1.", rest)
    rest = re.sub(r"^norm_out\.gamma$", "head.0.gamma", rest)
    rest = re.sub(r"^conv_out\.", "head.2.", rest)
    rest = rest.replace("mid_block.resnets.0.", "middle.0.").replace("mid_block.attentions.0.", "middle.1.")
    rest = rest.replace("mid_block.resnets.1.", "middle.2.")
    rest = re.sub(r"^down_blocks\.(\d+)\.", r"downsamples.\1.", rest)
    m = re.match(r"^up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", rest)
    if m:  # stage i holds NRB + 1 residual blocks then one resampler: NRB + 2 entries per stage
        rest = f"upsamples.{int(m.group(1)) * (NRB + 2) + int(m.group(2))}.{m.group(3)}"
    m = re.match(r"^up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", rest)
    if m:
        rest = f"upsamples.{int(m.group(1)) * (NRB + 2) + NRB + 1}.{m.group(2)}"
    for new, old in (
        ("norm1.gamma", "residual.0.gamma"),
        ("conv1.", "residual.2."),
        ("norm2.gamma", "residual.3.gamma"),
        ("conv2.", "residual.6."),
        ("conv_shortcut.", "shortcut."),
    ):
        rest = re.sub(r"((?:downsamples|upsamples|middle)\.\d+\.)" + re.escape(new), r"\g<1>" + old, rest)
    return f"{side}.{rest}"


@pytest.fixture(scope="module")
def converted(vae, tmp_path_factory):
    root = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(root / "diffusers")
    convert_vae(str(root / "diffusers"), str(root / "from_diffusers"))
    state = {_original_name(k): v.detach().clone() for k, v in vae.state_dict().items()}
    assert len(state) == len(vae.state_dict())  # the renaming is one-to-one
    torch.save(state, root / "Wan2.1_VAE.pth")
    convert_vae(str(root / "Wan2.1_VAE.pth"), str(root / "from_wan"))
    return root


def _to_jax(x):  # torch [B, C, T, H, W] -> jax [B, T, H, W, C]
    return jnp.asarray(x.permute(0, 2, 3, 4, 1).numpy())


def _to_torch(x):
    return torch.from_numpy(np.array(x)).permute(0, 4, 1, 2, 3)


def _reference_decode_unclamped(vae, z):
    """diffusers' _decode loop (post_quant_conv, one latent frame at a time with the feature cache) without the
    final clamp, so random weights' out-of-range values are compared too."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        outs.append(
            vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    vae.clear_cache()
    return torch.cat(outs, 2)


def test_both_layouts_convert_to_the_same_params(converted):
    cfg_d, p_d = load(str(converted / "from_diffusers"))
    cfg_w, p_w = load(str(converted / "from_wan"))
    assert cfg_d == cfg_w == preset("tiny")
    flat_d, flat_w = jax.tree.leaves_with_path(p_d), jax.tree.leaves_with_path(p_w)
    assert len(flat_d) == len(flat_w) > 0
    for (path_d, a), (path_w, b) in zip(flat_d, flat_w, strict=True):
        assert path_d == path_w
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert plan_vae_conversion(str(converted / "Wan2.1_VAE.pth")).naming == "wan"
    assert plan_vae_conversion(str(converted / "diffusers")).naming == "diffusers"
    assert is_vae_source(str(converted / "diffusers")) and is_vae_source(str(converted / "Wan2.1_VAE.pth"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["from_diffusers", "from_wan"])
def test_whole_decode_matches_diffusers(vae, converted, layout):
    config, params = load(str(converted / layout))
    z = torch.randn(1, 16, 7, 2, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _reference_decode_unclamped(vae, z)
        ref_clamped = vae.decode(z).sample
    assert ref.shape == (1, 3, 25, 16, 24) and 0.05 < float(ref.abs().mean()) < 5
    assert float((ref.abs() > 1).float().mean()) > 0.01  # the unclamped comparison sees out-of-range values
    ours = np.asarray(_to_torch(decode(params, config, _to_jax(z), clamp=False)))
    np.testing.assert_allclose(ours, ref.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.clip(ours, -1, 1), ref_clamped.numpy(), atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [(1, 3, 3), (3, 3, 1), (1, 2, 3, 1), (1,) * 7])
def test_streamed_decode_matches_diffusers(vae, converted, schedule):
    config, params = load(str(converted / "from_diffusers"))
    z = torch.randn(1, 16, sum(schedule), 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = _reference_decode_unclamped(vae, z)
    state = init_decoder_state(config, 1, 2, 3)
    pieces, start = [], 0
    for n in schedule:
        frames, state = decode_chunk(params, config, state, _to_jax(z[:, :, start : start + n]), clamp=False)
        pieces.append(frames[:, config.first_chunk_padding :] if start == 0 else frames)
        start += n
    ours = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    assert ours.shape[1] == 1 + 4 * (sum(schedule) - 1) == ref.shape[2]
    np.testing.assert_allclose(np.asarray(_to_torch(ours)), ref.numpy(), atol=TOL, rtol=0)


@pytest.mark.slow
def test_encode_matches_diffusers(vae, converted):
    config, params = load(str(converted / "from_wan"))
    video = torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(video).latent_dist
    mean, logvar = encode(params, config, _to_jax(video))
    assert mean.shape == (1, 3, 2, 3, 16)
    assert float(posterior.mean.abs().mean()) > 0.05
    np.testing.assert_allclose(np.asarray(_to_torch(mean)), posterior.mean.numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(_to_torch(logvar)), posterior.logvar.numpy(), atol=TOL, rtol=0)


def test_wan22_vae_is_refused_and_nothing_is_written(tmp_path):
    model = diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=48,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
    )
    model.save_pretrained(tmp_path / "wan22")
    assert is_vae_source(str(tmp_path / "wan22"))
    with pytest.raises(ConversionError, match="Wan 2.2"):
        convert_vae(str(tmp_path / "wan22"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # The same tensors without the config.json: refused from the shapes alone.
    (tmp_path / "wan22" / "config.json").unlink()
    with pytest.raises(ConversionError, match="48 latent channels"):
        convert_vae(str(tmp_path / "wan22"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_real_size_layout_matches_diffusers_shapes():
    """The converter's tables and the params layout at the real Wan 2.1 size, against diffusers' own module
    (built on the meta device: shapes only, nothing allocated)."""
    from jaxkv.convert.vae_layouts import mapping, source_shape
    from jaxkv.models.wan_vae import num_params
    from jaxkv.models.wan_vae.params import flat_param_shapes

    with torch.device("meta"):
        model = diffusers.AutoencoderKLWan()
    ref = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    config = preset("wan2.1-vae")
    shapes = flat_param_shapes(config)
    table = mapping(config, "diffusers")
    assert sorted(src for src, _ in table.values()) == sorted(ref)
    for key, (src, kind) in table.items():
        assert source_shape(kind, shapes[key]) == ref[src], key
    decoder = sum(int(np.prod(s)) for k, s in ref.items() if k.startswith(("decoder.", "post_quant_conv.")))
    assert num_params(config, "decoder") + num_params(config, "post_quant_conv") == decoder
    assert 70e6 < decoder < 76e6  # ~73 M, as published for the Wan 2.1 decoder
