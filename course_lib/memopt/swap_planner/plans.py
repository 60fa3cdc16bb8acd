"""A swap plan (what to release after which op, what to prefetch before which), its simulation on the modeled link
with exact device bytes at every op, and the least memory any plan can reach (docs/formulas.md §6.5).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.costmodel import Link, get_link
from ...memory import fmt_bytes
from ..memory_fit import DEFAULT_LINK
from .trace import Trace


@dataclass
class SwapPlan:
    """For each swapped candidate (by trace id): the op after which its device original is let go (`release`: the
    compute waits there for its d2h if that has not finished) and the op before which its prefetch is issued
    (`prefetch`: the compute waits at its first use if the h2d has not finished). drop ≤ release < prefetch < need."""
    release: dict = field(default_factory=dict)       # candidate id -> op index
    prefetch: dict = field(default_factory=dict)      # candidate id -> op index
    name: str = ""

    def swapped(self) -> list:
        return list(self.prefetch)

    def validate(self, trace: Trace) -> None:
        ids = trace.ids()
        named = set(self.prefetch) | set(self.release)
        unknown = sorted(named - ids)
        if unknown:
            known = {s.id for s in trace.storages}
            why = "are not storages of this trace" if any(u not in known for u in unknown) else \
                "are in the trace but cannot be swapped (parameters, or needed again before the forward lets go)"
            more = " …" if len(unknown) > 5 else ""
            raise ValueError(f"swap plan {self.name!r} refers to tensors {unknown[:5]}{more} that {why}; plan only "
                             f"ids from trace.candidates ({len(ids)} of them)")
        if set(self.prefetch) != set(self.release):
            raise ValueError(f"swap plan {self.name!r}: every swapped tensor needs both a release and a prefetch op")
        by_id = {c.id: c for c in trace.candidates}
        for cid, p in self.prefetch.items():
            c, w = by_id[cid], self.release[cid]
            if not c.drop <= w < p < c.need:
                raise ValueError(f"swap plan {self.name!r}: tensor {cid} needs drop ≤ release < prefetch < need, i.e. "
                                 f"{c.drop} ≤ {w} < {p} < {c.need}")


@dataclass
class Outcome:
    """A plan's modeled step: seconds (compute ÷ speedup + stalls), device peak and bytes each way."""
    seconds: float
    stall: float
    peak: int
    memory: np.ndarray = field(repr=False)
    moved: int = 0                  # bytes each way (d2h = h2d)

    def fits(self, budget: int) -> bool:
        return self.peak <= budget


def simulate(trace: Trace, plan: SwapPlan, link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0) -> Outcome:
    """Replay the traced ops with `plan` on the modeled link; exact device bytes at every op (see the module).

    Op k runs for its measured time ÷ speedup. A swap-out goes on the d2h lane when the op that saved the tensor
    ends; a prefetch goes on the h2d lane before its op (not before its swap-out is done); each lane carries one
    transfer at a time, α + S·β each. Before op `release + 1` the compute waits for that swap-out, before op `need`
    for that prefetch."""
    link = get_link(link)
    by_id = {c.id: c for c in trace.candidates}
    n = trace.n_ops
    start = trace.starts(speedup)                 # start of op k (k = n: the end) without stalls
    events = []                                   # (op boundary, order there, kind, candidate)
    for cid, p in plan.prefetch.items():
        c = by_id[cid]
        events += [(c.pack + 1, 0, "out", c), (plan.release[cid] + 1, 1, "wait", c), (p, 2, "in", c),
                   (c.need, 3, "need", c)]
    events.sort(key=lambda e: (e[0], e[1]))
    stall, d2h_free, h2d_free = 0.0, 0.0, 0.0
    out_done, in_done = {}, {}
    for k, _, kind, c in events:                  # only the boundaries where something happens
        t = start[min(k, n)] + stall
        if kind == "out":                         # the op that saved it has ended: its d2h joins the lane
            d2h_free = out_done[c.id] = max(t, d2h_free) + link.time(c.nbytes)
        elif kind == "in":                        # not before its d2h is done, one h2d at a time
            h2d_free = in_done[c.id] = max(t, h2d_free, out_done[c.id]) + link.time(c.nbytes)
        else:                                     # wait: its original must be gone; need: its copy must be here
            done = out_done[c.id] if kind == "wait" else in_done[c.id]
            if done > t:
                stall += done - t
    t = start[n] + stall
    diff = np.zeros(n + 1, dtype=np.int64)
    for c in trace.candidates:
        if c.id in plan.prefetch:
            spans = ((c.birth, max(c.drop, plan.release[c.id])), (plan.prefetch[c.id], c.release))
        else:
            spans = ((c.birth, max(c.drop, c.release)),)
        for a, b in spans:
            a, b = max(a, 0), min(b, n - 1)
            if a <= b:
                diff[a] += c.nbytes
                diff[b + 1] -= c.nbytes
    memory = trace.base + np.cumsum(diff[:n])
    return Outcome(float(t), stall, int(memory.max()), memory, sum(by_id[cid].nbytes for cid in plan.prefetch))


def least_memory(trace: Trace) -> SwapPlan:
    """Every candidate swapped, let go as soon as the forward drops it and brought back at the last boundary before
    it is needed: the least memory any plan uses, whatever it costs in stalls."""
    return SwapPlan({c.id: c.drop for c in trace.candidates}, {c.id: c.need - 1 for c in trace.candidates},
                "least memory")


def minimum_budget(trace: Trace) -> int:
    """The least device memory any plan needs: each candidate on the device only while the forward holds it and
    from its first use in backward until autograd lets go, everything else as traced."""
    return simulate(trace, least_memory(trace), _instant_link()).peak


def _instant_link() -> Link:
    """A link that takes no time (for bounds that do not depend on the link)."""
    return Link("instant", 0.0, float("inf"), "a bound, not a link", kind="modeled")


def check_budget(trace: Trace, budget: int) -> None:
    low = minimum_budget(trace)
    if budget < low:
        raise ValueError(f"a device budget of {fmt_bytes(budget)} ({budget:,} B) is below the least this step can "
                         f"run in, {fmt_bytes(low)} ({low:,} B): the parameters ({fmt_bytes(trace.psi_bytes)}), the "
                         f"gradients, the working set of the busiest op and the activations it uses must stay on the "
                         f"device. Give at least {low:,} bytes, or recompute activations / shrink the batch.")


__all__ = ["SwapPlan", "Outcome", "simulate", "least_memory", "minimum_budget", "check_budget"]
