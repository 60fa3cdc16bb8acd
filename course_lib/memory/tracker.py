"""The memory tracker: every storage counted from its creation (a TorchDispatchMode sees each op's outputs) to
its free (a weakref finalizer on the storage), by category × placement; and the simulated accelerator, a tracker
with a capacity. The method and its limits are described in `course_lib.memory`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .labels import (
    CATEGORIES,
    PLACEMENTS,
    _active,
    _category,
    _check_category,
    _check_placement,
    _paused,
    _placement,
    fmt_bytes,
    now,
    parse_bytes,
)
from .report import MemoryReport, SimulatedOutOfMemoryError


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor storage by category and placement while active (`with MemoryTracker() as mem:`).

    `watch(model, optimizer)` registers parameters and installs the gradient/optimizer hooks; `track(tensors, cat)`
    registers tensors created outside the tracker; `move(tensors, placement)` relabels where bytes live;
    `add_external(key, nbytes, category, placement)` counts bytes the dispatcher cannot see (a file on disk);
    `mark(label)` annotates the timeline. `current`, `peak`, `peak_by_category` and `max_by_category` are the
    device's; `current_at(placement)` and `peak_at(placement)` the others'.
    """

    def __init__(self, *, capacity: int | str | None = None, name: str = "simulated accelerator",
                 timeline: bool = True, max_timeline: int = 200_000):
        super().__init__()
        self.capacity = None if capacity is None else parse_bytes(capacity)
        self.name = name
        self._lock = threading.RLock()
        self._live: dict[int, list] = {}            # storage key -> [nbytes, category, placement]
        self._bytes = {p: dict.fromkeys(CATEGORIES, 0) for p in PLACEMENTS}
        self._peak = dict.fromkeys(PLACEMENTS, 0)
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self.max_by_category = dict.fromkeys(CATEGORIES, 0)
        self._record = timeline
        self._max_timeline = max_timeline
        self.timeline: list = []                    # [(t, {placement: {category: bytes}})], non-empty placements
        self.marks: list = []
        self.t0 = now()
        self._hooks: list = []
        self._saved_hooks = None
        self._token = None
        self._pinned: set[int] = set()              # buffers: never relabelled as activations
        self._saved: dict[int, list] = {}           # storage key -> [times saved, label before it was saved]

    # ------------------------------------------------------------------ bookkeeping
    @property
    def current(self) -> dict:
        """Device bytes by category, now."""
        return self._bytes["device"]

    def current_at(self, placement: str) -> dict:
        _check_placement(placement)
        return dict(self._bytes[placement])

    @property
    def total(self) -> int:
        return sum(self._bytes["device"].values())

    def total_at(self, placement: str) -> int:
        _check_placement(placement)
        return sum(self._bytes[placement].values())

    @property
    def peak(self) -> int:
        return self._peak["device"]

    def peak_at(self, placement: str) -> int:
        _check_placement(placement)
        return self._peak[placement]

    def _count(self, placement: str, category: str, delta: int) -> None:
        row = self._bytes[placement]
        row[category] = row.get(category, 0) + delta
        if delta <= 0:
            return
        total = sum(row.values())
        if total > self._peak[placement]:
            self._peak[placement] = total
            if placement == "device":
                self.peak_by_category = dict(row)
        if placement == "device" and row[category] > self.max_by_category.get(category, 0):
            self.max_by_category[category] = row[category]

    def _snapshot(self):
        if self._record and len(self.timeline) < self._max_timeline:
            self.timeline.append((now(), {p: dict(r) for p, r in self._bytes.items()
                                          if p == "device" or any(r.values())}))

    def _add(self, storage, category: str, placement: str) -> None:
        key = storage._cdata
        if key in self._live:             # a view of a counted storage (most ops' outputs): nothing to do
            return
        nbytes = storage.nbytes()
        with self._lock:
            if nbytes == 0 or key in self._live:
                return
            self._live[key] = [nbytes, category, placement]
            weakref.finalize(storage, self._free, key)
            self._count(placement, category, nbytes)
            self._snapshot()
            if placement == "device" and self.capacity is not None and self.total > self.capacity:
                self._oom(nbytes, category, self.total)

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._count(entry[2], entry[1], -entry[0])
                self._snapshot()

    def _relabel(self, storage, category: str | None = None, placement: str | None = None) -> None:
        if storage.nbytes() == 0:
            return
        with self._lock:
            entry = self._live.get(storage._cdata)
            if entry is None:
                self._add(storage, category or "other", placement or _placement.get())
                return
            new_cat, new_place = category or entry[1], placement or entry[2]
            if (new_cat, new_place) == (entry[1], entry[2]):
                return
            self._count(entry[2], entry[1], -entry[0])
            entry[1], entry[2] = new_cat, new_place
            self._count(new_place, new_cat, entry[0])
            self._snapshot()
            if new_place == "device" and self.capacity is not None and self.total > self.capacity:
                self._oom(entry[0], new_cat, self.total)

    def _oom(self, nbytes: int, category: str, total: int):
        top = sorted(((b, c) for c, b in self.current.items() if b), reverse=True)[:3]
        split = ", ".join(f"{c} {fmt_bytes(b)} ({100 * b / total:.0f}%)" for b, c in top)
        raise SimulatedOutOfMemoryError(
            f"{self.name} out of memory: allocating {fmt_bytes(nbytes)} ({category}) brings use to {fmt_bytes(total)}, "
            f"over its capacity of {fmt_bytes(self.capacity)}. Largest: {split}. To fit: shrink the batch or seq_len, "
            f"recompute activations (notebook 08), shard with ZeRO/FSDP (04) or offload (07).")

    # ------------------------------------------------------------------ public API
    def track(self, tensors, category: str, placement: str | None = None) -> MemoryTracker:
        """Register (or relabel) existing tensors, e.g. `track(model.parameters(), 'parameters')`. A tensor already
        tracked keeps its placement unless one is given; a new one gets `placement` or the current `placed(...)`."""
        _check_category(category)
        if placement is not None:
            _check_placement(placement)
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if isinstance(t, torch.Tensor):
                self._relabel(t.untyped_storage(), category, placement)
        return self

    def move(self, tensors, placement: str) -> MemoryTracker:
        """Relabel where already tracked tensors live (their category stays)."""
        _check_placement(placement)
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if isinstance(t, torch.Tensor):
                self._relabel(t.untyped_storage(), None, placement)
        return self

    def add_external(self, key, nbytes: int, category: str, placement: str = "disk") -> None:
        """Count `nbytes` that live outside tensor storage (e.g. a file) under `key` until `remove_external(key)`."""
        _check_category(category)
        _check_placement(placement)
        with self._lock:
            ext = ("external", key)
            if ext in self._live:
                raise ValueError(f"external bytes {key!r} are already counted; remove_external({key!r}) first")
            self._live[ext] = [int(nbytes), category, placement]
            self._count(placement, category, int(nbytes))
            self._snapshot()

    def remove_external(self, key) -> None:
        self._free(("external", key))

    def watch(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        """Track a model's parameters (and buffers as 'other'), label its gradients and an optimizer's state."""
        if model is not None:
            self.track(list(model.parameters()), "parameters")
            self.track(list(model.buffers()), "other")
            self._pinned.update(b.untyped_storage()._cdata for b in model.buffers())
            for p in model.parameters():
                if p.grad is not None:
                    self.track(p.grad, "gradients")
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        if optimizer is not None:
            # what the optimizer is handed is a gradient, wherever it lives (a DDP bucket, a ZeRO shard)
            self._hooks.append(optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: self.track(_optimizer_grads(opt), "gradients") and None))
            self.track(_optimizer_tensors(optimizer), "optimizer")
            self._hooks.append(optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self.track(_optimizer_tensors(opt), "optimizer") and None))
        return self

    def _grad_hook(self, p: torch.Tensor) -> None:   # must return None (autograd would take it as a new grad)
        if p.grad is not None:
            self.track(p.grad, "gradients")

    def mark(self, label: str) -> None:
        self.marks.append((now(), label))

    def reset_peak(self) -> None:
        with self._lock:
            for p in PLACEMENTS:
                self._peak[p] = sum(self._bytes[p].values())
            self.peak_by_category = dict(self.current)
            self.max_by_category = dict(self.current)

    def report(self) -> MemoryReport:
        def series(p):
            return [(t, dict(s.get(p, {}))) for t, s in self.timeline]
        others = {p: {"peak": self._peak[p], "current": dict(self._bytes[p]), "timeline": series(p)}
                  for p in PLACEMENTS[1:]}
        return MemoryReport(self.peak, dict(self.peak_by_category), dict(self.max_by_category), dict(self.current),
                            series("device"), list(self.marks), self.t0, others)

    # ------------------------------------------------------------------ the dispatch mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._outputs(out)
        return out

    def _outputs(self, out) -> None:
        if _paused.get():
            return
        category, placement = _category.get(), _placement.get()
        if isinstance(out, torch.Tensor):       # most ops return one tensor: no need to walk a pytree
            self._add(out.untyped_storage(), category, placement)
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), category, placement)

    def _pack(self, t: torch.Tensor):
        # Saved for backward: a temporary becomes an activation while autograd holds it; parameters, buffers and
        # comm buffers keep their label. The returned holder tells us when autograd lets go (after backward, or
        # when the graph is dropped); a storage still alive then (a model input, say) gets its old label back.
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._pinned or storage.nbytes() == 0:
            return t
        with self._lock:
            if key not in self._saved:
                entry = self._live.get(key)
                if entry is not None and entry[1] not in ("other", "activations"):
                    return t
                self._saved[key] = [0, entry[1] if entry is not None else "other"]
                self._relabel(storage, "activations")
            self._saved[key][0] += 1
        # detached: a saved *output* (softmax, log-softmax) carries its grad_fn, and holding it here would make a
        # reference cycle through autograd's C++ nodes that the garbage collector cannot break, so a graph dropped
        # without backward would never be freed. Python attributes stay: inner hooks may have left notes on it.
        held = t.detach()
        if t.__dict__:
            held.__dict__.update(t.__dict__)
        return _Saved(self, key, held)

    def _unsave(self, key: int) -> None:
        with self._lock:
            ref = self._saved.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                del self._saved[key]
                entry = self._live.get(key)
                if entry is not None and entry[1] == "activations":
                    self._count(entry[2], "activations", -entry[0])
                    entry[1] = ref[1]
                    self._count(entry[2], ref[1], entry[0])
                    self._snapshot()

    def __enter__(self):
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        self._token = _active.set(_active.get() + (self,))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _active.reset(self._token)
            self._token = None
            self._saved_hooks.__exit__(*exc)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()

    def close(self) -> None:
        """Stop tracking (what leaving the `with` block does), for a tracker entered by hand; idempotent."""
        if self._token is not None:
            self.__exit__(None, None, None)


class _ThreadView(TorchDispatchMode):
    """A tracker's eyes in another thread (dispatch modes are per thread): reports every new storage to it."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._outputs(out)
        return out


def carry_tracking(fn):
    """Wrap `fn` so that, run in another thread, its allocations are counted by the trackers active here (with the
    labels that thread sets itself: a thread starts with the default category 'other' and placement 'device')."""
    trackers = _active.get()

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for t in trackers:
                stack.enter_context(_ThreadView(t))
            return fn(*args, **kwargs)
    return run


class _Saved:
    """What autograd stores instead of a saved tensor while a tracker is active; dies when autograd lets go."""
    __slots__ = ("tracker", "key", "tensor")

    def __init__(self, tracker, key, tensor):
        self.tracker, self.key, self.tensor = tracker, key, tensor

    def __del__(self):
        self.tensor = None              # drop our reference first: if it was the last, the storage is freed now
        self.tracker._unsave(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


def _optimizer_grads(optimizer) -> list:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class SimulatedAccelerator:
    """A device with a memory limit, modelled on CPU: `with SimulatedAccelerator('8 MiB').track(model, opt) as mem:`.

    The capacity is a model (labelled so in every message); the counting under it is exact. Only bytes placed on
    the device count against it: what offload moves to 'host' or 'disk' does not.
    """

    def __init__(self, capacity: int | str, name: str = "simulated accelerator"):
        self.capacity = parse_bytes(capacity)
        if self.capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity!r}")
        self.name = f"{name} [{fmt_bytes(self.capacity)}, modeled]"

    def track(self, model=None, optimizer=None, **kwargs) -> MemoryTracker:
        return MemoryTracker(capacity=self.capacity, name=self.name, **kwargs).watch(model, optimizer)

    def fits(self, fn) -> bool:
        """Run fn(); False if it ran out of this device's memory."""
        try:
            fn()
            return True
        except SimulatedOutOfMemoryError:
            return False
