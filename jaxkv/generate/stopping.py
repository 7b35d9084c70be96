"""Stop signals of ``jaxkv generate``: the first SIGINT, SIGTERM or SIGHUP lets the run finish its chunk and return
(`Stop`, installed by `stop_on_signals`); a second kills at once, or abandons a ``--save-state`` save cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from jaxkv import files as jfiles

STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Stop:
    """Set by a stop signal (`stop_on_signals`): the loop finishes the current chunk and returns. A second signal
    restores the default action and re-raises it (kills the process at once; the files stay readable), except
    while the final ``--save-state`` is written (`saving_session`): there it raises `jaxkv.files.Terminated` (or
    KeyboardInterrupt), so the save is abandoned and its temporary directory removed, never left half written."""

    def __init__(self):
        self.signum: int | None = None
        self.saving = False
        self.aborted_save = False  # a second signal abandoned the --save-state save

    def handler(self, signum, frame) -> None:
        if self.signum is not None:
            if self.saving:
                self.aborted_save = True
                jfiles.raise_stop(signum)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        what = "finishing the session save" if self.saving else "stopping after the current chunk"
        print(
            f"\njaxkv generate: {signal.Signals(signum).name}: {what} (send it again to abort "
            f"{'the save' if self.saving else 'at once'})",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def saving_session(self):
        """While the block writes the session, a second stop signal aborts it cleanly instead of killing."""
        self.saving = True
        try:
            with jfiles.keeping_lost_signals():
                yield
        finally:
            self.saving = False


@contextlib.contextmanager
def stop_on_signals():
    """Installs `Stop` for SIGINT, SIGTERM and SIGHUP while the block runs (main thread only; elsewhere the
    returned Stop is never set)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handler) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
