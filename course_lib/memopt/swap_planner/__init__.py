"""A swap planner in the style of SwapAdvisor (Huang, Jin & Li, ASPLOS 2020): trace one real training step, then
choose which activations to swap out to the host and when to prefetch each one, so that the step fits a device
memory budget and the transfers the compute cannot hide cost as little modeled time as possible.

    trace_step      one forward + backward under `TracingTracker` (the memory accountant with an op clock): every
                    storage's size, the op that allocated it and the op after which it was freed, every op's
                    measured time; every tensor autograd saves is swapped out once in this run, which shows when
                    the forward drops it (`drop`), when backward first needs it (`need`) and when autograd lets go
                    (`release`)
    simulate        a plan's modeled step time (ops ÷ speedup, the α–β link for d2h and h2d, one transfer at a
                    time per direction; a prefetch late for its op stalls everything after it) and its exact device
                    memory at every op
    greedy          budget-driven baseline (vDNN/Capuchin-like): while the peak is over the budget, swap the largest
                    tensor alive at the peak, prefetched just early enough to hide its own transfer
    genetic         the search: a genetic algorithm over (keep | swap with one of several prefetch leads) per
                    tensor, seeded with the baselines, minimizing modeled time subject to the budget
    execute         runs a plan for real on the simulated accelerator at the budget (no OOM allowed) and returns the
                    gradients, which must be the reference's bit for bit

Device memory of a saved storage c (ops are numbered; "alive during op k" is what the accountant counts):
    kept      [birth, max(drop, released)]
    swapped   [birth, max(drop, release)] ∪ [prefetch, released]        drop ≤ release < prefetch < need
A prefetch is issued at an op boundary, before op `prefetch`: backward asks for a tensor between two ops, and a
copy made right then could meet frees that have not happened yet, so the plan brings it in at the boundary before
(prefetch ≤ need − 1) and the model stays exact. The least any plan can use is max over ops of (everything else +
each swappable tensor on [birth, drop] ∪ [need − 1, released]): a budget below that is refused.
docs/formulas.md §6.5. One subject per file: `trace` (the traced step and running a plan for real), `plans` (a plan,
its simulation and the budget bounds), `search` (the baselines, greedy and the genetic search).
"""
from __future__ import annotations

from .plans import Outcome, SwapPlan, check_budget, least_memory, minimum_budget, simulate
from .search import evolve, genetic, greedy, no_swap, swap_all
from .trace import Storage, Trace, TracingTracker, execute, trace_step

__all__ = ["Storage", "TracingTracker", "Trace", "SwapPlan", "Outcome", "trace_step", "simulate", "minimum_budget",
           "check_budget", "least_memory", "no_swap", "swap_all", "greedy", "genetic", "evolve", "execute"]
