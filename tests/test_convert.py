"""Checkpoint conversion without torch: synthetic Wan 2.1 checkpoints in the original and diffusers namings, single
and sharded safetensors, every error path, atomic output and the CLI.

The fixtures below spell the original Wan key list and the jaxkv layout out by hand, independently of the
converter's own tables (jaxkv/convert/layouts.py), so a wrong mapping there cannot pass. The torch/diffusers parity
tests (test_convert_parity.py) check these hand-written tables against diffusers itself.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxkv.convert import cli
from jaxkv.convert.convert import convert_checkpoint, plan_conversion
from jaxkv.convert.errors import ConversionError
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan.config import PRESETS, WanConfig
from jaxkv.models.wan.params import flatten
from tests.helpers.wan_checkpoints import (
    CFG,
    assert_params_equal,
    diffusers_name,
    expected_params,
    leftovers,
    random_original,
)

# ------------------------------------------------------------------ hand-written layouts (independent references)


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


# ------------------------------------------------------------------------------------------------ conversions


def test_hand_written_layout_matches_the_documented_param_shapes():
    # The fixture and the params.py contract agree on every shape, so the expected params are well-formed.
    from jaxkv.models.wan.params import flat_param_shapes

    want = flatten(expected_params(random_original(CFG), CFG))
    assert {k: v.shape for k, v in want.items()} == flat_param_shapes(CFG)


def test_original_layout_single_file(tmp_path):
    sd = random_original(CFG)
    (tmp_path / "src").mkdir()
    save_file(sd, str(tmp_path / "src" / "diffusion_pytorch_model.safetensors"))
    plan = convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), num_heads=CFG.num_heads, dtype="f32")
    assert plan.naming == "wan"
    config, params = checkpoint.load(str(tmp_path / "out"))
    assert config == WanConfig(**{**CFG.to_dict(), "text_len": 512})  # text_len cannot be seen in tensors
    assert_params_equal(params, expected_params(sd, CFG))


def test_sharded_original_layout_with_config_hints(tmp_path):
    sd = random_original(CFG, seed=1)
    src = tmp_path / "wan"
    write_sharded(src, sd)
    # The original Wan repos ship a config.json with the head count and text length.
    (src / "config.json").write_text(
        json.dumps({"_class_name": "WanModel", "num_heads": 2, "text_len": 8, "dim": 32, "eps": 1e-6})
    )
    plan = convert_checkpoint(str(src), str(tmp_path / "out"), dtype="f32")
    assert "3 shards" in plan.source.description
    config, params = checkpoint.load(str(tmp_path / "out"))
    assert config == CFG
    assert_params_equal(params, expected_params(sd, CFG))


def test_trailing_blocks_missing_are_caught_with_a_config_json(tmp_path):
    sd = {k: v for k, v in random_original(CFG).items() if not k.startswith("blocks.2.")}
    src = tmp_path / "src"
    src.mkdir()
    save_file(sd, str(src / "diffusion_pytorch_model.safetensors"))
    # Without a config.json the tensors look like a complete 2-layer model...
    assert plan_conversion(str(src), num_heads=2).config.num_layers == 2
    # ...with one, the missing third block is reported.
    (src / "config.json").write_text(json.dumps({"num_heads": 2, "num_layers": 3}))
    msg = _error(tmp_path, src)
    assert "missing keys (27): blocks.2.cross_attn.k.bias" in msg  # a whole block: 27 tensors


def test_diffusers_naming_gives_the_same_params(tmp_path):
    sd = random_original(CFG, seed=2)
    src = tmp_path / "pipeline" / "transformer"
    src.mkdir(parents=True)
    save_file({diffusers_name(k): v for k, v in sd.items()}, str(src / "diffusion_pytorch_model.safetensors"))
    (src / "config.json").write_text(
        json.dumps({"_class_name": "WanTransformer3DModel", "num_attention_heads": 2, "attention_head_dim": 16})
    )
    # A diffusers pipeline root is entered at transformer/.
    plan = convert_checkpoint(str(tmp_path / "pipeline"), str(tmp_path / "out"), dtype="f32")
    assert plan.naming == "diffusers" and plan.config.num_heads == 2
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))


def test_wrapper_prefixes_are_stripped(tmp_path):
    sd = random_original(CFG, seed=3)
    prefixed = {f"model._fsdp_wrapped_module._orig_mod.{k}": v for k, v in sd.items()}
    save_file(prefixed, str(tmp_path / "ckpt.safetensors"))
    convert_checkpoint(str(tmp_path / "ckpt.safetensors"), str(tmp_path / "out"), preset=None, num_heads=2, dtype="f32")
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
    assert (
        f"blocks.1.ffn.2.weight: expected [{tiny.dim}, {tiny.ffn_dim}], found [{tiny.dim}, {tiny.ffn_dim + 1}]" in msg
    )
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


def test_evidence_table_matches_the_param_layout():
    # The width table the config inference votes with, filled in with a config's values, is params.py's layout.
    from jaxkv.convert.convert import EVIDENCE
    from jaxkv.models.wan.params import flat_param_shapes

    for c in (CFG, PRESETS["tiny"], PRESETS["wan2.1-t2v-14b"]):
        values = {
            "dim": c.dim,
            "ffn_dim": c.ffn_dim,
            "in_dim": c.in_dim,
            "text_dim": c.text_dim,
            "freq_dim": c.freq_dim,
            "pt": c.patch_size[0],
            "ph": c.patch_size[1],
            "pw": c.patch_size[2],
            "head_out": c.patch_volume * c.out_dim,
        }
        filled = {
            k: tuple(
                a if isinstance(a, int) else values[a] if isinstance(a, str) else values[a[0]] * a[1] for a in template
            )
            for k, template in EVIDENCE.items()
        }
        want = {k: v[1:] if k.startswith("blocks.") else v for k, v in flat_param_shapes(c).items()}
        assert filled == want


@pytest.mark.parametrize(
    "key, bad",
    [
        ("blocks.0.ffn.0.weight", (CFG.dim, CFG.ffn_dim)),  # transposed: used to set ffn_dim = dim
        ("blocks.2.ffn.2.bias", (CFG.dim + 2,)),
        ("text_embedding.2.weight", (CFG.dim, CFG.dim - 4)),
        ("blocks.1.self_attn.q.weight", (CFG.dim * CFG.dim,)),  # wrong rank
        ("head.modulation", (1, 3, CFG.dim)),
    ],
)
def test_a_mis_shaped_tensor_is_the_one_blamed(tmp_path, key, bad):
    sd = random_original(CFG)
    want = list(sd[key].shape)
    sd[key] = np.zeros(bad, np.float32)
    save_file(sd, str(tmp_path / "m.safetensors"))
    msg = _error(tmp_path, tmp_path / "m.safetensors", num_heads=2)
    # The widths come from the majority of tensors, so the config is right and only the culprit is named.
    assert f"dim {CFG.dim}, ffn_dim {CFG.ffn_dim}" in msg, msg
    assert f"shape mismatches (1): {key}: expected {want}, found {list(bad)}" in msg, msg
    assert "missing keys" not in msg and "unexpected keys" not in msg


def test_widths_with_equal_support_are_not_guessed(tmp_path):
    # A one-layer model has three tensors that show ffn_dim; if each says something else, none is the odd one out.
    c1 = WanConfig(**{**CFG.to_dict(), "num_layers": 1})
    sd = random_original(c1)
    sd["blocks.0.ffn.0.weight"] = np.zeros((40, c1.dim), np.float32)  # says 40
    sd["blocks.0.ffn.0.bias"] = np.zeros((44,), np.float32)  # says 44; ffn.2.weight says 48
    save_file(sd, str(tmp_path / "m.safetensors"))
    msg = _error(tmp_path, tmp_path / "m.safetensors", num_heads=2)
    assert "disagree on ffn_dim with equal support" in msg and "blocks.0.ffn.0.weight" in msg, msg


def test_diffusers_config_defaults_text_len_and_says_so(tmp_path, capsys):
    tiny = PRESETS["tiny"]
    sd = random_original(tiny)
    src = tmp_path / "transformer"
    src.mkdir()
    save_file({diffusers_name(k): v for k, v in sd.items()}, str(src / "diffusion_pytorch_model.safetensors"))
    (src / "config.json").write_text(
        json.dumps({"_class_name": "WanTransformer3DModel", "eps": 1e-6, "num_attention_heads": tiny.num_heads})
    )
    plan = plan_conversion(str(src))
    assert plan.config.text_len == tiny.text_len and plan.defaulted == {
        "text_len": "preset 'tiny'",
        "rope_theta": "preset 'tiny'",
    }
    assert cli.main([str(src), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert f"defaulted (not stored in the checkpoint): text_len {tiny.text_len} from the preset 'tiny'" in err
    assert "--text-len" in err
    # --text-len sets it, and it is no longer reported as defaulted.
    plan = plan_conversion(str(src), text_len=77)
    assert plan.config.text_len == 77 and "text_len" not in plan.defaulted
    assert cli.main([str(src), str(tmp_path / "out"), "--text-len", "77", "--no-progress"]) == 0
    assert "text_len 77" in capsys.readouterr().err
    assert checkpoint.read_config(str(tmp_path / "out")).text_len == 77
    # Without a preset of these widths the defaults are WanConfig's, also reported.
    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    assert plan_conversion(str(tmp_path / "m.safetensors"), num_heads=2).defaulted == {
        "text_len": "jaxkv default",
        "eps": "jaxkv default",
        "rope_theta": "jaxkv default",
    }


@pytest.mark.parametrize(
    "where, value, source_dtype",
    [
        ("blocks.1.ffn.2.weight", np.nan, np.float32),
        ("head.head.bias", -np.inf, np.float32),
        ("blocks.0.modulation", 3.4e38, np.float32),  # finite in float32, +Inf once rounded to bfloat16
    ],
)
def test_nonfinite_tensors_are_refused_by_name_unless_allowed(tmp_path, capsys, where, value, source_dtype):
    sd = random_original(CFG)
    sd[where] = sd[where].astype(source_dtype)
    sd[where].reshape(-1)[[1, 3]] = value
    save_file(sd, str(tmp_path / "m.safetensors"))
    msg = _error(tmp_path, tmp_path / "m.safetensors", num_heads=2, dtype="bf16")
    kind = "NaN" if np.isnan(value) else "+Inf" if value > 0 else "-Inf"
    assert f"tensor {where} holds non-finite values" in msg and f"2 {kind}" in msg and "--allow-nonfinite" in msg
    if np.isfinite(value):
        assert "after casting to bfloat16 (the source values are finite)" in msg
    dst = tmp_path / "out"
    assert cli.main([str(tmp_path / "m.safetensors"), str(dst), "--num-heads", "2", "--no-progress"]) == 1
    assert "non-finite" in capsys.readouterr().err and not dst.exists() and not leftovers(tmp_path)
    assert (
        cli.main([str(tmp_path / "m.safetensors"), str(dst), "--num-heads", "2", "--no-progress", "--allow-nonfinite"])
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: non-finite values kept in 1 tensor(s): " + where in err
    flat = flatten(checkpoint.load(str(dst), dtype=np.float32)[1])
    bad = [k for k, v in flat.items() if not np.isfinite(np.asarray(v)).all()]
    assert len(bad) == 1 and int((~np.isfinite(np.asarray(flat[bad[0]]))).sum()) == 2


# ------------------------------------------------------------------------------------------------ atomic output


def test_existing_destination_needs_force_and_only_a_jaxkv_checkpoint_is_replaced_whole(tmp_path):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    dst = tmp_path / "out"
    convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="bf16")
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2)
    convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="f32", force=True)
    assert sorted(os.listdir(dst)) == ["config.json", "params.safetensors"]
    assert_params_equal(checkpoint.load(str(dst))[1], expected_params(sd, CFG))  # f32: the new one, whole
    assert not leftovers(tmp_path)


def snapshot(root) -> dict:
    """Every path under ``root`` (itself included) -> its bytes, link target or None for a directory."""
    root = str(root)
    if os.path.islink(root) or os.path.isfile(root):
        return {".": os.readlink(root) if os.path.islink(root) else open(root, "rb").read()}
    out = {".": None}
    for folder, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(folder, n)
            out[os.path.relpath(p, root)] = (
                os.readlink(p) if os.path.islink(p) else None if os.path.isdir(p) else open(p, "rb").read()
            )
    return out


FORCE_REFUSED = [
    "current directory",
    "source directory",
    "source file's directory",
    "unrelated files",
    "regular file",
    "checkpoint plus a foreign file",
    "config without format marker",
    "symlink to a checkpoint",
    "inside the source",
    "symlinked alias of the source",
]


@pytest.mark.parametrize("case", FORCE_REFUSED)
def test_force_refuses_anything_but_a_jaxkv_checkpoint_and_never_touches_it(tmp_path, monkeypatch, capsys, case):
    sd = random_original(CFG)
    src_dir = tmp_path / "weights"
    src_dir.mkdir()
    save_file(sd, str(src_dir / "diffusion_pytorch_model.safetensors"))
    ck = tmp_path / "ck"  # a real jaxkv checkpoint, for the cases built from one
    convert_checkpoint(str(src_dir), str(ck), num_heads=2)
    src, dst, expect = str(src_dir), None, None
    if case == "current directory":
        monkeypatch.chdir(ck)  # even a checkpoint is not replaced while it is the current directory
        dst, expect = ".", "current directory"
    elif case == "source directory":
        dst, expect = str(src_dir), "is the source"
    elif case == "source file's directory":
        src, dst, expect = str(src_dir / "diffusion_pytorch_model.safetensors"), str(src_dir), "contains the source"
    elif case == "unrelated files":
        dst = tmp_path / "docs"
        dst.mkdir()
        (dst / "thesis.tex").write_text("years of work")
        expect = "thesis.tex"
    elif case == "regular file":
        dst = tmp_path / "notes.txt"
        dst.write_text("keep me")
        expect = "not a directory"
    elif case == "checkpoint plus a foreign file":
        (ck / "notes.txt").write_text("mine")
        dst, expect = ck, "notes.txt"
    elif case == "config without format marker":
        data = json.loads((ck / "config.json").read_text())
        del data["format"]
        (ck / "config.json").write_text(json.dumps(data))
        dst, expect = ck, "format marker"
    elif case == "symlink to a checkpoint":
        dst = tmp_path / "link"
        dst.symlink_to(ck)
        expect = "symbolic link"
    elif case == "inside the source":
        dst, expect = str(src_dir / "out"), "inside the source"
    elif case == "symlinked alias of the source":
        (tmp_path / "alias").symlink_to(src_dir)
        dst, expect = str(tmp_path / "alias"), "is the source"
    before = snapshot(tmp_path)
    assert cli.main([src, str(dst), "--num-heads", "2", "--force", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxkv convert: error: ") and "\n" not in err and expect in err, err
    assert snapshot(tmp_path) == before  # nothing touched, nothing left behind
    with pytest.raises(ConversionError, match=expect):  # the library refuses the same way
        convert_checkpoint(src, str(dst), num_heads=2, force=True)
    assert snapshot(tmp_path) == before


def test_output_directories_get_the_users_umask(tmp_path):
    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    for umask, dir_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)):
        old = os.umask(umask)
        try:
            dst = tmp_path / f"out{umask:o}"
            convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2)
        finally:
            os.umask(old)
        assert oct(os.stat(dst).st_mode & 0o777) == oct(dir_mode)
        for name in ("config.json", "params.safetensors"):
            assert oct(os.stat(dst / name).st_mode & 0o777) == oct(file_mode), name


def test_interrupted_conversion_leaves_the_old_destination(tmp_path, monkeypatch):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    dst = tmp_path / "out"
    convert_checkpoint(str(tmp_path / "m.safetensors"), str(dst), num_heads=2, dtype="f32")
    before = (dst / "params.safetensors").read_bytes()

    from jaxkv.convert import sources

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


_SLOW_CONVERT = """
import signal, sys, time
from jaxkv.convert import cli, sources
# a shell's dispositions: a test run started under nohup or in the background hands SIGHUP / SIGINT down ignored,
# and a conversion rightly leaves ignored signals alone (jaxkv.files)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
ready, calls, real = sys.argv[1], [], sources.SafetensorsSource.read
def read(self, key):  # a slow disk: the conversion is still streaming when the test signals it
    calls.append(key)
    if len(calls) == 10:
        open(ready, "w").close()
    if len(calls) >= 10:
        time.sleep(0.5)
    return real(self, key)
sources.SafetensorsSource.read = read
sys.exit(cli.main(sys.argv[2:]))
"""


def _start_slow_conversion(tmp_path, src, dst):
    import subprocess
    import sys
    import time

    script, ready = tmp_path / "slow_convert.py", tmp_path / "ready"
    script.write_text(_SLOW_CONVERT)
    if ready.exists():
        ready.unlink()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ready), str(src), str(dst), "--num-heads", "2", "--no-progress"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tmp_path),
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the conversion never started streaming"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGHUP", 129), ("SIGINT", 130)])
def test_signals_during_a_conversion_clean_up(tmp_path, signame, code):
    import signal

    save_file(random_original(CFG), str(tmp_path / "m.safetensors"))
    dst = tmp_path / "out"
    proc = _start_slow_conversion(tmp_path, tmp_path / "m.safetensors", dst)
    assert leftovers(tmp_path), "the temporary directory should exist while streaming"
    proc.send_signal(getattr(signal, signame))
    err = proc.stderr.read().strip()
    assert proc.wait(timeout=60) == code, err
    lines = err.splitlines()
    assert "Traceback" not in err and all(
        line.startswith(("source:", "config:", "defaulted")) for line in lines[:-1]
    ), err  # the summary, then one line for the stop
    assert lines[-1].endswith("nothing was written") and (signame in lines[-1] or signame == "SIGINT"), err
    assert not dst.exists() and not leftovers(tmp_path)


@pytest.mark.slow
def test_after_sigkill_the_next_conversion_removes_its_stale_temporary(tmp_path, capsys):
    import signal

    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    (tmp_path / ".out.tmp-notours").mkdir()  # same pattern, no marker: someone else's, never touched
    dst = tmp_path / "out"
    proc = _start_slow_conversion(tmp_path, tmp_path / "m.safetensors", dst)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stderr.close()
    stale = [n for n in leftovers(tmp_path) if n != ".out.tmp-notours"]
    assert len(stale) == 1 and os.path.isfile(tmp_path / stale[0] / ".jaxkv-partial")
    assert (
        cli.main([str(tmp_path / "m.safetensors"), str(dst), "--num-heads", "2", "--dtype", "f32", "--no-progress"])
        == 0
    )
    err = capsys.readouterr().err
    assert f"removed {tmp_path / stale[0]}, left by an interrupted write (pid {proc.pid})" in err
    assert leftovers(tmp_path) == [".out.tmp-notours"]
    assert_params_equal(checkpoint.load(str(dst))[1], expected_params(sd, CFG))


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_converts_and_reports(tmp_path, capsys):
    sd = random_original(CFG)
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert (
        cli.main(
            [
                str(tmp_path / "m.safetensors"),
                str(tmp_path / "out"),
                "--num-heads",
                "2",
                "--dtype",
                "f32",
                "--no-progress",
            ]
        )
        == 0
    )
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
    assert (
        jaxkv_cli.main(
            ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--num-heads", "2", "--no-progress"]
        )
        == 0
    )
    assert checkpoint.read_config(str(tmp_path / "out")).num_heads == 2


def test_write_tensor_directory_hooks_see_the_written_bytes(tmp_path):
    from jaxkv.convert.stream import Piece, write_tensor_directory

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.linspace(-1, 1, 5).astype(np.float64)
    seen, given = [], []

    def extra(params_path):
        given.append(params_path)
        return {"config.json": json.dumps({"format": "jaxkv-test", "n": len(seen)}), "blob.bin": b"\x00\xff\x01"}

    result = write_tensor_directory(
        str(tmp_path / "out"),
        [("a", (3, 4), [Piece("a0", lambda: a[:2]), Piece("a1", lambda: a[2:])]), ("b", (5,), [Piece("b", lambda: b)])],
        dtype=np.float32,
        extra_files=extra,
        replaceable=lambda p: None,
        on_piece=lambda v: seen.append(v.tobytes()),
    )
    raw = (tmp_path / "out" / "params.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    # The hook saw every piece as cast, in file order: together they are the file's data region.
    assert len(seen) == 3 and b"".join(seen) == raw[8 + n :] == a.tobytes() + b.astype(np.float32).tobytes()
    assert len(given) == 1 and os.path.basename(given[0]) == "params.safetensors"
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"format": "jaxkv-test", "n": 3}
    assert (tmp_path / "out" / "blob.bin").read_bytes() == b"\x00\xff\x01"
    assert result.params_bytes == len(raw) and result.nonfinite == []
