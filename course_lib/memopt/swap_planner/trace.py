"""The swap planner's trace: one real forward + backward under the memory accountant with an op clock, every saved
storage swapped out once to see when the forward drops it, when backward needs it and when autograd lets go; and
`execute`, which runs a plan for real on the simulated accelerator with the same hooks (docs/formulas.md §6.5).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from ...core.costmodel import Link
from ...memory import MemoryTracker, now, saved_tensors_hooks_over, untracked
from ..memory_fit import DEFAULT_LINK
from ..offload import StorageSwap, _Packed, transfer_log


@dataclass
class Storage:
    """One storage of the traced step. Op indices: -1 = before the step, n_ops = still alive after it."""
    id: str                 # "op:k" — the op that allocated it and which of its new storages it is
    nbytes: int
    birth: int
    free: int
    placement: str
    category: str           # its label when it was born (parameters, gradients, other…)
    op: str
    last_use: int = -1      # the last op that read it
    saved: bool = False     # autograd saved it for backward
    pack: int = -1          # the op during which it was first saved
    drop: int = -1          # the op after which the forward no longer holds it (it was swapped out in the trace)
    need: int = -1          # the first op in backward that needs it back (asked for just before this op)
    release: int = -1       # the op after which autograd let go of it
    swappable: bool = False


class TracingTracker(MemoryTracker):
    """The memory accountant with an op clock: the op index is the clock every record is kept in. Ops run while
    `quiet()` (the swap machinery's own copies) are counted as memory but are not ops of the step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.clock = -1
        self.ops: list = []                         # (op name, measured seconds)
        self.at_op: list = []                       # device bytes right after each op's outputs appeared
        self.records: list[Storage] = []
        self._record_of: dict = {}                  # storage key -> its live record
        self._counters: dict = {}
        self._local = threading.local()
        self.boundary = None                        # callback(op index) before each op runs (the executor's)

    @contextlib.contextmanager
    def quiet(self):
        before = getattr(self._local, "quiet", False)
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = before

    def _pack(self, t: torch.Tensor):
        with self.quiet():                          # the accountant's own detached alias is bookkeeping, not an op
            return super()._pack(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(self._local, "quiet", False):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if self.boundary is not None:
            with self.quiet():
                self.boundary(self.clock + 1)
        self.clock += 1
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                rec = self._record_of.get(t.untyped_storage()._cdata)
                if rec is not None:
                    rec.last_use = self.clock
        t0 = now()
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func.overloadpacket.__name__), now() - t0))
        self._outputs(out)
        self.at_op.append(self.total)
        return out

    def _add(self, storage, category, placement):
        key = storage._cdata
        new = storage.nbytes() > 0 and key not in self._live
        if new:
            k = self._counters.get(self.clock, 0)
            self._counters[self.clock] = k + 1
            rec = Storage(f"{self.clock}:{k}", storage.nbytes(), self.clock, -2, placement, category,
                          self.ops[-1][0] if self.ops and self.clock >= 0 else "(before the step)")
            self.records.append(rec)
            self._record_of[key] = rec
        super()._add(storage, category, placement)

    def _free(self, key):
        rec = self._record_of.pop(key, None)
        if rec is not None:
            rec.free = self.clock
        super()._free(key)

    def record_of(self, t: torch.Tensor) -> Storage | None:
        return self._record_of.get(t.untyped_storage()._cdata)


@dataclass
class Trace:
    """A traced forward + backward: ops with measured seconds, and every device storage with its lifetime."""
    ops: list                   # [(name, seconds)]
    storages: list              # [Storage] on the device (the offload's own copies excluded)
    candidates: list            # [Storage] that can be swapped: saved, not parameters, idle between drop and need
    base: np.ndarray            # device bytes alive during each op of everything but the candidates (a saved
                                # storage that cannot be swapped counted as kept); a plan adds the candidates
    peak: int                   # device peak without swapping (the accountant's, reconstructed)
    measured_peak: int          # the accountant's peak in the trace run itself (every saved tensor swapped)
    psi_bytes: int              # parameter bytes (always on the device)

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    def starts(self, speedup: float = 1.0) -> np.ndarray:
        """When op k starts if nothing stalls (k = n_ops: when the step ends), ops at measured time ÷ speedup."""
        return np.concatenate([[0.0], np.cumsum([sec for _, sec in self.ops])]) / speedup

    @property
    def compute_seconds(self) -> float:
        return sum(s for _, s in self.ops)

    def ids(self) -> set:
        return {c.id for c in self.candidates}


class _Executor:
    """The saved-tensor hook pair of the trace run and of a plan's execution.

    trace (plan=None): every saved storage (but parameters and buffers) is copied to the host at its first save and
        autograd keeps a note, so the forward's own references decide when the device original dies (`drop`); in
        backward it is brought back when first asked for (before op `need`) and dies when autograd lets go.
    plan: only the plan's storages are swapped; the device original is held through its `release` op, its copy
        comes back before its `prefetch` op (at its first use, if that is the prefetch op itself), and everything
        else stays as it is. Ops that run at an op boundary are the tracker's own: they count as memory, not ops.
    """

    def __init__(self, tracker: TracingTracker, keep: set, plan=None):
        self.tracker, self.keep, self.plan = tracker, keep, plan
        self.swap = StorageSwap(transfer_log())
        self.packs: dict = {}           # record id -> stash
        self.first_need: dict = {}
        self.first_pack: dict = {}
        self.copies: dict = {}          # record id -> the record of its device copy
        if plan is not None:
            self._out = plan.release
            self._due: dict = {}
            for cid, p in plan.prefetch.items():
                self._due.setdefault(p, []).append(cid)
            tracker.boundary = self._boundary

    def _boundary(self, k: int) -> None:
        for cid, s in self.packs.items():
            if s.hold is not None and self._out[cid] < k:    # past its release op: the original may go
                s.hold = None
        for cid in self._due.get(k, ()):
            s = self.packs.get(cid)
            if s is not None and s.device is None and s.host is not None:
                self._fetch(s)

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata in self.keep or not storage.nbytes() or t.layout != torch.strided:
            return t
        rec = self.tracker.record_of(t)
        if rec is None or rec.placement != "device" or (self.plan is not None and rec.id not in self.plan.prefetch):
            return t
        with self.tracker.quiet():
            s, new = self.swap.stash(t, rec.id, rec.id)
        if new:
            self.packs[rec.id] = s
            self.first_pack[rec.id] = self.tracker.clock
            if self.plan is not None:
                s.hold = t                       # the original stays until its modeled d2h is done
        return self.swap.packed(s, t)

    def unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        s = x.stash
        self.first_need.setdefault(s.group, self.tracker.clock + 1)
        with self.tracker.quiet():
            if s.device is None:
                self._fetch(s)
            return self.swap.view(x)

    def _fetch(self, s) -> None:
        buffers = self.swap.allocate([s])
        # at an op boundary we run inside the tracker's own dispatch, where a mode does not see itself: count the
        # buffer explicitly (a no-op when the tracker saw it allocated)
        self.tracker.track(buffers, "activations", "device")
        self.copies[s.group] = self.tracker.record_of(buffers[0])
        self.swap.copy_in([s], buffers, s.group, now())


def _step(model, batch, tracker: TracingTracker, executor: _Executor) -> dict:
    """One forward + backward of `model` on `batch` under the tracker and the executor's hooks; the gradients."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    tracker.watch(model)
    with saved_tensors_hooks_over(executor.pack, executor.unpack):
        _, loss = model(x, y)
    loss.backward()
    del loss
    with untracked():
        return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _keep_set(model) -> set:
    return {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}


def trace_step(model: torch.nn.Module, batch) -> Trace:
    """Trace one forward + backward of `model` (a GPT: `model(x, y) -> (logits, loss)`) on `batch` = (x, y)."""
    tracker = TracingTracker()
    executor = _Executor(tracker, _keep_set(model))
    with tracker:
        _step(model, batch, tracker, executor)
        tracker.boundary = None
    n = tracker.clock + 1
    by_id = {r.id: r for r in tracker.records}
    for r in tracker.records:
        if r.free == -2:
            r.free = n                                           # still alive when the step ended
    for cid in executor.packs:
        rec = by_id[cid]
        rec.saved, rec.pack, rec.drop = True, executor.first_pack[cid], rec.free
        rec.need = executor.first_need.get(cid, n)
        copy = executor.copies.get(cid)
        rec.release = copy.free if copy is not None else rec.drop    # autograd let go of its device copy then
    copy_ids = {id(c) for c in executor.copies.values()}
    storages = [r for r in tracker.records if r.placement == "device" and id(r) not in copy_ids]
    for r in storages:
        r.swappable = r.saved and r.category not in ("parameters",) and r.drop < r.need - 1
    candidates = [r for r in storages if r.swappable]
    base = np.zeros(n, dtype=np.int64)
    for r in storages:
        if not r.swappable:                                      # as traced; a saved one as if autograd kept it
            end = max(r.free, r.release) if r.saved else r.free
            base[max(r.birth, 0):min(end, n - 1) + 1] += r.nbytes
    keep = base.copy()
    for c in candidates:
        keep[max(c.birth, 0):min(max(c.drop, c.release), n - 1) + 1] += c.nbytes
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    return Trace(tracker.ops, storages, candidates, base, int(keep.max()), tracker.peak, psi)


def execute(model: torch.nn.Module, batch, trace: Trace, plan, budget: int | None = None,
            link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0) -> dict:
    """Run one forward + backward with `plan` on a simulated accelerator of `budget` bytes (None: unlimited):
    a plan the model says fits must not run out. Returns the gradients, the accountant's device peak and the
    bytes moved each way."""
    plan.validate(trace)
    tracker = TracingTracker(capacity=budget, name="simulated accelerator")
    executor = _Executor(tracker, _keep_set(model), plan)
    with tracker:
        grads = _step(model, batch, tracker, executor)
        tracker.boundary = None
    if [name for name, _ in tracker.ops] != [name for name, _ in trace.ops]:
        raise RuntimeError("the executed step ran other ops than its trace: trace and execute the same model on "
                           "the same batch")
    log = executor.swap.log
    return {"grads": grads, "peak": tracker.peak, "d2h": log.bytes_sent(op="d2h"), "h2d": log.bytes_recv(op="h2d"),
            "report": tracker.report(), "at_op": np.array(tracker.at_op)}



__all__ = ["Storage", "TracingTracker", "Trace", "trace_step", "execute"]
