"""Parity against the real PyTorch implementation: a tiny random `diffusers.WanTransformer3DModel`, saved in the
diffusers layout, the original Wan layout and a Self-Forcing `.pt`, converted, and run through the jaxkv forward.

The original-layout fixture is produced with the hand-written name table of test_convert.py (DIFFUSERS_TOP /
DIFFUSERS_BLOCK), which is itself checked here against diffusers' own state dict and diffusers' own
original->diffusers converter, so neither the fixture nor the converter's table is trusted on its own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from safetensors.torch import save_file

from jaxkv.convert.convert import convert_checkpoint
from jaxkv.models.wan import checkpoint, forward
from jaxkv.models.wan.config import WanConfig
from tests.helpers.wan_checkpoints import (
    assert_params_equal,
    diffusers_name,
    expected_params,
    original_wan_shapes,
)

pytestmark = pytest.mark.torch

# head_dim 16 splits RoPE 8 + 4 + 4; in != out channels; a non-square latent grid below.
HEADS, HEAD_DIM = 2, 16
CFG = WanConfig(
    dim=HEADS * HEAD_DIM,
    ffn_dim=48,
    num_heads=HEADS,
    num_layers=2,
    in_dim=4,
    out_dim=6,
    patch_size=(1, 2, 2),
    text_dim=24,
    text_len=512,
    freq_dim=32,
)


def tiny_diffusers_model(seed: int = 0):
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=CFG.patch_size,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=CFG.in_dim,
        out_channels=CFG.out_dim,
        text_dim=CFG.text_dim,
        freq_dim=CFG.freq_dim,
        ffn_dim=CFG.ffn_dim,
        num_layers=CFG.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=CFG.eps,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Re-randomise every parameter (biases, norm scales and modulation tables included, some of which start at 0
    # or 1) so that each one changes the output; scales keep activations O(1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "scale_shift_table" not in name:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn_like(p) / fan_in**0.5)
            elif name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm2.weight" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    for k, v in model.state_dict().items():
        assert not torch.equal(v, before[k]), f"{k} was not re-randomised"
    return model.eval()


def original_state_dict(model) -> dict:
    """The model's weights under original Wan names, via the hand-written table."""
    sd = model.state_dict()
    names = {key: diffusers_name(key) for key in original_wan_shapes(CFG)}
    assert sorted(names.values()) == sorted(sd), "hand-written table does not cover diffusers' state dict exactly"
    out = {key: sd[name].clone().contiguous() for key, name in names.items()}
    assert {k: tuple(v.shape) for k, v in out.items()} == original_wan_shapes(CFG)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The model converted from four sources: (model, {source name: (config, params)}, original sd, folder)."""
    tmp = tmp_path_factory.mktemp("parity")
    model = tiny_diffusers_model()
    original = original_state_dict(model)

    model.save_pretrained(tmp / "diffusers")
    model.save_pretrained(tmp / "diffusers_sharded", max_shard_size="30KB")
    assert len(list((tmp / "diffusers_sharded").glob("*.safetensors"))) > 1

    (tmp / "wan").mkdir()
    save_file(original, str(tmp / "wan" / "diffusion_pytorch_model.safetensors"))
    (tmp / "wan" / "config.json").write_text(
        json.dumps({"_class_name": "WanModel", "num_heads": HEADS, "dim": CFG.dim})
    )

    # Self-Forcing: EMA weights are the model; the raw generator differs (so choosing the wrong one fails).
    ema = {f"model._fsdp_wrapped_module.{k}": v for k, v in original.items()}
    raw = {f"model.{k}": v + 0.5 for k, v in original.items()}
    torch.save({"generator": raw, "generator_ema": ema}, tmp / "self_forcing.pt")

    out = {}
    for name, src in [
        ("diffusers", "diffusers"),
        ("diffusers_sharded", "diffusers_sharded"),
        ("wan", "wan"),
        ("pt", "self_forcing.pt"),
    ]:
        convert_checkpoint(
            str(tmp / src), str(tmp / f"out_{name}"), num_heads=None if name != "pt" else HEADS, dtype="f32"
        )
        out[name] = checkpoint.load(str(tmp / f"out_{name}"))
    return model, out, {k: v.numpy() for k, v in original.items()}, tmp


def test_hand_written_table_agrees_with_diffusers_own_converter():
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = tiny_diffusers_model(1)
    original = original_state_dict(model)
    back = convert_wan_transformer_to_diffusers(dict(original))
    want = model.state_dict()
    assert sorted(back) == sorted(want)
    for k in want:
        assert torch.equal(back[k], want[k]), k


def test_all_layouts_convert_to_the_same_params(converted):
    _, out, original, _ = converted
    want = expected_params(original, CFG)
    for name, (config, params) in out.items():
        assert config.dim == CFG.dim and config.num_heads == HEADS and config.num_layers == CFG.num_layers, name
        assert (config.in_dim, config.out_dim, config.text_dim, config.freq_dim) == (4, 6, 24, 32), name
        assert_params_equal(params, want)


def test_converted_layers_compute_what_the_torch_modules_compute(converted):
    # Each converted kernel, used the jaxkv way (x @ kernel + bias; patch @ kernel.reshape(-1, dim)), reproduces
    # the torch module it came from: catches a transposition the name tables cannot.
    model, out, _, _ = converted
    p = out["diffusers"][1]
    rng = np.random.default_rng(0)
    pairs = [
        (model.condition_embedder.text_embedder.linear_1, p["text_embedding"]["fc1"]),
        (model.condition_embedder.time_embedder.linear_2, p["time_embedding"]["fc2"]),
        (model.condition_embedder.time_proj, p["time_projection"]),
        (model.proj_out, p["head"]["head"]),
    ]
    for layer, block in enumerate(model.blocks):
        stacked = p["blocks"]
        pairs += [
            (block.attn1.to_q, {k: v[layer] for k, v in stacked["self_attn"]["q"].items()}),
            (block.attn2.to_out[0], {k: v[layer] for k, v in stacked["cross_attn"]["o"].items()}),
            (block.ffn.net[0].proj, {k: v[layer] for k, v in stacked["ffn"]["fc1"].items()}),
            (block.ffn.net[2], {k: v[layer] for k, v in stacked["ffn"]["fc2"].items()}),
        ]
    for module, lin in pairs:
        x = rng.standard_normal((3, module.in_features)).astype(np.float32)
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        got = x @ np.asarray(lin["kernel"]) + np.asarray(lin["bias"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # Patch embedding: one patch, channels-last, flattened (pt, ph, pw, channel).
    patch = rng.standard_normal((1, CFG.in_dim, *CFG.patch_size)).astype(np.float32)  # NCTHW
    with torch.no_grad():
        want = model.patch_embedding(torch.from_numpy(patch)).numpy().reshape(-1)
    flat = patch[0].transpose(1, 2, 3, 0).reshape(-1)
    got = flat @ np.asarray(p["patch_embedding"]["kernel"]).reshape(-1, CFG.dim) + np.asarray(
        p["patch_embedding"]["bias"]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _inputs(seed=0, batch=2, frames=3, height=4, width=6, tokens=7):
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((batch, CFG.in_dim, frames, height, width)).astype(np.float32)  # NCFHW
    timesteps = np.array([937.0, 12.5], np.float32)[:batch]
    context = rng.standard_normal((batch, tokens, CFG.text_dim)).astype(np.float32)
    return latents, timesteps, context


def _diffusers_forward(model, latents, timesteps, context):
    with torch.no_grad():
        out = model(
            torch.from_numpy(latents), torch.from_numpy(timesteps), torch.from_numpy(context), return_dict=False
        )[0]
    return out.numpy().transpose(0, 2, 3, 4, 1)  # -> [batch, frames, height, width, out_dim]


@pytest.mark.parametrize("source", ["diffusers", "wan", "pt"])
def test_forward_matches_diffusers(converted, source):
    model, out, _, _ = converted
    config, params = out[source]
    latents, timesteps, context = _inputs()
    want = _diffusers_forward(model, latents, timesteps, context)
    # diffusers does not pad the text context; the tokens given are all the model sees on both sides.
    got = np.asarray(forward(params, config, latents.transpose(0, 2, 3, 4, 1), timesteps, context, pad_context=False))
    assert got.shape == want.shape == (2, 3, 4, 6, CFG.out_dim)
    assert np.abs(want).max() > 0.1  # a non-degenerate output
    # Measured: max |got - want| ~4e-6 for outputs of magnitude ~4 (float32 on both sides).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_forward_with_the_raw_generator_differs(converted, tmp_path):
    # The EMA/generator choice matters: the raw generator's weights give a different output.
    model, _, _, folder = converted
    pt = folder / "self_forcing.pt"
    convert_checkpoint(str(pt), str(tmp_path / "raw"), num_heads=HEADS, ema=False, dtype="f32")
    config, params = checkpoint.load(str(tmp_path / "raw"))
    latents, timesteps, context = _inputs()
    want = _diffusers_forward(model, latents, timesteps, context)
    got = np.asarray(forward(params, config, latents.transpose(0, 2, 3, 4, 1), timesteps, context, pad_context=False))
    assert np.abs(got - want).max() > 1e-2
