"""benchmarks/gpu_check.py --dry-run: the GPU check's code paths at tiny shapes on CPU (Pallas interpreted, cuDNN
reported unavailable, FP8 attention emulated), each part in its own process, so the prepared GPU command is known
to run before a GPU is lent; its trace parser on a synthetic GPU trace and on a real CPU trace; and the peer
benchmark's jaxkv half without a Self-Forcing checkout."""

from __future__ import annotations

import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from tests.helpers.benchmarks import load_benchmark as _load


def _synthetic_gpu_trace():
    """A Chrome trace shaped like a GPU profile: kernels on two stream rows of /device:GPU:0, the same time again
    on its derived "XLA Ops" row, and host events; 2 chunks."""
    meta = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}
    x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "ts": 0, "dur": dur, "name": name}
    events = [
        meta(1, 0, "process_name", "/device:GPU:0"),
        meta(1, 7, "thread_name", "Stream #20(Compute)"),
        meta(1, 8, "thread_name", "Stream #24(MemcpyD2D)"),
        meta(1, 9, "thread_name", "XLA Ops"),
        meta(2, 0, "process_name", "/host:CPU"),
        meta(2, 3, "thread_name", "python"),
    ]
    for _ in range(2):  # two chunks
        events += [x(1, 7, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 140_000.0)] * 2
        events += [x(1, 7, "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", 42_000.0)]
        events += [x(1, 7, "loop_convert_fusion", 5_500.0), x(1, 8, "Memcpy DtoD", 5_000.0)]
        events += [x(1, 9, "fusion.12", 330_000.0), x(2, 3, "PjitFunction(step)", 450_000.0)]
    events.append({"ph": "i", "pid": 1, "tid": 7, "ts": 0, "name": "marker"})  # not a complete event
    return {"traceEvents": events}


def test_trace_parser_sums_kernel_time_per_chunk_from_the_device_streams_only(tmp_path):
    gc = _load("gpu_check")
    # written and found where jax.profiler.trace puts it
    run = tmp_path / "plugins" / "profile" / "2026_12_05"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(_synthetic_gpu_trace(), f)
    times, where = gc.kernel_times(gc.read_trace(str(tmp_path)))
    assert where == "device"
    assert times == {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": {"us": 560_000.0, "calls": 4},
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT": {"us": 84_000.0, "calls": 2},
        "loop_convert_fusion": {"us": 11_000.0, "calls": 2},
        "Memcpy DtoD": {"us": 10_000.0, "calls": 2},
    }
    b = gc.breakdown(times, chunks=2, top=3)
    assert b["kernel_ms_per_chunk"] == pytest.approx(332.5)
    assert b["by_kind_ms_per_chunk"] == pytest.approx({"attention": 280.0, "gemm": 42.0, "fusion": 5.5, "copy": 5.0})
    assert [t["name"][:5] for t in b["top"]] == ["cudnn", "nvjet", "loop_"]
    top = b["top"][0]
    assert top["ms_per_chunk"] == 280.0 and top["calls_per_chunk"] == 2 and top["share"] == pytest.approx(280 / 332.5)
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        gc.read_trace(str(tmp_path / "plugins" / "nothing"))


def test_trace_parser_reads_a_real_cpu_trace(tmp_path):
    """On XLA:CPU there is no device process: the parser falls back to the host's XLA worker threads."""
    gc = _load("gpu_check")
    f = jax.jit(lambda a: jnp.tanh(a @ a) + 1.0)
    a = jnp.ones((128, 128))
    f(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            f(a).block_until_ready()
    times, where = gc.kernel_times(gc.read_trace(str(tmp_path)))
    assert where == "host" and times, times
    assert all(t["us"] >= 0 and t["calls"] >= 1 for t in times.values())
    assert not any(name.startswith(("end: ", "ThreadpoolListener")) for name in times)
    assert gc.breakdown(times, chunks=2)["kernel_ms_per_chunk"] > 0


def test_rows_are_checked_and_the_summary_takes_ratios():
    gc = _load("gpu_check")
    assert gc.parse_row("auto:fp8") == ("auto", "fp8")
    assert gc.parse_row("mosaic:bf16:stacked") == ("mosaic", "bf16") and "mosaic:bf16:stacked" in gc.ROWS
    assert gc.row_layout("mosaic:bf16:stacked") == "stacked" and gc.row_layout("mosaic:bf16") is None
    for bad in ("auto", "tpu:bf16", "auto:int8", "mosaic:bf16:tiled"):
        with pytest.raises(ValueError, match="expected BACKEND:PRECISION"):
            gc.parse_row(bad)
    row = lambda ms, precision, peak: {
        "ms_per_chunk": ms,
        "video_fps": 12e3 / ms,
        "peak_bytes_in_use": peak,
        "precision": precision,
        "backend": "auto",
    }
    result = {
        "chunk:auto:bf16": row(400.0, "bf16", 9.0e9),
        "chunk:auto:fp8": row(250.0, "fp8", 6.0e9),
        "chunk:xla:bf16": {"error": "rc 1"},
        "peer": {"torch_ms": 520.0, "peak_bytes": 9.3e9},
    }
    s = gc.summarize(result)
    assert set(s) == {"auto:bf16", "auto:fp8", "self_forcing"}
    assert s["auto:fp8"]["vs_auto_bf16"] == pytest.approx(0.625)
    assert s["auto:fp8"]["self_forcing_over_this"] == pytest.approx(2.08) and s["auto:fp8"]["meets_1.6x"]
    assert s["auto:bf16"]["meets_target"] is False and s["auto:fp8"]["meets_target"] is True
    assert s["auto:bf16"]["peak_over_self_forcing"] == pytest.approx(9.0 / 9.3)


@pytest.mark.slow  # a fresh process per part: 5 jax start-ups and compilations
def test_gpu_check_dry_run_runs_every_part_in_its_own_process(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU run the real check instead")
    out = tmp_path / "gpu.json"
    env_sf = os.environ.pop("SF_SRC", None)
    try:
        rc = _load("gpu_check").main(["--dry-run", "--json", str(out)])
    finally:
        if env_sf is not None:
            os.environ["SF_SRC"] = env_sf
    result = json.loads(out.read_text())
    assert rc == 0, {k: v for k, v in result.items() if isinstance(v, dict) and "error" in v}
    assert result["meta"]["fresh_process_per_part"] is True
    attention = result["attention"]
    assert attention["cudnn"] is False
    pallas = {k: v for k, v in attention["correctness"].items() if k.endswith("/pallas")}
    assert len(pallas) == 2 and all(v["ok"] and v["max_abs_err"] < 3e-2 for v in pallas.values())
    assert [row["keys"] for row in attention["timing"]] == [128, 320]
    _check_mosaic_parts(result)
    rows = {k: v for k, v in result.items() if k.startswith("chunk:")}
    assert set(rows) == {"chunk:auto:bf16", "chunk:auto:fp8", "chunk:auto:bf16+fp8_kv", "chunk:xla:bf16"}
    assert all(r["ms_per_chunk"] > 0 and r["finite"] and r["wall_s"] > 0 for r in rows.values())
    # the FP8 cache: K/V at one byte instead of two (positions and scales on top)
    ratio = rows["chunk:auto:fp8"]["kv_cache_bytes"] / rows["chunk:auto:bf16"]["kv_cache_bytes"]
    assert 0.5 < ratio < 0.6, ratio
    assert rows["chunk:auto:bf16+fp8_kv"]["kv_cache_bytes"] == rows["chunk:auto:fp8"]["kv_cache_bytes"]
    trace = result["trace"]
    assert trace["events_from"] == "host" and trace["kernel_ms_per_chunk"] > 0 and trace["top"]
    assert result["peer"]["skipped"].startswith("no Self-Forcing checkout")
    assert result["summary"]["auto:fp8"]["vs_auto_bf16"] > 0


def _check_mosaic_parts(result):
    """The Mosaic kernel's parts of a dry run: every check case against the dense reference, every timing row."""
    check = result["mosaic_check"]
    assert check["kernel"] == "emulation (dry run)"
    cases = {"partial", "wrapped_sink", "filling_sink_causal", "permuted_nan_empty", "stacked_layer"}
    assert cases <= set(check) and all(check[c]["ok"] and check[c]["max_abs_err"] < 3e-2 for c in cases), check
    timing = result["mosaic_time"]
    assert [(r["keys"], r["case"]) for r in timing["rows"]] == [
        (k, c) for k in (128, 320) for c in ("full", "filling_sink", "filling_sink_causal")
    ]
    assert all(r["mosaic_ms"] > 0 and r["pallas_ms"] > 0 and "cudnn_ms" not in r for r in timing["rows"])
    assert all(r["visible_pairs"] > 0 for r in timing["rows"])
    assert [e["block_q_block_k_stages"] for e in timing["sweep"]] == [list(s) for s in _load("gpu_check").MOSAIC_SWEEP]
    assert all(e["ms"] > 0 for e in timing["sweep"])
    assert set(timing["suggested"]) == {"MOSAIC_OVER_CUDNN", "MOSAIC_OVER_TRITON"}


@pytest.mark.slow  # two parts, a few dozen compilations
def test_gpu_check_mosaic_parts_alone_dry_run(tmp_path):
    """``--parts mosaic_check,mosaic_time``: the one command for the kernel on a GPU, here with its emulation."""
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU run the real check instead")
    out = tmp_path / "mosaic.json"
    rc = _load("gpu_check").main(["--dry-run", "--parts", "mosaic_check,mosaic_time", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["meta"]["parts"] == ["mosaic_check", "mosaic_time"]
    _check_mosaic_parts(result)


def test_a_stacked_chunk_row_runs_the_layer_scan_dry_run(tmp_path):
    """``chunk:BACKEND:PRECISION:stacked`` (GPU: ``mosaic:bf16:stacked``, the kernel reading the cache stack in
    place) runs the stacked layer scan; the same row without ``:stacked`` the per-layer loop."""
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU run the real check instead")
    out = tmp_path / "rows.json"
    parts = "chunk:xla:bf16:stacked,chunk:xla:bf16"
    assert _load("gpu_check").main(["--dry-run", "--parts", parts, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    stacked, per_layer = result["chunk:xla:bf16:stacked"], result["chunk:xla:bf16"]
    assert stacked["layout"] == "stacked" and per_layer["layout"] == "per_layer"
    assert (
        stacked["finite"] and stacked["ms_per_chunk"] > 0 and per_layer["kv_cache_bytes"] == stacked["kv_cache_bytes"]
    )


def test_gpu_check_rejects_unknown_parts():
    with pytest.raises(SystemExit):
        _load("gpu_check").main(["--dry-run", "--parts", "mosaic_check,nonsense"])


def test_gpu_check_refuses_to_pretend_without_a_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert _load("gpu_check").main([]) == 2
    assert "--dry-run" in capsys.readouterr().out


def test_peer_benchmark_gpu_mode_needs_a_checkout(capsys, monkeypatch):
    monkeypatch.delenv("SF_SRC", raising=False)
    assert _load("peer_selfforcing").main(["--device", "cuda"]) == 2
    assert "set SF_SRC" in capsys.readouterr().out
