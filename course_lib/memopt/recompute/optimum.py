"""The best recomputation plan under a memory budget, and the plans no other beats on both peak and extra cost.

The optimal plan under a budget is a dynamic program over the chain — the single-level case of Herrmann et al.,
"Optimal checkpointing for heterogeneous chains", ACM TOMS 2024 (Inria hal-02352969, 2019); Checkmate (Jain et al.,
MLSys 2020) solves general graphs with an ILP. Walk the blocks left to right keeping, for every prefix, the plans no
other plan beats in all three of (held bytes, peak so far, extra cost).

Each plan's peak and extra cost are `costs.plan_peak` and `costs.plan_extra`, unit by unit (`costs.ChainCosts.unit`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...memory import fmt_bytes
from . import RecomputePlan, Unit
from .costs import ChainCosts


@dataclass(frozen=True)
class Choice:
    plan: RecomputePlan
    peak: int
    extra: float


def frontier(costs: ChainCosts, cost: str, budget: int | None) -> list:
    """Every plan not beaten on (peak, extra), as (peak, extra, units). Dynamic program over the chain: states after
    blocks [0, i) are (held, peak so far, extra, units); a state another one beats on all three is dropped."""
    n = len(costs.blocks)
    states: list[list] = [[] for _ in range(n + 1)]
    states[0] = [(costs.embed, 0, 0, ())]
    for i in range(n):
        states[i] = _prune(states[i])
        for held, peak, extra, units in states[i]:
            steps = [Unit(i, i + 1, "store"), Unit(i, i + 1, "selective")] + [Unit(i, j, "full")
                                                                               for j in range(i + 1, n + 1)]
            for u in steps:
                h, w, e = costs.unit(u, cost)
                new_peak = max(peak, held + w)
                if budget is None or new_peak <= budget:
                    states[u.end].append((held + h, new_peak, extra + e, units + (u,)))
    final = [(max(peak, held + costs.head), extra, units) for held, peak, extra, units in states[n]]
    final = [f for f in final if budget is None or f[0] <= budget]
    best = []
    for peak, extra, units in sorted(final, key=lambda f: (f[0], f[1])):
        if not best or extra < best[-1][1]:
            best.append((peak, extra, units))
    return best


def _prune(states: list) -> list:
    states = sorted(states, key=lambda s: (s[0], s[1], s[2]))
    kept = []
    for s in states:
        if not any(k[0] <= s[0] and k[1] <= s[1] and k[2] <= s[2] for k in kept):
            kept.append(s)
    return kept


def min_budget(costs: ChainCosts) -> int:
    """The smallest activation peak any plan reaches (every plan must fit the embedding, the head and, at some
    moment, one block's working set)."""
    return frontier(costs, "flops", None)[0][0]


def pareto_front(costs: ChainCosts, cost: str = "flops") -> list[Choice]:
    """The plans no other plan beats on both peak and extra cost, from the smallest peak up."""
    return [Choice(RecomputePlan(units, "optimal"), peak, extra) for peak, extra, units in frontier(costs, cost, None)]


def optimal_plan(costs: ChainCosts, budget: int, cost: str = "flops") -> Choice:
    """The plan with the least extra cost ('flops' or 'seconds') whose activation peak fits `budget` bytes."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget is a positive number of bytes, got {budget!r}")
    if cost not in ("flops", "seconds"):
        raise ValueError(f"cost is 'flops' or 'seconds', got {cost!r}")
    smallest = min_budget(costs)
    if budget < smallest:
        raise ValueError(f"a budget of {budget:,} bytes ({fmt_bytes(budget)}) is below the minimum of {smallest:,} "
                         f"bytes ({fmt_bytes(smallest)}) that any recomputation plan needs: the embedding's and the "
                         f"head's saved tensors plus one block's working set must fit at once. Use budget >= "
                         f"{smallest:,}, a smaller batch, or a shorter sequence")
    peak, extra, units = min(frontier(costs, cost, budget), key=lambda f: (f[1], f[0]))
    return Choice(RecomputePlan(units, "optimal"), peak, extra)
