"""The modeled host link of one offloaded forward + backward: what `ActivationOffload` recorded (measured compute
spans, when each transfer was issued and needed), replayed on the α–β model of the PCIe link (vDNN's rules, Rhu et
al. MICRO 2016), and the device speed at which the link stops hiding behind compute (docs/formulas.md §6.3, §6.4).

    OffloadPass          what one forward and its backward did, on `memory.now`
    link_schedule        the pass on a modeled link: transfers, stalls, the compute shifted by them
    break_even_speedup   the smallest device speedup over this CPU at which a transfer is exposed
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.costmodel import Link, get_link
from ..memory_fit import DEFAULT_LINK


@dataclass
class OffloadPass:
    """What one forward + backward did, for the modeled link schedule (times on `memory.now`)."""
    layer_bytes: dict = field(default_factory=dict)      # layer -> bytes of the unique storages it offloaded
    offloads: list = field(default_factory=list)          # (t issued, layer, bytes) one per storage, d2h
    fetches: dict = field(default_factory=dict)           # layer -> (t issued, bytes), h2d
    needed: dict = field(default_factory=dict)            # layer -> t its backward first asked for a tensor
    forward: dict = field(default_factory=dict)           # layer -> (t0, t1) of its forward
    backward: dict = field(default_factory=dict)          # layer -> (t0, t1) of its backward
    saves: int = 0                                        # pack calls on offloaded tensors (several per storage)



@dataclass
class LinkSchedule:
    """Measured compute spans and modeled transfers of one offloaded forward + backward, on one time axis.

    Rules (vDNN's): layer i's offload starts when autograd saves each tensor and must be done by the end of layer
    i + 1's forward (so only the layers in flight wait on the device); layer i's prefetch starts when it is issued
    (when the backward of layer i + 1 starts) and must be done when layer i's backward first asks. Each direction of
    the link carries one transfer at a time (α + S·β each). A transfer late for its deadline stalls the compute, and
    every later time shifts by the stall. `speedup` models a device that computes that many times faster than this
    CPU (compute spans are divided by it; the link is not).
    """
    compute: list           # (t0, t1, label) seconds from the start of the forward, after stalls
    transfers: list         # (lane 'd2h' | 'h2d', t0, t1, bytes, layer) modeled
    exposed: float          # seconds the compute waited for the link
    compute_seconds: float  # measured compute (÷ speedup)
    link_seconds: dict      # lane -> modeled seconds busy
    link: Link
    start: float = 0.0      # memory.now of the forward's start: time 0 of this schedule

    @property
    def hidden(self) -> bool:
        return self.exposed == 0.0


def link_schedule(p: OffloadPass, link: Link, *, speedup: float = 1.0) -> LinkSchedule:
    """Replay one pass on a modeled link (the rules are `LinkSchedule`'s)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup!r}")
    if not p.forward or not p.offloads:
        raise ValueError("nothing was offloaded in this pass: run a forward and backward through ActivationOffload")
    start = min(t0 for t0, _ in p.forward.values())
    scale = lambda t: (t - start) / speedup                     # noqa: E731  (measured time -> modeled device time)
    layers = sorted(p.forward)
    fwd_end = {i: scale(p.forward[i][1]) for i in layers}
    offload_due = {i: fwd_end[layers[min(k + 1, len(layers) - 1)]] for k, i in enumerate(layers)}
    events = []                                                 # (time, order, kind, payload)
    for t0, layer, n in p.offloads:
        events.append((scale(t0), 0, "issue", ("d2h", layer, n)))
    for layer, (t0, n) in p.fetches.items():
        events.append((scale(t0), 0, "issue", ("h2d", layer, n)))
    for layer, t in offload_due.items():
        events.append((t, 1, "due", ("d2h", layer)))
    for layer, t in p.needed.items():
        events.append((scale(t), 1, "due", ("h2d", layer)))
    events.sort(key=lambda e: (e[0], e[1]))
    delay, free = 0.0, {"d2h": 0.0, "h2d": 0.0}
    done: dict = {}
    transfers, stalls = [], []                                  # stalls: (measured time, added delay)
    for t, _, kind, payload in events:
        if kind == "issue":
            lane, layer, n = payload
            t0 = max(t + delay, free[lane])
            t1 = t0 + link.time(n)
            free[lane] = t1
            done[(lane, layer)] = max(done.get((lane, layer), 0.0), t1)
            transfers.append((lane, t0, t1, n, layer))
        else:
            lane, layer = payload
            late = done.get((lane, layer), 0.0) - (t + delay)
            if late > 0:
                delay += late
                stalls.append((t, late))

    def shifted(t):                                             # a measured compute time after the stalls before it
        return t + sum(d for ts, d in stalls if ts <= t)

    compute = [(shifted(scale(a)), shifted(scale(b)), f"fwd {i}") for i, (a, b) in p.forward.items() if b]
    compute += [(shifted(scale(a)), shifted(scale(b)), f"bwd {i}") for i, (a, b) in p.backward.items() if b]
    ends = [b for a, b in p.backward.values() if b] + [b for a, b in p.forward.values() if b]
    busy = {lane: sum(t1 - t0 for ln, t0, t1, _, _ in transfers if ln == lane) for lane in ("d2h", "h2d")}
    return LinkSchedule(sorted(compute), transfers, delay, scale(max(ends)), busy, link, start)


def break_even_speedup(p: OffloadPass, link: Link | str = DEFAULT_LINK, *, hi: float = 1e7) -> float:
    """The smallest device speedup over this CPU (compute ÷ s, link unchanged) at which the modeled link stops
    hiding behind compute: below it every transfer is hidden (bisection on `link_schedule`)."""
    link = get_link(link)
    if link_schedule(p, link, speedup=hi).exposed == 0.0:
        return float("inf")
    lo = 1.0
    if link_schedule(p, link, speedup=lo).exposed > 0.0:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if link_schedule(p, link, speedup=mid).exposed == 0.0 else (lo, mid)
        if hi / lo < 1.001:
            break
    return hi



__all__ = ["OffloadPass", "LinkSchedule", "link_schedule", "break_even_speedup"]
