"""benchmarks/e2e_gpu.py --dry-run: the end-to-end GPU benchmark's code path (umT5 -> Wan DiT -> Wan VAE -> mp4, each
part in its own process) at tiny presets on CPU, so the prepared GPU command is known to run before a GPU is lent;
its figures are all present and consistent with each other and with the mp4 read back."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.benchmarks import load_benchmark

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_gpu.py"
FIGURES = (
    "compile_s",
    "vae_compile_s",
    "encode_s",
    "first_frame_s",
    "e2e_video_fps",
    "e2e_ms_per_chunk",
    "denoise_video_fps",
    "denoise_ms_per_chunk",
    "denoise_device_ms_per_chunk",
    "decode_ms_per_chunk",
    "decode_tflops",
    "decode_flops_per_chunk",
    "overlap",
    "live_bytes_after_encode",
    "live_bytes_after_release",
    "text_encoder_bytes",
    "dit_bytes",
    "vae_bytes",
    "cache_bytes",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    out = tmp / "result.json"
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT), "--dry-run", "--json", str(out), "--out-dir", str(tmp / "videos")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f), proc.stdout


def _frames(path: str) -> list[np.ndarray]:
    import av

    with av.open(path) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


@pytest.mark.slow  # two fresh processes, each compiling three models (~35 s on 2 cores)
def test_dry_run_figures(dry_run):
    result, stdout = dry_run
    assert result["dry_run"] and set(result["parts"]) == {"offload", "keep"}
    for name, r in result["parts"].items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        missing = [k for k in FIGURES if r.get(k) is None]
        assert not missing, f"{name}: missing {missing}"
        # after the release nothing may be live (the prompt's embeddings are on the host)
        assert all(r[k] > 0 for k in FIGURES if k not in ("overlap", "live_bytes_after_release")), name
        assert r["peak_bytes"] is None  # CPU has no memory_stats: reported as None, never invented
        assert r["decode_flops_source"] == "cost_analysis"
        np.testing.assert_allclose(r["decode_tflops"], r["decode_flops_per_chunk"] / r["decode_ms_per_chunk"] / 1e9)
        # Frames: the first chunk gives 1 + 4 (T - 1) video frames (the VAE's causal first frame), later ones 4 T.
        t = result["settings"]["chunk_frames"]
        assert r["video_frames"] == 1 + 4 * (t - 1) + 4 * t * (r["chunks"] - 1)
        frames = _frames(r["video"])
        assert len(frames) == r["video_frames"]
        h, w = result["settings"]["latent"]
        assert frames[0].shape == (8 * h, 8 * w, 3) and r["video_size"] == [8 * h, 8 * w]
        assert len(r["chunk_latency_ms"]) == r["chunks"]
        # A steady chunk cannot finish faster than its slower part: the e2e rate is bounded by the parts'.
        bound = 4 * t / (max(r["denoise_ms_per_chunk"], r["decode_ms_per_chunk"]) / 1e3)
        assert r["e2e_video_fps"] <= 1.25 * bound, (r["e2e_video_fps"], bound)
        assert r["e2e_video_fps"] < r["denoise_video_fps"]  # the decode is extra work
        np.testing.assert_allclose(
            r["overlap"],
            (r["denoise_ms_per_chunk"] + r["decode_ms_per_chunk"] - r["e2e_ms_per_chunk"]) / r["decode_ms_per_chunk"],
        )
        np.testing.assert_allclose(r["e2e_video_fps"] * r["e2e_ms_per_chunk"] / 1e3, 4 * t)
        assert r["offload_text_encoder"] == (name == "offload")
    off, keep = result["parts"]["offload"], result["parts"]["keep"]
    # Releasing the encoder frees exactly its weights; keeping it frees nothing.
    assert off["live_bytes_after_encode"] - off["live_bytes_after_release"] == off["text_encoder_bytes"]
    assert keep["live_bytes_after_release"] == keep["live_bytes_after_encode"]
    assert keep["live_bytes_stream_start"] - off["live_bytes_stream_start"] == keep["text_encoder_bytes"]
    for name in ("offload", "keep"):
        assert name in stdout and "VAE decode" in stdout
    assert os.path.exists(off["video"])


def test_device_params_bf16_without_float32():
    """The full-size init writes each leaf in its dtype on the device with the stated distributions."""
    import jax.numpy as jnp

    from jaxkv.models.param_tree import unflatten

    module = load_benchmark("e2e_gpu")
    shapes = {"blocks.ffn.up.kernel": (2, 256, 512), "norm.scale": (4096,), "embedding": (64, 256)}
    params = module.device_params(shapes, unflatten, 0, jnp.bfloat16)
    up, scale, emb = params["blocks"]["ffn"]["up"]["kernel"], params["norm"]["scale"], params["embedding"]
    assert up.dtype == scale.dtype == emb.dtype == jnp.bfloat16 and up.shape == (2, 256, 512)
    assert abs(float(np.std(np.asarray(up, np.float32))) - 256**-0.5) < 0.1 * 256**-0.5
    assert abs(float(np.mean(np.asarray(scale, np.float32))) - 1.0) < 0.01
    assert abs(float(np.std(np.asarray(emb, np.float32))) - 1.0) < 0.05
    assert not np.array_equal(np.asarray(up[0]), np.asarray(up[1]))
