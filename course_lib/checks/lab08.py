"""Checks for Lab 08: a recomputation policy of your own, and Chen et al.'s memory-greedy segments.

    check_norms_and_gelu(policy)            one block with dropout: gradients bitwise those of no recomputation and of
                                            torch's selective checkpointing with the same policy; it keeps exactly a
                                            block less its LayerNorm and GELU outputs; 0 extra FLOPs (the bound)
    check_held_bytes(held_bytes, policy)    your formula equals the measured bytes for 4 configs, and the whole model's
                                            activation peak through the training loop equals the plan formula with it
    check_greedy_segments(greedy_segments)  equals the greedy rule on heterogeneous chains; an impossible budget is a
                                            ValueError naming the block
    check_greedy_plan(greedy_segments)      your segments on the model: peak = formula, gradients bitwise those of no
                                            recomputation, extra FLOPs ≤ one forward of the blocks (the bound)

Every run goes through `course_lib.train.run` or a block alone, under the memory accountant and torch's
FlopCounterMode; the expected values come from `course_lib.memopt.recompute.costs`.
"""
from __future__ import annotations

import re
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from .. import optim
from ..core.data import ShardedBatches
from ..core.model import GPT, block_activation_bytes, get_config
from ..memopt.recompute import RecomputePlan, Unit, apply_recompute, checkpoint, make_plan, torch_policy
from ..memopt.recompute.costs import BlockCost, ChainCosts, formula_costs, plan_extra, plan_peak
from ..memopt.recompute.measured import FlopProbe, activation_peak
from ..memory import MemoryTracker
from ..train import GradProbe, MemoryProbe, TrainConfig, optimizer_kwargs, run
from . import check

CFG = get_config("micro", n_layer=6, seq_len=64, dropout=0.1)
B = 2
CONFIGS = [CFG, get_config("nano", dropout=0.0), get_config("mini", seq_len=40, mlp_ratio=2, dropout=0.2),
           get_config("micro", n_head=8, seq_len=33)]


def _block_step(cfg, wrap):
    """One block alone, forward and backward: (gradients, activations after forward, FLOPs)."""
    block = GPT(cfg, seed=0).blocks[0]
    x = torch.randn(B, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with MemoryTracker(timeline=False).watch(block) as mem, FlopCounterMode(display=False) as fc:
        h = x.clone().requires_grad_()
        torch.manual_seed(2)                                       # the same dropout masks for every variant
        out = wrap(block, h)
        held = mem.current["activations"]
        out.backward(torch.ones_like(out))
    return {"input": h.grad, **{n: p.grad for n, p in block.named_parameters()}}, held, fc.get_total_flops()


def _equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _expected_held(cfg) -> int:
    """A block less the outputs of its two LayerNorms (with their statistics) and of GELU."""
    tokens = B * cfg.seq_len
    return block_activation_bytes(cfg, B) - 4 * tokens * (2 + cfg.mlp_ratio) * cfg.d_model - 16 * tokens


def check_norms_and_gelu(policy) -> None:
    with check("norms_and_gelu") as c:
        plain, stored, flops = _block_step(CFG, lambda b, h: b(h))
        ours, held, our_flops = _block_step(CFG, lambda b, h: checkpoint(b, h, policy=policy))
        context = partial(create_selective_checkpoint_contexts, torch_policy(policy), allow_cache_entry_mutation=True)
        theirs, _, _ = _block_step(CFG, lambda b, h: torch_checkpoint(b, h, use_reentrant=False, context_fn=context))
        c.expect(_equal(ours, plain), "gradients differ from those without recomputation",
                 hint="a policy only answers True (recompute) or False (keep) for each op")
        c.expect(_equal(ours, theirs), "gradients differ from torch's selective checkpointing with your policy")
        c.expect(our_flops == flops, f"your policy adds {our_flops - flops:,} FLOPs; recomputing LayerNorm and GELU "
                 f"adds none (the bound is 0)", hint="recompute only aten.native_layer_norm and aten.gelu: every "
                 "matrix multiply's output must stay kept")
        want = _expected_held(CFG)
        tokens = B * CFG.seq_len
        kept = {held - want: None, 4 * tokens * CFG.mlp_ratio * CFG.d_model: "GELU's output is still kept: "
                "answer True for aten.gelu.default too", 4 * tokens * 2 * CFG.d_model + 16 * tokens: "the LayerNorms' "
                "outputs are still kept: answer True for aten.native_layer_norm.default too",
                stored - want: "your policy never answered True: func is an OpOverload, not a string — compare it "
                "with torch.ops.aten.native_layer_norm.default and torch.ops.aten.gelu.default"}
        c.expect(held == want, f"one block keeps {held:,} bytes with your policy; recomputing exactly the two "
                 f"LayerNorms and GELU keeps {want:,} (storing everything: {stored:,})",
                 hint=kept[held - want] or "recompute exactly aten.native_layer_norm.default and aten.gelu.default "
                                           "(func is an OpOverload: compare it with those two)")
        c.passed(f"bitwise equal to no recomputation and to torch's selective checkpointing (dropout "
                 f"{CFG.dropout}); keeps {held:,} of {stored:,} bytes per block; 0 extra FLOPs")


def _costs_with(cfg, held, work):
    """The closed-form chain of `cfg` with 'selective' units replaced by the lab's policy: held, work per block."""
    f = formula_costs(cfg, B)
    b = f.blocks[0]
    block = BlockCost(b.saved, b.input, held, work, b.fwd_flops, b.full_flops, 0)
    return ChainCosts(f.embed, f.head, (block,) * cfg.n_layer)


def _train_step(cfg, plan, selective_policy=None):
    model = GPT(cfg, seed=0)
    if plan is not None:
        kwargs = {} if selective_policy is None else {"selective_policy": selective_policy}
        apply_recompute(model, policy=plan, **kwargs)
    torch.manual_seed(0)
    r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), ShardedBatches(cfg.seq_len, B, seed=0),
            steps=1, probes=[MemoryProbe(), FlopProbe(), GradProbe()])
    flops = r["flops"][0]
    return activation_peak(r["memory"]["report"]), flops["backward"] - 2 * flops["forward"], r["grads"]


def check_held_bytes(held_bytes, policy) -> None:
    with check("held_bytes") as c:
        for cfg in CONFIGS:
            _, held, _ = _block_step(cfg, lambda b, h: checkpoint(b, h, policy=policy))
            got = held_bytes(cfg, B)
            tokens, d, r = B * cfg.seq_len, cfg.d_model, cfg.mlp_ratio
            known = {16 * tokens: "you kept both LayerNorms' mean and 1/std in: they are LayerNorm's outputs too "
                                  "(2 fp32 per token each), recomputed with it",
                     8 * tokens: "count the mean and 1/std of BOTH LayerNorms (2 fp32 per token each)",
                     4 * tokens * (r - 1) * d: f"GELU's output has mlp_ratio·d_model = {r * d} values per token, "
                                               f"not d_model",
                     4 * tokens * d: "two LayerNorms: subtract both outputs (d_model per token each)",
                     4 * tokens * r * d: "GELU's output (mlp_ratio·d_model per token) is recomputed too: subtract it",
                     -(4 * tokens * (2 + r) * d + 16 * tokens): "the inputs of LayerNorm and GELU stay kept: "
                                                                 "subtract only what those ops made, once"}
            c.expect(got == held, f"for {cfg.n_head} heads, d_model {cfg.d_model}, seq_len {cfg.seq_len}, mlp_ratio "
                     f"{cfg.mlp_ratio}, dropout {cfg.dropout} you predict {got:,} bytes; the accountant measured "
                     f"{held:,} (off by {got - held:+,})",
                     hint=known.get(got - held) or "start from block_activation_bytes(cfg, batch_size) and "
                          "subtract, per token, the two "
                          "LayerNorm outputs (d_model each), GELU's output (mlp_ratio·d_model) — 4 bytes per "
                          "element — and both LayerNorms' mean and 1/std (2 floats each)")
        # backward reruns all of a block's tickets at once, when it first needs GELU's output: work = everything
        costs = _costs_with(CFG, held_bytes(CFG, B), block_activation_bytes(CFG, B))
        plan = make_plan("selective", CFG.n_layer)
        peak, extra, _ = _train_step(CFG, plan, policy)
        want = plan_peak(plan, costs)
        c.expect(peak == want and extra == 0, f"the whole model with your policy peaked at {peak:,} bytes with "
                 f"{extra:,} extra FLOPs; the formula with your held bytes says {want:,} and 0")
        c.passed(f"exact for {len(CONFIGS)} configs; {CFG.n_layer}-layer model peaks at {peak:,} bytes = formula")


def _greedy(saved, budget, at_budget=False):
    """The greedy rule; `at_budget`: the common slip of closing a segment when it would reach the budget."""
    segments, start, total = [], 0, 0
    for i, s in enumerate(saved):
        if s > budget:
            raise ValueError(i)
        if total + s > budget or (at_budget and total + s == budget):
            segments.append((start, i))
            start, total = i, 0
        total += s
    return segments + [(start, len(saved))]


def check_greedy_segments(greedy_segments) -> None:
    with check("greedy_segments") as c:
        chains = [([5, 5, 5, 5, 5, 5], 10), ([3, 9, 2, 2, 7, 1, 1, 8], 10), ([4], 4), ([1, 1, 1], 100),
                  ([6, 1, 6, 1, 6], 7)]
        for saved, budget in chains:
            got, want = [tuple(s) for s in greedy_segments(list(saved), budget)], _greedy(saved, budget)
            slips = {tuple(_greedy(saved, budget, at_budget=True)): "a segment may hold exactly the budget: close it "
                     "only when adding the next block would go OVER it (>, not ≥)",
                     tuple(want[:-1]): "close the segment still open after the last block"}
            if any(a[1] + 1 == b[0] for a, b in zip(got, got[1:])):
                slips[tuple(got)] = ("segments are [start, end): end is the first block NOT in the segment, and the "
                                     "next segment starts at it")
            c.expect(got == want, f"for saved bytes {saved} and budget {budget} you made segments {got}; the "
                     f"greedy rule makes {want}",
                     hint=slips.get(tuple(got)) or "walk the blocks; when adding the next block would take the open "
                          "segment over the budget, close it and start a new one at that block; segments are "
                          "[start, end)")
        saved, budget, block = [5, 2, 2, 12, 2], 6, 3     # the numbers in it are 5, 2, 12 and 6: only 3 names the block
        try:
            greedy_segments(saved, budget)
            raised = None
        except ValueError as e:
            raised = str(e)
        c.expect(raised is not None, f"for saved bytes {saved} and budget {budget} block {block} alone keeps more "
                 f"than the budget; you returned instead of raising", hint="raise ValueError when a block alone "
                 "keeps more than the budget: no segment can hold it")
        named = re.findall(r"\d+", raised)
        c.expect(str(block) in named, f"for saved bytes {saved} and budget {budget} you raised {raised!r}: it "
                 f"should name block {block} (numbered from 0, as the segments are)",
                 hint=f"count blocks from 0, as the segments do: this one is block {block}, not {block + 1}"
                 if str(block + 1) in named else "name the block's index (enumerate's i), not its size")
        c.passed(f"the greedy segments for {len(chains)} chains; an impossible budget is refused: {raised}")


def check_greedy_plan(greedy_segments) -> None:
    with check("greedy_plan") as c:
        f = formula_costs(CFG, B)
        saved = [b.saved for b in f.blocks]
        plain_peak, _, plain = _train_step(CFG, None)
        rows = []
        for per_segment in (2, 3):
            segments = greedy_segments(saved, per_segment * saved[0])
            plan = RecomputePlan([Unit(a, b, "full") for a, b in segments], f"greedy {per_segment}")
            peak, extra, grads = _train_step(CFG, plan)
            want_peak, want_extra = plan_peak(plan, f), plan_extra(plan, f)
            bound = sum(b.fwd_flops for b in f.blocks)
            c.expect(_equal(grads, plain), f"{plan}: gradients differ from those without recomputation")
            c.expect(peak == want_peak and extra == want_extra, f"{plan}: peak {peak:,} bytes and {extra:,} extra "
                     f"FLOPs, the formula says {want_peak:,} and {want_extra:,}")
            c.expect(extra <= bound, f"{plan}: {extra:,} extra FLOPs, more than one forward of the blocks "
                     f"({bound:,})", hint="each block belongs to exactly one segment")
            rows.append(f"{plan} peaks at {peak:,} B (no recomputation: {plain_peak:,}), +{extra / bound:.0%} of "
                        f"a forward")
        c.passed("; ".join(rows))
