"""Checkpoint conversion without torch: synthetic Wan 2.1 checkpoints in the original and diffusers namings, single
and sharded safetensors, every error path, atomic output and the CLI.

The fixtures below spell the original Wan key list and the jaxkv layout out by hand, independently of the
converter's own tables (converters/layouts.py), so a wrong mapping there cannot pass. The torch/diffusers parity
tests (test_convert_parity.py) check these hand-written tables against diffusers itself.
"""

from __future__ import annotations

import json
import os
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from converters import cli
from converters.convert import convert_checkpoint, plan_conversion
from converters.errors import ConversionError
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan.config import PRESETS, WanConfig
from jaxkv.models.wan.params import flatten

# Asymmetric patch, in_dim != out_dim, text_dim != dim: a swapped axis cannot go unnoticed.
CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=3, in_dim=4, out_dim=6, patch_size=(1, 3, 2),
                text_dim=24, text_len=8, freq_dim=16)


# ------------------------------------------------------------------ hand-written layouts (independent references)

def original_wan_shapes(c: WanConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an original Wan 2.1 T2V DiT state dict, with its PyTorch shape."""
    d, f = c.dim, c.ffn_dim
    pt, ph, pw = c.patch_size
    shapes = {
        "patch_embedding.weight": (d, c.in_dim, pt, ph, pw), "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, c.text_dim), "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d), "text_embedding.2.bias": (d,),
        "time_embedding.0.weight": (d, c.freq_dim), "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d), "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d), "time_projection.1.bias": (6 * d,),
        "head.head.weight": (pt * ph * pw * c.out_dim, d), "head.head.bias": (pt * ph * pw * c.out_dim,),
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
        return {"kernel": np.stack([sd[f"blocks.{i}.{name}.weight"].T for i in layers]),
                "bias": np.stack([sd[f"blocks.{i}.{name}.bias"] for i in layers])}

    def attn(kind):
        out = {p: stacked_lin(f"{kind}.{p}") for p in ("q", "k", "v", "o")}
        for n in ("norm_q", "norm_k"):
            out[n] = {"scale": np.stack([sd[f"blocks.{i}.{kind}.{n}.weight"] for i in layers])}
        return out

    return {
        "patch_embedding": {"kernel": sd["patch_embedding.weight"].transpose(2, 3, 4, 1, 0),
                            "bias": sd["patch_embedding.bias"]},
        "text_embedding": {"fc1": lin("text_embedding.0"), "fc2": lin("text_embedding.2")},
        "time_embedding": {"fc1": lin("time_embedding.0"), "fc2": lin("time_embedding.2")},
        "time_projection": lin("time_projection.1"),
        "blocks": {
            "self_attn": attn("self_attn"),
            "cross_attn": attn("cross_attn"),
            "norm3": {"scale": np.stack([sd[f"blocks.{i}.norm3.weight"] for i in layers]),
                      "bias": np.stack([sd[f"blocks.{i}.norm3.bias"] for i in layers])},
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
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "norm3": "norm2",  # the affine LayerNorm before cross-attention
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
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


def write_sharded(folder, sd: dict, shards: int = 3, stem: str = "diffusion_pytorch_model"):
    os.makedirs(folder, exist_ok=True)
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"{stem}-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, os.path.join(folder, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def leftovers(parent) -> list[str]:
    """Temporary directories a failed write may have left."""
    return [n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n]


# ------------------------------------------------------------------------------------------------ conversions

def test_hand_written_layout_matches_the_documented_param_shapes():
    # The fixture and the params.py contract agree on every shape, so the expected params are well-formed.
    from jaxkv.models.wan.params import flat_param_shapes
    want = flatten(expected_params(random_original(CFG), CFG))
    assert {k: v.shape for k, v in want.items()} == flat_param_shapes(CFG)


def test_original_layout_single_file(tmp_path):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    plan = convert_checkpoint(str(tmp_path), str(tmp_path / "out"), num_heads=CFG.num_heads, dtype="f32")
    assert plan.naming == "wan"
    config, params = checkpoint.load(str(tmp_path / "out"))
    assert config == WanConfig(**{**CFG.to_dict(), "text_len": 512})  # text_len cannot be seen in tensors
    assert_params_equal(params, expected_params(sd, CFG))


def test_sharded_original_layout_with_config_hints(tmp_path):
    sd = random_original(CFG, seed=1)
    src = tmp_path / "wan"
    write_sharded(src, sd)
    # The original Wan repos ship a config.json with the head count and text length.
    (src / "config.json").write_text(json.dumps({"_class_name": "WanModel", "num_heads": 2, "text_len": 8,
                                                 "dim": 32, "eps": 1e-6}))
    plan = convert_checkpoint(str(src), str(tmp_path / "out"), dtype="f32")
    assert "3 shards" in plan.source.description
    config, params = checkpoint.load(str(tmp_path / "out"))
    assert config == CFG
    assert_params_equal(params, expected_params(sd, CFG))


def test_trailing_blocks_missing_are_caught_with_a_config_json(tmp_path):
    sd = {k: v for k, v in random_original(CFG).items() if not k.startswith("blocks.2.")}
    save_file(sd, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    # Without a config.json the tensors look like a complete 2-layer model...
    assert plan_conversion(str(tmp_path), num_heads=2).config.num_layers == 2
    # ...with one, the missing third block is reported.
    (tmp_path / "config.json").write_text(json.dumps({"num_heads": 2, "num_layers": 3}))
    msg = _error(tmp_path, tmp_path)
    assert "missing keys (27): blocks.2.cross_attn.k.bias" in msg  # a whole block: 27 tensors


def test_diffusers_naming_gives_the_same_params(tmp_path):
    sd = random_original(CFG, seed=2)
    src = tmp_path / "transformer"
    src.mkdir()
    save_file({diffusers_name(k): v for k, v in sd.items()}, str(src / "diffusion_pytorch_model.safetensors"))
    (src / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_attention_heads": 2,
                                                 "attention_head_dim": 16}))
    # A diffusers pipeline root is entered at transformer/.
    plan = convert_checkpoint(str(tmp_path), str(tmp_path / "out"), dtype="f32")
    assert plan.naming == "diffusers" and plan.config.num_heads == 2
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))


def test_wrapper_prefixes_are_stripped(tmp_path):
    sd = random_original(CFG, seed=3)
    prefixed = {f"model._fsdp_wrapped_module._orig_mod.{k}": v for k, v in sd.items()}
    save_file(prefixed, str(tmp_path / "ckpt.safetensors"))
    convert_checkpoint(str(tmp_path / "ckpt.safetensors"), str(tmp_path / "out"), preset=None,
                       num_heads=2, dtype="f32")
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))


def test_bf16_output_rounds_to_nearest_and_bf16_input_widens_exactly(tmp_path):
    sd = random_original(CFG, seed=4)
    save_file(sd, str(tmp_path / "f32.safetensors"))
    convert_checkpoint(str(tmp_path / "f32.safetensors"), str(tmp_path / "bf16"), num_heads=2, dtype="bf16")
    _, params = checkpoint.load(str(tmp_path / "bf16"))
    want = {k: v.astype(ml_dtypes.bfloat16) for k, v in flatten(expected_params(sd, CFG)).items()}
    for k, v in flatten(params).items():
        assert v.dtype == ml_dtypes.bfloat16, k
        np.testing.assert_array_equal(np.asarray(v).view(np.uint16), want[k].view(np.uint16), err_msg=k)
    # bf16 source -> f32 output is exact; load(dtype=...) casts.
    sd16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    save_file(sd16, str(tmp_path / "bf16.safetensors"))
    convert_checkpoint(str(tmp_path / "bf16.safetensors"), str(tmp_path / "f32"), num_heads=2, dtype="f32")
    _, params = checkpoint.load(str(tmp_path / "f32"))
    assert_params_equal(params, expected_params({k: v.astype(np.float32) for k, v in sd16.items()}, CFG))


def test_patch_kernel_convention_matches_a_conv3d():
    # params.py: a patch flattened (pt, ph, pw, channel) times kernel.reshape(-1, dim) == Conv3d on that patch.
    sd = random_original(CFG, seed=5)
    kernel = expected_params(sd, CFG)["patch_embedding"]["kernel"]
    weight = sd["patch_embedding.weight"]  # [dim, in, pt, ph, pw]
    patch = np.random.default_rng(0).standard_normal((*CFG.patch_size, CFG.in_dim)).astype(np.float32)
    conv = np.einsum("dcthw,thwc->d", weight, patch)
    np.testing.assert_allclose(patch.reshape(-1) @ kernel.reshape(-1, CFG.dim), conv, rtol=1e-5, atol=1e-5)


def test_preset_is_inferred_from_widths(tmp_path):
    tiny = PRESETS["tiny"]
    sd = random_original(tiny, seed=6)
    save_file(sd, str(tmp_path / "m.safetensors"))
    plan = plan_conversion(str(tmp_path / "m.safetensors"))
    assert plan.config == tiny and "tiny" in plan.config_origin
    # ...and an explicit preset gives the same.
    assert plan_conversion(str(tmp_path / "m.safetensors"), preset="tiny").config == tiny


def test_explicit_config_file(tmp_path):
    sd = random_original(CFG, seed=7)
    save_file(sd, str(tmp_path / "m.safetensors"))
    (tmp_path / "cfg.json").write_text(CFG.to_json())
    assert plan_conversion(str(tmp_path / "m.safetensors"), config=str(tmp_path / "cfg.json")).config == CFG


# ------------------------------------------------------------------------------------------------ errors

def _error(tmp_path, src, **kw) -> str:
    dst = tmp_path / "never"
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(str(src), str(dst), **kw)
    assert not dst.exists() and not leftovers(tmp_path)
    return str(e.value)


def test_heads_cannot_be_guessed(tmp_path):
    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    msg = _error(tmp_path, tmp_path / "m.safetensors")
    assert "--num-heads" in msg and "dim 32" in msg


def test_missing_and_unexpected_keys_are_listed_in_source_names(tmp_path):
    sd = random_original(CFG)
    del sd["blocks.1.cross_attn.norm_k.weight"], sd["head.head.bias"]
    sd["blocks.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    sd["blocks.3.ffn.0.bias"] = np.zeros(CFG.ffn_dim, np.float32)  # a 4th block of a 3-layer preset
    save_file(sd, str(tmp_path / "m.safetensors"))
    (tmp_path / "cfg.json").write_text(CFG.to_json())
    msg = _error(tmp_path, tmp_path / "m.safetensors", config=str(tmp_path / "cfg.json"))
    assert "missing keys (2): blocks.1.cross_attn.norm_k.weight, head.head.bias" in msg
    assert "unexpected keys (2): blocks.0.self_attn.extra.weight, blocks.3.ffn.0.bias" in msg
    assert "\n" not in msg


def test_shape_mismatches_name_key_expected_and_found(tmp_path):
    tiny = PRESETS["tiny"]
    sd = random_original(tiny)
    sd["blocks.1.ffn.2.weight"] = np.zeros((tiny.dim, tiny.ffn_dim + 1), np.float32)
    save_file(sd, str(tmp_path / "m.safetensors"))
    msg = _error(tmp_path, tmp_path / "m.safetensors", preset="tiny")
    assert f"blocks.1.ffn.2.weight: expected [{tiny.dim}, {tiny.ffn_dim}], found [{tiny.dim}, {tiny.ffn_dim + 1}]" \
        in msg
    # The 1.3B preset against a tiny checkpoint: every width is wrong, and the message says so per key.
    msg = _error(tmp_path, tmp_path / "m.safetensors", preset="wan2.1-t2v-1.3b")
    assert "patch_embedding.weight: expected [1536, 16, 1, 2, 2], found [64, 16, 1, 2, 2]" in msg
    assert "missing keys" in msg  # 30 layers expected, 2 present


def test_truncated_and_corrupt_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(random_original(CFG), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    assert "truncated" in _error(tmp_path, path, num_heads=2)
    path.write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 31 + data[48:])
    assert "corrupt" in _error(tmp_path, path, num_heads=2)
    path.write_bytes(b"\x01\x02")
    assert "not a safetensors file" in _error(tmp_path, path, num_heads=2)
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert "corrupt" in _error(tmp_path, path, num_heads=2)


def test_unknown_formats(tmp_path):
    save_file({"encoder.layer.0.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "bert.safetensors"))
    assert "unknown checkpoint format" in _error(tmp_path, tmp_path / "bert.safetensors")
    (tmp_path / "notes.txt").write_text("hello")
    assert "unknown checkpoint format" in _error(tmp_path, tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    assert "unknown checkpoint format" in _error(tmp_path, tmp_path / "empty")
    assert "does not exist" in _error(tmp_path, tmp_path / "nope")


def test_inconsistent_shard_index(tmp_path):
    src = tmp_path / "wan"
    write_sharded(src, random_original(CFG))
    index = src / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["blocks.9.ffn.0.bias"] = "diffusion_pytorch_model-00001-of-00003.safetensors"
    index.write_text(json.dumps(data))
    assert "no shard holds it" in _error(tmp_path, src, num_heads=2)
    os.remove(src / "diffusion_pytorch_model-00002-of-00003.safetensors")
    assert "missing" in _error(tmp_path, src, num_heads=2)


def test_ema_flags_only_apply_to_training_checkpoints(tmp_path):
    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    assert "--ema" in _error(tmp_path, tmp_path / "m.safetensors", num_heads=2, ema=True)


# ------------------------------------------------------------------------------------------------ atomic output

def test_existing_destination_needs_force_and_is_replaced_whole(tmp_path):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "stale.txt").write_text("old")
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2)
    assert (dst / "stale.txt").exists()
    convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="f32", force=True)
    assert sorted(os.listdir(dst)) == ["config.json", "params.safetensors"]
    assert_params_equal(checkpoint.load(str(dst))[1], expected_params(sd, CFG))
    assert not leftovers(tmp_path)


def test_interrupted_conversion_leaves_the_old_destination(tmp_path, monkeypatch):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    dst = tmp_path / "out"
    convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="f32")
    before = (dst / "params.safetensors").read_bytes()

    from converters import sources
    real_read, calls = sources.SafetensorsSource.read, []

    def read_then_interrupt(self, key):
        calls.append(key)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return real_read(self, key)

    monkeypatch.setattr(sources.SafetensorsSource, "read", read_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="bf16", force=True)
    assert len(calls) == 20
    assert (dst / "params.safetensors").read_bytes() == before and not leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_converts_and_reports(tmp_path, capsys):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert cli.main([str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--num-heads", "2", "--dtype", "f32",
                     "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "wan naming" in err and "wrote" in err
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))


def test_cli_dry_run_writes_nothing(tmp_path, capsys):
    save_file(random_original(PRESETS["tiny"]), str(tmp_path / "m.safetensors"))
    assert cli.main([str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--dry-run"]) == 0
    assert "equals preset 'tiny'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("problem", ["missing", "exists", "unknown", "truncated"])
def test_cli_errors_are_one_paragraph_without_traceback(tmp_path, capsys, problem):
    sd = random_original(CFG)
    src, dst = tmp_path / "m.safetensors", tmp_path / "out"
    if problem == "missing":
        del sd["blocks.0.ffn.0.weight"]
    save_file(sd, str(src))
    if problem == "exists":
        dst.mkdir()
    if problem == "unknown":
        src = tmp_path / "m.onnx"
        src.write_bytes(b"\0" * 16)
    if problem == "truncated":
        src.write_bytes(src.read_bytes()[:-1])
    assert cli.main([str(src), str(dst), "--num-heads", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxkv convert: error: ") and "Traceback" not in err and "\n" not in err
    assert (dst.exists() and not os.listdir(dst)) if problem == "exists" else not dst.exists()
    assert not leftovers(tmp_path)


def test_jaxkv_console_script_dispatches_convert(tmp_path):
    from jaxkv import cli as jaxkv_cli
    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    assert jaxkv_cli.main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--num-heads", "2",
                           "--no-progress"]) == 0
    assert checkpoint.read_config(str(tmp_path / "out")).num_heads == 2
