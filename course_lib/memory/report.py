"""What a memory tracker hands back (`MemoryReport`, picklable: ranks return it), the simulated accelerator's
out-of-memory error, and the closed form for parameter bytes (`tensor_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .labels import CATEGORIES, _check_placement, fmt_bytes


class SimulatedOutOfMemoryError(RuntimeError):
    """The tracked device bytes exceeded a simulated accelerator's capacity."""


@dataclass
class MemoryReport:
    """A tracker's numbers, picklable (ranks return it). The top-level fields are the *device* placement."""
    peak: int
    peak_by_category: dict          # the device split at the moment of the device peak
    max_by_category: dict           # each category's own maximum on the device over the run
    current_by_category: dict
    timeline: list = field(repr=False, default_factory=list)   # [(perf_counter seconds, {category: device bytes})]
    marks: list = field(repr=False, default_factory=list)      # [(perf_counter seconds, label)]
    t0: float = 0.0                                            # when the tracker started (perf_counter)
    placements: dict = field(repr=False, default_factory=dict)  # placement -> {"peak", "current", "timeline"}

    def table(self) -> str:
        rows = [f"{'category':<12} {'at peak':>12} {'own max':>12}"]
        for c in self.max_by_category:
            if self.max_by_category[c] or c in CATEGORIES[:6]:
                rows.append(f"{c:<12} {fmt_bytes(self.peak_by_category.get(c, 0)):>12} "
                            f"{fmt_bytes(self.max_by_category[c]):>12}")
        rows.append(f"{'peak total':<12} {fmt_bytes(self.peak):>12}")
        return "\n".join(rows)

    def at(self, placement: str) -> dict:
        """{'peak': bytes, 'current': {category: bytes}, 'timeline': [...]} of one placement."""
        _check_placement(placement)
        if placement == "device":
            return {"peak": self.peak, "current": self.current_by_category, "timeline": self.timeline}
        return self.placements.get(placement, {"peak": 0, "current": {}, "timeline": []})


def tensor_bytes(tensors) -> int:
    """numel × element size, summed over tensors (the closed form for 'parameters')."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)
