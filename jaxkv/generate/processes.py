"""``jaxkv generate --mesh`` as one process of a multi-process JAX job.

Every process runs the same command with its own ``--process-id`` (or ``--coordinator auto`` where the cluster
tells JAX who is who: SLURM, Open MPI, Kubernetes, Cloud TPU; `jax.distributed.initialize` with no arguments).
`join` initialises ``jax.distributed`` before anything touches a device; the ``--mesh`` then spans every process's
devices. Each process computes its shards of every chunk; the chunk's latents (small: batch x channels x frames x
height x width) are gathered to every process (`fetch`), so that every process sees the same values and takes the
same decisions (a NaN chunk stops all of them at the same chunk) without another message. Process 0 alone writes
the outputs (latents, preview, mp4, summary.json); the others write nothing but, with ``--save-state``, their own
session shard file (`jaxkv.parallel.checkpoint`); ``--resume`` is read by every process.

Failures: the processes meet at a few points (`together`, `agree_chunk`: an exchange of every process's status,
`jaxkv.parallel.processes.exchange`): after the checks (``_mesh``), after process 0 opened the outputs, after it
started the video decoder, after each chunk is written, and when the files are closed. An exception in one process
between two points is carried to the next point (`join_after_failure` from ``main`` when it left the run), where
every process raises (that one its own error, the others `ProcessFailed` naming it), so none hangs and process 0's
files say "failed". A stop signal is acted on only where every process agrees on it (`defer_signals`): at the next
chunk every process stops alike. A process killed outright leaves the others blocked in a collective until JAX's
coordination service notices (its heartbeat timeout: 100 s by default, ``--heartbeat-timeout``) and ends them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxkv import session_format as SF
from jaxkv.generate.options import UsageError
from jaxkv.parallel.processes import ProcessFailed, exchange

AUTO = "auto"  # --coordinator auto: jax.distributed.initialize() detects the cluster


class _Job:
    """Which meeting points this process has passed (`together`), and whether a meeting already made every process
    raise (``over``), for `join_after_failure`."""

    def __init__(self):
        self.passed: set[str] = set()
        self.over = False


_job = _Job()
# The meeting points every process reaches in this order (`together`); a process that failed before one of them
# joins the first it had not passed (`join_after_failure`).
STEPS = ("checking the settings", "loading the inputs", "opening the outputs", "starting the video decoder")


def multi() -> bool:
    return jax.process_count() > 1


def lead() -> bool:
    """Whether this process writes the outputs (process 0; the only one without a multi-process job)."""
    return jax.process_index() == 0


def join(flags: Mapping[str, Any]) -> None:
    """Joins the multi-process job ``--coordinator`` names (``jax.distributed.initialize``); nothing without it (a
    run in a job joined before goes on in it). Called by ``main`` first, before anything touches a device.
    UsageError for an incomplete or inconsistent set of flags."""
    _job.passed.clear()  # a new run (in a job joined by an earlier run of this process too)
    _job.over = False
    coordinator, count, index = (flags.get(k) for k in ("coordinator", "num_processes", "process_id"))
    heartbeat = flags.get("heartbeat_timeout")
    if coordinator is None:
        if count is not None or index is not None or heartbeat is not None:
            raise UsageError(
                "--num-processes / --process-id / --heartbeat-timeout need --coordinator HOST:PORT (or "
                "--coordinator auto)"
            )
        return
    if flags.get("mesh") is None:
        raise UsageError(
            "--coordinator: a multi-process job needs --mesh (its devices are every process's; without a mesh each "
            "process would generate the whole video alone)"
        )
    if coordinator != AUTO:
        if count is None or index is None:
            raise UsageError(
                "--coordinator HOST:PORT needs --num-processes N and --process-id I (every process runs the same "
                "command with its own --process-id)"
            )
        if index >= count:
            raise UsageError(f"--process-id {index} must be below --num-processes {count}")
    try:
        jax.distributed.initialize(
            coordinator_address=None if coordinator == AUTO else coordinator,
            num_processes=count,
            process_id=index,
            **({} if heartbeat is None else {"heartbeat_timeout_seconds": heartbeat}),
        )
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--coordinator {coordinator}: joining the job failed: {e}") from None


@contextlib.contextmanager
def together(step: str):
    """Runs the block, then meets every process (a multi-process job; a plain block otherwise): when the block raised
    in any process, every process raises (that one its own exception, the others `ProcessFailed`)."""
    if not multi():
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every process must hear of it before any raises
        error = e
    _job.passed.add(step)
    _meet(None, error, step)


def meet(step: str) -> None:
    """Every process of a multi-process job reaches this point (`together` of nothing)."""
    with together(step):
        pass


def _meet(value, error, step: str) -> list:
    try:
        return exchange(value, error, step)
    except BaseException:
        _job.over = True  # every process raises here: nobody waits for anybody after this
        raise


def join_after_failure(error: BaseException) -> None:
    """Called by ``main`` when this process left the run with ``error`` before the loop: meets the others at the
    first point (`STEPS`) it had not passed, so they raise `ProcessFailed` instead of waiting for it. Nothing
    without a multi-process job, or once every point is passed (later failures meet them in the loop)."""
    if not multi() or _job.over or isinstance(error, ProcessFailed):
        return
    step = next((s for s in STEPS if s not in _job.passed), None)
    if step is None:
        return
    _job.passed.add(step)
    with contextlib.suppress(BaseException):
        exchange(None, error, step)


def fetch(x: jax.Array, finite: jax.Array) -> tuple[np.ndarray, bool]:
    """A chunk's latents and its finiteness on the host: the whole chunk in every process (gathered across a
    multi-process mesh; every process then decides alike)."""
    if not multi():
        return jax.device_get((x, finite))
    from jax.experimental import multihost_utils

    x, finite = multihost_utils.process_allgather((x, finite), tiled=True)
    return np.asarray(x), bool(finite)


def defer_signals(stop) -> None:
    """In a multi-process job, a stop signal is only noted (``stop.signum`` stays unset) until `agree_chunk` sets it
    in every process at the same chunk; a second signal before that kills the process at once, one after it acts as
    ``stop.handler`` (aborting a session save)."""
    if not multi():
        return
    stop.heard = None

    def handler(signum, frame):
        if stop.signum is not None:
            stop.handler(signum, frame)
        elif stop.heard is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        else:
            stop.heard = signum
            print(
                f"\njaxkv generate: {signal.Signals(signum).name}: every process stops after the next chunk (send it "
                f"again to abort this process at once)",
                file=sys.stderr,
                flush=True,
            )

    for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if s is not None and signal.getsignal(s) == stop.handler:
            signal.signal(s, handler)


def agree_chunk(files, index: int, latents: np.ndarray, stop) -> None:
    """Writes chunk ``index`` to ``files`` (process 0's `OutputDir`, the others' `Quiet`), then every process meets:
    a failed write raises in every process, and a stop signal heard by any process stops every one
    (``stop.signum``)."""
    if not multi():
        files.write_chunk(index, latents)
        return
    error = None
    try:
        files.write_chunk(index, latents)
    except Exception as e:  # noqa: BLE001 - every process must hear of it before any raises
        error = e
    heard = _meet(getattr(stop, "heard", None), error, f"writing chunk {index}")
    signums = [h for h in heard if h is not None]
    if signums and stop.signum is None:
        stop.signum = signums[0]


class Quiet:
    """The outputs of a process other than 0: counts the chunks, writes nothing (`jaxkv.generate.outputs.OutputDir`'s
    interface as the loop uses it)."""

    def __init__(self):
        self.chunks = 0

    def write_chunk(self, index: int, latents: np.ndarray) -> None:
        self.chunks += 1

    def close(self, status: str, summary: dict, reason: str | None = None, *, strict: bool = True) -> dict:
        summary.update(status=status, chunks_written=self.chunks, written_by="process 0")
        if reason is not None:
            summary["reason"] = reason
        return summary

    def write_summary(self, summary: dict) -> None:
        pass

    def release(self) -> None:
        pass


def from_lead(extras: dict) -> dict:
    """Process 0's ``extras`` (nested dicts of arrays, as a session's: the VAE decoder's caches, which only process 0
    keeps) in every process of a multi-process job, so that every process saves the same (`jaxkv.parallel.checkpoint`
    checks it); ``extras`` itself otherwise. A collective: every process calls it (the others' ``extras`` unused)."""
    if not multi():
        return extras
    from jax.experimental import multihost_utils

    flat = {n: np.asarray(a) for n, a in SF._flat_extras(extras).items()} if lead() else {}
    layout = exchange([[n, list(a.shape), a.dtype.str] for n, a in flat.items()], None, "sharing process 0's extras")
    out = {}
    for name, shape, dtype in layout[0]:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.ascontiguousarray(flat[name]).view(np.uint8).reshape(-1) if lead() else np.zeros(size, np.uint8)
        got = np.asarray(multihost_utils.broadcast_one_to_all(raw))  # bytes: exact for any dtype
        out[name] = got.view(np.dtype(dtype)).reshape(shape)
    return SF.nest_extras(out)
