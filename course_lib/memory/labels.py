"""The memory accountant's labels: what bytes are for (category), where they live (placement), the one clock.

Labels come from context variables (`alloc_category`, `placed`, `untracked`), so they are per thread; a tracker
reads them for every storage it sees allocated. `saved_tensors_hooks_over` nests saved-tensor hooks so that a
technique's hooks (FSDP, recomputation) and a tracker's labelling of activations both keep working.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
from typing import NamedTuple

import torch

CATEGORIES = ["parameters", "gradients", "optimizer", "activations", "comm", "other"]   # open: register_category
CATEGORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
                   "activations": "#C44E52", "comm": "#8172B3", "other": "#BBBBBB"}
PLACEMENTS = ("device", "host", "disk")

_category: contextvars.ContextVar = contextvars.ContextVar("course_memory_category", default="other")
_placement: contextvars.ContextVar = contextvars.ContextVar("course_memory_placement", default="device")
_active: contextvars.ContextVar = contextvars.ContextVar("course_memory_trackers", default=())
_paused: contextvars.ContextVar = contextvars.ContextVar("course_memory_paused", default=False)

now = time.perf_counter          # the one clock of the course: memory timelines and ledger events


def register_category(name: str, color: str = "#999999") -> str:
    """Add a memory category (idempotent), e.g. `register_category("stashed weights")`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a category is a non-empty string, got {name!r}")
    if name not in CATEGORIES:
        CATEGORIES.append(name)
        CATEGORY_COLORS[name] = color
    return name


def _check_category(name: str) -> None:
    if name not in CATEGORIES:
        raise ValueError(f"unknown memory category {name!r}; use one of {CATEGORIES} "
                         f"(or add one with course_lib.memory.register_category)")


def _check_placement(name: str) -> None:
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; use one of {PLACEMENTS}")


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def alloc_category(name: str):
    """Label every storage allocated inside the block, in this thread, as `name`."""
    _check_category(name)
    return _setting(_category, name)


def placed(placement: str):
    """Every storage allocated inside the block, in this thread, lives at `placement` ('device', 'host', 'disk')."""
    _check_placement(placement)
    return _setting(_placement, placement)


def untracked():
    """Storage allocated inside the block, in this thread, is not counted: for a measurement's own bookkeeping
    (copies a probe keeps), which is not part of what is measured."""
    return _setting(_paused, True)


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(size: int | float | str) -> int:
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


class _Outer(NamedTuple):      # a tensor handed on to the saved-tensor hooks that were active around ours
    unpack: object
    packed: object


@contextlib.contextmanager
def saved_tensors_hooks_over(pack, unpack):
    """`torch.autograd.graph.saved_tensors_hooks(pack, unpack)` that keeps the enclosing pair working.

    Saved-tensor hooks nest by replacement: only the innermost pair runs. Here, when `pack(t)` returns a tensor, the
    enclosing pack hook (a MemoryTracker labelling activations, say) gets that tensor; on the way back the enclosing
    unpack runs first, then `unpack`. When `pack` returns anything else (a note, a handle), the enclosing pair is
    not involved: that object is what autograd keeps.
    """
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack_(t):
        x = pack(t)
        return _Outer(outer[1], outer[0](x)) if outer is not None and isinstance(x, torch.Tensor) else x

    def unpack_(x):
        return unpack(x.unpack(x.packed) if isinstance(x, _Outer) else x)

    with torch.autograd.graph.saved_tensors_hooks(pack_, unpack_):
        yield


def active_trackers() -> tuple:
    """The trackers active in this thread, outermost first: for code that counts what the dispatcher cannot see
    (`add_external` for a file) or labels what it did not allocate itself (`track` on an autograd gradient)."""
    return _active.get()
