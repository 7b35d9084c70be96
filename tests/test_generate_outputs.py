"""`jaxkv generate`'s output directory: refused places, --overwrite of a previous output only, never old and new
files mixed; per-chunk files and the manifest read back by `load_latents`; the preview bounded in size and memory."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv.generate import outputs
from jaxkv.generate.options import UsageError
from jaxkv.generate.preview import PreviewSink

RANDOM = ["--preset", "tiny", "--random-weights"]  # the random-weight model
FAST = ["--num-chunks", "2", "--no-progress", "--no-video", *RANDOM]  # the mp4 path: test_generate_media.py


def _chunks(n, shape=(2, 3, 4, 4, 16), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _write(path, chunks, fmt="npy", status="complete"):
    os.makedirs(path, exist_ok=True)
    files = outputs.OutputDir(
        str(path), [outputs.LatentsSink(str(path), fmt)], chunk_shape=chunks[0].shape, latents_format=fmt
    )
    for i, c in enumerate(chunks):
        files.write_chunk(i, c)
    return files.close(status, {})


@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_chunks_round_trip_through_load_latents(tmp_path, fmt):
    chunks = _chunks(4)
    _write(tmp_path / "o", chunks, fmt)
    np.testing.assert_array_equal(G.load_latents(str(tmp_path / "o")), np.concatenate(chunks, axis=1))
    assert len(list(G.latent_chunks(str(tmp_path / "o")))) == 4
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["chunks"] == 4 and manifest["status"] == "complete" and manifest["latents_format"] == fmt
    assert sorted(os.listdir(tmp_path / "o" / "latents")) == [f"chunk_{i:06d}.{fmt}" for i in range(4)]


def test_manifest_counts_only_complete_chunks_while_running(tmp_path):
    """A reader during the run (or after a SIGKILL) sees exactly the chunks the manifest counts."""
    chunks = _chunks(3)
    path = tmp_path / "o"
    os.makedirs(path)
    files = outputs.OutputDir(
        str(path), [outputs.LatentsSink(str(path), "npy")], chunk_shape=chunks[0].shape, latents_format="npy"
    )
    assert G.load_latents(str(path)).shape == (2, 0, 4, 4, 16)
    files.write_chunk(0, chunks[0])
    files.write_chunk(1, chunks[1])
    (path / "latents" / "chunk_000002.npy.tmp").write_bytes(b"half a chunk")  # killed mid-write
    assert json.loads((path / "manifest.json").read_text())["status"] == "running"
    np.testing.assert_array_equal(G.load_latents(str(path)), np.concatenate(chunks[:2], axis=1))
    with pytest.raises(ValueError, match="expected chunk 2, got 3"):
        files.write_chunk(3, chunks[2])
    with pytest.raises(ValueError, match="expected float32"):
        files.write_chunk(2, chunks[2][:1])
    # and such a directory is still recognised as ours (the .tmp file included)
    assert outputs._is_previous_output(str(path))


def test_load_latents_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="not a jaxkv generate output"):
        G.load_latents(str(tmp_path))
    _write(tmp_path / "o", _chunks(2))
    os.remove(tmp_path / "o" / "latents" / "chunk_000001.npy")
    with pytest.raises(ValueError, match="chunk_000001.npy is missing"):
        G.load_latents(str(tmp_path / "o"))
    np.save(tmp_path / "o" / "latents" / "chunk_000001.npy", np.zeros((1, 3, 4, 4, 16), np.float32))
    with pytest.raises(ValueError, match=r"is \[1, 3, 4, 4, 16\], the manifest says \[2, 3, 4, 4, 16\]"):
        G.load_latents(str(tmp_path / "o"))


def test_output_dir_refusals_touch_nothing(tmp_path):
    (tmp_path / "file").write_text("precious")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        outputs.prepare_output_dir(str(tmp_path / "file"), overwrite=True, create=True)
    assert (tmp_path / "file").read_text() == "precious"
    # a directory of other things is refused even with overwrite
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for overwrite in (False, True):
        with pytest.raises(UsageError, match="not a jaxkv generate output"):
            outputs.prepare_output_dir(str(tmp_path / "mine"), overwrite=overwrite, create=True)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # a previous output with a foreign file added is no longer ours
    _write(tmp_path / "prev", _chunks(1))
    (tmp_path / "prev" / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a jaxkv generate output"):
        outputs.prepare_output_dir(str(tmp_path / "prev"), overwrite=True, create=True)
    os.remove(tmp_path / "prev" / "notes.txt")
    (tmp_path / "prev" / "latents" / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="not a jaxkv generate output"):
        outputs.prepare_output_dir(str(tmp_path / "prev"), overwrite=True, create=True)
    # below a file
    with pytest.raises(UsageError, match="is not a directory"):
        outputs.prepare_output_dir(str(tmp_path / "file" / "sub"), overwrite=False, create=True)
    # an empty directory and a new nested path are fine
    (tmp_path / "empty").mkdir()
    assert outputs.prepare_output_dir(str(tmp_path / "empty"), overwrite=False, create=True)
    assert outputs.prepare_output_dir(str(tmp_path / "a" / "b"), overwrite=False, create=True)
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_is_refused(tmp_path):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        with pytest.raises(UsageError, match="not writable"):
            outputs.prepare_output_dir(str(tmp_path / "ro" / "out"), overwrite=False, create=False)
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_unwritable_out_is_refused_even_as_root(tmp_path, monkeypatch):
    """The writability check itself (os.access), with access denied as it is for a normal user."""
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(
        outputs.os, "access", lambda p, mode: False if os.path.samefile(p, tmp_path / "ro") else real(p, mode)
    )
    with pytest.raises(UsageError, match=f"{tmp_path / 'ro'} is not writable"):
        outputs.prepare_output_dir(str(tmp_path / "ro" / "out"), overwrite=False, create=True)
    assert os.listdir(tmp_path / "ro") == []


@pytest.mark.slow
def test_generate_refuses_existing_output_then_overwrites_without_mixing(tmp_path, capsys):
    out = tmp_path / "out"
    assert G.main(["--out", str(out), *FAST, "--format", "safetensors"]) == 0
    first = G.load_latents(str(out))
    before = sorted(os.listdir(out / "latents"))
    # refused without --overwrite: nothing changes
    assert G.main(["--out", str(out), *FAST, "--seed", "1"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(out / "latents")) == before
    np.testing.assert_array_equal(G.load_latents(str(out)), first)
    # with --overwrite: a fresh directory, no safetensors chunk left beside the new npy ones
    assert G.main(["--out", str(out), "--num-chunks", "1", "--no-progress", "--seed", "1", "--overwrite", *RANDOM]) == 0
    assert sorted(os.listdir(out / "latents")) == ["chunk_000000.npy"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out")]  # nothing left beside it
    again = G.load_latents(str(out))
    assert again.shape[1] == 3 and np.abs(again - first[:, :3]).max() > 1e-3
    # an existing file as --out: refused before compiling
    (tmp_path / "f").write_text("x")
    assert G.main(["--out", str(tmp_path / "f"), *FAST]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_preview_is_bounded_and_shows_first_and_last_frames(tmp_path):
    chunks = _chunks(50, shape=(2, 3, 4, 4, 16), seed=1)
    sink = PreviewSink(str(tmp_path / "p.png"), frames=5, scale=2)
    for i, c in enumerate(chunks):
        sink.write_chunk(i, c)
    assert len(sink.head) + len(sink.tail) == 10  # memory: 10 frames of 150
    info = sink.close()
    assert info["preview_frames"] == [0, 1, 2, 3, 4, 145, 146, 147, 148, 149]
    allframes = np.concatenate(chunks, axis=1)
    want = G.preview_image(allframes[:, info["preview_frames"]], 2, columns=5)
    from tests.helpers.images import read_png

    np.testing.assert_array_equal(read_png(tmp_path / "p.png"), want)
    # the size does not depend on the number of frames: 2 videos x 2 rows of 5 tiles of 8 px, 1 px gaps
    assert want.shape == (4 * 8 + 3, 5 * 8 + 4, 3)
    # a short video shows every frame in order
    short = PreviewSink(str(tmp_path / "s.png"), frames=5, scale=2)
    for i, c in enumerate(chunks[:3]):
        short.write_chunk(i, c)
    assert short.close()["preview_frames"] == list(range(9))
    # nothing arrived: no file
    assert PreviewSink(str(tmp_path / "n.png"), frames=5, scale=2).close() == {}
    assert not (tmp_path / "n.png").exists()


def test_denoise_rate_is_device_time_not_inflated_by_a_slow_writer(tmp_path, monkeypatch):
    """The next chunk is dispatched before this one is written, so a slow writer hides the device's work: the
    denoise-only rate must come from the device's time per chunk, not from what is left of the host's wait."""
    args = ["--num-chunks", "6", "--no-progress", "--no-video", "--random-weights"]
    plain = G.main([*args, "--out", str(tmp_path / "a")])
    assert plain == 0
    fast = json.loads((tmp_path / "a" / "summary.json").read_text())["denoise_latent_frames_per_s"]
    write = outputs.LatentsSink.write_chunk

    def slow_write(self, index, latents):
        time.sleep(0.5)  # several chunks' worth of device time
        write(self, index, latents)

    monkeypatch.setattr(outputs.LatentsSink, "write_chunk", slow_write)
    assert G.main([*args, "--out", str(tmp_path / "b")]) == 0
    slow = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert slow["denoise_latent_frames_per_s"] is not None
    # the device did the same work: the two readings agree within the machine's noise, not a slow writer's factor
    assert slow["denoise_latent_frames_per_s"] < 3 * fast, (slow["denoise_latent_frames_per_s"], fast)
    # and the end-to-end rate shows the writer
    assert slow["end_to_end_latent_frames_per_s"] < slow["denoise_latent_frames_per_s"]
