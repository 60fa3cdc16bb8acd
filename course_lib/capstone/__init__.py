"""The capstone worker: several `ParallelPlan`s trained in ONE launch through `parallelize`, each measured four
ways — equality with the single-process run of the same recipe, ledger bytes per mesh axis per step against the sum
of the techniques' formulas, model-state memory per rank against ZeRO's formula, and matmul FLOPs per rank (what
recomputation and every other technique add to the work).

    jobs = [Job("5D", ParallelPlan(pp=2, dp=2, tp=2, zero=1, num_microbatches=2, recompute="selective"), cfg, tc)]
    refs = [reference_run(j)[1] for j in jobs]                       # one process, the same recipe
    res = launch(capstone_worker, 8, jobs, refs)                     # res[rank][job]: a dict (see `run_job`)

The same worker runs unchanged under torchrun (each process computes the references itself):

    torchrun --standalone --nproc-per-node 8 -m course_lib.run course_lib.capstone:torchrun_worker 2

Formulas (docs/formulas.md): bytes are `Parallelized.expected_bytes` (each technique's own closed form, §2–§12;
under mixed precision the vocab-parallel loss reduces fp32 logits, §13.1); expert parallelism's all-to-all bytes
from the routing counts of each step (`Parallelized.expected_bytes_per_step`, §12.3–12.4); model states are ZeRO's
Ψ·(e_p + e_g + K) divided by the dp group as each stage shards them (Rajbhandari et al. SC'20 §5.1;
`parallel.zero.zero_state_bytes`) plus AdamW's step count per tensor (docs/formulas.md §2.2 and §13.1). The survey's
rows and the tensor-parallel grids are in `course_lib.capstone.survey`, the pictures in `course_lib.capstone.plots`.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from ..composer.parallelize import parallelize
from ..composer.plan import ParallelPlan
from ..core.model import GPT, GPTConfig, get_config
from ..distributed.mesh import Mesh
from ..memopt.recompute.measured import activation_peak
from ..parallel.expert import aux_loss_per_step
from ..train import LedgerProbe, MemoryProbe, TrainConfig

GROUPS = ("pp", "dp", "cp", "tp", "ep", "edp", "dp×cp")
STATES = ("parameters", "gradients", "optimizer")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class Job:
    """One run of a launch: `plan` on `cfg` with `tc`, the model built in `dtype` ('float64' for runs compared
    exactly, 'float32' for the precision recipes). `timeline`: hand back the ledger's events (for the Gantt chart)."""
    name: str
    plan: ParallelPlan
    cfg: GPTConfig
    tc: TrainConfig
    dtype: str = "float64"
    timeline: bool = False
    flops: bool = False                 # count matmul FLOPs (torch's FlopCounterMode: slows the run ~2×)
    checkpoint: str | None = None       # after every step: 'sync' | 'async' (CheckFreq) to `root`, 'peer' (Gemini)
    root: str | None = None             # the checkpoint directory (shared by the ranks of one machine)

    @property
    def world_size(self) -> int:
        return self.plan.world_size


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def reference_run(job: Job) -> tuple:
    """One process, the same recipe (precision, and the MoE's capacity groups as the ranks decide them), the whole
    global batch: the run every composed one must equal. Returns (losses, {name: final parameter}, matmul FLOPs per
    step if `job.flops`). A mixed-precision
    recipe runs through `parallelize` on a world of one rank (its casts and fp32 masters, nothing split); call it
    from the caller, not inside a rank."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..parallel.expert import set_moe_groups
    from ..train import train_reference
    if job.plan.precision is not None:
        from ..distributed.launch import launch
        return launch(_single_worker, 1, job, timeout=120)[0]
    with _default_dtype(DTYPES[job.dtype]):
        model = GPT(job.cfg, seed=job.tc.seed).to(DTYPES[job.dtype])
        if job.cfg.n_expert:
            set_moe_groups(model, job.plan.dp * job.plan.num_microbatches,      # one capacity group per micro-batch
                           cp=job.plan.cp, layout=job.plan.cp_layout,        # (and per cp rank's tokens of it,
                           tp=job.plan.tp if job.plan.sequence_parallel else 1)    # SP's slice of those)
        with FlopCounterMode(display=False) if job.flops else contextlib.nullcontext() as flops:
            ref = train_reference(job.cfg, job.tc, progress=False, model=model)
    return ref.losses, {k: v.detach().clone() for k, v in ref.model.named_parameters()}, \
        flops.get_total_flops() // job.tc.steps if job.flops else None


def _single_worker(ctx, job: Job):
    with _default_dtype(DTYPES[job.dtype]):
        plan = ParallelPlan(precision=job.plan.precision)
        with parallelize(GPT(job.cfg, seed=job.tc.seed).to(DTYPES[job.dtype]), Mesh(ctx.comm), plan,
                         train_config=job.tc) as p:
            run = p.train(job.tc.steps, keep_params=True)
    return run.losses, run.params, None


# ------------------------------------------------------------------------------------------------- formulas
def one_process_losses(ranks: list, plan: ParallelPlan) -> list:
    """The loss one process reports at each step, from every rank's `run_job` result: the mean over the (dp, cp)
    positions of the last stage's loss — plus, with experts inside a pipeline, every stage's share of the
    load-balancing loss at that position (`aux`: it reached the gradients through backward, not the last stage's
    loss). The tp ranks of a position report the same loss; one of them counts."""
    last = [r for r in ranks if r["coords"]["pp"] == plan.pp - 1 and r["coords"]["tp"] == 0]
    split = plan.tp if plan.sequence_parallel else 1        # SP: each tp rank routes, and reports, its own slice
    out = []
    for s in range(len(last[0]["losses"])):
        per = []
        for r in last:
            if not r.get("aux"):                                  # no expert-parallel layer logged one
                per.append(r["losses"][s])
                continue
            here = [q for q in ranks if all(q["coords"][a] == r["coords"][a] for a in ("dp", "cp"))]
            every = sum(q["aux"][s] for q in here) / plan.tp      # Σ over stages of the mean over the tp ranks
            own = r["aux"][s] / split if plan.pp == 1 else 0.0     # what this rank's reported loss holds of it
            per.append(r["losses"][s] - own + every)
        out.append(sum(per) / len(per))
    return out


def state_formula(plan: ParallelPlan, layout: dict, model_elem: int, step_elem: int = 4) -> dict:
    """Model states per rank after an optimizer step, by category (device bytes): ZeRO's formula over the P elements
    this rank's dp group shards (`layout`: P, the optimizer's elements P_opt, its tensors K, what FSDP leaves whole
    R), with the recipe's bytes — the compute copy e_c for parameters and gradients; for the optimizer an fp32
    master (4, if the recipe keeps one) + Adam's m and v (2·e_state) + AdamW's step count per tensor (`step_elem`: a
    scalar of the default dtype). m, v and the counts exist once a step was taken: fp16's loss scaler skips the
    steps whose gradients overflowed (`layout['stepped']`). Optimizer offload moves the whole optimizer off the
    device."""
    from ..memopt.precision.recipes import get_recipe
    from ..parallel.zero import zero_state_bytes
    if layout.get("parts"):     # experts under ZeRO: the formula once per part, each over its own group (dp, edp)
        each = [state_formula(plan, {**part, "stepped": layout.get("stepped", True)}, model_elem, step_elem)
                for part in layout["parts"]]
        return {c: sum(e[c] for e in each) for c in each[0]}
    if plan.precision is None:
        e_c, master, e_s = model_elem, 0, model_elem
    else:
        r = get_recipe(plan.precision)
        e_c, master, e_s = r.compute_bytes, 4 if r.master_weights else 0, r.state_bytes
    n = layout.get("n", plan.dp * plan.cp)     # the group ZeRO shards over (a part's own, under experts)
    if plan.zero == 3 and master:              # FSDP under bf16: the fp32 shards are the masters and the parameters
        e_c, master = 4, 0
    out = zero_state_bytes(layout["P"], n, plan.zero, param=e_c, grad=e_c, optim=0)
    for c in ("parameters", "gradients"):      # FSDP: what it leaves whole on every rank (fsdp_replicate)
        out[c] += e_c * layout.get("R", 0)
    stepped = layout.get("stepped", True)
    shard = layout["P_opt"] // (n if plan.zero in (1, 2) else 1)
    out["optimizer"] = (master + 2 * e_s * stepped) * shard + step_elem * layout["K"] * stepped
    if plan.offload_optimizer is not None:
        out["optimizer"] = 0
    return out


def _layout(p) -> dict:
    """P (what ZeRO shards, padded to the dp group), P_opt (what the optimizer steps), K (its tensors), psi (the
    trainable elements this rank holds, as the model holds them)."""
    from ..parallel.expert import ExpertShardedOptimizer
    from ..parallel.zero import ShardedOptimizer
    opt, held = p.optimizer, [t for _, t in p.named_parameters() if t.requires_grad]
    psi = sum(t.numel() for t in held)
    scaler = getattr(p.handles.get("precision"), "scaler", None)
    history = scaler.history if scaler is not None else []           # (scale, overflowed) per step
    skipped = sum(inf for _, inf in history)
    out = {"stepped": skipped == 0 or skipped < len(history), "skipped": skipped}
    if isinstance(opt, ShardedOptimizer):
        return {**out, "P": opt.padded_numel, "P_opt": opt.padded_numel, "K": opt.num_shards, "psi": psi}
    if isinstance(opt, ExpertShardedOptimizer):        # two ZeRO groups: the replicated parameters', the experts'
        parts = [{"P": o.padded_numel, "P_opt": o.padded_numel, "K": o.num_shards, "n": o.comm.world_size}
                 for o in opt.parts.values()]
        return {**out, "parts": parts, "psi": psi, **{k: sum(q[k] for q in parts) for k in ("P", "P_opt", "K")}}
    if p.plan.zero == 3:
        fsdp = p.model
        return {**out, "P": fsdp.padded_numel, "P_opt": fsdp.local_numel, "K": len(list(fsdp.parameters())),
                "psi": fsdp.local_numel, "R": sum(fsdp.replicated_numel)}
    return {**out, "P": psi, "P_opt": psi, "K": len(held), "psi": psi}


# ------------------------------------------------------------------------------------------------- the worker
def run_job(ctx, job: Job, reference: dict | None = None) -> dict:
    """Train `job` on this rank; return what it measured: losses, max |Δ| against `reference` (this rank's shard of
    each parameter), bytes per step by mesh group and the formulas', model states after the last step and their
    formula, the peak of each memory category, matmul FLOPs per step, and (timeline) the ledger."""
    from torch.utils.flop_counter import FlopCounterMode
    plan, dtype = job.plan, DTYPES[job.dtype]
    device = getattr(ctx, "device", torch.device("cpu"))
    # NCCL (under torchrun on GPUs): what the library creates goes to this rank's GPU; nothing changes on CPU
    on_device = torch.device(device) if device.type != "cpu" else contextlib.nullcontext()
    with _default_dtype(dtype), on_device:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        ctx.comm.ledger.reset()
        model = GPT(job.cfg, seed=job.tc.seed).to(dtype)
        with parallelize(model, mesh, plan, train_config=job.tc) as p:
            e = next(p.model.parameters()).element_size() if plan.zero != 3 else dtype.itemsize
            # a recomputation's rebuilt tensors are their own category: its activation peak needs the timeline
            mem = MemoryProbe(timeline=plan.recompute is not None)
            probes, host = [LedgerProbe(ctx.comm, groups=GROUPS), mem], None
            if job.checkpoint is not None:
                probes.append(_checkpoint_probe(job))
                host = getattr(probes[-1], "memory", None)
            with FlopCounterMode(display=False) if job.flops else contextlib.nullcontext() as flops:
                run = p.train(job.tc.steps, keep_params=True, probes=probes)
            # the formulas per step (with experts: the all-to-all's bytes from the counts each step's routers made)
            wants = [{g: n for g, n in s.items() if n} for s in p.expected_bytes_per_step(job.tc.steps)]
            out = {"losses": run.losses, "coords": mesh.coords,
                   # a pipeline's last stage reports its cross-entropy; each rank's share of the load-balancing loss
                   "aux": aux_loss_per_step(p.model, job.cfg, plan.num_microbatches) if plan.ep > 1 else None,
                   "bytes": [{g: n for g, n in s.items() if n} for s in run["ledger"]["group_bytes"]],
                   "want": wants, "layout": _layout(p),
                   "state": {c: run["memory"]["after_step"][-1][c] for c in STATES},
                   "peak": dict(run["memory"]["report"].max_by_category),
                   "saved": _saved_peak(run["memory"]["report"]),
                   "flops": flops.get_total_flops() // job.tc.steps if job.flops else None,
                   "names": sorted(run.params)}
            out["state_formula"] = state_formula(plan, out["layout"], e, dtype.itemsize)
            if reference is not None:
                out["err"] = max(((v.double() - p.local_shard(k, reference[k].to(v.device)).double()).abs().max().item()
                                  for k, v in run.params.items()), default=0.0)
            if job.checkpoint is not None:
                out["checkpoint"] = _checkpoint_measures(ctx, job, run, host)
            if job.timeline:                    # a copy: the next job of this launch resets the ledger
                out["ledger"] = copy.deepcopy(ctx.comm.ledger)
    return out


def _saved_peak(report) -> int:
    """The activation peak: saved for backward plus what a recomputation rebuilds (a category of its own, summed
    over the timeline); without recomputation, the activations' own maximum."""
    return activation_peak(report) if report.timeline else report.max_by_category.get("activations", 0)


def _checkpoint_probe(job: Job):
    from ..resilience.async_ckpt import CheckpointProbe
    from ..resilience.peer import HostMemory, PeerCheckpointProbe
    if job.checkpoint == "peer":
        return PeerCheckpointProbe(HostMemory(job.root), every=1)
    return CheckpointProbe(job.root, every=1, asynchronous=job.checkpoint == "async")


def _checkpoint_measures(ctx, job: Job, run, host) -> dict:
    """What checkpoints cost this rank: the last snapshot's bytes (parameters and optimizer state as held, and the
    generators' states) and every one's ('blobs'), the bytes it sent in the whole run (in-memory copies on peers: one
    ring shift per checkpoint), on rank 0 every byte the checkpoints left on disk (tensors, headers, meta.json,
    manifest), and what it holds in host memory (Gemini: the last two snapshots of its own and of its predecessor)."""
    import os
    events = run["checkpoint" if job.checkpoint != "peer" else "peer"]
    sent = sum(v["sent"] for t, v in ctx.comm.ledger.by("tag").items() if str(t).startswith("gemini"))
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(job.root) for f in fs) \
        if ctx.rank == 0 else None
    return {"bytes": events[-1]["bytes"], "blobs": [e["bytes"] for e in events], "sent": sent, "stored": on_disk,
            "host": host.nbytes(ctx.rank) if host is not None else None}


def capstone_worker(ctx, jobs, references=None) -> list:
    """Every job of `jobs` on these ranks, one after the other (one launch: the process start is paid once)."""
    references = references or [None] * len(jobs)
    return [run_job(ctx, job, ref) for job, ref in zip(jobs, references)]


# ------------------------------------------------------------------------------------------------- torchrun
CONFIG = dict(n_layer=4, n_head=4, d_model=32, seq_len=16)
MOE = get_config("nano", **{**CONFIG, "n_layer": 2}, n_expert=4, top_k=2)        # 2 MoE layers of 4 experts


def composed_shape(world_size: int) -> dict:
    """pp × dp × tp for `world_size` ranks: tp = 2 and pp = 2 where the world divides, dp the rest (8: 2×2×2)."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if (world_size // tp) % 2 == 0 else 1
    return {"pp": pp, "dp": world_size // (pp * tp), "tp": tp}


def capstone_jobs(steps: int = 2, world_size: int = 8, seed: int = 0) -> list:
    """The composed run of the capstone: pp × dp × tp (2 × 2 × 2 on 8 ranks), ZeRO-1, 1F1B over 2 micro-batches,
    selective recomputation — in float64 (equal to one process to rounding) and under bf16 mixed precision."""
    cfg = get_config("nano", **CONFIG)
    shape = composed_shape(world_size)
    tc = TrainConfig(steps=steps, batch_size=4 * shape["dp"], lr=2e-3, seed=seed, data_seed=seed)
    plan = dict(**shape, zero=1, schedule="1f1b", num_microbatches=2, recompute="selective")
    return [Job("composed, float64", ParallelPlan(**plan), cfg, tc, "float64", timeline=True),
            Job("composed, bf16", ParallelPlan(**plan, precision="bf16"), cfg, tc, "float32")]


def shape_jobs(steps: int = 2, seed: int = 0) -> list:
    """Context and expert parallelism on 4 ranks, float64, equal to one process: pp × cp with ZeRO-1 over dp × cp,
    cp × tp with sequence parallelism, and DeepSeek-V3's pp × ep × ZeRO-1 on the toy (each stage's MoE layers
    exchange tokens in that stage's ep group; the experts' optimizer state sharded over edp, the rest over dp) — with
    the per-rank ledger kept for a timeline."""
    cfg = get_config("nano", **CONFIG)
    tc = TrainConfig(steps=steps, batch_size=8, lr=1e-3, seed=seed, data_seed=seed)
    return [Job("PP × CP", ParallelPlan(pp=2, cp=2, zero=1, num_microbatches=2), cfg, tc),
            Job("CP × TP", ParallelPlan(cp=2, tp=2, zero=1, sequence_parallel=True), cfg, tc),
            Job("PP × EP × ZeRO-1", ParallelPlan(pp=2, dp=2, ep=2, zero=1, num_microbatches=2), MOE, tc, timeline=True)]


def llama3_job(steps: int = 2, seed: int = 0) -> Job:
    """Llama 3's long-context layout on the toy (Dubey et al. 2024, Table 4: TP 8 × CP 16 × PP 16 × DP), every axis
    at 2: pp × dp × cp × tp = 16 ranks, ZeRO-1 over dp × cp, sequence parallelism, 1F1B; float64, with the ledger."""
    cfg = get_config("nano", **CONFIG)
    tc = TrainConfig(steps=steps, batch_size=8, lr=1e-3, seed=seed, data_seed=seed)
    return Job("4D (Llama 3)", ParallelPlan(pp=2, dp=2, cp=2, tp=2, zero=1, sequence_parallel=True, num_microbatches=2),
               cfg, tc, timeline=True)


def time_worker(ctx, jobs, steps: int = 5, ping_sizes=(8, 4096, 65536, 524288, 2097152), rings: int = 100) -> dict:
    """The toy's step, measured for the calculator to model (notebook 13 §3): first this machine's link between
    ranks 0 and 1 (`distributed.comm.ping_pong`, the fastest of 5; the notebook fits α + S·β to it) and the seconds per
    message of `rings` ring all-reduces on all ranks (`distributed.collectives.ring_message_seconds`: what a message
    costs inside a collective), back to back ("ring_messages") and each after one block's forward + backward on this
    rank's share of the first job's batch ("ring_messages_after_compute": as a step's messages follow its compute),
    then each job trained `steps` steps with nothing attached (no memory tracker, no FLOP counter, no ledger probe),
    then the ring all-reduces again (the load may change while the jobs run). Per job: this rank's seconds of every
    step and the messages it sent per step on each mesh axis (the ledger's count ÷ steps)."""
    from ..distributed.collectives import ring_message_seconds
    from ..distributed.comm import ping_pong
    cfg, tc = jobs[0].cfg, jobs[0].tc
    block = GPT(cfg.replace(n_layer=1), seed=tc.seed).blocks[0]
    x = torch.randn(max(tc.batch_size // ctx.world_size, 1), cfg.seq_len, cfg.d_model, requires_grad=True)

    def compute():
        block(x).sum().backward()

    def ring_costs(n):
        return {"ring_messages": ring_message_seconds(ctx, n),
                "ring_messages_after_compute": ring_message_seconds(ctx, n, between=compute)}
    first = ring_costs(rings // 2)
    out = {"one_way": ping_pong(ctx, list(ping_sizes), 5), **first, "jobs": []}
    for job in jobs:
        mesh = Mesh(ctx.comm, pp=job.plan.pp, dp=job.plan.dp, cp=job.plan.cp, tp=job.plan.tp, ep=job.plan.ep)
        with parallelize(GPT(job.cfg, seed=job.tc.seed), mesh, job.plan, train_config=job.tc) as p:
            ctx.comm.ledger.reset()
            run = p.train(steps)
        sent = ctx.comm.ledger.by("group")
        out["jobs"].append({"seconds": run.step_seconds,
                            "messages": {g: r["messages"] / steps for g, r in sent.items()
                                         if g in GROUPS and r["messages"]}})
    for key, times in ring_costs(rings - rings // 2).items():
        out[key] += times
    return out


def torchrun_worker(ctx, steps: str = "2") -> dict:
    """`python -m torch.distributed.run --standalone --nproc-per-node 8 -m course_lib.run
    course_lib.capstone:torchrun_worker 2`: the capstone's float64 composed run on however many ranks torchrun
    started (`composed_shape`), checked on every rank against one process (computed here, on each rank: the whole
    job is tiny). Returns a one-line summary per rank."""
    job = capstone_jobs(int(steps), ctx.world_size)[0]
    losses, ref, _ = reference_run(job)
    r = run_job(ctx, job, ref)
    loss = r["losses"][-1]
    return {"err": r["err"], "bytes_equal": r["bytes"] == r["want"], "want": r["want"][0],
            "state_equal": r["state"] == r["state_formula"],
            "loss_err": abs(loss - losses[-1]) if loss == loss else None}


__all__ = ["Job", "run_job", "capstone_worker", "reference_run", "one_process_losses", "state_formula",
           "MOE", "CONFIG", "composed_shape", "capstone_jobs", "shape_jobs", "llama3_job", "torchrun_worker",
           "time_worker", "GROUPS", "STATES"]
