"""What a recomputation plan costs: the chain model of its bytes and extra FLOPs, and their closed forms.

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

Measured on a real model: `measured`; the best plan under a budget: `optimum`; inside a pipeline: `pipeline`; the
bytes a rerun of tensor-parallel blocks sends again: `tensor_parallel`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.model import block_activation_bytes, embed_activation_bytes, get_config, head_activation_bytes
from . import RecomputePlan, Unit


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


def plan_held(plan: RecomputePlan, costs: ChainCosts) -> int:
    """What one forward keeps until its backward under `plan`: E + Σ_u held_u + H (`plan_peak` is the most it needs
    at once, in backward included)."""
    _check(plan, costs)
    return costs.embed + sum(costs.unit(u)[0] for u in plan.units) + costs.head


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
