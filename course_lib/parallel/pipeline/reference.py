"""The independent reference: the same split of the same GPT trained by `torch.distributed.pipelining`.

PyTorch's schedules run on CPU/gloo. Their `pipeline_order[rank]` lists each rank's actions in torch's notation
("0F0 0F1 1B0 …"; I is an input-gradient backward, W a weight-gradient one, REDUCE_GRAD and idle steps are
bookkeeping), so our schedule tables can be compared with theirs op by op (`torch_order`), and their gradients with
ours parameter by parameter (same parameter names: each torch stage wraps our `PipelineStage` of that stage).

    ours          torch.distributed.pipelining
    gpipe         ScheduleGPipe
    1f1b          Schedule1F1B                      (torch needs M ≥ S)
    interleaved   ScheduleInterleaved1F1B           (a list of v stages per rank)
    zb_h1         ScheduleInterleavedZeroBubble     (one stage per rank: its ZB1P order is ZB-H1)

Call `torch_pipeline_run(ctx, …)` inside `launch` on S ranks (a world of one pipeline).
"""
from __future__ import annotations

import time

import torch

from ...core.data import ShardedBatches
from ...core.model import GPT, lm_loss
from ...train import TrainConfig, optimizer_kwargs
from .executor import plan_pipeline
from .stage import PipelineStage

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb_h1": "ScheduleInterleavedZeroBubble"}


def torch_order(schedule, rank: int) -> list[str]:
    """A torch schedule's compute actions on `rank` in our notation (its I — input-gradient backward — is our B of a
    B/W-split schedule; idle steps and REDUCE_GRAD dropped)."""
    out = []
    for a in schedule.pipeline_order[rank]:
        if a is not None and a.computation_type.value in ("F", "B", "I", "W"):
            kind = "B" if a.computation_type.value == "I" else a.computation_type.value
            out.append(f"{a.stage_index}{kind}{a.microbatch_index}")
    return out


def torch_schedule(ctx, cfg, schedule: str, num_microbatches: int, *, chunks: int = 1, layers=None,
                   dtype=torch.float64, seed: int = 0):
    """torch's schedule object for this rank's stages of the course GPT split as `plan_pipeline` splits it, and this
    rank's parameters by name. Building it does not communicate."""
    import torch.distributed.pipelining as tpp
    plan = plan_pipeline(cfg, ctx.world_size, num_microbatches, schedule, chunks=chunks, layers=layers)
    n = plan.schedule.num_virtual_stages
    model = GPT(cfg, seed=seed).to(dtype)
    mine = plan.schedule.stages_of(ctx.rank)
    chunks_here = [PipelineStage(model, [k], plan.bounds, n) for k in mine]
    stages = [tpp.PipelineStage(c, k, n, torch.device("cpu")) for c, k in zip(chunks_here, mine)]
    multi = schedule in ("interleaved", "zb_h1")
    sched = getattr(tpp, TORCH_SCHEDULES[schedule])(stages if multi else stages[0], n_microbatches=num_microbatches,
                                                    loss_fn=lm_loss)
    return sched, dict(p for c in chunks_here for p in c.named_parameters()), (0 in mine, n - 1 in mine)


def torch_pipeline_run(ctx, cfg, tc: TrainConfig, schedule: str, num_microbatches: int, *, chunks: int = 1,
                       layers=None, dtype=torch.float64) -> dict:
    """Train `tc.steps` steps of the course GPT (seed tc.seed) split as `plan_pipeline` splits it, with torch's
    schedule; return this rank's step-0 gradients (by parameter name), final parameters, losses (last stage),
    step times and the schedule's order on every rank."""
    sched, params, (first, last) = torch_schedule(ctx, cfg, schedule, num_microbatches, chunks=chunks, layers=layers,
                                                  dtype=dtype, seed=tc.seed)
    opt = torch.optim.AdamW(params.values(), **optimizer_kwargs(tc))
    data = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    grads0, losses, seconds = {}, [], []
    for step in range(tc.steps):
        x, y = data.global_batch(step)                      # torch splits it into M micro-batches along dim 0
        t0 = time.perf_counter()
        mb_losses = []
        sched.step(*([x] if first else []), **({"target": y, "losses": mb_losses} if last else {}))
        seconds.append(time.perf_counter() - t0)
        if step == 0:
            grads0 = {k: p.grad.detach().clone() for k, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mb_losses:
            losses.append(torch.stack([loss.detach() for loss in mb_losses]).mean().item())
    return {"grads0": grads0, "params": {k: p.detach().clone() for k, p in params.items()}, "losses": losses,
            "seconds": seconds, "order": {r: torch_order(sched, r) for r in range(ctx.world_size)}}


__all__ = ["TORCH_SCHEDULES", "torch_order", "torch_schedule", "torch_pipeline_run"]
