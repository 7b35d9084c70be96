"""Runs a test script as the processes of one ``jax.distributed`` job on localhost (tests/parallel_multihost.py,
tests/multiprocess_session.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(script: str, count: int, *args: str, timeout: int = 1200) -> list[str]:
    """Runs ``python tests/SCRIPT PROCESS_ID COUNT PORT *ARGS`` as ``count`` processes of one job; asserts each exits
    0 printing ``OK PROCESS_ID``; returns their outputs."""
    port = str(_free_port())
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), str(i), str(count), port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(count)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {i}" in out, f"process {i}:\n{out}"
    return outs
