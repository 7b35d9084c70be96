"""Torch-free tests of the VAE converter: a diffusers-layout safetensors directory built from jaxkv params
converts back to them exactly; wrong-family and incomplete checkpoints are refused by name with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxkv.convert.errors import ConversionError
from jaxkv.convert.wan_vae import (
    convert_vae,
    detect_vae_naming,
    is_vae_source,
    load,
    plan_vae_conversion,
)
from jaxkv.models.wan_vae import init_params
from jaxkv.models.wan_vae.params import flatten
from tests.helpers.vae_checkpoints import CONFIG, DIFFUSERS_CONFIG, torch_layout


@pytest.fixture(scope="module")
def flat():
    return {k: np.asarray(v) for k, v in flatten(init_params(0, CONFIG)).items()}


def _write(tmp_path, tensors, config=None, name="src"):
    folder = tmp_path / name
    folder.mkdir()
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_round_trip_through_the_diffusers_layout(tmp_path, flat):
    src = _write(
        tmp_path,
        torch_layout(flat, "diffusers"),
        DIFFUSERS_CONFIG,
    )
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    src.rename(pipeline / "vae")  # a diffusers pipeline root is entered at vae/
    plan = convert_vae(str(pipeline), str(tmp_path / "out"))
    assert plan.naming == "diffusers" and plan.config == CONFIG
    config, params = load(str(tmp_path / "out"))
    assert config == CONFIG
    got = {k: np.asarray(v) for k, v in flatten(params).items()}
    assert set(got) == set(flat)
    for k in flat:
        np.testing.assert_array_equal(got[k], flat[k])
    assert is_vae_source(str(pipeline / "vae")) and not is_vae_source(str(pipeline))
    with pytest.raises(ConversionError, match="already exists"):
        convert_vae(str(pipeline), str(tmp_path / "out"))


def test_bf16_output(tmp_path, flat):
    src = _write(tmp_path, torch_layout(flat, "wan"))
    with pytest.raises(ConversionError, match="output dtype 'f16' is not supported"):
        convert_vae(str(src), str(tmp_path / "out"), dtype="f16")
    assert not (tmp_path / "out").exists()
    convert_vae(str(src), str(tmp_path / "out"), dtype="bf16")
    _, params = load(str(tmp_path / "out"))
    assert {str(v.dtype) for v in flatten(params).values()} == {"bfloat16"}


def test_refusals_write_nothing(tmp_path, flat):
    tensors = torch_layout(flat, "diffusers")
    dit = _write(
        tmp_path,
        {
            "patch_embedding.weight": np.zeros((8, 16, 1, 2, 2), np.float32),
            "blocks.0.ffn.0.weight": np.zeros((4, 4), np.float32),
        },
        name="dit",
    )
    with pytest.raises(ConversionError, match="holds a Wan DiT"):
        convert_vae(str(dit), str(tmp_path / "out"))
    assert not is_vae_source(str(dit))
    missing = dict(tensors)
    del missing["decoder.up_blocks.1.upsamplers.0.time_conv.weight"]
    with pytest.raises(ConversionError, match="unexpected tensors: decoder.up_blocks.1.upsamplers.0.time_conv.bias"):
        convert_vae(str(_write(tmp_path, missing, name="missing")), str(tmp_path / "out"))
    wrong = dict(tensors)
    wrong["encoder.conv_in.weight"] = np.zeros((8, 3, 3, 3, 5), np.float32)
    with pytest.raises(ConversionError, match=r"encoder.conv_in.weight: expected shape \[8, 3, 3, 3, 3\]"):
        convert_vae(str(_write(tmp_path, wrong, name="wrong")), str(tmp_path / "out"))
    lying = _write(tmp_path, tensors, {"_class_name": "AutoencoderKLWan", "base_dim": 96}, name="lying")
    with pytest.raises(ConversionError, match="base_dim: config.json 96, tensors 8"):
        convert_vae(str(lying), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert not is_vae_source(str(tmp_path / "nowhere")) and detect_vae_naming(["foo.weight"]) is None
    gone = dict(tensors)
    del gone["decoder.up_blocks.0.resnets.1.conv1.weight"]
    with pytest.raises(ConversionError, match="missing tensors: decoder.up_blocks.0.resnets.1.conv1.weight"):
        plan_vae_conversion(str(_write(tmp_path, gone, name="gone")))
    assert not (tmp_path / "out").exists()
