"""Which tensors to swap and when: the baselines (no offload, vDNN's swap-everything), a budget-driven greedy rule
and SwapAdvisor's genetic search (Huang, Jin & Li, ASPLOS 2020) over keep/swap and release/prefetch timing.
"""
from __future__ import annotations

import numpy as np

from ...core.costmodel import Link, get_link
from ..memory_fit import DEFAULT_LINK
from .plans import SwapPlan, check_budget, least_memory, simulate
from .trace import Storage, Trace


def _after(trace: Trace, k0: int, seconds: float, speedup: float, limit: int) -> int:
    """The first op k ≥ k0 such that ops k0..k take at least `seconds` (÷ speedup), or `limit`."""
    k, acc = k0, 0.0
    while k < limit and acc + trace.ops[k][1] / speedup < seconds:
        acc += trace.ops[k][1] / speedup
        k += 1
    return min(k, limit)


def _before(trace: Trace, k0: int, seconds: float, speedup: float, limit: int) -> int:
    """The last op k ≤ k0 such that ops k..k0−1 take at least `seconds` (÷ speedup), or `limit`."""
    k, acc = k0, 0.0
    while k > limit and acc < seconds:
        k -= 1
        acc += trace.ops[k][1] / speedup
    return max(k, limit)


def _timed(trace: Trace, c: Storage, lag: float, lead: float, speedup: float) -> tuple:
    """(release, prefetch) for c: let the original go once `lag` seconds of compute have run after its save, issue
    the prefetch `lead` seconds of compute before its use — both clamped to its idle window."""
    w = c.drop if lag == 0 else max(c.drop, _after(trace, c.pack + 1, lag, speedup, c.need - 2))
    return w, max(w + 1, min(_before(trace, c.need, lead, speedup, w + 1), c.need - 1))


def no_swap() -> SwapPlan:
    return SwapPlan({}, {}, "no offload")


def swap_all(trace: Trace, link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0) -> SwapPlan:
    """Every candidate swapped, each let go and prefetched just late and early enough to hide its own transfer
    (vDNN's 'offload all')."""
    link = get_link(link)
    plan = SwapPlan(name="swap everything")
    for c in trace.candidates:
        plan.release[c.id], plan.prefetch[c.id] = _timed(trace, c, link.time(c.nbytes), link.time(c.nbytes), speedup)
    return plan


def greedy(trace: Trace, budget: int, link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0) -> SwapPlan | None:
    """While the modeled peak is over the budget, swap the largest candidate resident at the peak op that is idle
    there (tie: the longest idle window), timed to hide its own transfer but off the device at that op. None: this
    baseline cannot reach the budget."""
    check_budget(trace, budget)
    link = get_link(link)
    plan = SwapPlan(name="greedy")
    while True:
        o = simulate(trace, plan, link, speedup=speedup)
        if o.peak <= budget:
            return plan
        k = int(np.argmax(o.memory))
        options = [c for c in trace.candidates if c.id not in plan.prefetch and c.drop < k < c.need - 1]
        if not options:
            return None
        c = max(options, key=lambda c: (c.nbytes, c.need - c.drop))
        w, p = _timed(trace, c, link.time(c.nbytes), link.time(c.nbytes), speedup)
        plan.release[c.id], plan.prefetch[c.id] = min(w, k - 1), max(p, k + 1)


def evolve(pop: list, fitness, random_genes, rng, *, population: int, generations: int):
    """The genetic algorithm's loop over genomes (integer arrays): each generation keeps the two fittest (lowest
    `fitness`), then fills `population` with children — two parents each chosen by a tournament of 3, uniform
    crossover, and each gene replaced by `random_genes()`'s with probability 1/len(genome). Returns the fittest."""
    for _ in range(generations):
        ranked = sorted(pop, key=fitness)
        nxt = ranked[:2]
        while len(nxt) < population:
            a, b = (min(rng.choice(len(pop), 3, replace=False), key=lambda i: fitness(pop[i])) for _ in range(2))
            n = len(pop[a])
            child = np.where(rng.random(n) < 0.5, pop[a], pop[b])
            flip = rng.random(n) < 1.0 / n
            nxt.append(np.where(flip, random_genes(), child))
        pop = nxt
    return min(pop, key=fitness)


def genetic(trace: Trace, budget: int, link: Link | str = DEFAULT_LINK, *, speedup: float = 1.0,
            population: int = 32, generations: int = 30, seed: int = 0) -> SwapPlan | None:
    """A genetic search over plans (SwapAdvisor's method, here on what to swap and when, not on the op order).

    Genome: two genes per candidate c. out ∈ {0 = keep it, 1…6}: let the original go after f·t_c of compute,
    in ∈ {1…6}: prefetch f·t_c of compute ahead, f = 0, ¼, ½, 1, 2, 4 (t_c: its modeled transfer; f = 0: at once
    and at the last moment). Fitness: the modeled step time; plans over the budget rank after every plan within it,
    by how far over. Tournament of 3, uniform crossover, one mutation per genome on average, the two best kept. The
    population starts from the greedy plan, swap-everything, the least-memory plan and no offload, and the result is
    the best of the search and those (exactly), so it is never worse than the baselines and always fits a budget
    ≥ `minimum_budget`.
    """
    check_budget(trace, budget)
    link = get_link(link)
    rng = np.random.default_rng(seed)
    C = trace.candidates
    if not C:
        return no_swap()
    factors = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    K = len(factors)
    lag = [[_timed(trace, c, f * link.time(c.nbytes), 0.0, speedup)[0] for f in factors] for c in C]
    lead = [[min(_before(trace, c.need, f * link.time(c.nbytes), speedup, c.drop + 1), c.need - 1) for f in factors]
            for c in C]

    def plan_of(genome) -> SwapPlan:
        plan = SwapPlan(name="genetic")
        for i, c in enumerate(C):
            if genome[i]:
                w = lag[i][genome[i] - 1]
                plan.release[c.id], plan.prefetch[c.id] = w, max(lead[i][genome[len(C) + i] - 1], w + 1)
        return plan

    cache: dict = {}

    def fitness(genome) -> tuple:
        key = genome.tobytes()
        if key not in cache:
            o = simulate(trace, plan_of(genome), link, speedup=speedup)
            cache[key] = (o.peak > budget, max(0, o.peak - budget), o.seconds)
        return cache[key]

    def genome_of(plan: SwapPlan | None):
        g = np.zeros(2 * len(C), dtype=np.int64)
        g[len(C):] = 1
        if plan is not None:
            for i, c in enumerate(C):
                if c.id in plan.prefetch:
                    g[i] = 1 + min(range(K), key=lambda j: abs(lag[i][j] - plan.release[c.id]))
                    g[len(C) + i] = 1 + min(range(K), key=lambda j: abs(lead[i][j] - plan.prefetch[c.id]))
        return g

    seeds = [p for p in (greedy(trace, budget, link, speedup=speedup), swap_all(trace, link, speedup=speedup),
                         least_memory(trace), no_swap()) if p is not None]
    pop = [genome_of(p) for p in seeds]
    while len(pop) < population:
        keep = rng.random(len(C)) < rng.random()
        pop.append(np.concatenate([rng.integers(1, K + 1, len(C)) * keep, rng.integers(1, K + 1, len(C))]))

    def random_genes():
        return np.concatenate([rng.integers(0, K + 1, len(C)), rng.integers(1, K + 1, len(C))])

    def rank(plan: SwapPlan) -> tuple:
        o = simulate(trace, plan, link, speedup=speedup)
        return o.peak > budget, max(0, o.peak - budget), o.seconds

    fittest = evolve(pop, fitness, random_genes, rng, population=population, generations=generations)
    best = min([plan_of(fittest)] + seeds, key=rank)                    # the seeds exactly, not their nearest genes
    best.name = "genetic"
    return None if rank(best)[0] else best



__all__ = ["no_swap", "swap_all", "greedy", "genetic", "evolve"]
