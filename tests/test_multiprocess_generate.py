"""``jaxkv generate --mesh data=2,model=2`` as a two-process job (``--coordinator``, 2 CPU devices per process,
gloo collectives) against the same commands in one process on 4 devices (tests/multiprocess_generate.py runs both):
the latents bit for bit (prompt switches, a mixed dense / dilated cache and an FP8 KV cache included; those
continuing a given image to float32 rounding: below), the decoded video frames within one uint8 step, process 0
alone writing the outputs (the same files as the one process), ``--save-state`` then ``--resume`` across the two
processes continuing as the uninterrupted run (the session saved by the job equals the single-process one, tensor
for tensor), and a failure in one process ending every process."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from PIL import Image

from jaxkv.generate import load_latents
from jaxkv.models.wan.config import PRESETS
from jaxkv.parallel import checkpoint as CK
from tests.helpers.processes import run_processes


def _frames(path: str) -> np.ndarray:
    import av

    with av.open(path) as f:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)])


def _tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    whole = {}
    for piece in CK.read_manifest(path)["pieces"]:
        whole.setdefault(piece["tensor"], []).append(piece)
    out = {}
    for name, pieces in whole.items():
        shape = CK.read_manifest(path)["tensors"][name]["shape"]
        dtype = CK.read_manifest(path)["tensors"][name]["dtype"]
        array = np.zeros(shape, np.dtype(dtype) if dtype != "bfloat16" else np.float32)
        for p in pieces:
            data = load_file(os.path.join(path, p["file"]))[p["key"]]
            array[tuple(slice(a, b) for a, b in p["index"])] = data
        out[name] = array
    return out


@pytest.mark.slow
def test_generate_on_a_two_process_mesh_matches_one_process(tmp_path):
    job, ref = tmp_path / "job", tmp_path / "ref"
    rng = np.random.default_rng(5)
    contexts = {name: rng.standard_normal((5, PRESETS["tiny"].text_dim)).astype(np.float32) for name in "ab"}
    picture = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for d in (job, ref):
        d.mkdir()
        for name, context in contexts.items():
            np.save(d / f"{name}.npy", context)
        for name, entries in (("ab", [(0, "a"), (1, "b")]), ("b", [(0, "b")])):
            (d / f"{name}.json").write_text(json.dumps([{"chunk": c, "context": f"{e}.npy"} for c, e in entries]))
        Image.fromarray(picture).save(d / "given.png")
    run_processes("multiprocess_generate.py", 2, str(job))
    run_processes("multiprocess_generate.py", 1, str(ref))
    for name in ("whole", "part", "rest", "switch", "switch_resumed", "image", "dilated", "fp8"):
        got, want = load_latents(str(job / name)), load_latents(str(ref / name))
        if name == "image":
            # Every process encodes the given picture with the VAE on one of its devices, as the frames below are
            # decoded: a process with 2 CPU devices and one with 4 may round that single-device encode differently
            # (seen on an AMD EPYC without AVX-512: frame 0 7e-7 apart, the stream after it <= 1e-6; bit for bit on
            # another 2-core machine), so these latents agree to float32 rounding, not bit for bit.
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
        summary = json.loads((job / name / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["mesh"]["data"] == 2, summary
        assert sorted(os.listdir(job / name)) == sorted(os.listdir(ref / name)), name
    given = json.loads((job / "image" / "summary.json").read_text())
    assert given["first_chunk"] > 0 and given["given"]["kind"] == "image", given
    assert json.loads((job / "dilated" / "summary.json").read_text())["dilated_every"] == 2
    for name in ("whole", "part", "rest"):
        # The VAE's frames (the mp4 encoder is lossy): the same single-device decode of the same latents, in a
        # process with 2 CPU devices against one with 4; seen to differ by one uint8 step in 1 of 221184 values.
        for chunk in sorted(os.listdir(ref / name / "frames")):
            got = np.load(job / name / "frames" / chunk).astype(np.int16)
            want = np.load(ref / name / "frames" / chunk).astype(np.int16)
            assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 1e-3, (name, chunk)
        for video in ("video_0.mp4", "video_1.mp4"):
            assert len(_frames(str(job / name / video))) == len(_frames(str(ref / name / video)))
    # the saved session continues as the uninterrupted run: chunk 0 + the resumed chunks 1, 2 == the 3-chunk run
    whole = load_latents(str(job / "whole"))
    resumed = np.concatenate([load_latents(str(job / "part")), load_latents(str(job / "rest"))], axis=1)
    np.testing.assert_array_equal(resumed, whole)
    assert sorted(os.listdir(job / "s")) == ["session.json", "shards-00000.safetensors", "shards-00001.safetensors"]
    got, want = _tensors(str(job / "s")), _tensors(str(ref / "s"))
    assert set(got) == set(want) and any(n.startswith("extras/") for n in got)  # the VAE decoder's caches too
    for n in want:  # the state bit for bit; the VAE decoder's caches as its frames (see above)
        if n.startswith("extras/"):
            np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-5, err_msg=n)
        else:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    # process 0's failed write: its files say so; the check failing in process 1 alone: nothing written
    failed = json.loads((job / "fail_write" / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["chunks_written"] == 0, failed
    assert not (job / "fail_check").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-processes", "2"], "--num-processes / --process-id / --heartbeat-timeout need --coordinator"),
        (["--process-id", "0"], "--num-processes / --process-id / --heartbeat-timeout need --coordinator"),
        (["--heartbeat-timeout", "5"], "--num-processes / --process-id / --heartbeat-timeout need --coordinator"),
        (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"], "needs --mesh"),
        (["--mesh", "data=1", "--coordinator", "localhost:1234", "--process-id", "0"], "needs --num-processes N"),
        (
            ["--mesh", "data=1", "--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2 must be below --num-processes 2",
        ),
    ],
)
def test_incomplete_job_flags_are_refused_before_joining(argv, message, tmp_path, capsys):
    """Each names the problem (exit 2), before jax.distributed is initialised and before --out exists."""
    from jaxkv.generate import loop

    out = tmp_path / "out"
    assert loop.main(["--random-weights", "--num-chunks", "1", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_join_hands_the_flags_to_jax_distributed(monkeypatch):
    """`processes.join` passes --coordinator, --num-processes, --process-id and --heartbeat-timeout (JAX's own
    default when not given) to ``jax.distributed.initialize``; ``auto`` lets JAX find the coordinator."""
    import jax

    from jaxkv.generate import processes as PJ

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    job = dict(mesh="data=2", coordinator="localhost:1234", num_processes=2, process_id=1)
    PJ.join(job)
    PJ.join({**job, "heartbeat_timeout": 7})
    PJ.join(dict(mesh="data=2", coordinator="auto", heartbeat_timeout=9))
    assert calls == [
        dict(coordinator_address="localhost:1234", num_processes=2, process_id=1),
        dict(coordinator_address="localhost:1234", num_processes=2, process_id=1, heartbeat_timeout_seconds=7),
        dict(coordinator_address=None, num_processes=None, process_id=None, heartbeat_timeout_seconds=9),
    ]


def _two_processes(monkeypatch, others):
    """This process as process 0 of two, the other's part of each exchange from ``others(value, error, step)``;
    returns the list of (step, value, error) this process exchanged."""
    from jaxkv.generate import processes as PJ

    calls = []

    def exchange(value, error, step):
        calls.append((step, value, error))
        if error is not None:
            raise error
        return [value, others(value, error, step)]

    PJ.join({})  # a fresh run's record of meeting points
    monkeypatch.setattr(PJ, "multi", lambda: True)
    monkeypatch.setattr(PJ, "lead", lambda: True)
    monkeypatch.setattr(PJ, "exchange", exchange)
    return calls


@pytest.mark.parametrize("other_heard", [None, signal.SIGTERM])
def test_a_stop_signal_heard_by_any_process_stops_every_one_at_the_same_chunk(monkeypatch, other_heard):
    from jaxkv.generate import loop
    from jaxkv.generate import processes as PJ

    calls = _two_processes(monkeypatch, lambda value, error, step: other_heard)
    stop, files = loop.Stop(), PJ.Quiet()
    stop.heard = None  # as `defer_signals` sets it: this process heard nothing
    PJ.agree_chunk(files, 0, np.zeros(2), stop)
    assert files.chunks == 1 and calls == [("writing chunk 0", None, None)]
    assert stop.signum == other_heard


def test_a_failure_before_the_loop_meets_the_others_at_the_next_point(monkeypatch):
    """A process that left the run meets the others at the first point it had not passed, with its error; after
    a meeting where every process raised, it meets nobody (they have stopped)."""
    from jaxkv.generate import processes as PJ
    from jaxkv.parallel.processes import ProcessFailed

    calls = _two_processes(monkeypatch, lambda value, error, step: None)
    with PJ.together("checking the settings"):
        pass
    error = ValueError("no such file")
    PJ.join_after_failure(error)
    assert calls == [("checking the settings", None, None), ("loading the inputs", None, error)]

    def fail(value, error, step):
        raise ProcessFailed(f"{step} failed in process 1 of 2: OSError: disk full")

    calls = _two_processes(monkeypatch, fail)
    with pytest.raises(ProcessFailed, match="opening the outputs failed in process 1"):
        with PJ.together("opening the outputs"):
            pass
    PJ.join_after_failure(RuntimeError("later"))
    assert [c[0] for c in calls] == ["opening the outputs"]


@pytest.mark.slow
def test_a_process_killed_outright_ends_the_job_within_its_heartbeat_timeout(tmp_path):
    """Two ``jaxkv generate`` processes (``--heartbeat-timeout 5``); process 1 killed (SIGKILL) once process 0 has
    written a few chunks: process 0 ends well before JAX's default 100 s (measured here: 4 s, and 73 s without the
    flag) and its summary says "failed" with the chunks it wrote."""
    import subprocess
    import sys
    import time

    from tests.helpers.processes import _free_port

    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    code = "import sys; from jaxkv.cli import main; sys.exit(main())"
    argv = ["generate", "--random-weights", "--mesh", "data=2,model=2", "--batch", "2", "--height", "8", "--width"]
    argv += ["8", "--no-progress", "--no-video", "--num-chunks", "100000", "--heartbeat-timeout", "5"]
    argv += ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv, "--out", str(tmp_path / f"out{i}"), "--process-id", str(i)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for i in range(2)
    ]
    try:
        latents = tmp_path / "out0" / "latents"
        deadline = time.monotonic() + 300
        while not (latents.exists() and len(list(latents.glob("chunk_*.npy"))) >= 3):
            assert time.monotonic() < deadline and procs[0].poll() is None, "the job did not start"
            time.sleep(0.5)
        procs[1].kill()
        killed = time.monotonic()
        rc = procs[0].wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert rc != 0 and waited < 60
    summary = json.loads((tmp_path / "out0" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["chunks_written"] >= 3
