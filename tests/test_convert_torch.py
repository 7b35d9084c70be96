"""Self-Forcing / CausVid `.pt` training checkpoints: entry selection (generator_ema / generator / model), wrapper
prefixes, bf16 and strided tensors, and files that torch.load(weights_only=True) refuses or cannot read."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from jaxkv.convert import cli
from jaxkv.convert.convert import convert_checkpoint, plan_conversion
from jaxkv.convert.errors import ConversionError
from jaxkv.models.wan import checkpoint
from tests.helpers.wan_checkpoints import CFG, assert_params_equal, expected_params, leftovers, random_original

pytestmark = pytest.mark.torch


def as_torch(sd: dict, prefix: str = "", dtype=torch.float32) -> dict:
    return {prefix + k: torch.from_numpy(v).to(dtype) for k, v in sd.items()}


@pytest.fixture
def training_checkpoint(tmp_path):
    """A Self-Forcing-style file: generator (FSDP-wrapped names), generator_ema, a critic and a step counter."""
    gen, ema = random_original(CFG, seed=10), random_original(CFG, seed=11)
    path = tmp_path / "self_forcing.pt"
    torch.save(
        {
            "generator": as_torch(gen, "model._fsdp_wrapped_module."),
            "generator_ema": as_torch(ema, "model."),
            "critic": {"model.blocks.0.self_attn.q.weight": torch.zeros(2, 2)},
            "step": 600,
        },
        path,
    )
    return path, gen, ema


@pytest.mark.parametrize("ema, which", [(None, "ema"), (True, "ema"), (False, "gen")])
def test_entry_selection(tmp_path, training_checkpoint, ema, which):
    path, gen, ema_sd = training_checkpoint
    plan = convert_checkpoint(str(path), str(tmp_path / "out"), num_heads=2, ema=ema, dtype="f32")
    assert plan.source.entry == ("generator_ema" if which == "ema" else "generator")
    assert_params_equal(
        checkpoint.load(str(tmp_path / "out"))[1], expected_params(ema_sd if which == "ema" else gen, CFG)
    )


def test_causvid_style_and_bare_state_dicts(tmp_path):
    sd = random_original(CFG, seed=12)
    torch.save({"generator": as_torch(sd, "model.")}, tmp_path / "causvid.pt")
    assert plan_conversion(str(tmp_path / "causvid.pt"), num_heads=2).source.entry == "generator"
    with pytest.raises(ConversionError, match="no 'generator_ema' entry.*'generator'"):
        plan_conversion(str(tmp_path / "causvid.pt"), num_heads=2, ema=True)
    torch.save(as_torch(sd), tmp_path / "bare.pth")
    convert_checkpoint(str(tmp_path / "bare.pth"), str(tmp_path / "out"), num_heads=2, dtype="f32")
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))


def test_bf16_and_strided_tensors(tmp_path):
    sd = random_original(CFG, seed=13)
    tensors = as_torch(sd, "model.", dtype=torch.bfloat16)
    # A transposed view is saved with its strides; it must be read as the same values.
    w = tensors["model.blocks.1.ffn.0.weight"]
    tensors["model.blocks.1.ffn.0.weight"] = w.t().contiguous().t()
    assert not tensors["model.blocks.1.ffn.0.weight"].is_contiguous()
    torch.save({"generator_ema": tensors}, tmp_path / "bf16.pt")
    convert_checkpoint(str(tmp_path / "bf16.pt"), str(tmp_path / "out"), num_heads=2, dtype="f32")
    widened = {k: v.float().numpy() for k, v in as_torch(sd, dtype=torch.bfloat16).items()}
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(widened, CFG))


class NotAWeight:
    """A pickled Python object, which weights_only loading refuses."""

    def __init__(self):
        self.lr = 1e-4


def test_weights_only_refusal_is_a_clear_error(tmp_path, capsys):
    torch.save({"generator": as_torch(random_original(CFG)), "args": NotAWeight()}, tmp_path / "unsafe.pt")
    with pytest.raises(ConversionError, match=r"refused by torch.load\(weights_only=True\)"):
        plan_conversion(str(tmp_path / "unsafe.pt"), num_heads=2)
    assert cli.main([str(tmp_path / "unsafe.pt"), str(tmp_path / "out"), "--num-heads", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxkv convert: error:") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


class RunsAShellCommand:
    """What a malicious checkpoint holds: unpickling it would call os.system."""

    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_refusal_names_the_refused_global_and_says_it_would_execute_code(tmp_path):
    torch.save({"generator": as_torch(random_original(CFG)), "payload": RunsAShellCommand()}, tmp_path / "evil.pt")
    with pytest.raises(ConversionError) as e:
        plan_conversion(str(tmp_path / "evil.pt"), num_heads=2)
    msg = str(e.value)
    assert f"{os.system.__module__}.system" in msg and "blocks" in msg, msg  # posix.system on Linux
    assert "execute code" in msg and "weights_only" in msg
    torch.save({"generator": as_torch(random_original(CFG)), "args": NotAWeight()}, tmp_path / "obj.pt")
    with pytest.raises(ConversionError, match=r"NotAWeight, which is not an allowed global.*execute code"):
        plan_conversion(str(tmp_path / "obj.pt"), num_heads=2)


def test_garbage_and_legacy_files_are_told_apart(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"<html>404 Not Found</html>" * 20)
    with pytest.raises(ConversionError) as e:
        plan_conversion(str(tmp_path / "garbage.pt"), num_heads=2)
    assert "is not a PyTorch checkpoint" in str(e.value) and "legacy (pre-1.6)" not in str(e.value)
    assert "b'<html>40'" in str(e.value)
    torch.save({"generator": as_torch(random_original(CFG))}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ConversionError, match=r"legacy \(pre-1.6\) torch.save format"):
        plan_conversion(str(tmp_path / "old.pt"), num_heads=2)


def test_truncated_pt(tmp_path):
    torch.save({"generator": as_torch(random_original(CFG))}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="truncated or corrupt"):
        plan_conversion(str(tmp_path / "cut.pt"), num_heads=2)


def test_missing_entry_and_non_dict(tmp_path):
    torch.save({"optimizer": {"lr": torch.tensor(1.0)}, "step": 3}, tmp_path / "opt.pt")
    with pytest.raises(
        ConversionError,
        match=r"no 'generator_ema' / 'generator' / 'model' / 'state_dict' entry.*"
        r"'optimizer'",
    ):
        plan_conversion(str(tmp_path / "opt.pt"))
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(ConversionError, match="expected a dict"):
        plan_conversion(str(tmp_path / "list.pt"))


def test_pt_inside_a_directory_is_found(tmp_path):
    sd = random_original(CFG, seed=14)
    (tmp_path / "run").mkdir()
    torch.save({"generator": as_torch(sd, "model.")}, tmp_path / "run" / "checkpoint_model_000600.pt")
    plan = plan_conversion(str(tmp_path / "run"), num_heads=2)
    assert plan.source.entry == "generator" and plan.config.num_layers == CFG.num_layers
    assert os.path.basename(plan.source.description.split()[2]) == "checkpoint_model_000600.pt"


def test_tensors_sharing_a_storage_survive_page_release(tmp_path):
    # Pages of a converted tensor are dropped from the file mapping; a later tensor in the same storage must be
    # re-read from the file, intact.
    sd = random_original(CFG, seed=15)
    tensors = as_torch(sd, "model.")
    shared = torch.stack([tensors[f"model.blocks.0.self_attn.{p}.weight"] for p in "qkvo"])
    for i, p in enumerate("qkvo"):
        tensors[f"model.blocks.0.self_attn.{p}.weight"] = shared[i]
    torch.save({"generator": tensors}, tmp_path / "shared.pt")
    plan = plan_conversion(str(tmp_path / "shared.pt"), num_heads=2)
    if os.path.exists("/proc/self/maps"):
        assert plan.source._mapped, "the checkpoint file should be memory-mapped"
    plan.source.close()
    convert_checkpoint(str(tmp_path / "shared.pt"), str(tmp_path / "out"), num_heads=2, dtype="f32")
    assert_params_equal(checkpoint.load(str(tmp_path / "out"))[1], expected_params(sd, CFG))
