"""What a recomputation plan costs, measured and predicted, and the best plan under a memory budget.

The layer chain is embedding → block 0 → … → block L−1 → head (+ loss). A plan (`recompute.RecomputePlan`)
stores each block, recomputes its attention core (selective), or groups blocks into fully recomputed segments. Each
unit u of a plan holds `held_u` bytes from its forward to its backward, and needs `work_u` bytes at once in backward:

    stored block l         held = work = s_l                     (everything the block saves)
    selective block l      held = s_l − δ_l,   work = max(s_l − δ_l, α_l + δ_l)
    full segment [i, j)    held = a_i (its input),  work = Σ_{l=i}^{j−1} s_l

(δ: the attention-core tensors it drops; α: what the block still keeps when backward reaches its attention core —
its input, ln1's output and statistics, q, k and v). Backward frees later units before it reaches an earlier one, so
the activation peak (bytes saved for backward, plus recomputed ones) is

    peak = max( E + Σ_u held_u + H ,  max_u ( E + Σ_{v<u} held_v + work_u ) )        E embedding, H head + loss

and the extra FLOPs are what the recomputation executes: a segment's forward less its last block's output
projection (nobody needs that block's output again: the next unit keeps it), or QKᵀ for a selective block.

Korthikanti et al. (MLSys 2023, Table 2; docs/formulas.md §4.3) per layer, 16-bit, with dropout: s = sbh(34 + 5as/h),
selective keeps 34·sbh, full recomputation 2·sbh. For this toy (fp32, masks as wide as
activations, `model.block_activation_bytes`): s = 4·sbh(18 + 3as/h) + 16sb + s² with dropout (4·sbh(16 + as/h) + 16sb
+ s² without); selective keeps 4·sbh·18 (16) + 16sb; full keeps 4·sbh.

Inside a pipeline (notebook 05's executor) stage k runs its part of the chain (`stage_chain`) once per micro-batch,
so each of the m micro-batches it has in flight holds held_k = E + Σ_u held_u + H (`plan_held`; E and H only on the
first and last stage) and the one whose backward runs needs the stage chain's peak: the stage's peak is
(m − 1)·held_k + peak_k (`pipeline_peaks`; 1F1B: m = S − k), and a budget C admits 1 + ⌊(C − peak_k)/held_k⌋
micro-batches in flight (`max_in_flight`).

The optimal plan under a budget is a dynamic program over the chain — the single-level case of Herrmann et al.,
"Optimal checkpointing for heterogeneous chains", ACM TOMS 2024 (Inria hal-02352969, 2019); Checkmate (Jain et al.,
MLSys 2020) solves general graphs with an ILP. Walk the blocks left to right keeping, for every prefix, the plans no
other plan beats in all three of (held bytes, peak so far, extra cost).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from ...distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from ...memory import MemoryTracker, fmt_bytes
from ...core.model import GPT, block_activation_bytes, embed_activation_bytes, get_config, head_activation_bytes
from ...train import MemoryProbe, Probe
from . import RecomputePlan, Unit, attention_core, checkpoint, recompute_all


@dataclass(frozen=True)
class BlockCost:
    """One block. Bytes: saved (s), its input (a), and held and work when selectively recomputed; the extra cost of
    recomputing it in FLOPs (exact) and seconds (measured; 0 in the closed forms)."""
    saved: int
    input: int
    selective_held: int
    selective_work: int
    fwd_flops: int            # the block's forward
    full_flops: int           # recomputing it as the last block of a segment (its output projection is not rerun)
    selective_flops: int      # recomputing its attention core
    fwd_seconds: float = 0.0
    full_seconds: float = 0.0
    selective_seconds: float = 0.0

    def held_work(self, kind: str) -> tuple[int, int]:
        if kind == "store":
            return self.saved, self.saved
        if kind == "selective":
            return self.selective_held, self.selective_work
        raise ValueError("held_work is per block, for 'store' or 'selective'; a 'full' unit is a segment")


@dataclass(frozen=True)
class ChainCosts:
    """The chain: embedding bytes E, head (+ loss) bytes H, and every block."""
    embed: int
    head: int
    blocks: tuple = field(default_factory=tuple)

    def unit(self, u: Unit, cost: str = "flops") -> tuple[int, int, float]:
        """(held, work, extra cost) of one unit of a plan; cost 'flops' or 'seconds'."""
        bs = self.blocks[u.start:u.end]
        if u.kind == "full":
            fwd = sum(getattr(b, f"fwd_{cost}") for b in bs[:-1])
            return bs[0].input, sum(b.saved for b in bs), fwd + getattr(bs[-1], f"full_{cost}")
        held, work = bs[0].held_work(u.kind)
        return held, work, getattr(bs[0], f"selective_{cost}") if u.kind == "selective" else 0


def plan_peak(plan: RecomputePlan, costs: ChainCosts) -> int:
    """The activation peak of `plan` by the formula in the module docstring."""
    _check(plan, costs)
    held, peak = costs.embed, 0
    for u in plan.units:
        h, w, _ = costs.unit(u)
        peak = max(peak, held + w)
        held += h
    return max(peak, held + costs.head)


def plan_extra(plan: RecomputePlan, costs: ChainCosts, cost: str = "flops") -> float:
    """The extra compute of `plan`: FLOPs (exact) or seconds (measured)."""
    _check(plan, costs)
    return sum(costs.unit(u, cost)[2] for u in plan.units)


def _check(plan: RecomputePlan, costs: ChainCosts) -> None:
    if plan.n_layer != len(costs.blocks):
        raise ValueError(f"the plan covers {plan.n_layer} blocks, the costs {len(costs.blocks)}")


# ============================================================================================ closed forms
def formula_costs(cfg, batch_size: int, seq_len: int | None = None, elem_bytes: int = 4) -> ChainCosts:
    """Every term from the config (see the module docstring; fp32 by default)."""
    c = get_config(cfg)
    B, T, d, r, nh = batch_size, seq_len or c.seq_len, c.d_model, c.mlp_ratio, c.n_head
    drop = c.dropout > 0
    tokens = B * T
    s = block_activation_bytes(c, B, T, elem_bytes)
    a = elem_bytes * tokens * d
    delta = elem_bytes * tokens * nh * T * (3 if drop else 1) + T * T     # softmax (+ mask, output), causal mask
    alpha = elem_bytes * tokens * (5 * d + 2)                             # input, ln1 out, q, k, v; ln1 mean, rstd
    linear = 2 * tokens * (4 + 2 * r) * d * d                              # q, k, v, o, fc_in, fc_out
    scores = 2 * 2 * B * T * T * d                                         # QKᵀ and A·V
    block = BlockCost(s, a, s - delta, max(s - delta, alpha + delta), linear + scores,
                      linear + scores - 2 * tokens * r * d * d, scores // 2)
    return ChainCosts(embed_activation_bytes(c, B, T, elem_bytes), head_activation_bytes(c, B, T, elem_bytes),
                      (block,) * c.n_layer)


# ============================================================================================ measured
def _lone_block(block, x, policy) -> tuple[int, int, int]:
    """(held, work, FLOPs) of one block run alone, forward and backward, under the memory accountant and torch's
    FlopCounterMode: held = activations after forward, work = the most activations + recomputed in backward."""
    with MemoryTracker().watch(block) as mem:      # watched: weights autograd saves are parameters, not activations
        with FlopCounterMode(display=False) as fc:
            h = x.detach().clone().requires_grad_()
            out = block(h) if policy is None else checkpoint(block, h, policy=policy)
            held = mem.current["activations"]
            start = len(mem.timeline)
            out.backward(torch.ones_like(out))
        work = max(s["device"].get("activations", 0) + s["device"].get("recomputed", 0)
                   for _, s in mem.timeline[start:])
    block.zero_grad(set_to_none=True)
    return held, work, fc.get_total_flops()


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(cfg, batch_size: int, *, seed: int = 0, repeats: int = 3) -> ChainCosts:
    """Every term measured on a real model, block by block: bytes with the memory accountant (each block alone:
    stored, fully and selectively recomputed), FLOPs with torch's FlopCounterMode, seconds as the median of `repeats`
    timed runs (noisy: for the `cost='seconds'` optimum, never asserted)."""
    c = get_config(cfg)
    model = GPT(c, seed=seed)
    idx = torch.randint(0, c.vocab_size, (batch_size, c.seq_len), generator=torch.Generator().manual_seed(seed))
    with MemoryTracker().watch(model) as mem:
        ids, targets = idx.clone(), idx.roll(1, dims=1)
        x = model.embed(ids)
        embed = mem.current["activations"]
        h = x.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(model.head(h).flatten(0, 1), targets.flatten())
        head = mem.current["activations"] - embed
        loss.backward()            # releases what the head saved (a graph dropped unused would keep its outputs)
    model.zero_grad(set_to_none=True)
    del loss, h
    x = x.detach()
    blocks = []
    for block in model.blocks:
        (saved, _, store), (held_f, work_f, full), (held_sel, work_sel, sel) = (
            _lone_block(block, x, p) for p in (None, recompute_all, attention_core))
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            out = block(x)
        if work_f != saved or held_f != x.numel() * x.element_size():    # what full recomputation must measure
            raise RuntimeError(f"block measured inconsistently: full recomputation held {held_f:,} bytes (its input "
                               f"is {x.numel() * x.element_size():,}) and rebuilt {work_f:,} (stored: {saved:,})")

        def seconds(policy):
            def fwd_bwd():
                h = x.clone().requires_grad_()
                y = block(h) if policy is None else checkpoint(block, h, policy=policy)
                y.backward(torch.ones_like(y))
            return _seconds(fwd_bwd, repeats)
        t_store, t_full, t_sel = seconds(None), seconds(recompute_all), seconds(attention_core)
        with torch.no_grad():
            t_fwd = _seconds(lambda: block(x), repeats)
        block.zero_grad(set_to_none=True)
        blocks.append(BlockCost(saved, held_f, held_sel, work_sel, fc.get_total_flops(), full - store, sel - store,
                                t_fwd, max(0.0, t_full - t_store), max(0.0, t_sel - t_store)))
        x = out
    return ChainCosts(embed, head, tuple(blocks))


# ============================================================================================ the optimum
@dataclass(frozen=True)
class Choice:
    plan: RecomputePlan
    peak: int
    extra: float


def _frontier(costs: ChainCosts, cost: str, budget: int | None) -> list:
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
    return _frontier(costs, "flops", None)[0][0]


def pareto_front(costs: ChainCosts, cost: str = "flops") -> list[Choice]:
    """The plans no other plan beats on both peak and extra cost, from the smallest peak up."""
    return [Choice(RecomputePlan(units, "optimal"), peak, extra) for peak, extra, units in _frontier(costs, cost, None)]


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
    peak, extra, units = min(_frontier(costs, cost, budget), key=lambda f: (f[1], f[0]))
    return Choice(RecomputePlan(units, "optimal"), peak, extra)


# ============================================================================================ with tensor parallelism
def rerun_tp_bytes(plan: RecomputePlan, cfg, micro_batch_size: int, tp_size: int, rank: int, elem: int, *,
                   sequence_parallel: bool = False, seq_len: int | None = None) -> int:
    """Bytes tp rank `rank` sends again per micro-batch when `plan` recomputes tensor-parallel blocks (`apply_tp`,
    then `apply_recompute`): the rerun re-issues every forward collective before the last op a saved tensor needs,
    and no block's output is needed (the next unit keeps it), so each segment skips its last collective.

        1D   a block's forward sends g (all-reduce of b·s·h) after attention and after the MLP
             full segment of n blocks: 2n − 1 all-reduces      selective: 0 (the core precedes any collective)
        SP   g_sp (all-gather), ḡ (reduce-scatter) after attention, the same around the MLP
             full segment: 2n all-gathers + 2n − 1 reduce-scatters      selective: 1 all-gather (attention's g_sp)
        MoE  (1D; experts whole on every tp rank) only attention's g, which the block's MoE reads:
             full segment: n all-reduces

    `tp_bytes_per_microbatch` + this = what the ledger shows on the tp axis (tests/integration/test_recompute_tp.py).
    """
    n = micro_batch_size * (seq_len or get_config(cfg).seq_len) * get_config(cfg).d_model
    ar, ag, rs = (f(n, tp_size, rank, elem) for f in (ring_all_reduce_bytes, ring_all_gather_bytes,
                                                      ring_reduce_scatter_bytes))
    total = 0
    for u in plan.units:
        blocks = u.end - u.start
        if u.kind == "full" and get_config(cfg).n_expert:     # MoE blocks: only attention's g, each one needed
            total += blocks * ar
        elif u.kind == "full":
            total += (2 * blocks * ag + (2 * blocks - 1) * rs) if sequence_parallel else (2 * blocks - 1) * ar
        elif u.kind == "selective" and sequence_parallel:
            total += ag
    return total


# ============================================================================================ inside a pipeline
def stage_chain(costs: ChainCosts, bounds, stage: int) -> ChainCosts:
    """The part of the chain pipeline stage `stage` runs (`bounds`: [start, end) blocks of every stage): its blocks,
    the embedding on stage 0, the head and loss on the last. A later stage's input — received from the stage before
    — is its first block's input, which that block's costs already count."""
    start, end = bounds[stage]
    return ChainCosts(costs.embed if stage == 0 else 0, costs.head if stage == len(bounds) - 1 else 0,
                      tuple(costs.blocks[start:end]))


def plan_held(plan: RecomputePlan, costs: ChainCosts) -> int:
    """What one forward keeps until its backward under `plan`: E + Σ_u held_u + H (`plan_peak` is the most it needs
    at once, in backward included)."""
    _check(plan, costs)
    return costs.embed + sum(costs.unit(u)[0] for u in plan.units) + costs.head


def pipeline_peaks(schedule, bounds, costs: ChainCosts, policy: "str | dict" = "full") -> list[int]:
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


# ============================================================================================ measuring a run
class FlopProbe(Probe):
    """FLOPs of every 'forward' and 'backward' phase, counted by torch's FlopCounterMode (matrix multiplies)."""
    name = "flops"

    def __init__(self):
        self.steps: list[dict] = []
        self._mode = None

    def enter(self, step, phase):
        if phase in ("forward", "backward"):
            if len(self.steps) <= step:
                self.steps.append({})
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()

    def exit(self, step, phase):
        if self._mode is not None and phase in ("forward", "backward"):
            self._mode.__exit__(None, None, None)
            self.steps[step][phase] = self.steps[step].get(phase, 0) + self._mode.get_total_flops()
            self._mode = None

    def close(self):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def finish(self):
        return self.steps


def activation_peak(report) -> int:
    """The most bytes saved for backward (activations) plus recomputed ones at any moment of a MemoryReport (or of
    a MemoryTracker's own timeline)."""
    if isinstance(report, MemoryTracker):
        snaps = (snap["device"] for _, snap in report.timeline)
    else:
        snaps = (snap for _, snap in report.timeline)
    return max(snap.get("activations", 0) + snap.get("recomputed", 0) for snap in snaps)


class ActivationPeakProbe(MemoryProbe):
    """The memory accountant over a run, handing back only its `activation_peak` — for runs that need that one
    number (many short pipeline steps): building the whole report copies the timeline, which costs more than a
    short step itself."""
    name = "activation peak"

    def finish(self):
        self.close()
        return activation_peak(self.tracker)
