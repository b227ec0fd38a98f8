"""Writing a directory so that a crash at any moment leaves either the old one or the complete new one:
written in a temporary sibling, every file flushed to disk, then renamed into place."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

# Temporary siblings start with this, so a later save can find and remove the leftovers of a killed one.
TEMP_PREFIX = ".tmp-"


def disk_is_full(error: BaseException | None) -> bool:
    """Whether `error` is a write refused for want of room: the disk full, or the user's quota."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def fsync_path(path: Path) -> None:
    """Flush one file, or one directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory`, and `directory` itself, to disk."""
    for path in sorted(directory.rglob("*"), reverse=True) + [directory]:
        fsync_path(path)


@contextlib.contextmanager
def atomic_directory(final: Path):
    """Yield a temporary directory next to `final`; on success it is flushed and renamed to `final`
    (replacing an older directory of that name). On error the temporary directory is removed."""
    temp = fresh_temp_directory(final, str(os.getpid()))
    try:
        yield temp
        publish_directory(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def fresh_temp_directory(final: Path, suffix: str) -> Path:
    """An empty temporary sibling of `final` (a leftover of that name is removed first)."""
    temp = final.parent / f"{TEMP_PREFIX}{final.name}-{suffix}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    return temp


def publish_directory(temp: Path, final: Path) -> None:
    """Flush the written `temp` to disk and rename it to `final` (replacing an older directory of that
    name)."""
    fsync_tree(temp)
    if final.exists():
        shutil.rmtree(final)
    temp.rename(final)
    fsync_path(final.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` through a flushed temporary sibling and a rename: readers see no half-written file."""
    temp = path.parent / f"{TEMP_PREFIX}{path.name}"
    temp.write_text(text)
    fsync_path(temp)
    temp.rename(path)
    fsync_path(path.parent)
