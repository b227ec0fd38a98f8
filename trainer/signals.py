"""Graceful stop on SIGTERM/SIGINT (preemption, scancel, Ctrl-C): the loop finishes the current step, writes
a checkpoint and exits cleanly. A second signal kills the process at once."""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager; `requested` turns true on the first SIGTERM/SIGINT. Previous handlers come back
    on exit. Outside the main thread (where Python cannot install handlers) it never triggers."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGINT will not stop training gracefully")
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        # The operating system's default action makes a second signal end the process immediately, even
        # while the main thread is blocked in native code.
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_DFL)
        log.warning("%s received: finishing the current step, then writing a checkpoint and exiting "
                    "(send it again to exit immediately without saving)", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # None: the previous handler was not installed from Python (signal.signal cannot take it back).
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
