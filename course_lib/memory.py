"""Exact memory accounting on CPU: live bytes by category, peak, timeline, and a simulated accelerator.

There is no CPU memory-stats API in PyTorch, RSS does not fall after frees and tracemalloc does not see tensor
storage. What *is* exact (see shared/reference/PLATFORM.md) is to watch every storage as it is created: a
`TorchDispatchMode` sees the output of every op, and a weakref finalizer on the output's storage fires when it is
freed. Categories come from what holds the storage:

    parameters   registered with `track`/`watch` (numel × element size, exactly)
    gradients    relabelled by a post-accumulate-grad hook on each parameter
    optimizer    relabelled by the optimizer's step post-hook (AdamW: exp_avg + exp_avg_sq = 2 × params, plus a
                 4-byte `step` tensor per parameter tensor)
    activations  relabelled when autograd saves them for backward (`saved_tensors_hooks`)
    comm         allocated under `alloc_category("comm")` (communication buffers)
    other        everything else: temporaries, buffers, inputs

`SimulatedAccelerator(capacity)` raises `SimulatedOutOfMemoryError` (naming the largest categories) when the tracked
bytes exceed the capacity: the notebooks fit models into it with ZeRO, offload and recomputation. It is a model of a
device memory limit, not a measurement of one.
"""
from __future__ import annotations

import contextlib
import re
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "comm", "other")
_category_stack: list[str] = []


@contextlib.contextmanager
def alloc_category(name: str):
    """Label every storage allocated inside the block (by any active tracker) as `name`."""
    if name not in CATEGORIES:
        raise ValueError(f"unknown memory category {name!r}; use one of {CATEGORIES}")
    _category_stack.append(name)
    try:
        yield
    finally:
        _category_stack.pop()


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(size: "int | float | str") -> int:
    """'8 MiB' / '1.5GB' / 1024 -> bytes."""
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        return int(size)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?i?[bB])?\s*", str(size))
    if not m:
        raise ValueError(f"cannot read {size!r} as a size; write e.g. 8388608, '8 MiB' or '1.5 GB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


class SimulatedOutOfMemoryError(RuntimeError):
    """The tracked bytes exceeded a simulated accelerator's capacity."""


@dataclass
class MemoryReport:
    peak: int
    peak_by_category: dict          # the split at the moment of the peak
    max_by_category: dict           # each category's own maximum over the run
    current_by_category: dict
    timeline: list = field(repr=False, default_factory=list)   # [(seconds, {category: bytes})]
    marks: list = field(repr=False, default_factory=list)      # [(seconds, label)]

    def table(self) -> str:
        rows = [f"{'category':<12} {'at peak':>12} {'own max':>12}"]
        for c in CATEGORIES:
            rows.append(f"{c:<12} {fmt_bytes(self.peak_by_category[c]):>12} {fmt_bytes(self.max_by_category[c]):>12}")
        rows.append(f"{'peak total':<12} {fmt_bytes(self.peak):>12}")
        return "\n".join(rows)


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor storage by category while active (`with MemoryTracker() as mem:`).

    `watch(model, optimizer)` registers parameters and installs the gradient/optimizer hooks; `track(tensors, cat)`
    registers tensors created outside the tracker; `mark(label)` annotates the timeline.
    """

    def __init__(self, *, capacity: "int | str | None" = None, name: str = "simulated accelerator",
                 timeline: bool = True, max_timeline: int = 200_000):
        super().__init__()
        self.capacity = None if capacity is None else parse_bytes(capacity)
        self.name = name
        self._live: dict[int, list] = {}            # storage key -> [nbytes, category]
        self._finalizers: dict[int, weakref.finalize] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.max_by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self._record = timeline
        self._max_timeline = max_timeline
        self.timeline: list = []
        self.marks: list = []
        self._t0 = time.perf_counter()
        self._hooks: list = []
        self._saved_hooks = None
        self._pinned: set[int] = set()              # buffers: never relabelled as activations
        self._saved: dict[int, list] = {}           # storage key -> [times saved, label before it was saved]

    # ------------------------------------------------------------------ bookkeeping
    @property
    def total(self) -> int:
        return sum(self.current.values())

    def _snapshot(self):
        if self._record and len(self.timeline) < self._max_timeline:
            self.timeline.append((time.perf_counter() - self._t0, dict(self.current)))

    def _add(self, storage, category: str) -> None:
        nbytes = storage.nbytes()
        key = storage._cdata
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = [nbytes, category]
        self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self.current[category] += nbytes
        total = self.total
        self.max_by_category[category] = max(self.max_by_category[category], self.current[category])
        if total > self.peak:
            self.peak, self.peak_by_category = total, dict(self.current)
        self._snapshot()
        if self.capacity is not None and total > self.capacity:
            self._oom(nbytes, category, total)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._finalizers.pop(key, None)
        if entry is not None:
            self.current[entry[1]] -= entry[0]
            self._snapshot()

    def _relabel(self, storage, category: str) -> None:
        if storage.nbytes() == 0:
            return
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._add(storage, category)
        elif entry[1] != category:
            self.current[entry[1]] -= entry[0]
            entry[1] = category
            self.current[category] += entry[0]
            self.max_by_category[category] = max(self.max_by_category[category], self.current[category])
            self._snapshot()

    def _oom(self, nbytes: int, category: str, total: int):
        top = sorted(((b, c) for c, b in self.current.items() if b), reverse=True)[:3]
        split = ", ".join(f"{c} {fmt_bytes(b)} ({100 * b / total:.0f}%)" for b, c in top)
        raise SimulatedOutOfMemoryError(
            f"{self.name} out of memory: allocating {fmt_bytes(nbytes)} ({category}) brings use to {fmt_bytes(total)}, "
            f"over its capacity of {fmt_bytes(self.capacity)}. Largest: {split}. To fit: shrink the batch or seq_len, "
            f"recompute activations (notebook 08), shard with ZeRO/FSDP (04) or offload (07).")

    # ------------------------------------------------------------------ public API
    def track(self, tensors, category: str) -> "MemoryTracker":
        """Register (or relabel) existing tensors, e.g. `track(model.parameters(), 'parameters')`."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; use one of {CATEGORIES}")
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._relabel(t.untyped_storage(), category)
        return self

    def watch(self, model: "torch.nn.Module | None" = None, optimizer: "torch.optim.Optimizer | None" = None):
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
            self.track(_optimizer_tensors(optimizer), "optimizer")
            self._hooks.append(optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self.track(_optimizer_tensors(opt), "optimizer") and None))
        return self

    def _grad_hook(self, p: torch.Tensor) -> None:   # must return None (autograd would take it as a new grad)
        if p.grad is not None:
            self.track(p.grad, "gradients")

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter() - self._t0, label))

    def reset_peak(self) -> None:
        self.peak, self.peak_by_category = self.total, dict(self.current)
        self.max_by_category = dict(self.current)

    def report(self) -> MemoryReport:
        return MemoryReport(self.peak, dict(self.peak_by_category), dict(self.max_by_category),
                            dict(self.current), list(self.timeline), list(self.marks))

    # ------------------------------------------------------------------ the dispatch mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _category_stack[-1] if _category_stack else "other"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), category)
        return out

    def _pack(self, t: torch.Tensor):
        # Saved for backward: a temporary becomes an activation while autograd holds it; parameters, buffers and
        # comm buffers keep their label. The returned holder tells us when autograd lets go (after backward, or
        # when the graph is dropped); a storage still alive then (a model input, say) gets its old label back.
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._pinned or storage.nbytes() == 0:
            return t
        if key not in self._saved:
            entry = self._live.get(key)
            if entry is not None and entry[1] not in ("other", "activations"):
                return t
            self._saved[key] = [0, entry[1] if entry is not None else "other"]
            self._relabel(storage, "activations")
        self._saved[key][0] += 1
        return _Saved(self, key, t)

    def _unsave(self, key: int) -> None:
        ref = self._saved.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._saved[key]
            entry = self._live.get(key)
            if entry is not None and entry[1] == "activations":
                self.current["activations"] -= entry[0]
                entry[1] = ref[1]
                self.current[ref[1]] += entry[0]
                self._snapshot()

    def __enter__(self):
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._saved_hooks.__exit__(*exc)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()


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


def _optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class SimulatedAccelerator:
    """A device with a memory limit, modelled on CPU: `with SimulatedAccelerator('8 MiB').track(model, opt) as mem:`.

    The capacity is a model (labelled so in every message), the counting under it is exact.
    """

    def __init__(self, capacity: "int | str", name: str = "simulated accelerator"):
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


def tensor_bytes(tensors) -> int:
    """numel × element size, summed over unique storages-worth of tensors (the closed form for 'parameters')."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)
