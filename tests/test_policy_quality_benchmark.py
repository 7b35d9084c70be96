"""benchmarks/policy_quality.py runs on the shipped toy-world model: its rows, JSON and table, at a few chunks."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("policy_quality")


@pytest.mark.slow
def test_rows_carry_scores_travel_speed_and_cache_bytes(bench, tmp_path, capsys):
    out = tmp_path / "policy.json"
    # 10 three-frame chunks: the 30 frames one travel window needs; the trained policy and the sink-less one
    bench.main(["--chunks", "10", "--window-chunks", "5", "--policies", "0,3", "--json", str(out)])
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [r["policy"] for r in rows] == [list(bench.POLICIES)[0], list(bench.POLICIES)[3]]
    for r in rows:
        assert 0.0 <= r["overall"] <= 1.0 and len(r["window_overall"]) == 2
        assert 0.0 <= r["travel_least"] <= r["travel_median"]
        assert r["ms_per_chunk"] > 0
    # the sink-less ring holds 6 of the trained ring's 9 frames of K/V (positions are per frame)
    assert rows[1]["cache_bytes"] < rows[0]["cache_bytes"]
    table = capsys.readouterr().out
    assert "travel least / median" in table and f"{rows[0]['travel_least']:.2f}" in table
