"""Stopping a run cleanly: SIGTERM (how TPU preemption and job schedulers stop a job) and the first
Ctrl-C ask the loop to finish its step, checkpoint and exit 0; a second Ctrl-C stops at once.
"""
from __future__ import annotations

import signal
import sys
import threading


class StopSignals:
    """Context manager: while active, SIGTERM and SIGINT set `requested` (and `reason`) instead
    of killing the process; the loop polls it once per step. Handlers are restored on exit.
    Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.requested = False
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt            # second Ctrl-C: stop now
        self.requested = True
        self.reason = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if signum == signal.SIGINT:
            print("\nCtrl-C: finishing this step and writing a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
