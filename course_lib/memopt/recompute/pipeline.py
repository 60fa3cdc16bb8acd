"""Recomputation inside a pipeline: the activation peak of each pipeline rank, and how many micro-batches fit.

Inside a pipeline (notebook 05's executor) stage k runs its part of the chain (`stage_chain`) once per micro-batch,
so each of the m micro-batches it has in flight holds held_k = E + Σ_u held_u + H (`plan_held`; E and H only on the
first and last stage) and the one whose backward runs needs the stage chain's peak: the stage's peak is
(m − 1)·held_k + peak_k (`pipeline_peaks`; 1F1B: m = S − k), and a budget C admits 1 + ⌊(C − peak_k)/held_k⌋
micro-batches in flight (`max_in_flight`).
"""
from __future__ import annotations

from .costs import ChainCosts, plan_held, plan_peak


def stage_chain(costs: ChainCosts, bounds, stage: int) -> ChainCosts:
    """The part of the chain pipeline stage `stage` runs (`bounds`: [start, end) blocks of every stage): its blocks,
    the embedding on stage 0, the head and loss on the last. A later stage's input — received from the stage before
    — is its first block's input, which that block's costs already count."""
    start, end = bounds[stage]
    return ChainCosts(costs.embed if stage == 0 else 0, costs.head if stage == len(bounds) - 1 else 0,
                      tuple(costs.blocks[start:end]))


def pipeline_peaks(schedule, bounds, costs: ChainCosts, policy: str | dict = "full") -> list[int]:
    """Per pipeline rank, the activation peak of `schedule` (no B/W split) when every (virtual) stage recomputes its
    blocks by `policy` — a name for `make_plan` or {stage: RecomputePlan}. Each micro-batch in flight on stage k holds
    held_k = `plan_held` of the stage's chain; the one whose backward runs needs work_k = `plan_peak` at once. With
    m micro-batches in flight the peak is (m − 1)·held_k + work_k (1F1B: m = S − k, docs/formulas.md §3.2);
    `schedules.peak_bytes` walks the op lists. The exact form of GPipe's O(N + (L/K)·(N/M)) with
    re-materialization (docs/formulas.md §3.1)."""
    from ...parallel.pipeline.schedules import peak_bytes
    from . import make_plan
    held, work = {}, {}
    for k in range(schedule.num_virtual_stages):
        chain = stage_chain(costs, bounds, k)
        plan = make_plan(policy, len(chain.blocks)) if isinstance(policy, str) else policy[k]
        held[k], work[k] = plan_held(plan, chain), plan_peak(plan, chain)
    return peak_bytes(schedule, held, work)


def max_in_flight(budget: int, held: int, work: int) -> int:
    """The most micro-batches a stage can have in flight within `budget` bytes of activations: the largest m with
    (m − 1)·held + work ≤ budget, 0 if not even one micro-batch's working set fits."""
    if work > budget:
        return 0
    return 1 + (budget - work) // held
