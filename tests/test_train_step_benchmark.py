"""benchmarks/train_step.py runs on the shipped toy model and its two variants agree (the speed is its reading, not
a test)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import load_benchmark


def _bench():
    return load_benchmark("train_step")


@pytest.mark.slow  # ~2 min on 2 cores: four compilations of the recipe's training steps
def test_train_step_benchmark_writes_both_losses_and_their_variants_agree(tmp_path, capsys):
    out = tmp_path / "train_step.json"
    assert _bench().main(["--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["loss"].split(" (")[0] for r in rows] == ["teacher forcing", "self-forcing"]
    for r in rows:
        assert r["seconds"] > 0 and r["seconds_remat"] > 0
        assert abs(r["loss_value_remat"] - r["loss_value"]) <= 1e-5 * abs(r["loss_value"])
        assert r["max_grad_difference_relative"] < 1e-4
    assert capsys.readouterr().out.count("\n| ") == 3  # the table's rule and one row per loss


def test_train_step_benchmark_refuses_no_repeats(capsys):
    assert _bench().main(["--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
