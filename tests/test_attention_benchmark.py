"""benchmarks/attention.py runs: its CPU part and its GPU part (on CPU: interpreted kernel, XLA SDPA), tiny shapes."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from jaxkv.attention import BlockSizes
from tests.helpers.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("attention")


def test_cpu_part_rows_agree_with_copy_then_attend(bench):
    row = bench.measure_cpu(6, 3, tokens_per_frame=4, reps=1, head_dim=16, heads=2)
    assert row["keys"] == 9 * 4 and row["queries"] == 12
    # Both ring paths, reading the ring in physical order, equal attention over the gathered copy.
    assert row["max_abs_diff"] < 1e-5 and row["ring_dense_max_abs_diff"] < 1e-5
    assert row["ring_blockwise_ms"] > 0 and row["copy_over_ring_blockwise"] > 0


def test_gpu_part_runs_on_cpu_interpreted(bench):
    row = bench.measure_gpu(
        6,
        0,
        tokens_per_frame=8,
        reps=1,
        dtype=jnp.float32,
        head_dim=16,
        heads=2,
        implementation="xla",
        interpret=True,
        block_sizes=BlockSizes(16, 16),
    )
    assert row["keys"] == 48 and row["max_abs_diff"] < 1e-5
    assert row["pallas_ms"] > 0 and row["pallas_over_sdpa"] > 0


def test_main_writes_json(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CPU_ROWS", [(3, 0)])
    out = tmp_path / "rows.json"
    assert bench.main(["--reps", "1", "--tokens-per-frame", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["part"] for r in rows] == ["cpu"] and rows[0]["window_frames"] == 3


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_gpu_checks_run_interpreted(bench):
    checks = [(16, "float32", dict(chunk=60, window=120, sink=60), "half"), (16, "float32", dict(), None)]
    rows = bench.gpu_checks(interpret=True, block_sizes=BlockSizes(32, 32), checks=checks)
    assert all(r["ok"] for r in rows), rows


def test_backend_rows_run_on_cpu_with_the_kernels_interpreted_and_emulated(bench):
    """The GPU part's per-backend rows: full / filling rings (with a sink) and a dilated cache; the Triton kernel
    interpreted and the Mosaic GPU kernel emulated agree with the blockwise path; cuDNN reports its error."""
    rows = bench.backend_rows(
        8, 1, rows=[(6, 3)], dtype=jnp.float32, head_dim=16, heads=2, interpret=True, dilated_buckets=4
    )
    assert [r["case"] for r in rows] == ["full", "filling", "dilated"]
    assert rows[0]["visible_fraction"] == 1.0 and rows[1]["visible_fraction"] < 1.0
    for row in rows:
        assert row["pallas_max_abs_diff"] < 1e-5 and row["mosaic_max_abs_diff"] < 1e-5, row
        assert row["mosaic_ms"] > 0 and row["pallas_tflops"] >= 0 and "cudnn" in row["errors"]
