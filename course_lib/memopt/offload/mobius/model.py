"""Mobius's model of a step (Feng et al., ASPLOS 2023; docs/formulas.md §14.1): the GPT cut into units, a partition
into stages, the bytes each stage moves, the order of operations, the step on one clock (measured or stated compute,
modeled PCIe transfers), and the partition problem solved exhaustively at toy size. Nothing here moves a byte: the
executor (`mobius.executor`) does, and its transfer log must equal `mobius_bytes`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.nn as nn

from ....core.costmodel import Link, get_link
from ....core.model import (
    block_activation_bytes,
    embed_activation_bytes,
    get_config,
    head_activation_bytes,
    stage_bounds,
)
from ...memory_fit import DEFAULT_LINK


def units_of(model: nn.Module) -> list:
    """The GPT as Mobius's layers: [embedding (wte, wpe), block 0, …, block L−1, head (ln_f, lm_head)], each a list of
    modules. A stage is a contiguous range of units."""
    return [[model.wte, model.wpe], *[[b] for b in model.blocks], [model.ln_f, model.lm_head]]


def _params(unit) -> list:
    return [p for m in unit for p in m.parameters()]


def unit_bytes(model: nn.Module) -> list:
    """Parameter bytes of each unit (numel × element size, exactly)."""
    return [sum(p.numel() * p.element_size() for p in _params(u)) for u in units_of(model)]


def even_partition(n_layer: int, n_stages: int) -> list:
    """Unit bounds [start, end) of the course's even split: the blocks cut by `model.stage_bounds`, the embedding in
    the first stage, the head in the last — what a pipeline of notebook 05 would do."""
    bounds = [(a + 1, b + 1) for a, b in stage_bounds(n_layer, n_stages)]
    bounds[0] = (0, bounds[0][1])
    bounds[-1] = (bounds[-1][0], n_layer + 2)
    return bounds


def _check_bounds(bounds, n_units: int) -> list:
    bounds = [(int(a), int(b)) for a, b in bounds]
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != n_units or \
            any(a >= b for a, b in bounds) or any(b != a2 for (_, b), (a2, _) in zip(bounds, bounds[1:])):
        raise ValueError(f"stage bounds {bounds} must cut units 0…{n_units - 1} into contiguous, non-empty ranges")
    return bounds


def unit_activation_bytes(cfg, batch_size: int, num_microbatches: int = 1, seq_len: int | None = None,
                          elem_bytes: int = 4) -> list:
    """Device activation bytes a unit needs while its stage runs backward, for the partition search: what the
    unit saves for one micro-batch (`model.*_activation_bytes`, recomputed one micro-batch at a time), plus for
    every unit the M boundaries (inputs in forward, gradients in backward, e·B·T·d each), plus for the head the
    temporaries of width V the saved-tensor count does not see — logits, their gradient, the log-softmax's
    gradient and two more in cross-entropy's backward: 5·e·B·T·V, counted once on this implementation. A planning
    bound, not an exact count: the run's measured peak is checked against the budget, not against this."""
    c = get_config(cfg)
    T = seq_len or c.seq_len
    edge = num_microbatches * elem_bytes * batch_size * T * c.d_model
    head = head_activation_bytes(c, batch_size, T, elem_bytes) + 5 * elem_bytes * batch_size * T * c.vocab_size
    return [embed_activation_bytes(c, batch_size, T, elem_bytes) + edge,
            *[block_activation_bytes(c, batch_size, T, elem_bytes) + edge] * c.n_layer, head + edge]


def stage_sums(values, bounds) -> list:
    return [sum(values[a:b]) for a, b in bounds]


def states_peak(stage_param_bytes) -> int:
    """Model-state bytes on the device at their peak (the formula in the module docstring)."""
    P = list(stage_param_bytes) + [0]
    fwd = [P[s] + P[s + 1] for s in range(len(P) - 1)]
    bwd = [2 * P[s] + (P[s - 1] if s else 0) + P[s + 1] for s in range(len(P) - 1)]
    return max(fwd + bwd)


def state_peaks(stage_param_bytes) -> dict:
    """Device bytes of parameters and of gradients at their peaks, each exact: parameters max_s(P_s + P_{s+1})
    (a stage in use and its neighbour arriving, in either direction), gradients the same (a stage's in backward
    and its successor's still leaving); one stage: P_0 each."""
    P = list(stage_param_bytes)
    pair = max([a + b for a, b in zip(P, P[1:])] or [P[0]])
    return {"parameters": pair, "gradients": pair}


def mobius_bytes(stage_param_bytes, num_microbatches: int, boundary_bytes: int) -> dict:
    """h2d and d2h bytes of one Mobius step (docs/formulas.md §14.1)."""
    P = list(stage_param_bytes)
    S, total = len(P), sum(P)
    acts = num_microbatches * (S - 1) * boundary_bytes
    return {"h2d": 2 * total - P[-1] + acts, "d2h": total + acts, "boundary": acts}


# ---------------------------------------------------------------------------------------------- the modeled clock
@dataclass
class MobiusTimeline:
    """One step on one clock: compute spans (measured or stated) and transfers on the modeled link, each direction
    one transfer at a time. Rules: stage s + 1's parameters are issued when stage s starts computing (prefetch) or
    when it ends (no prefetch); a stage starts when the one before it has ended and its parameters have arrived;
    boundary activations leave as they are made and come back before their stage's backward; gradients leave as a
    stage's backward ends, and the step ends when the last of them has left."""
    compute: list = field(default_factory=list)     # (t0, t1, label)
    transfers: list = field(default_factory=list)   # (lane 'h2d' | 'd2h', t0, t1, bytes, label)
    total: float = 0.0
    compute_seconds: float = 0.0
    link: Link | None = None

    @property
    def exposed(self) -> float:
        """Seconds of the step the device waited for the link."""
        return self.total - self.compute_seconds


def mobius_plan(n_stages: int, *, prefetch: bool = True) -> list:
    """The order of one Mobius step as operations: ('load', s) copies stage s in, ('fwd', s) / ('bwd', s) run it
    (all micro-batches), ('drop', s) frees it. With prefetch the next stage's load comes *before* the current
    stage computes; the last stage stays from its forward to its backward; a stage is dropped once computed.

        load 0, load 1, fwd 0, drop 0, load 2, fwd 1, drop 1, …, fwd S−1, load S−2, bwd S−1, drop S−1, …, bwd 0, drop 0
    """
    S = n_stages
    order = [("fwd", s) for s in range(S)] + [("bwd", s) for s in reversed(range(S))]
    ops = [("load", 0)]
    for k, (kind, s) in enumerate(order):
        nxt = order[k + 1] if k + 1 < len(order) else None
        load = nxt is not None and nxt != ("bwd", S - 1)
        if prefetch and load:
            ops.append(("load", nxt[1]))
        ops.append((kind, s))
        if kind == "bwd" or s < S - 1:
            ops.append(("drop", s))
        if not prefetch and load:
            ops.append(("load", nxt[1]))
    return ops


def mobius_timeline(stage_param_bytes, forward_s, backward_s, *, boundary_bytes: int = 0, num_microbatches: int = 1,
                    link: Link | str = DEFAULT_LINK, prefetch: bool = True, plan=None) -> MobiusTimeline:
    """The step of `MobiusExecutor` on a modeled link: `forward_s[s]` and `backward_s[s]` are stage s's compute
    (all micro-batches; backward includes the recomputation), measured or from stated op costs; `plan` the order
    of operations (`mobius_plan(S, prefetch=prefetch)` by default). A load the next compute needs is issued when
    the compute before it ends; any other load pending at a compute is issued when that compute starts (it is
    prefetched under it); a backward's boundaries are issued when the compute before it starts."""
    link = get_link(link)
    P, S = list(stage_param_bytes), len(stage_param_bytes)
    plan = mobius_plan(S, prefetch=prefetch) if plan is None else plan
    tl = MobiusTimeline(link=link)
    free = {"h2d": 0.0, "d2h": 0.0}

    def move(lane, t, n, label):
        t0 = max(t, free[lane])
        free[lane] = t1 = t0 + link.time(n)
        tl.transfers.append((lane, t0, t1, n, label))
        return t1

    acts = num_microbatches * boundary_bytes
    arrived = {}                          # stage -> when its parameters are on the device
    pending = []                          # stages loaded by the plan, not yet sent
    prev_start = prev_end = 0.0           # the compute before this one
    for kind, s in plan:
        if kind == "load":
            pending.append(s)
            continue
        if kind == "drop":
            continue
        for x in [x for x in pending if x == s]:
            arrived[x] = move("h2d", prev_end, P[x], f"stage {x}")
        ready = arrived[s]
        if kind == "bwd" and s > 0 and acts:
            ready = max(ready, move("h2d", prev_start, acts, f"boundary {s - 1}"))
        start = max(prev_end, ready)
        for x in [x for x in pending if x != s]:
            arrived[x] = move("h2d", start, P[x], f"stage {x}")
        pending = []
        secs = (forward_s if kind == "fwd" else backward_s)[s]
        tl.compute.append((start, start + secs, f"{kind} {s}"))
        prev_start, prev_end = start, start + secs
        if kind == "fwd" and s < S - 1 and acts:
            move("d2h", prev_end, acts, f"boundary {s}")
        if kind == "bwd":
            move("d2h", prev_end, P[s], f"grads {s}")
    tl.compute_seconds = sum(forward_s) + sum(backward_s)
    tl.total = max(prev_end, free["d2h"])
    return tl


def search_partition(unit_param_bytes, unit_forward_s, unit_backward_s, device_bytes: float, *,
                     activation_bytes=None, boundary_bytes: int = 0, num_microbatches: int = 1,
                     link: Link | str = DEFAULT_LINK, prefetch: bool = True) -> dict:
    """Every contiguous partition of the units (2^(U−1) of them), each stage count: the fastest modeled step whose
    device bytes fit — Mobius's mixed-integer program solved by enumeration at toy size. A
    partition fits when `states_peak` + the largest stage's `activation_bytes` (per unit, summed; 0 if None) ≤
    `device_bytes`. Returns {'bounds', 'seconds', 'device', 'tried', 'feasible'}; bounds None if nothing fits."""
    U = len(unit_param_bytes)
    acts = list(activation_bytes) if activation_bytes is not None else [0] * U
    best = {"bounds": None, "seconds": float("inf"), "device": None, "tried": 0, "feasible": 0}
    for cuts in itertools.product((False, True), repeat=U - 1):
        edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [U]
        bounds = list(zip(edges, edges[1:]))
        P = stage_sums(unit_param_bytes, bounds)
        device = states_peak(P) + max(stage_sums(acts, bounds))
        best["tried"] += 1
        if device > device_bytes:
            continue
        best["feasible"] += 1
        secs = mobius_timeline(P, stage_sums(unit_forward_s, bounds), stage_sums(unit_backward_s, bounds),
                               boundary_bytes=boundary_bytes, num_microbatches=num_microbatches, link=link,
                               prefetch=prefetch).total
        if secs < best["seconds"]:
            best.update(bounds=bounds, seconds=secs, device=device)
    return best
