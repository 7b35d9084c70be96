"""`jaxkv convert` picks the model family from the files (Wan DiT, Wan VAE, umT5), `--family` forces one, and a
Wan release directory (original or diffusers layout) becomes DST/{dit,vae,text_encoder}/ as one atomic unit.

The fixtures are the ones the per-family converter tests build (tiny random checkpoints); each converted part is
compared with the params it was made from, so a part routed to the wrong converter or written wrongly fails.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxkv.convert import cli, release
from jaxkv.convert.errors import ConversionError
from jaxkv.models.umt5 import UMT5Config
from jaxkv.models.umt5 import checkpoint as t5_checkpoint
from jaxkv.models.umt5 import init_params as t5_init
from jaxkv.models.umt5.params import flatten as t5_flatten
from jaxkv.models.wan import checkpoint as dit_checkpoint
from jaxkv.models.wan_vae import checkpoint as vae_checkpoint
from jaxkv.models.wan_vae import init_params as vae_init
from jaxkv.models.wan_vae.params import flatten as vae_flatten
from tests.helpers.umt5_checkpoints import CFG as T5_BASE
from tests.helpers.umt5_checkpoints import sentencepiece_model, wan_layout
from tests.helpers.vae_checkpoints import CONFIG as VAE_CFG
from tests.helpers.vae_checkpoints import DIFFUSERS_CONFIG as VAE_DIFFUSERS_CONFIG
from tests.helpers.vae_checkpoints import torch_layout
from tests.helpers.wan_checkpoints import CFG as DIT_CFG
from tests.helpers.wan_checkpoints import (
    assert_params_equal,
    diffusers_name,
    expected_params,
    leftovers,
    random_original,
)

# The sentencepiece fixture has 40 pieces; Wan's layout does not store max_distance (128) or text_len (512).
T5_CFG = UMT5Config(**{**T5_BASE.to_dict(), "vocab_size": 40, "max_distance": 128, "text_len": 512})


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def dit_sd():
    return random_original(DIT_CFG, seed=5)


@pytest.fixture(scope="module")
def vae_flat():
    return {k: np.asarray(v) for k, v in vae_flatten(vae_init(1, VAE_CFG)).items()}


@pytest.fixture(scope="module")
def t5_params():
    return t5_init(T5_CFG, 3)


@pytest.fixture(scope="module")
def spiece():
    return sentencepiece_model()


def hf_t5_layout(params, cfg) -> dict[str, np.ndarray]:
    """Hugging Face UMT5EncoderModel names, renamed from test_umt5's hand-written Wan names."""
    out = {}
    for key, value in wan_layout(params, cfg).items():
        if key == "token_embedding.weight":
            out["shared.weight"] = out["encoder.embed_tokens.weight"] = value
            continue
        if key == "norm.weight":
            out["encoder.final_layer_norm.weight"] = value
            continue
        _, i, rest = key.split(".", 2)
        h = f"encoder.block.{i}.layer."
        names = {
            "norm1.weight": "0.layer_norm.weight",
            "norm2.weight": "1.layer_norm.weight",
            "pos_embedding.embedding.weight": "0.SelfAttention.relative_attention_bias.weight",
            "ffn.gate.0.weight": "1.DenseReluDense.wi_0.weight",
            "ffn.fc1.weight": "1.DenseReluDense.wi_1.weight",
            "ffn.fc2.weight": "1.DenseReluDense.wo.weight",
        }
        # attn.{q,k,v,o}.weight -> 0.SelfAttention.{q,k,v,o}.weight
        out[h + names.get(rest, f"0.SelfAttention.{rest.split('.')[1]}.weight")] = value
    return out


def hf_t5_config(cfg) -> dict:
    return {
        "model_type": "umt5",
        "feed_forward_proj": "gated-gelu",
        "d_model": cfg.dim,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.ffn_dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "relative_attention_num_buckets": cfg.num_buckets,
        "relative_attention_max_distance": cfg.max_distance,
        "vocab_size": cfg.vocab_size,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }


def write_diffusers_release(root, dit_sd, vae_flat, t5_params, spiece):
    """A diffusers pipeline root: transformer/, vae/, text_encoder/ (safetensors + config.json), tokenizer/."""
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        (root / sub).mkdir(parents=True)
    save_file(
        {diffusers_name(k): v for k, v in dit_sd.items()},
        str(root / "transformer" / "diffusion_pytorch_model.safetensors"),
    )
    (root / "transformer" / "config.json").write_text(
        json.dumps({"_class_name": "WanTransformer3DModel", "num_attention_heads": 2, "attention_head_dim": 16})
    )
    save_file(torch_layout(vae_flat, "diffusers"), str(root / "vae" / "diffusion_pytorch_model.safetensors"))
    (root / "vae" / "config.json").write_text(json.dumps(VAE_DIFFUSERS_CONFIG))
    save_file(hf_t5_layout(t5_params, T5_CFG), str(root / "text_encoder" / "model.safetensors"))
    (root / "text_encoder" / "config.json").write_text(json.dumps(hf_t5_config(T5_CFG)))
    (root / "tokenizer" / "spiece.model").write_bytes(spiece)
    return root


def check_dit(path, dit_sd):
    config, params = dit_checkpoint.load(str(path))
    assert config.dim == DIT_CFG.dim and config.num_layers == DIT_CFG.num_layers
    assert_params_equal(params, expected_params(dit_sd, DIT_CFG))


def check_vae(path, vae_flat):
    config, params = vae_checkpoint.load(str(path))
    assert config == VAE_CFG
    got = vae_flatten(params)
    assert set(got) == set(vae_flat)
    for k in vae_flat:
        np.testing.assert_array_equal(np.asarray(got[k]), vae_flat[k], err_msg=k)


def check_t5(path, t5_params, spiece):
    config, params, _ = t5_checkpoint.load(str(path))
    assert config == T5_CFG
    got, want = t5_flatten(params), t5_flatten(t5_params)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), err_msg=k)
    assert (path / "spiece.model").read_bytes() == spiece


def run(argv, capsys):
    rc = cli.main([*map(str, argv), "--no-progress"])
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ single parts


def test_each_family_is_detected_and_converted(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    for sub, family in (("transformer", "dit"), ("vae", "vae"), ("text_encoder", "umt5")):
        assert release.detect_family(str(root / sub)) == family
    assert release.detect_family(str(root)) == "release"

    rc, err = run([root / "vae", tmp_path / "vae", "--dtype", "f32"], capsys)
    assert rc == 0, err
    assert "vae: " in err and "diffusers naming" in err
    check_vae(tmp_path / "vae", vae_flat)
    rc, err = run([root / "text_encoder", tmp_path / "t5", "--dtype", "f32"], capsys)
    assert rc == 0, err
    assert "text encoder: " in err and "hf layout" in err
    check_t5(tmp_path / "t5", t5_params, spiece)
    rc, err = run([root / "transformer", tmp_path / "dit", "--dtype", "f32"], capsys)
    assert rc == 0, err
    check_dit(tmp_path / "dit", dit_sd)
    assert not leftovers(tmp_path)


def test_forced_family_takes_that_part_of_a_release(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    rc, err = run([root, tmp_path / "vae", "--family", "vae", "--dtype", "f32"], capsys)
    assert rc == 0, err
    check_vae(tmp_path / "vae", vae_flat)
    rc, err = run([root, tmp_path / "dit", "--family", "dit", "--dtype", "f32"], capsys)
    assert rc == 0, err
    check_dit(tmp_path / "dit", dit_sd)
    # Forcing the wrong family gets that converter's own complaint, nothing written.
    rc, err = run([root / "vae", tmp_path / "bad", "--family", "umt5"], capsys)
    assert rc == 1 and err.startswith("jaxkv convert: error: ") and not (tmp_path / "bad").exists()
    rc, err = run([root / "text_encoder", tmp_path / "bad", "--family", "vae"], capsys)
    assert rc == 1 and "not a Wan VAE" in err and not (tmp_path / "bad").exists()
    # DiT-only options are refused for the other families rather than ignored.
    rc, err = run([root / "vae", tmp_path / "bad", "--num-heads", "2"], capsys)
    assert rc == 1 and "--num-heads only apply to the DiT" in err and not (tmp_path / "bad").exists()
    assert not leftovers(tmp_path)


def test_force_replaces_only_the_same_family(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    assert run([root / "vae", tmp_path / "vae", "--dtype", "f32"], capsys)[0] == 0
    assert run([root / "text_encoder", tmp_path / "t5"], capsys)[0] == 0
    # Without --force: refused, as for the DiT.
    rc, err = run([root / "vae", tmp_path / "vae"], capsys)
    assert rc == 1 and "already exists" in err
    # A VAE directory over a text encoder one: refused even with --force, and the old one is intact.
    rc, err = run([root / "vae", tmp_path / "t5", "--force"], capsys)
    assert rc == 1 and "refusing to replace" in err and "spiece.model" in err  # not a VAE file
    check_t5_files = sorted(os.listdir(tmp_path / "t5"))
    assert check_t5_files == ["config.json", "params.safetensors", "spiece.model"]
    # Same family: replaced (f32 -> bf16 here), not merged.
    rc, err = run([root / "vae", tmp_path / "vae", "--force"], capsys)
    assert rc == 0, err
    assert vae_checkpoint.load(str(tmp_path / "vae"))[1]["decoder"] is not None
    assert sorted(os.listdir(tmp_path / "vae")) == ["config.json", "params.safetensors"]
    # A foreign directory is never replaced.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    rc, err = run([root / "text_encoder", tmp_path / "mine", "--force"], capsys)
    assert rc == 1 and (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert not leftovers(tmp_path)


def test_dry_run_of_each_family_writes_nothing(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    for src in (root / "vae", root / "text_encoder", root):
        rc, err = run([src, tmp_path / "out", "--dry-run"], capsys)
        assert rc == 0 and "dry run: nothing written" in err, err
        assert not (tmp_path / "out").exists()
    assert "release directory" in err and "dit: " in err and "vae: " in err and "text encoder: " in err


def test_none_and_ambiguous_sources_list_what_was_looked_for(tmp_path, capsys, dit_sd, vae_flat):
    save_file({"foo.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "other.safetensors"))
    rc, err = run([tmp_path / "other.safetensors", tmp_path / "out"], capsys)
    assert rc == 1 and "none of the model families" in err
    for what in ("Wan 2.1 DiT", "Wan VAE", "umT5", "release directory", "--family"):
        assert what in err
    assert "\n" not in err.strip() and not (tmp_path / "out").exists()
    # DiT and VAE tensors in one file: both fit, so the user must choose.
    mixed = {**dit_sd, **torch_layout(vae_flat, "diffusers")}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    with pytest.raises(ConversionError, match=r"ambiguous.*dit and vae.*--family dit\|vae"):
        release.detect_family(str(tmp_path / "mixed.safetensors"))
    rc, err = run([tmp_path / "mixed.safetensors", tmp_path / "out"], capsys)
    assert rc == 1 and "ambiguous" in err and not (tmp_path / "out").exists()
    # An unreadable source still gets the DiT converter's message, as before.
    (tmp_path / "m.onnx").write_bytes(b"\0" * 16)
    rc, err = run([tmp_path / "m.onnx", tmp_path / "out"], capsys)
    assert rc == 1 and "unknown checkpoint format" in err


# ------------------------------------------------------------------------------------------------ releases


def test_diffusers_release_converts_as_one_unit(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    dst = tmp_path / "wan-jaxkv"
    rc, err = run([root, dst, "--dtype", "f32"], capsys)
    assert rc == 0, err
    assert sorted(os.listdir(dst)) == ["dit", "text_encoder", "vae"]
    check_dit(dst / "dit", dit_sd)
    check_vae(dst / "vae", vae_flat)
    check_t5(dst / "text_encoder", t5_params, spiece)
    # --force replaces a jaxkv release directory as a whole...
    rc, err = run([root, dst, "--force"], capsys)
    assert rc == 0, err
    assert sorted(os.listdir(dst)) == ["dit", "text_encoder", "vae"]
    # ...but not a release directory holding anything else, nor a single-part checkpoint.
    (dst / "README.txt").write_text("mine")
    rc, err = run([root, dst, "--force"], capsys)
    assert rc == 1 and "not exactly the jaxkv release parts" in err and (dst / "README.txt").exists()
    rc, err = run([root, dst / "vae", "--force"], capsys)
    assert rc == 1 and "refusing to replace" in err
    assert release.replace_problem("release", str(dst / "dit")) is not None
    assert not leftovers(tmp_path)


def test_a_broken_part_leaves_nothing(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    tensors = hf_t5_layout(t5_params, T5_CFG)
    del tensors["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
    save_file(tensors, str(root / "text_encoder" / "model.safetensors"))
    rc, err = run([root, tmp_path / "out"], capsys)
    assert rc == 1 and "release part text_encoder/" in err and "layer 1" in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_failure_while_writing_the_last_part_removes_the_first_parts(
    tmp_path, dit_sd, vae_flat, t5_params, spiece, monkeypatch
):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    from jaxkv.convert import umt5

    def fail(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(umt5, "write_umt5_checkpoint", fail)
    with pytest.raises(OSError, match="simulated"):
        release.convert_release(str(root), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    # A previous release survives a failed --force replacement untouched.
    monkeypatch.undo()
    release.convert_release(str(root), str(tmp_path / "out"), dtype="f32")
    before = {n: sorted(os.listdir(tmp_path / "out" / n)) for n in os.listdir(tmp_path / "out")}
    monkeypatch.setattr(umt5, "write_umt5_checkpoint", fail)
    with pytest.raises(OSError):
        release.convert_release(str(root), str(tmp_path / "out"), force=True)
    assert {n: sorted(os.listdir(tmp_path / "out" / n)) for n in os.listdir(tmp_path / "out")} == before
    check_vae(tmp_path / "out" / "vae", vae_flat)
    assert not leftovers(tmp_path)


def test_partial_release_is_not_a_release(tmp_path, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    os.rename(root / "text_encoder", tmp_path / "elsewhere")
    assert release.find_release(str(root)) is None
    assert release.detect_family(str(root)) == "dit"  # a pipeline root without the others: its transformer/, as before
    with pytest.raises(ConversionError, match="not a Wan release directory"):
        release.plan_release(str(root))


@pytest.mark.torch
def test_original_release_converts_as_one_unit(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    torch = pytest.importorskip("torch")
    root = tmp_path / "Wan2.1-T2V-1.3B"
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    save_file(dit_sd, str(root / "diffusion_pytorch_model.safetensors"))
    torch.save(
        {k: torch.from_numpy(v.copy()) for k, v in torch_layout(vae_flat, "wan").items()}, root / "Wan2.1_VAE.pth"
    )
    torch.save(
        {k: torch.from_numpy(v.copy()) for k, v in wan_layout(t5_params, T5_CFG).items()},
        root / "models_t5_umt5-xxl-enc-bf16.pth",
    )
    (root / "google" / "umt5-xxl" / "spiece.model").write_bytes(spiece)
    assert release.find_release(str(root))["layout"] == "original"
    assert release.detect_family(str(root / "Wan2.1_VAE.pth")) == "vae"
    assert release.detect_family(str(root / "models_t5_umt5-xxl-enc-bf16.pth")) == "umt5"
    dst = tmp_path / "out"
    rc, err = run([root, dst, "--num-heads", "2", "--dtype", "f32"], capsys)
    assert rc == 0, err
    assert "original layout" in err
    check_dit(dst / "dit", dit_sd)
    check_vae(dst / "vae", vae_flat)
    check_t5(dst / "text_encoder", t5_params, spiece)
    # One part of the release alone, by --family.
    rc, err = run([root, tmp_path / "t5", "--family", "umt5", "--dtype", "f32"], capsys)
    assert rc == 0, err
    check_t5(tmp_path / "t5", t5_params, spiece)
    assert not leftovers(tmp_path)


def test_ctrl_c_during_a_release_exits_130_and_leaves_nothing(
    tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece, monkeypatch
):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    from jaxkv.convert import umt5

    def interrupt(*a, **k):  # after dit/ and vae/ are written
        raise KeyboardInterrupt

    monkeypatch.setattr(umt5, "write_umt5_checkpoint", interrupt)
    rc, err = run([root, tmp_path / "out"], capsys)
    assert rc == 130 and "interrupted; nothing was written" in err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_tokenizer_option(tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    os.rename(root / "tokenizer", tmp_path / "tok")
    rc, err = run([root / "text_encoder", tmp_path / "t5"], capsys)
    assert rc == 1 and "no umT5 tokenizer found" in err and not (tmp_path / "t5").exists()
    rc, err = run([root / "text_encoder", tmp_path / "t5", "--tokenizer", tmp_path / "tok", "--dtype", "f32"], capsys)
    assert rc == 0, err
    check_t5(tmp_path / "t5", t5_params, spiece)
    rc, err = run([root / "vae", tmp_path / "v", "--tokenizer", tmp_path / "tok"], capsys)
    assert rc == 1 and "--tokenizer applies to a umT5" in err and not (tmp_path / "v").exists()


# ------------------------------------------------------------------------------------------------ NaN / Inf


def _poison_release(root, vae_flat, t5_params):
    """The release's VAE gets one NaN (decoder.conv_in.weight) and its text encoder two +Inf (layer 1's wo)."""
    vae = {k: v.copy() for k, v in torch_layout(vae_flat, "diffusers").items()}
    vae["decoder.conv_in.weight"].reshape(-1)[3] = np.nan
    save_file(vae, str(root / "vae" / "diffusion_pytorch_model.safetensors"))
    t5 = {k: v.copy() for k, v in hf_t5_layout(t5_params, T5_CFG).items()}
    t5["encoder.block.1.layer.1.DenseReluDense.wo.weight"][0, [1, 4]] = np.inf
    save_file(t5, str(root / "text_encoder" / "model.safetensors"))


VAE_BAD, T5_BAD = "decoder.conv_in.weight", "encoder.block.1.layer.1.DenseReluDense.wo.weight"


def test_nonfinite_vae_and_umt5_tensors_are_refused_by_name_unless_allowed(
    tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece
):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    _poison_release(root, vae_flat, t5_params)
    for sub, bad, counts in (("vae", VAE_BAD, "1 NaN, 0 +Inf"), ("text_encoder", T5_BAD, "0 NaN, 2 +Inf")):
        rc, err = run([root / sub, tmp_path / sub], capsys)
        assert rc == 1, err
        assert f"tensor {bad} holds non-finite values ({counts}" in err and "--allow-nonfinite" in err
        assert not (tmp_path / sub).exists() and not leftovers(tmp_path)
        rc, err = run([root / sub, tmp_path / sub, "--allow-nonfinite", "--dtype", "f32"], capsys)
        assert rc == 0, err
        assert f"warning: non-finite values kept in 1 tensor(s): {bad}: {counts}" in err
    # Kept as they were: exactly the poisoned values are non-finite, everything else converted exactly.
    _, vae = vae_checkpoint.load(str(tmp_path / "vae"))
    got = np.asarray(vae_flatten(vae)["decoder.conv_in.kernel"])
    want = vae_flat["decoder.conv_in.kernel"].copy()
    assert int(np.isnan(got).sum()) == 1
    want[np.isnan(got)] = np.nan
    np.testing.assert_array_equal(got, want)
    _, t5, _ = t5_checkpoint.load(str(tmp_path / "text_encoder"))
    down = np.asarray(t5_flatten(t5)["blocks.ffn.down.kernel"][1])  # [ffn, dim]: the source's [dim, ffn] transposed
    assert np.isposinf(down[[1, 4], 0]).all() and int((~np.isfinite(down)).sum()) == 2


def test_a_release_refuses_nonfinite_parts_and_names_them_when_allowed(
    tmp_path, capsys, dit_sd, vae_flat, t5_params, spiece
):
    root = write_diffusers_release(tmp_path / "pipe", dit_sd, vae_flat, t5_params, spiece)
    _poison_release(root, vae_flat, t5_params)
    rc, err = run([root, tmp_path / "out"], capsys)
    assert rc == 1 and f"tensor {VAE_BAD} holds non-finite values" in err, err  # the first part with one
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    rc, err = run([root, tmp_path / "out", "--allow-nonfinite"], capsys)
    assert rc == 0, err
    assert (
        f"warning: non-finite values kept in 2 tensor(s): vae/{VAE_BAD}: 1 NaN" in err
        and f"text_encoder/{T5_BAD}: 0 NaN, 2 +Inf" in err
    ), err
    assert sorted(os.listdir(tmp_path / "out")) == ["dit", "text_encoder", "vae"]
    # The API says the same: one result per part.
    plan = release.plan_release(str(root))
    try:
        results = release.write_release(plan, str(tmp_path / "api"), allow_nonfinite=True)
    finally:
        plan.close()
    assert {f: [line.split(":")[0] for line in r.nonfinite] for f, r in results.items()} == {
        "dit": [],
        "vae": [VAE_BAD],
        "umt5": [T5_BAD],
    }
    assert results["vae"].params_bytes == os.path.getsize(tmp_path / "api" / "vae" / "params.safetensors")


def test_a_nonfinite_embedding_row_block_is_named_with_its_rows(tmp_path, t5_params, spiece, monkeypatch):
    from jaxkv.convert import umt5

    monkeypatch.setattr(umt5, "PIECE_BYTES", 200)  # the embedding goes out in row blocks
    rows = 200 // (T5_CFG.dim * 4)
    t5 = {k: v.copy() for k, v in hf_t5_layout(t5_params, T5_CFG).items()}
    for name in ("shared.weight", "encoder.embed_tokens.weight"):  # both stored (tied), both with the NaN
        t5[name][7, 2] = np.nan
    (tmp_path / "enc").mkdir()
    save_file(t5, str(tmp_path / "enc" / "model.safetensors"))
    (tmp_path / "enc" / "config.json").write_text(json.dumps(hf_t5_config(T5_CFG)))
    (tmp_path / "enc" / "spiece.model").write_bytes(spiece)
    lo = 7 // rows * rows
    label = f"encoder.embed_tokens.weight rows {lo}:{lo + rows}"
    with pytest.raises(ConversionError, match=f"tensor {label} holds non-finite values \\(1 NaN"):
        umt5.convert_umt5(str(tmp_path / "enc"), str(tmp_path / "out"), dtype="f32")
    assert not (tmp_path / "out").exists()
    plan = umt5.plan_umt5_conversion(str(tmp_path / "enc"))
    try:
        result = umt5.write_umt5_checkpoint(plan, str(tmp_path / "out"), dtype="f32", allow_nonfinite=True)
    finally:
        plan.source.close()
    assert result.nonfinite == [f"{label}: 1 NaN, 0 +Inf, 0 -Inf of {rows * T5_CFG.dim} values"]
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["fingerprint"] == t5_checkpoint.params_fingerprint(str(tmp_path / "out" / "params.safetensors"))
