"""Checkpointing inside THE training loop, synchronous or asynchronous (CheckFreq).

Mohan, Phanishayee & Chidambaram, "CheckFreq: Frequent, Fine-Grained DNN Checkpointing", FAST'21. A synchronous
save stops training for all of it: copy, serialize, write, fsync, publish. CheckFreq cuts a checkpoint in two:

    snapshot()   copy the state into host memory (on a GPU, device → host); training waits for this part only
    persist()    write that copy (checkpoint.persist) on a background thread while training goes on

    training     | step k | snap | step k+1 | step k+2 | step k+3 | …
    background                   [ serialize → write → fsync → rename ]

Training also waits if the next checkpoint is due before the previous persist finished: the snapshot buffer is
reused (CheckFreq keeps one), and overwriting it mid-write would tear the checkpoint. What training loses per
checkpoint — the stall — is the δ of Young's interval √(2δM) (docs/formulas.md §8.3).

`CheckpointProbe` is a `train.Probe`: `run(model, opt, batches, steps=…, probes=[CheckpointProbe(root, every=…)])`
saves after every `every`-th optimizer step, counted from `start_step` (a resumed run's first step), and after
each step listed in `at`.
"""
from __future__ import annotations

import threading

from ..memory import now
from ..train import Probe
from .checkpoint import CheckpointError, Snapshot, agree_run_id, persist, snapshot
from .state import data_position, training_state


class CheckpointProbe(Probe):
    """Save a checkpoint in `root` after every `every`-th step. asynchronous=False: snapshot and persist on the
    training thread (the stall is the whole save). asynchronous=True: snapshot on the training thread, persist on a
    background thread (CheckFreq). copy=False skips the snapshot copy and persists the live tensors — a wrong
    design, kept to show what the copy is for. `hold` (a threading.Event) makes the background thread wait before
    writing, as a slow disk would. `at`: steps to save after as well, whether or not `every` divides them."""
    name = "checkpoint"

    def __init__(self, root, every: int, *, asynchronous: bool = False, batches=None, start_step: int = 0,
                 keep: int = 3, copy: bool = True, hold: threading.Event | None = None, at=()):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if not copy and not asynchronous:
            raise ValueError("copy=False only makes sense with asynchronous=True (a synchronous save reads the "
                             "live tensors while nothing changes them)")
        self.root, self.every, self.asynchronous, self.batches = root, every, asynchronous, batches
        self.start_step, self.keep, self.copy, self.hold, self.at = start_step, keep, copy, hold, set(at)
        self.events: list[dict] = []          # per checkpoint: step, stall and persist spans (perf_counter)
        self._buffer: Snapshot | None = None  # CheckFreq's one snapshot buffer, reused
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        comm = training_state(model, optimizer).comm
        self.comm = comm
        self.run_id = agree_run_id(comm)
        # the background thread runs its collectives (did every rank write?) on a group of its own, so they never
        # interleave with the training thread's collectives on the main group
        self.persist_comm = comm.new_group(range(comm.world_size), "ckpt") \
            if self.asynchronous and comm is not None and comm.world_size > 1 else comm

    def after_step(self, step):
        s = self.start_step + step + 1
        if s % self.every and s not in self.at:
            return
        t0 = now()
        self.wait()                           # the previous persist must finish before its buffer is reused
        t_wait = now()
        state = training_state(self.model, self.optimizer)
        data = data_position(self.batches, s) if self.batches is not None else None
        snap = snapshot(state, s, data=data, into=self._buffer, copy=self.copy)
        event = {"step": s, "bytes": snap.nbytes, "wait": (t0, t_wait), "snapshot": (t_wait, now())}
        self.events.append(event)
        if self.copy:
            self._buffer = snap
        if self.asynchronous:
            self._thread = threading.Thread(target=self._persist, args=(snap, event), name="ckpt-persist",
                                            daemon=True)
            self._thread.start()
        else:
            self._persist(snap, event)
            self._raise()
        event["stall"] = (t0, now())

    def _persist(self, snap: Snapshot, event: dict) -> None:
        try:
            if self.hold is not None:
                self.hold.wait()
            t0 = now()
            event["path"] = persist(snap, self.root, comm=self.persist_comm, run_id=self.run_id, keep=self.keep)
            event["persist"] = (t0, now())
        except BaseException as e:        # noqa: BLE001 — handed to the training thread at its next call
            self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the background checkpoint failed: {error!r}") from error

    def wait(self) -> None:
        """Block until the checkpoint being persisted (if any) is published; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def finish(self):
        self.wait()
        return [{k: v for k, v in e.items() if k != "path"} | {"path": str(e.get("path"))} for e in self.events]

    def close(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None


__all__ = ["CheckpointProbe"]
