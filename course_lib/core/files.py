"""Files that a crash cannot leave half-written: the one atomic write of the course.

    atomic_write(path, data)              temporary name in the same directory → write → fsync → rename → fsync dir
    atomic_write(path, data, durable=False)   the same without the fsyncs: atomic against a crash of this process
                                          (readers never see half a file), not against a power cut — for copies
                                          that live in RAM or are a cache of something durable elsewhere

A rename is atomic on POSIX: a reader sees the old file or the new one, never a part of either, and the rename
itself survives a power cut only once its directory is fsynced (docs/formulas.md §8; Pillai et al., OSDI'14,
"All File Systems Are Not Created Equal"). Checkpoints (notebook 10), the SSD tier of offload (notebook 07), the
peers' in-memory replicas and the shard cache (notebook 11) all write through here. `disk_full` injects the fault
a full disk causes, where it would happen.
"""
from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
from pathlib import Path

_disk_left: list = []          # a stack of byte budgets that `disk_full` sets (empty: the disk is never full)


@contextlib.contextmanager
def disk_full(after_bytes: int = 0):
    """Inside the block, atomic writes of this process fail with ENOSPC ("No space left on device") once
    `after_bytes` more bytes were written: the fault a full disk causes, injected where it would happen."""
    _disk_left.append(int(after_bytes))
    try:
        yield
    finally:
        _disk_left.pop()


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = len(view)
        if _disk_left:
            if _disk_left[-1] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = min(n, _disk_left[-1])
            _disk_left[-1] -= n
        view = view[os.write(fd, view[:n]):]


def fsync_dir(path) -> None:
    """Make the directory entry changes (creates, renames) in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data, *, durable: bool = True) -> None:
    """Write `data` (bytes-like) to `path` so that a crash leaves the old file or the new one, never a part of
    either. `durable` fsyncs the file before the rename and the directory after it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)             # the bytes reach the disk before any name points at them
        finally:
            os.close(fd)
        os.replace(tmp, path)            # atomic: a reader sees the old file or the new one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)           # the rename is durable once the directory is


def is_temporary(path) -> bool:
    """Whether `path` is a temporary name `atomic_write` uses (never a finished file)."""
    return ".tmp-" in Path(path).name and Path(path).name.startswith(".")



def data_dir() -> Path:
    """The course's data/ folder: the repository's (a clone, an editable install), else the copy a plain
    `pip install` of the course puts under sys.prefix/share/llm-systems-course/data (pyproject.toml's data-files)."""
    repo = Path(__file__).resolve().parents[2] / "data"
    return repo if repo.is_dir() else Path(sys.prefix, "share", "llm-systems-course", "data")

__all__ = ["data_dir", "atomic_write", "disk_full", "fsync_dir", "is_temporary"]
