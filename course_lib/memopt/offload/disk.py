"""ZeRO-Infinity's SSD tier (Rajbhandari et al., SC'21, arXiv 2104.07857), for the optimizer state only: OffloadAdam's
fp32 master weights, m and v in real files, read and written chunk by chunk every step, the next chunk's read
overlapped on a thread pool; each chunk replaced atomically (`files.atomic_write`) and the directory removed at the
end. Per step: 12Ψ read + 12Ψ written (docs/formulas.md §6.6). Disk time is measured, not modeled.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ...core.files import atomic_write
from ...distributed.comm import Ledger
from ...memory import active_trackers, alloc_category, carry_tracking, fmt_bytes, now, placed
from .swaps import _book, transfer_log


class OffloadDiskError(RuntimeError):
    """The SSD tier could not use its directory (not writable, full, or a file vanished)."""


class DiskTier:
    """Optimizer state (fp32 master, m, v) of a list of tensors in real files, one file per chunk of tensors.

    Chunks follow the course's bucketing rule (`distributed.flat.bucket_params`, here in bytes of state: 12 per
    element).
    Each step reads every chunk, updates it and writes it back: chunk c + 1 is read on a thread pool while chunk c is
    updated, and chunk c is written while c + 1 is updated, so at most three chunks are in host memory. A write is
    `files.atomic_write` (a temporary name, fsync when `durable`, a rename over the chunk: atomic on POSIX), and with
    `durable` its pages are dropped from the page cache, so the next read comes from the disk, not from RAM. Every
    read and write is booked in `log` (group 'disk': writes sent, reads received) with its measured time.

    The directory is a fresh temporary one inside `directory`; it is removed by `close()`, on any error, and at exit.
    Before writing anything the free space (or `quota`, a simulated size limit) must hold all chunks plus one
    rewrite; `fault(chunk, nbytes)`, called before every write, lets tests inject an OSError (a disk filling up).
    """

    def __init__(self, numels, *, directory: str | None = None, chunk_bytes: int = 1 << 20, log: Ledger | None = None,
                 dtype: torch.dtype = torch.float32, durable: bool = True, quota: int | None = None, fault=None):
        from ...distributed.flat import FlatBuffer, bucket_params
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        numels = [int(n) for n in numels]
        if not numels or min(numels) <= 0:
            raise ValueError("DiskTier needs at least one tensor, each with at least one element")
        self.dtype, self.durable, self.quota, self.fault = dtype, durable, quota, fault
        self.log = transfer_log() if log is None else log
        elem = torch.tensor([], dtype=dtype).element_size()
        # chunks by the bucketing rule, on stand-ins of each tensor's size: 3 state values per element
        stand_ins = [torch.empty(1).expand(n) for n in numels]
        groups = bucket_params(stand_ins, max(1, chunk_bytes // 3))
        index = {id(t): i for i, t in enumerate(stand_ins)}
        self.chunks = [[index[id(t)] for t in g] for g in groups]           # tensor indices per chunk
        self.layouts = [FlatBuffer(shapes=[numels[i] for i in c], dtype=dtype) for c in self.chunks]
        self.chunk_nbytes = [3 * lay.padded * elem for lay in self.layouts]
        self.file_bytes = sum(self.chunk_nbytes)
        self.root = self._make_dir(directory)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._trackers = active_trackers()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="offload-disk")
        self._on_disk = 0
        self._counted = False
        try:
            need = self.file_bytes + max(self.chunk_nbytes)                 # all chunks + one atomic rewrite
            free = shutil.disk_usage(self.root).free
            room = free if quota is None else min(free, quota)
            if need > room:
                raise OffloadDiskError(
                    f"offload directory {self.root} has room for {fmt_bytes(room)}"
                    f"{' (quota)' if quota is not None and quota < free else ''}, but the SSD tier needs "
                    f"{fmt_bytes(need)} (optimizer state {fmt_bytes(self.file_bytes)} + one chunk being rewritten). "
                    f"Free space there, or pass offload_dir= a directory on a larger disk.")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _make_dir(directory) -> str:
        base = tempfile.gettempdir() if directory is None else os.fspath(directory)
        try:
            return tempfile.mkdtemp(prefix="course-offload-", dir=base)
        except OSError as e:
            raise OffloadDiskError(f"cannot create the SSD tier's files in {base!r}: {e.strerror or e}. Pass "
                                   f"offload_dir= an existing, writable directory on a local disk.") from None

    def path(self, c: int) -> str:
        return os.path.join(self.root, f"chunk{c:04d}.bin")

    # ---------------------------------------------------------------- one chunk in and out
    def _read(self, c: int) -> torch.Tensor:
        with placed("host"), alloc_category("optimizer"):
            buf = torch.empty(self.chunk_nbytes[c] // torch.tensor([], dtype=self.dtype).element_size(),
                              dtype=self.dtype)
        t0 = now()
        try:
            with open(self.path(c), "rb", buffering=0) as f:
                got = f.readinto(memoryview(buf.numpy()).cast("B"))
        except OSError as e:
            raise OffloadDiskError(f"reading {self.path(c)} failed: {e.strerror or e}") from None
        if got != self.chunk_nbytes[c]:
            raise OffloadDiskError(f"{self.path(c)} holds {got} bytes, expected {self.chunk_nbytes[c]}: the file was "
                                   f"truncated or replaced while training")
        _book(self.log, "recv", "read", f"chunk {c}", t0, got, group="disk")
        return buf

    def write_chunk(self, c: int, buf: torch.Tensor) -> None:
        """Chunk c replaced atomically by the course's one atomic write (fsynced when `durable`), then, when
        `durable`, its pages dropped from the page cache so that the next read comes from the disk, not from RAM."""
        final = self.path(c)
        n = buf.numel() * buf.element_size()
        t0 = now()
        try:
            if self.quota is not None and self._on_disk + n > self.quota:
                raise OSError(errno.ENOSPC, "No space left on device (quota)")
            if self.fault is not None:
                self.fault(c, n)
            atomic_write(final, memoryview(buf.numpy()).cast("B"), durable=self.durable)
            if self.durable and hasattr(os, "posix_fadvise"):
                fd = os.open(final, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # the next read comes from the disk
                finally:
                    os.close(fd)
        except OSError as e:                         # atomic_write has removed its temporary file
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OffloadDiskError(f"offload directory {self.root} is full: writing chunk {c} "
                                       f"({fmt_bytes(n)}) failed ({e.strerror}). The SSD tier needs "
                                       f"{fmt_bytes(self.file_bytes)} there; free space or pass offload_dir= a "
                                       f"larger disk.") from None
            raise OffloadDiskError(f"writing {final} failed: {e.strerror or e}") from None
        _book(self.log, "send", "write", f"chunk {c}", t0, n, group="disk")

    # ---------------------------------------------------------------- the state, chunk by chunk
    def initialize(self, tensors) -> None:
        """Write the first state: master = the tensors (cast to dtype), m = v = 0."""
        tensors = list(tensors)
        try:
            for c, idx in enumerate(self.chunks):
                with placed("host"), alloc_category("optimizer"):
                    buf = torch.zeros(self.chunk_nbytes[c] // torch.tensor([], dtype=self.dtype).element_size(),
                                      dtype=self.dtype)
                lay = self.layouts[c]
                master = buf[:lay.padded]
                lay.pack(master, [tensors[i].reshape(-1) for i in idx])
                self.write_chunk(c, buf)
                self._on_disk += self.chunk_nbytes[c]
            for tracker in self._trackers:
                tracker.add_external(("offload", self.root), self.file_bytes, "optimizer", "disk")
            self._counted = True
        except BaseException:
            self.close()
            raise

    def step(self, update) -> None:
        """Read, update and write back every chunk: `update(i, master, exp_avg, exp_avg_sq)` for tensor i (views
        into the chunk just read, changed in place). The next chunk's read and this chunk's write overlap the
        update on the thread pool; at most one write is outstanding, so at most three chunks are in memory."""
        # A chunk travels to and from the threads in a one-element list that the receiving side empties: the
        # pool's own bookkeeping (a finished task's arguments, a future's result) then never keeps a chunk alive,
        # so host memory falls the moment a write is done, not whenever the pool lets go.
        def read(c, box):
            box.append(self._read(c))

        def write(c, box):
            self.write_chunk(c, box.pop())

        read, write = carry_tracking(read), carry_tracking(write)
        boxes = {0: []}
        pending_read = self._pool.submit(read, 0, boxes[0])
        pending_write = None
        try:
            for c, idx in enumerate(self.chunks):
                pending_read.result()
                buf = boxes.pop(c).pop()
                if c + 1 < len(self.chunks):
                    boxes[c + 1] = []
                    pending_read = self._pool.submit(read, c + 1, boxes[c + 1])
                else:
                    pending_read = None
                lay = self.layouts[c]
                parts = [buf[k * lay.padded:(k + 1) * lay.padded] for k in range(3)]   # master | m | v
                for j, i in enumerate(idx):
                    update(i, *(lay.view(part, j) for part in parts))
                if pending_write is not None:
                    pending_write.result()
                pending_write = self._pool.submit(write, c, [buf])
                del buf, parts
            pending_write.result()
        except BaseException:
            for fut in (pending_read, pending_write):
                if fut is not None:
                    fut.cancel()
                    with contextlib.suppress(BaseException):
                        fut.result()
            self.close()
            raise

    def close(self) -> None:
        """Remove the files and the directory (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._counted:
            for tracker in self._trackers:
                tracker.remove_external(("offload", self.root))
            self._counted = False
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def measure_disk(directory: str | None = None, nbytes: int = 32 << 20, chunk_bytes: int = 4 << 20) -> dict:
    """Sequential write and read bandwidth of the disk under `directory`, in bytes/s, the way the SSD tier uses it:
    chunks written, fsynced and dropped from the page cache, then read back. The file is removed."""
    n, count = max(1, chunk_bytes // 12), max(2, nbytes // chunk_bytes)
    tier = DiskTier([n] * count, directory=directory, chunk_bytes=chunk_bytes)
    try:
        tier.initialize([torch.randn(n) for _ in range(count)])
        tier.step(lambda i, master, m, v: None)
        reads = [e for e in tier.log.events if e.op == "read"]
        writes = [e for e in tier.log.events if e.op == "write"]
        return {"read": sum(e.recv for e in reads) / sum(e.t1 - e.t0 for e in reads),
                "write": sum(e.sent for e in writes) / sum(e.t1 - e.t0 for e in writes), "bytes": tier.file_bytes}
    finally:
        tier.close()



__all__ = ["OffloadDiskError", "DiskTier", "measure_disk"]
