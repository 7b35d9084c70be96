"""benchmarks/gpu_check.py --dry-run: the GPU check's code paths at tiny shapes on CPU (Pallas interpreted, cuDNN
reported unavailable), so the prepared GPU command is known to run before a GPU is lent; and the peer benchmark's
jaxkv half without a Self-Forcing checkout."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_check_dry_run_attention_parts(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU run the real check instead")
    out = tmp_path / "gpu.json"
    assert _load("gpu_check").main(["--dry-run", "--skip-wan", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["cudnn"] is False
    pallas = {k: v for k, v in result["correctness"].items() if k.endswith("/pallas")}
    assert len(pallas) == 2 and all(v["ok"] and v["max_abs_err"] < 3e-2 for v in pallas.values())
    assert [row["keys"] for row in result["attention"]] == [128, 320]
    assert all(row["pallas_ms"] > 0 and row["xla_ms"] > 0 for row in result["attention"])


def test_gpu_check_refuses_to_pretend_without_a_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert _load("gpu_check").main([]) == 2
    assert "--dry-run" in capsys.readouterr().out
