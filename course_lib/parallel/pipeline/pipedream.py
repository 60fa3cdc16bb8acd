"""Asynchronous pipelines: PipeDream's weight stashing and PipeDream-2BW's double-buffered weights.

A synchronous schedule (GPipe, 1F1B) flushes the pipeline before every optimizer step: the bubble is the price of
every micro-batch seeing the same weights. PipeDream (Narayanan et al., SOSP'19) never flushes: it runs 1F1B over
an endless stream of minibatches and each stage updates its weights right after each backward. Stage i then has
S−i minibatches in flight, whose forwards ran on S−i different weight versions, while its weights keep moving:

    mode "naive"   backward with whatever the weights are now — not the weights the forward used. The gradient is
                   then not the gradient of anything (PyTorch's version counter refuses such a backward; updating
                   through `.data`, as a framework without that check would, shows the silent bug).
    mode "stash"   weight stashing: the forward of minibatch k runs on a copy of the weights of that moment (memory
                   category 'stashed weights'), its backward uses the same copy. Stage i holds S−i copies at its peak
                   — one per in-flight minibatch (docs/formulas.md §3.4) — beside the master copy it updates.
    mode "2bw"     PipeDream-2BW (Narayanan et al., ICML 2021): gradients are accumulated over a batch of m ≥ S
                   micro-batches and the weights change once per batch, with a constant delay of one step,
                       W⁽ᵗ⁺¹⁾ = W⁽ᵗ⁾ − ν · ∇f(W⁽ᵗ⁻¹⁾)
                   so every batch t uses version t−1; at most 2 versions are ever in flight, whatever the depth.

The updates are plain SGD (W ← W − ν·g), so the 2BW rule can be checked exactly against `two_bw_reference`, a
single-process loop; weight stashing is checked per micro-batch: the applied gradient equals the gradient
recomputed on the weights the forward used (`check=True` keeps those, unaccounted, for the comparison).
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from ...core.data import ShardedBatches
from ...core.model import GPT
from ...memory import MemoryTracker, alloc_category, register_category, untracked
from .executor import Pipeline, plan_pipeline
from .stage import PipelineStage

STASH = register_category("stashed weights", "#937860")
MODES = ("naive", "stash", "2bw")


class AsyncPipeline(Pipeline):
    """1F1B over `num_microbatches` micro-batches without a flush, updating this stage's weights as it goes."""

    def __init__(self, stage, comm, plan, *, mode: str, lr: float, batch_microbatches: int = 1, check: bool = False):
        super().__init__(stage, comm, plan)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        m = batch_microbatches if mode == "2bw" else 1
        if mode == "2bw" and (m < comm.world_size or plan.num_microbatches % m):
            raise ValueError(f"PipeDream-2BW needs batches of m ≥ S = {comm.world_size} micro-batches that divide the "
                             f"{plan.num_microbatches} micro-batches of the run; got m={batch_microbatches}")
        self.mode, self.lr, self.m, self.check = mode, lr, m, check
        self.loss_scale = 1.0 / m                # a 2BW batch's gradient is the mean over its m micro-batches
        self.params = dict(stage.named_parameters())
        self.updates = 0                         # versions made so far: version v = the weights after v updates
        self._versions: dict = {}                # 2bw: version → stashed weights (shared by a batch's micro-batches)
        self._uses: dict = {}                    # stashed weights of each in-flight micro-batch
        self.grad_errors: list = []              # per micro-batch: max |applied − consistent| gradient (check=True)
        self._kept: dict = {}                    # check=True: (weights the forward used, input, targets) per mb

    # ------------------------------------------------------------------ which weights a forward uses
    def _clone(self) -> dict:
        with alloc_category(STASH):
            return {k: p.detach().clone().requires_grad_() for k, p in self.params.items()}

    def stage_forward(self, op, x, targets):
        if self.check and self.mode != "2bw":
            with untracked():
                self._kept[op.mb] = ({k: p.detach().clone() for k, p in self.params.items()}, x.detach(), targets)
        if self.mode == "naive":
            return self.stage(x, targets, stage=op.stage)
        if self.mode == "stash":
            w = self._uses[op.mb] = self._clone()            # the weights of this moment, for this micro-batch
        else:
            v = max(op.mb // self.m - 1, 0)                   # batch t runs on version t−1 (t = 0 on version 0)
            if v not in self._versions:
                self._versions[v] = self._clone()
            w = self._uses[op.mb] = self._versions[v]
        return functional_call(self.stage, w, (x, targets), {"stage": op.stage})

    # ------------------------------------------------------------------ after each backward: maybe update
    @torch.no_grad()
    def after_backward(self, op, x, grad) -> None:
        if self.mode == "naive":
            g = {k: p.grad for k, p in self.params.items()}
        elif self.mode == "stash":
            g = {k: t.grad for k, t in self._uses.pop(op.mb).items()}
        else:
            w = self._uses.pop(op.mb)
            if (op.mb + 1) % self.m:                          # not the batch's last micro-batch: keep accumulating
                return
            g = {k: t.grad for k, t in w.items()}
            for tensor in w.values():                         # batch 0 and 1 share version 0: start afresh
                tensor.grad = None
            t = op.mb // self.m                               # batch t is done: W(t+1) = W(t) − ν·∇f(W(t−1))
            if t + 1 < self.schedule.num_microbatches // self.m and t not in self._versions:
                self._versions[t] = self._clone()             # batch t+1 runs on W(t): keep it before it moves
            self._versions.pop(t - 1, None)
        if self.check and self.mode != "2bw":
            want = self._consistent_grad(op, grad)
            self.grad_errors.append(max((g[k] - want[k]).abs().max().item() for k in g))
        for k, p in self.params.items():
            if self.mode == "naive":
                p.data.sub_(self.lr * g[k])                   # .data: past autograd's version check, as the bug does
                p.grad = None
            else:
                p.sub_(self.lr * g[k])
        self.updates += 1

    def _consistent_grad(self, op, grad) -> dict:
        """The gradient this micro-batch should give: forward and backward again on the weights its forward used."""
        w, x, targets = self._kept.pop(op.mb)
        with untracked(), torch.enable_grad():
            w = {k: t.requires_grad_() for k, t in w.items()}
            out = functional_call(self.stage, w, (x, targets), {"stage": op.stage})
            torch.autograd.backward(out * self.loss_scale if op.stage == self.last else out, grad)
        return {k: t.grad for k, t in w.items()}


def pipedream_run(ctx, cfg, mode: str, num_microbatches: int, micro_batch_size: int, *, lr: float = 0.05,
                  batch_microbatches: int = 1, check: bool = True, seed: int = 0, dtype=torch.float64) -> dict:
    """Run the GPT (seed `seed`) as an asynchronous S-stage pipeline over `num_microbatches` micro-batches on the
    ranks of `ctx` (one stage each), under the memory accountant. Returns this stage's final parameters, its losses
    (last stage), the per-micro-batch gradient error against the consistent gradient (naive / stash), and the peak
    of stashed weights in bytes and in copies of the stage's parameters."""
    plan = plan_pipeline(cfg, ctx.world_size, num_microbatches, "1f1b")
    model = GPT(cfg, seed=seed).to(dtype)
    stage = PipelineStage(model, [ctx.rank], plan.bounds, ctx.world_size)
    pipe = AsyncPipeline(stage, ctx.comm, plan, mode=mode, lr=lr, batch_microbatches=batch_microbatches, check=check)
    data = ShardedBatches(cfg.seq_len, micro_batch_size, num_microbatches=num_microbatches, seed=seed)
    with MemoryTracker(timeline=False) as mem:
        mem.watch(stage)
        pipe.run(data, 0)
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    return {"stage": ctx.rank, "params": {k: p.detach().clone() for k, p in stage.named_parameters()},
            "losses": [l.item() for l in pipe._losses], "grad_errors": pipe.grad_errors, "updates": pipe.updates,
            "stash_peak": mem.max_by_category.get(STASH, 0), "param_bytes": param_bytes,
            "stash_copies": mem.max_by_category.get(STASH, 0) / param_bytes}


def two_bw_reference(cfg, num_batches: int, batch_microbatches: int, micro_batch_size: int, lr: float, *,
                     seed: int = 0, dtype=torch.float64) -> dict:
    """PipeDream-2BW's update rule on one process: g_t = ∇ L_t(W⁽ᵗ⁻¹⁾) over batch t's m·b sequences (W⁽⁻¹⁾ = W⁽⁰⁾),
    W⁽ᵗ⁺¹⁾ = W⁽ᵗ⁾ − ν·g_t. Returns the final parameters by name."""
    model = GPT(cfg, seed=seed).to(dtype)
    m, b = batch_microbatches, micro_batch_size
    data = ShardedBatches(cfg.seq_len, b, num_microbatches=num_batches * m, seed=seed)
    older = {k: p.detach().clone() for k, p in model.named_parameters()}       # W(t−1)
    for t in range(num_batches):
        w = {k: v.clone().requires_grad_() for k, v in older.items()}
        for i in range(m):
            loss = functional_call(model, w, data.get(0, t * m + i))[1]
            (loss * (1.0 / m)).backward()                  # as the pipeline scales each micro-batch
        older = {k: p.detach().clone() for k, p in model.named_parameters()}  # W(t) becomes the next W(t−1)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.sub_(lr * w[k].grad)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


__all__ = ["AsyncPipeline", "pipedream_run", "two_bw_reference", "STASH", "MODES"]
