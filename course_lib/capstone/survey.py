"""The capstone's survey table (notebook 13 §3): one job per technique of the course on the same toy model, run
by the capstone worker (`course_lib.capstone.run_job`) beside the tensor-parallel grids (one `GridLinear` layer
each), and the closed forms of the extra compute each technique costs.

    jobs = survey_jobs(1, root=tmpdir) + [GridJob("TP 2D", "2D")]
    res = launch(survey_worker, 4, jobs)       # a GridJob needs exactly its grid's ranks (2D: 4, 2.5D and 3D: 8)

Extra compute is counted in matmul FLOPs (torch's FlopCounterMode): one process's step is 3·(L·block forward +
head) (forward once, backward twice: formulas §5.3); recomputation adds its replay (`plan_extra`), ring attention its
recomputed scores; everything else splits or moves the same matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..composer.plan import ParallelPlan
from ..core.model import get_config
from ..train import TrainConfig
from . import CONFIG, DTYPES, MOE, Job, run_job

SURVEY_WORLD = 2


def survey_jobs(steps: int = 1, seed: int = 0, root: str | None = None) -> list:
    """One job per technique of the survey's table, on 2 ranks, fp32, the same global batch; a 2-layer model (the
    interleaved schedule needs 4: two chunks on each of two stages). `root`: a directory for the checkpoint rows
    (each writes into its own sub-directory)."""
    cfg = get_config("nano", **{**CONFIG, "n_layer": 2})
    tc = TrainConfig(steps=steps, batch_size=8, lr=1e-3, seed=seed, data_seed=seed)
    P = ParallelPlan
    pipe = dict(pp=2, zero=1, num_microbatches=2)
    rows = [("DDP", P(dp=2)), ("ZeRO-1", P(dp=2, zero=1)), ("ZeRO-2", P(dp=2, zero=2)), ("ZeRO-3", P(dp=2, zero=3)),
            ("FSDP, norms+biases replicated", P(dp=2, zero=3, fsdp_replicate="norms+biases")),
            ("pipeline GPipe", P(**pipe, schedule="gpipe")), ("pipeline 1F1B", P(**pipe)),
            ("pipeline ZB-H1", P(**pipe, schedule="zb_h1")),
            ("TP 1D (Megatron)", P(tp=2)), ("TP + SP", P(tp=2, sequence_parallel=True)),
            ("CP (ring, zig-zag)", P(cp=2)), ("EP (2 MoE layers)", P(dp=2, ep=2)),
            ("offload activations", P(dp=2, offload_activations=True)),
            ("offload optimizer (host)", P(dp=2, zero=1, offload_optimizer="host", precision="bf16")),
            ("offload optimizer (disk)", P(dp=2, zero=1, offload_optimizer="disk", precision="bf16")),
            ("recompute full", P(dp=2, recompute="full")), ("recompute selective", P(dp=2, recompute="selective")),
            ("recompute √n", P(dp=2, recompute="sqrt")),
            ("bf16 mixed precision", P(dp=2, precision="bf16")), ("fp16 + loss scaling", P(dp=2, precision="fp16"))]
    jobs = [Job(name, plan, MOE if plan.ep > 1 else cfg, tc, "float32", flops=True) for name, plan in rows]
    jobs.insert(8, Job("pipeline interleaved (4 layers)", P(**pipe, schedule="interleaved", chunks=2),
                       get_config("nano", **CONFIG), tc, "float32", flops=True))
    if root is not None:
        for kind, name in (("sync", "checkpoint, synchronous"), ("async", "checkpoint, asynchronous (CheckFreq)"),
                           ("peer", "checkpoint in peers' memory (Gemini)")):
            jobs.append(Job(name, P(dp=2), cfg, tc, "float32", flops=True, checkpoint=kind,
                            root=f"{root}/{kind}"))
    return jobs


def extra_flops(job: Job) -> int:
    """Matmul FLOPs per step that `job`'s technique adds on all ranks together, beyond one process's
    3·(L·block forward + head) (formulas §5.3: forward 1×, backward 2×). Recomputation reruns what its plan drops
    (`plan_extra` over `formula_costs`, exact); ring attention recomputes each K/V block's scores QKᵀ in backward —
    with the zig-zag split every one of the cp blocks of every rank has a visible pair, so each rank recomputes cp
    blocks of 2·b·(T/cp)²·d per layer and micro-batch. Everything else reorders or splits the same matmuls: 0."""
    from ..memopt.recompute import make_plan
    from ..memopt.recompute.costs import formula_costs, plan_extra
    plan, cfg, B = job.plan, job.cfg, job.tc.batch_size
    if plan.recompute is not None:
        return plan_extra(make_plan(plan.recompute, cfg.n_layer), formula_costs(cfg, B))
    if plan.cp > 1:
        b = B // (plan.dp * plan.num_microbatches)
        per_rank = cfg.n_layer * plan.num_microbatches * plan.cp * 2 * b * (cfg.seq_len // plan.cp) ** 2 * cfg.d_model
        return per_rank * plan.world_size
    return 0


def base_flops(cfg, batch_size: int) -> int:
    """One process's matmul FLOPs per training step: 3·(L·block forward + the head's 2·B·T·d·V)."""
    from ..memopt.recompute.costs import formula_costs
    costs = formula_costs(cfg, batch_size)
    return 3 * (sum(b.fwd_flops for b in costs.blocks) + 2 * batch_size * cfg.seq_len * cfg.d_model * cfg.vocab_size)


NO_ACTIVATION_FORMULA = {
    "ep": "the router decides how many tokens each expert keeps",
    "zb_h1": "the B/W split keeps each linear's input and output gradient from B until its W runs",
    "mixed": "mixed precision with another technique: the formulas beside it take one element size, the loss is fp32",
}


def activation_formula(job: Job, coords: dict) -> tuple[int | None, str]:
    """(bytes, source): the activation peak — bytes saved for backward plus what a recomputation rebuilds, at the
    busiest moment — that the course's closed forms predict for `job` on the rank at mesh `coords`, and which
    formula gave it; (None, why) where the course has none (`NO_ACTIVATION_FORMULA`). Every rank holds
    b = batch / (dp · micro-batches) sequences at a time (tp and cp ranks share theirs)."""
    from ..core.model import activation_bytes
    from ..memopt.offload.activations import offloaded_activation_peak
    from ..memopt.recompute import make_plan
    from ..memopt.recompute.costs import formula_costs, plan_peak
    from ..memopt.recompute.pipeline import pipeline_peaks
    from ..parallel.context import cp_activation_bytes
    from ..parallel.pipeline.executor import plan_pipeline
    from ..parallel.tensor import tp_activation_bytes
    plan, cfg = job.plan, job.cfg
    b = job.tc.batch_size // (plan.dp * plan.num_microbatches)
    mixed = plan.precision in ("bf16", "fp16")
    e = 2 if mixed else DTYPES[job.dtype].itemsize
    others = plan.tp > 1 or plan.cp > 1 or plan.pp > 1 or plan.recompute is not None or plan.offload_activations
    if plan.ep > 1:
        return None, NO_ACTIVATION_FORMULA["ep"]
    if plan.pp > 1 and plan.schedule == "zb_h1":
        return None, NO_ACTIVATION_FORMULA["zb_h1"]
    if mixed and others:
        return None, NO_ACTIVATION_FORMULA["mixed"]
    if mixed:                                    # 16-bit activations; the logits are upcast for an fp32 loss
        return activation_bytes(cfg, b, elem_bytes=e, loss_elem_bytes=4), "activation_bytes, fp32 loss"
    if plan.tp > 1:
        return tp_activation_bytes(cfg, b, plan.tp, sequence_parallel=plan.sequence_parallel, elem=e), \
            "tp_activation_bytes"
    if plan.cp > 1:
        return cp_activation_bytes(cfg, b, plan.cp, e), "cp_activation_bytes"
    if plan.offload_activations:
        return offloaded_activation_peak(cfg, b, elem_bytes=e), "offloaded_activation_peak"
    costs, policy = formula_costs(cfg, b, elem_bytes=e), plan.recompute or "none"
    if plan.pp > 1:
        layout = plan_pipeline(cfg, plan.pp, plan.num_microbatches, plan.schedule, chunks=plan.chunks,
                               layers=plan.layers)
        return pipeline_peaks(layout.schedule, layout.bounds, costs, policy)[coords["pp"]], "pipeline_peaks"
    return plan_peak(make_plan(policy, cfg.n_layer), costs), "plan_peak"


@dataclass(frozen=True)
class GridJob:
    """One linear layer Y = X·W (X: R×K, W: K×N) on a 1D, 2D, 2.5D or 3D tensor-parallel grid (`GridLinear`)."""
    name: str
    kind: str
    R: int = 16
    K: int = 16
    N: int = 16
    depth: int = 1


def run_grid(ctx, job: GridJob) -> dict:
    """Forward + backward of `GridLinear` on this rank (float64): error against nn.Linear, bytes sent, parameters
    and saved activations held (the memory accountant), matmul FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..memory import MemoryTracker
    from ..parallel.tensor import GridLinear, make_grid
    g = torch.Generator().manual_seed(0)
    X, dY, W = (torch.randn(*shape, dtype=torch.float64, generator=g)
                for shape in ((job.R, job.K), (job.R, job.N), (job.N, job.K)))
    linear = torch.nn.Linear(job.K, job.N, bias=False).double()
    with torch.no_grad():
        linear.weight.copy_(W)
    grid = make_grid(ctx.comm, job.kind, depth=job.depth)
    layer = GridLinear(linear, grid)
    x = grid.piece(X, "input").clone().requires_grad_(True)
    ctx.comm.ledger.reset()
    with FlopCounterMode(display=False) as flops, MemoryTracker(timeline=False) as mem:
        mem.watch(layer)
        y = layer(x)
        held = {c: mem.current[c] for c in ("parameters", "activations")}
        y.backward(grid.piece(dY, "output"))
    err = max((y - grid.piece(X @ W.T, "output")).abs().max().item(),
              (layer.weight.grad - grid.piece((dY.T @ X).T, "weight")).abs().max().item())
    return {"err": err, "sent": ctx.comm.ledger.bytes_sent(), "held": held, "q": grid.q, "d": grid.d,
            "depth_rank": grid.coords.get("l", 0), "flops": flops.get_total_flops()}


RNG_BYTES = 5056 + 624 * 8   # torch.get_rng_state() (5,056 bytes) and numpy's 624-word MT19937 key, as int64


def redundant_worker(ctx, cfg, tc, num_microbatches: int = 2) -> dict:
    """Bamboo's redundant computation (notebook 10) as a pipeline over every rank of the launch: matmul FLOPs of this
    rank, the bytes of the replica's gradients it sent, and the elements of its replica. Run under
    `launch(..., allow_deaths=True)`, as `train_redundant` asks."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..resilience.redundant import GRAD_TAG, train_redundant
    ctx.comm.ledger.reset()
    with FlopCounterMode(display=False) as flops:
        out = train_redundant(ctx, cfg, tc, num_microbatches=num_microbatches, steps=tc.steps)
    return {"flops": flops.get_total_flops() // tc.steps, "sent": ctx.comm.ledger.bytes_sent(tag=GRAD_TAG),
            "replica": sum(t.numel() for t in out["replica"].values()), "layers": out["layouts"][-1]["layers"]}


def redundant_extra_flops(cfg, batch_size: int, layers: list) -> int:
    """What the redundant forwards add per step (formulas §8.4): every stage but the last runs its successor's
    forward on every micro-batch — its blocks and, for the last stage, the head — on the whole batch in all."""
    from ..memopt.recompute.costs import formula_costs
    costs = formula_costs(cfg, batch_size)
    head = 2 * batch_size * cfg.seq_len * cfg.d_model * cfg.vocab_size
    starts = [sum(layers[:k]) for k in range(len(layers))]
    return sum(sum(b.fwd_flops for b in costs.blocks[starts[k]:starts[k] + layers[k]]) + head * (k == len(layers) - 1)
               for k in range(1, len(layers)))


def survey_worker(ctx, jobs, references=None) -> list:
    """Every job of `jobs` on these ranks, one after the other: a `Job` through `run_job`, a `GridJob` through
    `run_grid` (one launch: the process start is paid once)."""
    references = references or [None] * len(jobs)
    return [run_grid(ctx, job) if isinstance(job, GridJob) else run_job(ctx, job, ref)
            for job, ref in zip(jobs, references)]


__all__ = ["survey_jobs", "survey_worker", "redundant_worker", "redundant_extra_flops", "GridJob", "run_grid",
           "extra_flops", "base_flops", "activation_formula", "NO_ACTIVATION_FORMULA", "RNG_BYTES", "SURVEY_WORLD"]
