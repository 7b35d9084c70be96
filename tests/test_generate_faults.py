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


def _generate(args, **kw):
    """A ``jaxkv generate`` child process with the shell's signal dispositions (SIGINT raises, as in a terminal)."""
    code = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    code += "from jaxkv.generate.loop import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), **kw
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
