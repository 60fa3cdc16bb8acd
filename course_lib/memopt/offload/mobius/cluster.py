"""Mobius on a modeled commodity server (Feng et al., ASPLOS 2023): N GPUs behind shared PCIe switches, each switch
one x16 uplink to the host's memory, no GPU peer-to-peer. Everything here is *modeled* (docs/formulas.md §14.2).

    Topology             GPUs, GPUs per switch, the per-GPU link and the switch uplink (`costmodel` presets)
    sequential_mapping   stage s on GPU s mod N (adjacent stages under the same switch)
    cross_mapping        adjacent stages under different switches (the paper's cross mapping)
    mobius_cluster_time  a fluid simulation of Mobius's pipeline: each GPU computes its stages in turn and prefetches
                         its next one; transfers through one switch share its uplink equally
    zero3_offload_time   DeepSpeed ZeRO-3 + offload on the same GPUs: every GPU gathers every layer from host memory
                         in each micro-batch's forward and backward, all GPUs at once
    plot_mobius_timeline the single-device timeline of `mobius.mobius_timeline` as Gantt rows

Contention rule (the model): a transfer's rate is min(B_gpu, B_up / n), n the transfers active under its switch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....core.costmodel import Link, get_link
from ...memory_fit import DEFAULT_LINK


@dataclass(frozen=True)
class Topology:
    """N GPUs, `per_switch` under each PCIe switch; each GPU's link and each switch's uplink to the host (modeled)."""
    n_gpus: int = 8
    per_switch: int = 2
    link: Link | str = DEFAULT_LINK
    uplink: Link | str = DEFAULT_LINK

    def __post_init__(self):
        if self.n_gpus < 1 or self.per_switch < 1 or self.n_gpus % self.per_switch:
            raise ValueError(f"{self.n_gpus} GPUs cannot sit {self.per_switch} to a switch")

    @property
    def n_switches(self) -> int:
        return self.n_gpus // self.per_switch

    def switch(self, gpu: int) -> int:
        return gpu // self.per_switch


def sequential_mapping(n_stages: int, topo: Topology) -> list:
    """Stage s on GPU s mod N: GPUs 0, 1 (under switch 0) take stages 0, 1 — adjacent stages share a switch."""
    return [s % topo.n_gpus for s in range(n_stages)]


def cross_mapping(n_stages: int, topo: Topology) -> list:
    """Adjacent stages under different switches: the k-th GPU of the round goes to switch k mod n_switches."""
    order = [(k % topo.n_switches) * topo.per_switch + k // topo.n_switches for k in range(topo.n_gpus)]
    return [order[s % topo.n_gpus] for s in range(n_stages)]


def mobius_cluster_time(stage_bytes, forward_s, backward_s, num_microbatches: int, topo: Topology, mapping) -> dict:
    """Modeled seconds of one Mobius step on `topo` (a fluid, event-driven simulation).

    Work items: the stages' forwards 0 … S−1, then their backwards S−1 … 0, each on GPU mapping[s], M micro-batches
    each (forward_s[s], backward_s[s]: seconds per micro-batch). Micro-batch m of an item starts when its GPU is free,
    the item's stage has arrived, and micro-batch m of the item before it has finished. A GPU holds two stages: it
    starts loading its next item's stage when it starts computing the current one (the last stage's backward needs
    no load: it stayed). Loads share their switch's uplink (the module's rule). Returns total seconds, the seconds
    the GPUs waited for loads, and the time-averaged number of concurrent loads per switch while any ran."""
    S = len(stage_bytes)
    if len(mapping) != S:
        raise ValueError("mapping needs one GPU per stage")
    link, up = get_link(topo.link), get_link(topo.uplink)
    items = [("fwd", s) for s in range(S)] + [("bwd", s) for s in reversed(range(S))]
    queue = {g: [j for j, (_, s) in enumerate(items) if mapping[s] == g] for g in range(topo.n_gpus)}
    cost = [(forward_s if k == "fwd" else backward_s)[s] for k, s in items]
    need_load = [not (k == "bwd" and s == S - 1 and mapping[s] == mapping[S - 1]) for k, s in items]
    remaining = {j: float(stage_bytes[items[j][1]]) for j in range(len(items)) if need_load[j]}
    loaded = {j: 0.0 for j in range(len(items)) if not need_load[j]}
    done = {}                                              # (item, micro-batch) -> finish time
    pos = {g: 0 for g in queue}                            # index into the GPU's queue of the item it computes
    mb = {g: 0 for g in queue}
    busy = {g: None for g in queue}                        # (finish time, item, micro-batch) while computing
    started = set()                                        # items whose first micro-batch started
    active, t, waited, share = set(), 0.0, 0.0, [0.0, 0.0]

    def may_load(j):
        g = mapping[items[j][1]]
        q = queue[g]
        i = q.index(j)
        return i == 0 or q[i - 1] in started

    while len(done) < len(items) * num_microbatches:
        for j in remaining:                                # loads whose slot is free start now
            if j not in active and remaining[j] > 0 and may_load(j):
                active.add(j)
        for g, q in queue.items():                         # idle GPUs start what is ready
            if busy[g] is None and pos[g] < len(q):
                j, m = q[pos[g]], mb[g]
                ready = j in loaded and (j == 0 or (j - 1, m) in done)
                if ready:
                    busy[g] = (t + cost[j], j, m)
                    started.add(j)
        rates = {}
        for j in active:
            n = sum(1 for i in active if topo.switch(mapping[items[i][1]]) == topo.switch(mapping[items[j][1]]))
            rates[j] = min(link.bandwidth, up.bandwidth / n)
        nxt = min([b[0] for b in busy.values() if b] + [t + remaining[j] / rates[j] for j in active])
        dt = nxt - t
        if active:
            per = {}
            for j in active:
                per.setdefault(topo.switch(mapping[items[j][1]]), 0)
                per[topo.switch(mapping[items[j][1]])] += 1
            share[0] += dt * sum(per.values()) / len(per)
            share[1] += dt
        waited += dt * sum(1 for g in queue if busy[g] is None and pos[g] < len(queue[g])
                           and queue[g][pos[g]] not in loaded)
        t = nxt
        for j in list(active):
            remaining[j] -= rates[j] * dt
            if remaining[j] <= 1e-6 * stage_bytes[items[j][1]]:
                remaining[j] = 0.0
                active.discard(j)
                loaded[j] = t
        for g, b in busy.items():
            if b and b[0] <= t + 1e-15:
                done[(b[1], b[2])] = t
                busy[g] = None
                mb[g] += 1
                if mb[g] == num_microbatches:
                    mb[g], pos[g] = 0, pos[g] + 1
    return {"seconds": t, "waiting": waited, "loads_per_switch": share[0] / share[1] if share[1] else 0.0}


def zero3_offload_time(param_bytes: float, compute_s: float, num_microbatches: int, topo: Topology) -> dict:
    """DeepSpeed ZeRO-3 + offload on `topo`, modeled as favourably as possible: data parallel over the N GPUs
    (num_microbatches/N micro-batches each, `compute_s` seconds of forward + backward per micro-batch), every GPU
    gathering all P parameter bytes through host memory for each micro-batch's forward and again for its backward (no
    peer-to-peer on commodity GPUs), all GPUs at once — each at min(B_gpu, B_up/per_switch) — and every transfer
    perfectly overlapped with compute: T = max(compute, link)."""
    link, up = get_link(topo.link), get_link(topo.uplink)
    per_gpu = max(1, -(-num_microbatches // topo.n_gpus))
    rate = min(link.bandwidth, up.bandwidth / topo.per_switch)
    comm = per_gpu * 2 * param_bytes / rate
    compute = per_gpu * compute_s
    return {"seconds": max(compute, comm), "compute": compute, "comm": comm, "h2d_per_gpu": per_gpu * 2 * param_bytes}


def plot_mobius_timeline(tl, *, ax=None, title: str = "Mobius step: measured compute, modeled PCIe"):
    """Gantt rows of a `MobiusTimeline`: compute, h2d (stages and boundaries in), d2h (boundaries and gradients
    out), in milliseconds on one clock, with a legend of what each colour moves or runs. A compute bar is labelled
    only where its label fits inside it (a short stage's would spill over its neighbours)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8), layout="constrained")
    rows = {"compute": 2, "h2d": 1, "d2h": 0}
    kinds = {"fwd": ("#4C72B0", "forward"), "bwd": ("#DD8452", "recompute + backward"),
             "stage": ("#55A868", "stage parameters in"), "boundary": ("#8172B3", "boundary activations"),
             "grads": ("#C44E52", "gradients out")}
    span = max([t1 for _, t1, _ in tl.compute] + [t1 for _, _, t1, _, _ in tl.transfers] + [1e-12]) * 1e3
    fig = ax.figure
    width_px = ax.get_window_extent().width or fig.get_figwidth() * fig.dpi
    used = set()
    for t0, t1, label in tl.compute:
        kind = label.split()[0]
        used.add(kind)
        ax.barh(rows["compute"], (t1 - t0) * 1e3, left=t0 * 1e3, color=kinds[kind][0], edgecolor="white")
        if (t1 - t0) * 1e3 / span * width_px > 7 * len(label):      # about 7 px per character at fontsize 7
            ax.text((t0 + t1) / 2 * 1e3, rows["compute"], label, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    for lane, t0, t1, _n, label in tl.transfers:
        kind = label.split()[0]
        used.add(kind)
        ax.barh(rows[lane], (t1 - t0) * 1e3, left=t0 * 1e3, color=kinds[kind][0], edgecolor="white")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms; compute measured, link modeled)")
    ax.legend(handles=[Patch(color=c, label=name) for k, (c, name) in kinds.items() if k in used], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_title(f"{title} — {tl.link.name}: step {tl.total * 1e3:.2f} ms, waiting {tl.exposed * 1e3:.2f} ms",
                 fontsize=9)
    return ax


__all__ = ["Topology", "sequential_mapping", "cross_mapping", "mobius_cluster_time", "zero3_offload_time",
           "plot_mobius_timeline"]
