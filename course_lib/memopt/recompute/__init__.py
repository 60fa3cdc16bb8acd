"""Activation recomputation: keep a segment's inputs, recompute in backward what it saved — and `apply_recompute`,
which puts segments on the blocks of a model by a plan.

Chen, Xu, Zhang & Guestrin, "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174 (2016): keep only
segment inputs, √n segments. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023 (arXiv 2205.05198): full and selective recomputation of a transformer layer. docs/formulas.md §4.3, §5.

The package, by subject:

    hooks            the mechanism: `Segment` (saved-tensor hooks and a record of the ops), `checkpoint`, the
                     rerun `Replay`, `CheckpointError`
    policies         per op, recomputed or kept: `recompute_all`, `attention_core` (Korthikanti's selective),
                     `all_but_matmuls`, `torch_policy` (the same for torch's selective checkpoint)
    (this module)    plans over a model's blocks (`Unit`, `RecomputePlan`, `make_plan`) and `apply_recompute`
    costs            what a plan costs: the chain model (bytes held, working set, extra FLOPs) and its closed forms
    measured         the same costs measured on a real model, and probes for a run's FLOPs and activation peak
    optimum          the best plan under a memory budget and the Pareto front (a dynamic program over the chain)
    pipeline         recomputation inside a pipeline: each rank's peak, how many micro-batches fit a budget
    tensor_parallel  the bytes a rerun of tensor-parallel blocks sends again

Checked against: gradients bitwise equal to no recomputation (dropout on) and to torch's checkpoint; the peak
the memory accountant sees never above torch's selective checkpoint with the same policy; tensor-parallel models
(the rerun re-issues the forward's collectives) equal to the model without recomputation and the single-process
reference; the bytes and FLOPs against the closed forms in `course_lib.memopt.recompute.costs`
(tests/unit/test_recompute.py, tests/integration/test_recompute*.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...core.handles import attach, detach
from ...core.model import blocks_of
from .hooks import RECOMPUTED, CheckpointError, Segment, Ticket, _open, _rerunning, checkpoint
from .policies import MATMULS, all_but_matmuls, attention_core, recompute_all, torch_policy

KINDS = ("store", "full", "selective")
POLICIES = ("none", "full", "every", "sqrt", "selective")


@dataclass(frozen=True)
class Unit:
    """Blocks [start, end) as one piece of a plan: 'store' (one block, nothing recomputed), 'full' (a segment:
    keep its input, recompute all of it) or 'selective' (one block, recompute its attention core)."""
    start: int
    end: int
    kind: str

    def __post_init__(self):
        size_ok = self.kind == "full" or self.end == self.start + 1      # only a segment spans blocks
        if self.kind not in KINDS or not 0 <= self.start < self.end or not size_ok:
            raise ValueError(f"a Unit is blocks [start, end) with kind in {KINDS} ('store' and 'selective' hold one "
                             f"block); got {self}")


@dataclass(frozen=True)
class RecomputePlan:
    """Which blocks are stored, selectively recomputed, or grouped into fully recomputed segments."""
    units: tuple
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "units", tuple(self.units))
        ends = [0] + [u.end for u in self.units]
        if not self.units or any(u.start != e for u, e in zip(self.units, ends)):
            raise ValueError(f"a RecomputePlan's units must cover blocks 0, 1, … in order without gaps; "
                             f"got {self.units}")

    @property
    def n_layer(self) -> int:
        return self.units[-1].end

    def __str__(self) -> str:
        """'S S [F F] s': S stored, s selective, [..] one fully recomputed segment."""
        return " ".join("S" if u.kind == "store" else "s" if u.kind == "selective" else
                        "[" + " ".join("F" * (u.end - u.start)) + "]" for u in self.units)




def make_plan(policy: str, n_layer: int, k: int | None = None) -> RecomputePlan:
    """The plan of a named policy over n_layer blocks: 'none', 'full' (each block its own segment), 'every' (segments
    of k blocks: keep the input of every k-th block), 'sqrt' (Chen et al.: round(√n) segments as even as possible)
    or 'selective' (every block, attention core only)."""
    from ...core.model import stage_bounds
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise ValueError(f"n_layer must be a positive integer, got {n_layer!r}")
    if policy == "every":
        if not isinstance(k, int) or not 1 <= k <= n_layer:
            raise ValueError(f"policy 'every' needs k, the blocks per segment, in 1..{n_layer}; got k={k!r}")
        bounds = [(s, min(s + k, n_layer)) for s in range(0, n_layer, k)]
        return RecomputePlan([Unit(a, b, "full") for a, b in bounds], f"every {k}")
    if k is not None:
        raise ValueError(f"k is for policy 'every' only; policy {policy!r} takes no k")
    if policy == "none":
        return RecomputePlan([Unit(i, i + 1, "store") for i in range(n_layer)], "none")
    if policy == "full":
        return RecomputePlan([Unit(i, i + 1, "full") for i in range(n_layer)], "full")
    if policy == "selective":
        return RecomputePlan([Unit(i, i + 1, "selective") for i in range(n_layer)], "selective")
    if policy == "sqrt":
        segments = max(1, round(n_layer ** 0.5))
        return RecomputePlan([Unit(a, b, "full") for a, b in stage_bounds(n_layer, segments)], "√n")
    raise ValueError(f"unknown recomputation policy {policy!r}; use one of {POLICIES} or a RecomputePlan")


def _holder(model: nn.Module) -> nn.Module:
    """The module whose `blocks` run: `model`, or the model inside its wrappers (`.module`), as `blocks_of` finds."""
    while not hasattr(model, "blocks") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _blocks_and_cuts(model) -> tuple[list, set]:
    """The blocks `model` runs, in order (`model.blocks_of`), and the positions between them where one forward call
    ends: none for a GPT or its tensor-parallel form; for a pipeline stage (`bounds`: the [start, end) blocks of each
    of its (virtual) stages) the end of every stage it holds — each stage is its own forward op, so a segment cannot
    run on past one."""
    try:
        blocks = blocks_of(model)
    except TypeError as e:
        raise TypeError(f"apply_recompute: {e}") from None
    bounds = getattr(_holder(model), "bounds", None)
    if not isinstance(bounds, dict):
        return blocks, set()
    sizes = [end - start for start, end in (bounds[k] for k in sorted(bounds))]
    return blocks, set(itertools.accumulate(sizes))


def apply_recompute(model, mesh=None, *, policy: str | RecomputePlan = "full", k: int | None = None, blocks=None,
                    selective_policy=attention_core, preserve_rng_state: bool = True):
    """Recompute the activations of the blocks `model` runs (`model.blocks_of`: a GPT's, a TensorParallelGPT's, a
    pipeline stage's — only this rank's, in order — or those inside a wrapper's `.module`), or of `blocks`,
    according to `policy`: a name for `make_plan` ('none', 'full', 'every' with k, 'sqrt', 'selective') or a
    `RecomputePlan`; 'selective' units recompute what `selective_policy` says (Korthikanti's attention core by
    default). Changes `model` in place and returns it; `handle_of(model, 'recompute')` is the plan.

    Nothing is replaced: a forward pre-hook on a unit's first block opens its `Segment`, a forward hook on its last
    block closes it, so parameter names, state dicts and the techniques applied after it (DDP, ZeRO-1/2, the
    pipeline executor) see the same modules. Apply it after tensor parallelism (its collectives are then inside the
    blocks, and the rerun re-issues those it needs) and after the pipeline split, before data parallelism. On a
    pipeline stage every micro-batch's forward opens its own segments, so each micro-batch in flight keeps only
    its segments' inputs. `mesh` is accepted so every `apply_*` reads alike, and not used: the collectives a
    tensor-parallel block reruns are those of its own communicator. Applying again replaces the plan.
    """
    from ..offload import activation_offload_of
    blocks, cuts = _blocks_and_cuts(model) if blocks is None else (list(blocks), set())
    if any(activation_offload_of(m) is not None for m in [model, *blocks]):
        raise ValueError("activation offload is applied to this model's blocks: recomputation would replay them in "
                         "backward, when their saved tensors are already on the host; offload or recompute a block, "
                         "not both")
    plan = policy if isinstance(policy, RecomputePlan) else make_plan(policy, len(blocks), k)
    if plan.n_layer != len(blocks):
        raise ValueError(f"the plan covers {plan.n_layer} blocks but the model runs {len(blocks)}; make it for "
                         f"n_layer={len(blocks)}")
    for u in plan.units:
        if any(u.start < c < u.end for c in cuts):
            raise ValueError(f"the segment of blocks {u.start}–{u.end - 1} (counted on this rank) spans two pipeline "
                             f"stages, whose forwards are separate ops (a stage ends after block(s) "
                             f"{sorted(c - 1 for c in cuts)}); use segments that stay within a stage, e.g. a "
                             f"per-block policy ('full', 'selective')")
    remove_recompute(model)
    handles = []
    for u in plan.units:
        if u.kind == "store":
            continue
        run = blocks[u.start:u.end]
        seg_policy = selective_policy if u.kind == "selective" else recompute_all
        name = f"block {u.start}" if u.end == u.start + 1 else f"blocks {u.start}–{u.end - 1}"
        handles.append(run[0].register_forward_pre_hook(
            lambda mod, args, run=run, p=seg_policy, name=name: _open_segment(run, args, p, name, preserve_rng_state)))
        for b in run:
            handles.append(b.register_forward_hook(
                lambda mod, args, out, last=b is run[-1]: _close_segment(out, last), always_call=True))
    model._recompute_handles = handles
    attach(model, "recompute", plan)
    return model


def remove_recompute(model) -> None:
    """Undo `apply_recompute(model, …)`: the blocks run and store as before."""
    for h in getattr(model, "_recompute_handles", ()):
        h.remove()
    model._recompute_handles = []
    detach(model, "recompute")


def _run_blocks(run):
    def forward(x):
        for block in run:
            x = block(x)
        return x
    return forward


def _open_segment(run, args, policy, name, preserve_rng_state) -> None:
    if _rerunning.get() or not torch.is_grad_enabled():
        return
    Segment(_run_blocks(run), args, policy=policy, preserve_rng_state=preserve_rng_state, name=name).__enter__()


def _close_segment(out, last: bool) -> None:
    seg = _open.get()
    if seg is None or _rerunning.get():
        return
    if out is None:                  # the block raised (always_call hooks run with no output): close, keep nothing
        seg.__exit__(RuntimeError, None, None)
    elif last:
        seg.__exit__(None, None, None)


__all__ = ["apply_recompute", "remove_recompute", "make_plan", "RecomputePlan", "Unit", "KINDS", "POLICIES",
           "checkpoint", "Segment", "Ticket", "CheckpointError", "RECOMPUTED", "recompute_all", "attention_core",
           "all_but_matmuls", "MATMULS", "torch_policy"]
