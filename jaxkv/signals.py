"""Stop signals as exceptions, so that a long write can clean up and exit with one line.

* `signals_as_exceptions()`: SIGTERM / SIGHUP raise `Terminated` (like SIGINT raises KeyboardInterrupt), so
  ``finally`` blocks run and a command can exit 143 / 129 with one line instead of leaving debris.
* A stop whose exception Python dropped (raised inside a finaliser or a gc callback) is kept and raised again by
  `check_signals` at the next safe point (`keeping_lost_signals`, `raise_stop`).
* `_deferred_signals()`: holds stop signals across a cleanup or a rename pair that must not stop half way
  (`jaxkv.files.atomic_directory`).

`jaxkv.files` re-exports these names (callers read them as ``jaxkv.files.X``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterable, Iterator


class Terminated(BaseException):
    """SIGTERM / SIGHUP turned into an exception (a BaseException, like KeyboardInterrupt, so ``except Exception``
    does not swallow it). ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


_TERMINATING = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)


# Stop signals whose exception our handlers raised inside the current `signals_as_exceptions` block. Python cannot
# raise out of a finaliser or a garbage-collection callback (JAX runs one on every collection): an exception raised
# there is printed as "Exception ignored in ..." and dropped, and the program carries on. A signal stays recorded
# here, so `check_signals` raises it again at the next safe point (every streamed tensor, before an atomic
# directory is renamed into place), and the hook below keeps the dropped one from printing a traceback.
_pending: list[int] = []


def _stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_stop(signum: int) -> None:
    """Raises stop signal ``signum``'s exception (`Terminated`, or KeyboardInterrupt for SIGINT) from a signal
    handler, recorded so that `check_signals` raises it again should Python drop it (used inside
    `keeping_lost_signals`, which `signals_as_exceptions` includes)."""
    _pending.append(signum)
    raise _stop_exception(signum)


def _raise_terminated(signum, frame):
    raise_stop(signum)


def check_signals() -> None:
    """Raises the stop signal (`Terminated`, or KeyboardInterrupt for SIGINT) that arrived in this
    `signals_as_exceptions` block but whose exception was lost (raised inside a finaliser or a gc callback);
    returns otherwise. Long writes call it at every step."""
    if _pending:
        raise _stop_exception(_pending[0])


def _quiet_lost_stops(previous_hook):
    def hook(unraisable) -> None:
        if _pending and isinstance(unraisable.exc_value, (Terminated, KeyboardInterrupt)):
            return  # recorded in _pending: `check_signals` raises it where it can propagate
        previous_hook(unraisable)

    return hook


@contextlib.contextmanager
def keeping_lost_signals() -> Iterator[None]:
    """Within the block, a stop signal raised by `raise_stop` that Python drops (in a finaliser or a gc callback)
    prints nothing and is raised again by `check_signals`; on exit the record is cleared."""
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_lost_stops(hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        _pending.clear()


@contextlib.contextmanager
def signals_as_exceptions(signals: Iterable[int] = _TERMINATING) -> Iterator[None]:
    """Within the block, SIGTERM / SIGHUP raise `Terminated` in the main thread instead of killing the process, and
    SIGINT raises KeyboardInterrupt as usual, but reliably: a signal whose exception Python dropped (it landed
    in a finaliser or a garbage-collection callback) is raised again by the next `check_signals`, without a
    traceback.

    Only signals still at their default disposition (SIGINT: Python's default handler) are taken over (a handler
    the program installed itself, or an ignored signal, is left alone), and the previous handlers come back on
    exit. Outside the main thread (where Python cannot install handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in signals:
        if signal.getsignal(s) is signal.SIG_DFL:
            previous[s] = signal.signal(s, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_terminated)
    try:
        with keeping_lost_signals() if previous else contextlib.nullcontext():
            yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _deferred_signals() -> Iterator[None]:
    """Holds SIGINT / SIGTERM / SIGHUP (when at their default or our handler) until the block is done, so a second
    Ctrl-C cannot stop a cleanup or a rename pair half way; a signal that came is raised at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for s in (signal.SIGINT, *_TERMINATING):
        current = signal.getsignal(s)
        if current in (signal.SIG_DFL, signal.default_int_handler, _raise_terminated):
            previous[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if pending:
        s = pending[0]
        if s == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(s)
