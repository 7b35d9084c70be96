"""SIGINT / SIGTERM stop `jaxkv generate` after the current chunk: the files are finished (manifest and summary say
"interrupted", the preview is written), what was written is printed, the exit code is 130 / 143, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxkv import generate as G
from jaxkv.generate import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_interrupted(out, name, printed):
    manifest = json.loads((out / "manifest.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert manifest["status"] == summary["status"] == "interrupted"
    assert name in manifest["reason"] and summary["signal"] == name
    chunks = manifest["chunks"]
    assert chunks >= 1 and summary["chunks_written"] == chunks
    latents = G.load_latents(str(out))
    assert latents.shape[1] == 3 * chunks
    assert (out / "preview.png").is_file()
    assert f"wrote        {chunks} chunk(s)" in printed
    return chunks


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_in_process_stops_after_the_current_chunk(tmp_path, capsys, monkeypatch, signum):
    """A real signal to this process while chunk 1 is being computed (main's handler is installed)."""
    real, calls = loop._chunk_finite, []

    def signal_on_second(x):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return real(x)

    monkeypatch.setattr(loop, "_chunk_finite", signal_on_second)
    out = tmp_path / "o"
    before = signal.getsignal(signum)
    code = G.main(["--out", str(out), "--num-chunks", "6", "--no-progress", "--preset", "tiny", "--random-weights"])
    captured = capsys.readouterr()
    assert code == 128 + signum
    name = signal.Signals(signum).name
    assert f"{name}: stopping after the current chunk" in captured.err and "Traceback" not in captured.err
    assert _check_interrupted(out, name, captured.out) == 1
    # the handlers are restored afterwards
    assert signal.getsignal(signum) is before


def test_signal_before_the_first_chunk_writes_nothing(tmp_path):
    args = G.build_parser().parse_args(["--out", str(tmp_path / "o"), "--no-progress", "--random-weights"])
    stop = loop.Stop()
    stop.signum = signal.SIGTERM
    summary = G.run(args, stop)
    assert summary["status"] == "interrupted" and summary["chunks_written"] == 0
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_a_real_process(tmp_path, signum):
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxkv.generate",
            "--out",
            str(out),
            "--num-chunks",
            "100000",
            "--no-progress",
            "--preset",
            "tiny",
            "--random-weights",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads((out / "manifest.json").read_text())["chunks"] >= 2:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = stdout.decode(), stderr.decode()
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "interrupted by" in stderr
    chunks = _check_interrupted(out, signal.Signals(signum).name, stdout)
    assert chunks >= 2
