"""SIGTERM/SIGINT (preemption, scancel, Ctrl-C). While a job started by train.py starts (validation, building,
tokenizing), the first one stops the process at once, with one line: nothing of the start is worth finishing,
and no checkpoint is written then. Once it trains, the loop finishes the current step, writes a checkpoint and
exits. Either way the process exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell
reports a job ended by that signal. A second signal kills the process at once."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

import psutil

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    return 128 + signum


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
        self._previous = install(self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        # The operating system's default action makes a second signal end the process immediately, even
        # while the main thread is blocked in native code.
        install(signal.SIG_DFL)
        log.warning("%s received: finishing the current step, then writing a checkpoint and exiting "
                    "(send it again to exit immediately without saving)", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        restore(self._previous)
        self._previous = {}


def _stop_at_once(signum: int, frame) -> None:
    """One line, the process's children ended (tokenizing workers, a manager process, the W&B service), and
    exit: a job interrupted as it starts has nothing to finish, and unwinding from wherever the signal caught
    the main thread (a worker pool's bookkeeping, a lock held) can hang or print a traceback per process."""
    global _stopping
    _stopping = True            # workers a pool forks from now on are still ended with this process
    install(signal.SIG_DFL)     # a second signal ends the process at once, as during training
    log.error("%s received while the job was starting: stopped before its first step; its checkpoints are as "
              "they were", signal.Signals(signum).name)
    end_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_status(signum))


def end_children(grace_s: float = 3.0) -> None:
    """Terminate this process's descendants, killing those still alive after `grace_s` seconds."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def stopped_at_once_on_signals():
    """While open (train.py's job; the training loop's StopSignals takes over from its first step to its end
    summary), the first SIGTERM/SIGINT ends the process at once (_stop_at_once), with 128 + its number. Outside
    the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = install(_stop_at_once)
    try:
        yield
    finally:
        restore(previous)


def install(handler) -> dict[int, object]:
    """`handler` for both stop signals; returns the previous ones."""
    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        # None: the previous handler was not installed from Python (signal.signal cannot take it back).
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _default_actions_in_child() -> None:
    """In a process forked (without exec: a worker pool's) while a handler of this module is installed: the
    default actions, so that it ends quietly with the signal its process group gets instead of running the
    trainer's handler (which would stop it as the trainer, or make it ignore the pool's SIGTERM); and, on
    Linux, SIGTERM when the thread that forked it ends, so that no worker outlives the trainer (a pool forks
    replacements for workers that died, which nobody would then end, blocked on its task queue)."""
    try:
        handlers = [signal.getsignal(signum) for signum in STOP_SIGNALS]
        if not _stopping and not any(handler is _stop_at_once or isinstance(getattr(handler, "__self__", None),
                                                                            StopSignals) for handler in handlers):
            return
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != _forking_pid:     # the parent ended before the line above: nobody would end this one
                os._exit(exit_status(signal.SIGTERM))
    finally:
        _release_held_signals()


def _before_fork() -> None:
    """Note the forking process and hold the stop signals back across the fork: a child they reached before
    _default_actions_in_child reset its handlers would run the trainer's (a second "stopped" line per worker)."""
    global _forking_pid, _mask_before_fork
    _forking_pid = os.getpid()
    _mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _release_held_signals() -> None:
    """After a fork, in the parent and (its handlers reset first) in the child: a stop signal _before_fork held
    back takes its action now."""
    signal.pthread_sigmask(signal.SIG_SETMASK, _mask_before_fork)


# prctl(2): the signal a process gets when the thread that forked it ends.
PR_SET_PDEATHSIG = 1
_forking_pid = os.getpid()
_mask_before_fork: set[signal.Signals] = set()
_stopping = False
os.register_at_fork(before=_before_fork, after_in_parent=_release_held_signals,
                    after_in_child=_default_actions_in_child)
