"""`jaxkv generate` under faults from outside: another run on the same ``--out`` (a live output is locked and never
replaced), the output directory moved or replaced under a run, a full disk or file-size limit, a second signal
during the final ``--save-state``, and sizes that cannot fit. Every test here failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxkv import files
from jaxkv import generate as G
from jaxkv.generate import outputs
from jaxkv.generate.options import UsageError

RANDOM = ["--preset", "tiny", "--random-weights"]
FAST = ["--no-progress", "--no-video", *RANDOM]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def _generate(args, *, file_size_limit=None):
    """A ``jaxkv generate`` child process with the shell's signal dispositions (SIGINT raises, as in a terminal),
    optionally under a file-size limit in bytes (``ulimit -f``; set in the child, not by forking this process)."""
    code = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    if file_size_limit is not None:
        code += f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
    code += "from jaxkv.generate.loop import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
    )


def _wait_for(predicate, proc, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _chunks_written(out) -> int:
    try:
        return json.loads((out / "manifest.json").read_text())["chunks"]
    except (OSError, ValueError, KeyError):
        return 0


# ------------------------------------------------------------------------------------------------ live outputs


@pytest.mark.slow
def test_a_live_output_is_never_replaced_even_with_overwrite(tmp_path, capsys):
    """A second run on the --out a first run is writing is refused (with and without --overwrite) before touching
    anything; the first run goes on undisturbed and its output holds only its own chunks."""
    out = tmp_path / "live"
    first = _generate(["--out", str(out), "--num-chunks", "100000", "--seed", "0", *FAST])
    try:
        _wait_for(lambda: _chunks_written(out) >= 2, first, "the first run wrote two chunks")
        for extra in (["--overwrite"], []):
            assert G.main(["--out", str(out), "--num-chunks", "2", "--seed", "1", *extra, *FAST]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1, err
            assert f"{out} is being written by a running process (pid {first.pid})" in err, err
        with pytest.raises(UsageError, match="is being written by a running process"):
            outputs.prepare_output_dir(str(out), overwrite=True, create=True)
        assert first.poll() is None, "the first run must still be running"
        written = _chunks_written(out)
    finally:
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["chunks"] >= written
    latents = G.load_latents(str(out))
    assert latents.shape[1] == manifest["chunks"] * manifest["chunk_shape"][1]
    # the finished run's output carries no lock (its lock file is gone) and is now an ordinary previous output
    assert files.live_writer(str(out)) is None and not (out / files.LOCK).exists()
    assert outputs.prepare_output_dir(str(out), overwrite=True, create=True) == str(out)


def test_the_lock_of_a_killed_writer_is_not_live(tmp_path):
    """A lock file that no process holds (its writer was SIGKILLed) does not block the next run."""
    out = tmp_path / "o"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from jaxkv import files; files.DirectoryLock.acquire(sys.argv[1]); "
         "print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert files.live_writer(str(out)) == f"a running process (pid {holder.pid})"
        with pytest.raises(files.LockedError, match=f"pid {holder.pid}"):
            files.DirectoryLock.acquire(str(out))
        with pytest.raises(UsageError, match=f"is being written by a running process \\(pid {holder.pid}\\)"):
            outputs.prepare_output_dir(str(out), overwrite=False, create=False)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (out / files.LOCK).exists() and files.live_writer(str(out)) is None
    with files.DirectoryLock.acquire(str(out)) as lock:
        lock.check()
    assert not (out / files.LOCK).exists()


@pytest.mark.parametrize("how", ["moved", "replaced"])
def test_a_run_whose_output_vanishes_fails_loudly(tmp_path, capsys, monkeypatch, how):
    """The output directory moved away (or replaced by another) between two chunks: the run stops with exit 1
    naming it, and writes nothing into whatever now stands at --out."""
    out, aside = tmp_path / "o", tmp_path / "elsewhere"
    real = outputs.LatentsSink.write_chunk

    def write_then_lose(self, index, latents):
        real(self, index, latents)
        if index == 0:
            os.rename(out, aside)
            if how == "replaced":
                out.mkdir()

    monkeypatch.setattr(outputs.LatentsSink, "write_chunk", write_then_lose)
    assert G.main(["--out", str(out), "--num-chunks", "3", *FAST]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    word = "vanished" if how == "moved" else "was replaced by another directory"
    assert err.startswith("jaxkv generate: error: ") and f"{out} {word}" in err, err
    assert "complete" not in captured.out
    if how == "replaced":
        assert os.listdir(out) == []  # the stranger's directory is left alone
    assert json.loads((aside / "manifest.json").read_text())["status"] == "running"
    assert sorted(os.listdir(aside / "latents")) == ["chunk_000000.npy"]


# ------------------------------------------------------------------------------------------------ full disks


def test_a_file_size_limit_fails_the_run_naming_the_file(tmp_path):
    """``ulimit -f``: the chunk write fails with EFBIG; exit 1, one error line naming the file and the cause, the
    manifest marked failed with that reason, the summary written, no temporary left."""
    out = tmp_path / "d"
    # tiny chunks at 8x8 are 12 KiB: over the limit, while the manifest and the summary fit
    proc = _generate(
        ["--out", str(out), "--num-chunks", "3", "--height", "8", "--width", "8", *FAST],
        file_size_limit=8000,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    chunk = out / "latents" / "chunk_000000.npy"
    expected = f"jaxkv generate: error: writing {chunk} failed: File too large (disk full or file-size limit)"
    assert stderr.strip() == expected, stderr
    assert "(failed)" in stdout and "Traceback" not in stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["chunks"] == 0
    assert manifest["reason"] == expected.removeprefix("jaxkv generate: error: ")
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    assert [p for p in out.rglob("*") if p.name.endswith(".tmp")] == []


class _Sink:
    def __init__(self, name, error=None):
        self.names, self.error, self.closed = (name,), error, False

    def write_chunk(self, index, latents):
        pass

    def close(self):
        self.closed = True
        if self.error:
            raise self.error
        return {self.names[0]: "closed"}


def test_closing_closes_every_sink_and_marks_the_manifest_failed(tmp_path):
    """One sink failing to finish its file (ENOSPC) neither stops the others from closing nor leaves the manifest at
    "running"; temporaries are removed and the first error is raised."""
    import errno

    out = tmp_path / "o"
    out.mkdir()
    failing = _Sink("video.mp4", OSError(errno.ENOSPC, "No space left on device"))
    other = _Sink("preview.png")
    shape = (1, 3, 4, 4, 16)
    dir_ = outputs.OutputDir(str(out), [failing, other], chunk_shape=shape, latents_format="npy")
    (out / "preview.png.tmp").write_bytes(b"half")
    with pytest.raises(OSError, match="No space left on device"):
        dir_.close("complete", {})
    assert failing.closed and other.closed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "No space left on device" in manifest["reason"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["preview.png"] == "closed"
    assert not (out / "preview.png.tmp").exists()


# ------------------------------------------------------------------------------------------------ signals

# A first SIGTERM while chunk 1 is computed, a second one while the session's tensor file is being written (its
# temporary directory exists then): the shell's "stop, then stop now".
_TWO_SIGNALS = """
import os, signal, sys
import safetensors.numpy
from jaxkv.generate import loop
signal.signal(signal.SIGINT, signal.default_int_handler)
signum = getattr(signal, sys.argv[1])
real_finite, real_save, calls = loop._chunk_finite, safetensors.numpy.save_file, []

def finite(x):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signum)
    return real_finite(x)

def save_file(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"half a tensor file")
    os.kill(os.getpid(), signum)
    for _ in range(10000):  # the handler runs here, mid-write
        pass
    return real_save(tensors, path, metadata=metadata)

loop._chunk_finite = finite
safetensors.numpy.save_file = save_file
sys.exit(loop.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signame", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_a_second_signal_during_the_final_save_aborts_it_cleanly(tmp_path, signame):
    """The session save is abandoned: no directory under --save-state, no temporary beside it, the output finished
    as interrupted with its chunks readable, one line, exit 128 + signal."""
    out, state = tmp_path / "o", tmp_path / "S"
    args = ["--out", str(out), "--save-state", str(state), "--num-chunks", "6", *FAST]
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_SIGNALS, signame, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=str(tmp_path),
    )
    signum = getattr(signal, signame)
    assert proc.returncode == 128 + signum, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"jaxkv generate: interrupted by {signame} twice: the session was not saved to {state} (the chunks written "
        f"are kept)"
    ), proc.stderr
    assert not state.exists() and [n for n in os.listdir(tmp_path) if n.startswith(".S.")] == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and "the session was not saved" in manifest["reason"]
    assert G.load_latents(str(out)).shape[1] == manifest["chunks"] * manifest["chunk_shape"][1] > 0


# ------------------------------------------------------------------------------------------------ sizes


def test_the_memory_estimate_matches_the_arrays_a_stream_allocates():
    """params and kv_cache against the arrays themselves (tiny model: cheap to allocate)."""
    import jax

    from jaxkv import rollout as R
    from jaxkv.generate import memory
    from jaxkv.models.wan import init_params
    from jaxkv.models.wan.config import PRESETS
    from jaxkv.schedule import Schedule

    config = PRESETS["tiny"]
    for guidance in (None, 3.0):
        rc = R.RolloutConfig(4, 6, chunk_frames=2, window_frames=6, sink_frames=2, schedule=Schedule(steps=(1000, 500)),
                             guidance_scale=guidance)  # fmt: skip
        need = memory.estimate(config, rc, batch=3)
        sessions = 6 if guidance else 3
        cache = R.empty_cache(config, rc, sessions)
        assert need["kv_cache"] == sum(x.nbytes for x in jax.tree.leaves(cache)) >= cache.nbytes
        params = init_params(config, jax.random.key(0))
        assert need["params"] == sum(x.nbytes for x in jax.tree.leaves(params))
        tokens = 2 * rc.tokens_per_frame(config)
        assert need["activations"] == sessions * tokens * config.ffn_dim * 4
        assert need["text_kv"] == 2 * config.num_layers * sessions * config.text_len * config.dim * 4


def test_a_run_that_cannot_fit_in_memory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """With too little memory for its arrays the run stops before loading or compiling anything, with the figures.
    (The memory is made small here: a real oversized run is never started by a test.)"""
    from jaxkv.generate import memory

    monkeypatch.setattr(memory, "available", lambda: (2**20, "available host memory"))
    monkeypatch.setattr(G.loop.inputs, "load_params", lambda *a, **k: pytest.fail("params loaded"))
    out = tmp_path / "o"
    assert G.main(["--out", str(out), "--num-chunks", "2", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxkv generate: error: --height ") and len(err.splitlines()) == 1, err
    assert (
        "needs at least" in err and "params" in err and "kv cache" in err and "available host memory is 1.0 MiB" in err
    )
    assert not out.exists()


def test_an_impossible_frame_size_is_refused_by_the_estimate_alone():
    """The estimate of a Wan 1.3B stream at a 100000 x 104 latent frame (shapes only, nothing allocated) exceeds any
    host, and `check` refuses it naming the settings."""
    from jaxkv import rollout as R
    from jaxkv.generate import memory
    from jaxkv.models.wan.config import PRESETS
    from jaxkv.schedule import Schedule

    rc = R.RolloutConfig(100000, 104, chunk_frames=3, window_frames=21, sink_frames=3, schedule=Schedule(steps=(1000,)))
    need = memory.estimate(PRESETS["wan2.1-t2v-1.3b"], rc, batch=1)
    assert need["kv_cache"] > 2**40  # 30 layers x 2 x 24 frames x 2.6 M tokens x 1536 x 4 bytes: 21 TiB
    with pytest.raises(ValueError, match=r"--height 100000 needs at least .* TiB|--height 100000 needs at least"):
        memory.check(PRESETS["wan2.1-t2v-1.3b"], rc, 1, "--height 100000")


def test_a_checkpoint_with_an_impossible_text_len_is_refused_at_load(tmp_path, capsys):
    import jax

    from jaxkv.models.wan import checkpoint, init_params
    from jaxkv.models.wan.config import PRESETS

    ck = tmp_path / "ck"
    checkpoint.save(str(ck), PRESETS["tiny"], init_params(PRESETS["tiny"], jax.random.key(0)))
    data = json.loads((ck / "config.json").read_text())
    data["text_len"] = 100_000_000_000
    (ck / "config.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="text_len must be at most 65536"):
        checkpoint.load(str(ck))
    assert G.main(["--checkpoint", str(ck), "--out", str(tmp_path / "o"), "--no-progress", "--no-video"]) == 2
    err = capsys.readouterr().err
    assert "text_len must be at most 65536" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
