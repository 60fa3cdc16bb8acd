"""Storages to the host and back, one copy each, booked in a transfer log: the machinery every offload of notebook 07
stands on (vDNN's activation offload, the swap planner's executor, lab 07's hooks).

    transfer_log   a `distributed.comm.Ledger` for one device's link to its host and disk: d2h and disk writes are
                   "sent", h2d and disk reads "received", compute spans "compute" events, all on `memory.now`
    StorageSwap    a storage copied to the host once however often autograd saves it (each save becomes a note over
                   the copy), device buffers allocated by the caller's thread, copies in on any thread

On a CPU box the "device" is the simulated accelerator (`memory.SimulatedAccelerator`): every transfer is a real
copy between memory labelled `placed("device")` and `placed("host")`; the link's time is modeled elsewhere
(`activations.link_schedule`, the α–β model of `costmodel`).
"""
from __future__ import annotations

import threading
import weakref

import torch

from ...distributed.comm import Event, Ledger
from ...memory import alloc_category, now, placed


def transfer_log(rank: int = 0) -> Ledger:
    """A ledger for one device's link to its host (and its host's disk): d2h and disk writes are booked as sent,
    h2d and disk reads as received, compute spans as 'compute' events — so bytes are read like the traffic ledger's
    (`log.bytes_sent(op="d2h")`) and everything shares `memory.now`."""
    return Ledger(rank, 1)


def _book(log: Ledger, kind: str, op: str, tag: str, t0: float, nbytes: int = 0, group: str = "pcie") -> None:
    log.record(Event(kind, op, tag, t0, now(), nbytes if kind == "send" else 0, nbytes if kind == "recv" else 0,
                     None, group))


def _bytes_view(storage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (no new storage: the memory accountant sees nothing allocated)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _copy_storage(storage, placement: str, category: str) -> torch.Tensor:
    """A copy of a whole storage, allocated at `placement` under `category`: the one real copy a transfer makes."""
    with placed(placement), alloc_category(category):
        out = torch.empty(storage.nbytes(), dtype=torch.uint8)
    return out.copy_(_bytes_view(storage))


class _Stash:
    """One storage moved off the device: its host copy, and its device copy while backward needs it back."""
    __slots__ = ("group", "nbytes", "host", "device", "original", "handles", "hold")

    def __init__(self, group, storage):
        self.group, self.nbytes = group, storage.nbytes()
        self.original = weakref.ref(storage)     # to tell this storage from a later one at a reused address
        self.host = None
        self.device = None
        self.handles = 0
        self.hold = None                         # the device original, while a modeled d2h is still running


class _Packed:
    """What autograd keeps instead of an offloaded tensor: where its storage went, how to view it again, and which
    group (layer, forward) saved it — a storage shared by two groups has one stash and a note per save."""
    __slots__ = ("owner", "stash", "group", "dtype", "size", "stride", "offset")

    def __init__(self, owner, stash, t: torch.Tensor, group=None):
        self.owner, self.stash, self.group = owner, stash, stash.group if group is None else group
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def __del__(self):                  # autograd let go: after this tensor's backward, or when the graph is dropped
        self.owner.release(self.stash)


class StorageSwap:
    """Storages out to the host and back, one copy each, for a pair of saved-tensor hooks.

    Autograd saves *tensors*, often several views of one storage (q, k and v share nothing, but a transposed k
    and k do) and the same tensor for several ops (ln1's output feeds wq, wk and wv). What occupies memory is the
    storage, so a storage is copied once, however many times it is saved, and each saved tensor becomes a note
    (`_Packed`: dtype, size, stride, offset) over the copy. A storage is known by its address only while it lives:
    once the original is freed its address can be reused, so a note is matched by a weak reference to the storage
    itself, not by the address. When autograd lets go of the last note, both copies go.
    """

    def __init__(self, log: Ledger, on_release=None):
        self.log = log
        self.on_release = on_release
        self._lock = threading.RLock()
        self._stashes: dict[int, _Stash] = {}     # storage key -> stash of the storage living there now

    def stash(self, t: torch.Tensor, group, tag: str) -> tuple[_Stash, bool]:
        """The stash of t's storage, copied to the host (booked as a d2h) if this is its first save; and whether it
        was new."""
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            s = self._stashes.get(key)
            if s is not None and s.original() is storage:
                return s, False
            s = _Stash(group, storage)
            t0 = now()
            s.host = _copy_storage(storage, "host", "activations")
            _book(self.log, "send", "d2h", tag, t0, s.nbytes)
            self._stashes[key] = s
            return s, True

    def packed(self, s: _Stash, t: torch.Tensor, group=None) -> _Packed:
        """The note autograd keeps for t (`group`: who saved it, if not the stash's first saver)."""
        with self._lock:
            s.handles += 1
        return _Packed(self, s, t, group)

    @staticmethod
    def allocate(stashes) -> list:
        """Device buffers for `stashes` (allocated by the caller's thread, so the peak does not depend on when a
        copy thread runs)."""
        with placed("device"), alloc_category("activations"):
            buffers = [torch.empty(s.nbytes, dtype=torch.uint8) for s in stashes]
        for s, b in zip(stashes, buffers):
            s.device = b.untyped_storage()
        return buffers

    def copy_in(self, stashes, buffers, tag: str, t0: float) -> None:
        """The h2d copies into buffers from `allocate` (any thread), booked as one transfer issued at t0. The list
        is emptied, so a thread pool holding this call's arguments a little longer holds no device memory."""
        for s, b in zip(stashes, buffers):
            b.copy_(s.host)
        buffers.clear()
        _book(self.log, "recv", "h2d", tag, t0, sum(s.nbytes for s in stashes))

    @staticmethod
    def view(p: _Packed) -> torch.Tensor:
        """The saved tensor again, over the device copy of its storage."""
        return torch.empty(0, dtype=p.dtype).set_(p.stash.device, p.offset, p.size, p.stride)

    def release(self, s: _Stash) -> None:
        with self._lock:
            s.handles -= 1
            if s.handles:
                return
            s.host = s.device = s.hold = None    # nothing in the graph refers to it any more: both copies go
            for k, v in list(self._stashes.items()):
                if v is s:
                    del self._stashes[k]
        if self.on_release is not None:
            self.on_release(s)


__all__ = ["transfer_log", "StorageSwap"]
