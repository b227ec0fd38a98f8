"""One writer per directory: an exclusive lock on a file in it, taken before anything else is written there.

The lock is fcntl.flock on the file, which the kernel releases when the holding process ends, however it
ends (kill -9 included): a lock left by a dead process never blocks the next one, so there is no stale lock
to detect or break. The file also holds the holder's pid, host and start time, for the message of a process
that finds the lock taken; it is emptied on release, and whatever a killed holder left in it is overwritten
by the next holder. Network filesystems: docs/JOBS.md ("One run per directory").
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path


class LockHeld(RuntimeError):
    """The lock is held by another process; the message names it (pid, host, start time)."""


class DirectoryLock:
    """The lock file `path`: acquire() takes it without waiting (LockHeld if another process holds it, OSError
    if the filesystem cannot lock), release() gives it back."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(holder_of(self.path)) from None
        except OSError:     # a filesystem that cannot lock (ENOLCK): the caller says so
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def holder_of(path: Path) -> str:
    """'pid <pid> on <host>, started <UTC time>' from the lock file, or what is known when it says nothing
    (its holder has only just taken it)."""
    try:
        holder = json.loads(path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["started"]))
        return f"pid {holder['pid']} on {holder['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its pid"
