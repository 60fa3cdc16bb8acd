"""`parallelize(model, mesh, plan)`: every technique of the course on one rank, in the one order they compose in.

    plan = ParallelPlan(pp=2, dp=2, tp=2, zero=1, microbatches=4, recompute="selective", precision="bf16")
    with parallelize(GPT(cfg, seed=0), Mesh(ctx.comm, pp=2, dp=2, tp=2), plan, train=tc) as job:
        run = job.train(steps=2, probes=[LedgerProbe(ctx.comm)])
        job.expected_bytes          # {'pp': …, 'dp': …, 'tp': …} per step, from each technique's formula
        job.expected_bytes_per_step(2)   # the same per step, + with experts the ep all-to-alls' from the routing

    run, ddp = train_parallel(ctx.comm, cfg, tc, wrap)   # the one-axis form: a hand-written DP wrapper over dp

The plan is checked first (`ParallelPlan.check`: sizes, divisibility, supported combinations), on every rank and
before any rank talks to another. Then each technique is applied to the model the previous one left — every
`apply_<technique>(model, mesh, *, options)` changes the model in place or returns a model of the same kind, so the
next one sees a model it understands (picotron swaps modules inside the model the same way; torchtitan's
`parallelize_llama` fixes the order). The order, and why each technique sits where it does:
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from ..distributed.mesh import Mesh
from .plan import ParallelPlan, PlanError

ORDER = (
    ("context parallel", "decides which tokens of every sequence this rank holds (and their positions): every later "
                         "technique sees this rank's T/cp tokens"),
    ("tensor parallel", "rewrites the layers themselves (which rows or columns of each weight this rank holds), so "
                        "it must see whole layers; the stages cut next hold TP's layers, embedding, head and loss"),
    ("pipeline split", "keeps this rank's blocks (and the embedding or the head); everything after it touches only "
                       "what runs here"),
    ("expert parallel", "replaces each MoE layer by this rank's experts and the all-to-all that feeds them"),
    ("recomputation", "hooks on the blocks that run here, after TP changed their insides: the replay re-runs TP's "
                      "collectives with the block"),
    ("activation offload", "hooks on the same blocks: what recomputation still keeps is what moves off the device"),
    ("precision", "casts what this rank holds to the compute dtype: what ZeRO shards and DP reduces is then in it"),
    ("data parallel / ZeRO", "outermost: reduces or shards whatever parameters this rank now has, over dp (× cp: "
                             "cp ranks hold partial gradients; expert weights over edp); a TP shard of one stage's "
                             "weight is just a tensor to it"),
    ("optimizer", "built once, last, over exactly what this rank updates (fp32 masters under mixed precision, "
                  "its shard under ZeRO, on the host or disk under offload)"),
)
__doc__ += "\n" + "\n".join(f"    {i}. {name:<22}{why}" for i, (name, why) in enumerate(ORDER, 1)) + "\n"


@dataclass
class Parallelized:
    """This rank's share of a composed training job: train it with `train()` (THE training loop, `train.run`)."""
    model: torch.nn.Module
    optimizer: object
    step_fn: object
    batches: object
    plan: ParallelPlan
    mesh: Mesh
    expected_bytes: dict = field(default_factory=dict)   # per step, every axis but ep (`expected_bytes_per_step`)
    applied: list = field(default_factory=list)          # (technique, what it returned) in ORDER

    def expected_bytes_per_step(self, steps: int) -> list:
        """`expected_bytes` for each of the `steps` steps trained so far — with experts over ep > 1, plus the ep
        axis's all-to-all bytes from the routing counts each step's routers produced (`expert.ep_bytes_per_step`),
        which no formula knows before the router has run."""
        from ..parallel.expert import ep_bytes_per_step
        out = [dict(self.expected_bytes) for _ in range(steps)]
        if self.plan.ep > 1:
            model = next(obj for name, obj in self.applied if name == "expert parallel")
            elem = next(p for _, p in self.named_parameters()).element_size()
            ep = ep_bytes_per_step(model, self.mesh["ep"].rank, elem, self.plan.microbatches)
            if len(ep) != steps:
                raise ValueError(f"the MoE layers logged {len(ep)} steps of routing, not {steps}")
            for step, n in zip(out, ep):
                step[self.mesh["ep"].name] = n
        return out

    def train(self, steps: int, *, probes=(), keep_params: bool = False, progress: bool = False):
        from ..train import run
        return run(self.model, self.optimizer, self.batches, steps=steps, probes=probes, step_fn=self.step_fn,
                   keep_params=keep_params, progress=progress)

    @property
    def pipeline(self):
        """This pp rank's executor (`course_lib.parallel.pipeline.Pipeline`; its `.stage`), or None without pp."""
        return next((obj for name, obj in self.applied if name == "pipeline split"), None)

    def named_parameters(self):
        """This rank's parameters under the single-process model's names (what it holds of each)."""
        inner = self.model
        while isinstance(getattr(inner, "module", None), torch.nn.Module) and inner.module is not inner:
            inner = inner.module
        return inner.named_parameters()

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of `full` (a parameter of the single-process model named `name`) that this rank holds: each
        technique that split it (TP's rows or columns, then FSDP's dim-0 shard) cuts it as it cut the parameter."""
        seen = set()
        for _, obj in self.applied:           # a technique that changed a model in place appears once per entry
            cut = getattr(obj, "local_shard", None)
            if cut is not None and id(obj) not in seen:
                seen.add(id(obj))
                full = cut(name, full)
        return full

    def close(self) -> None:
        """Stop what the techniques started (communication threads, offload files), in reverse order."""
        seen = set()
        for _, obj in reversed(self.applied):
            if isinstance(obj, contextlib.AbstractContextManager) and id(obj) not in seen:
                seen.add(id(obj))
                obj.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parallelize(model, mesh: Mesh, plan: ParallelPlan, *, train=None, data_parallel=None,
                config=None) -> Parallelized:
    """Apply `plan` to `model` (the course GPT, the same seed on every rank) on this rank of `mesh`; see the module
    docstring. `train` is the TrainConfig (optimizer hyper-parameters, global batch, data seed).

    `data_parallel(model, dp_comm)`, if given, takes the place of the plan's data-parallel step (its dp_kind and
    ZeRO stage): it returns the wrapped model, or a (model, optimizer) pair — a notebook's own DDP, torch's
    DistributedDataParallel as the reference, a quantized all-reduce. The reducer is whatever it returns that has
    `finish_gradient_synchronization` (the wrapper, else the optimizer); the plan's other techniques apply as
    always. `config`: the GPTConfig of the data and the checks when `model` is not the course GPT (a module of
    one's own, trained data-parallel only)."""
    from ..train import TrainConfig
    tc = train or TrainConfig()
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize needs a course_lib.distributed.mesh.Mesh, got {type(mesh).__name__}; build one with "
                        f"Mesh(ctx.comm, pp=…, dp=…, tp=…)")
    cfg = model.config if config is None else config
    if config is not None and plan.world_size != plan.dp:
        raise PlanError("config= trains a model of one's own data-parallel only; use the course GPT with tp, pp or cp")
    plan.check(cfg, mesh.world.world_size, batch_size=tc.batch_size)
    sizes = {a: mesh.size(a) for a in ("pp", "dp", "cp", "tp", "ep")}
    want = {a: getattr(plan, a) for a in sizes}
    if sizes != want:
        raise PlanError(f"the mesh has {sizes} but the plan asks for {want}; build "
                        f"Mesh(comm, {', '.join(f'{a}={v}' for a, v in want.items())})")
    if data_parallel is not None and (plan.zero or plan.offload_optimizer is not None or cfg.n_expert):
        raise PlanError("data_parallel= replaces the plan's data-parallel step, so the plan must not ask for one "
                        "of its own: use zero=0, offload_optimizer=None and a dense model with it")
    return _build(model, mesh, plan, tc, data_parallel, cfg)


def train_parallel(mesh_or_comm, cfg, tc, wrap=None, *, model=None, probes=(), accum_steps: int = 1,
                   keep_params: bool = False, progress: bool = False):
    """The one-axis form of `parallelize`: train the course GPT (or `model`) over all ranks as dp, `wrap(model,
    comm)` reducing the gradients (a wrapper, or a (model, optimizer) pair; None: the plan's bucketed DDP), each
    rank's share of every global batch of `tc.batch_size` sequences in `accum_steps` micro-steps, `tc.steps` steps
    of `train.run`. Returns (train.Run, the wrapped model); compare with `train.train_reference(cfg, tc)`."""
    from ..distributed.mesh import axis_comm
    from ..core.model import GPT
    comm = axis_comm(mesh_or_comm, "dp")
    mesh = mesh_or_comm if isinstance(mesh_or_comm, Mesh) else Mesh(comm, dp=comm.world_size)
    own = model is not None and not hasattr(model, "config")       # a module of one's own: cfg says the data
    model = GPT(cfg, seed=tc.seed) if model is None else model
    plan = ParallelPlan(dp=mesh.size("dp"), microbatches=accum_steps)
    with parallelize(model, mesh, plan, train=tc, data_parallel=wrap, config=cfg if own else None) as job:
        return job.train(tc.steps, probes=probes, keep_params=keep_params, progress=progress), job.model


def _build(model, mesh: Mesh, plan: ParallelPlan, tc, data_parallel, cfg) -> Parallelized:
    from .. import optim
    from ..memopt.offload import activation_offload_of, apply_activation_offload
    from ..memopt.precision import apply_precision
    from ..memopt.recompute import apply_recompute
    from ..parallel.context import apply_cp
    from ..parallel.dp import apply_dp
    from ..parallel.expert import ExpertDataParallel, ExpertShardedOptimizer, apply_ep
    from ..parallel.fsdp import apply_fsdp
    from ..parallel.pipeline import apply_pipeline
    from ..parallel.tensor import apply_tp
    from ..parallel.zero import ShardedOptimizer
    from ..train import forward_backward, optimizer_kwargs
    applied = []
    M = plan.microbatches
    if plan.cp > 1:                                                           # context parallel
        model = apply_cp(model, mesh, layout=plan.cp_layout)
        applied.append(("context parallel", model))
    if plan.tp > 1:                                                           # tensor parallel
        model = apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel)
        applied.append(("tensor parallel", model))
    step_fn, pipe = forward_backward, None
    if plan.pp > 1:                                                           # pipeline split
        model = apply_pipeline(model, mesh, num_microbatches=M, schedule=plan.schedule, chunks=plan.chunks,
                               layers=plan.layers)
        step_fn = pipe = model.pipeline
        applied.append(("pipeline split", pipe))
    if plan.pp > 1 and cfg.n_expert:          # the stages' load-balancing losses enter through backward (Megatron)
        from ..core.moe import attach_aux_losses
        per = cfg.n_layer * M * (plan.tp if plan.sequence_parallel else 1)  # coef × mean over layers (and SP's
        attach_aux_losses(model, cfg.aux_loss_coef / per)                  # slices), 1/M per micro-batch
    if plan.ep > 1:                                                           # expert parallel
        apply_ep(model, mesh)
        applied.append(("expert parallel", model))
    if plan.recompute is not None:                                            # recomputation
        apply_recompute(model, mesh, policy=plan.recompute)
        applied.append(("recomputation", model))
    if plan.offload_activations:                                              # activation offload
        apply_activation_offload(model, mesh)
        applied.append(("activation offload", activation_offload_of(model)))
    recipe, scaler = "fp32", None                                             # precision
    if plan.precision is not None:
        apply_precision(model, mesh, recipe=plan.precision, cast=plan.zero != 3)   # FSDP casts its own gathers
        recipe, scaler = model.recipe, model.scaler
        if recipe.loss_scaling:
            step_fn = model.step_fn(step_fn)
        applied.append(("precision", model))
    hyper = optimizer_kwargs(tc)                                              # data parallel / ZeRO, optimizer
    group = mesh.group("dp", "cp")
    wrapped, optimizer = model, None
    if data_parallel is not None:                 # the caller's own reducer over dp (see parallelize)
        out = data_parallel(model, group)
        wrapped, optimizer = out if isinstance(out, tuple) else (out, None)
    elif cfg.n_expert and plan.zero in (1, 2):    # ZeRO over dp (× cp) for the replicated, edp (× cp) for experts
        optimizer = ExpertShardedOptimizer(model, mesh, optim.optimizer_class(recipe, scaler=scaler, vote=mesh),
                                           stage=plan.zero, **hyper)
    elif cfg.n_expert:
        wrapped = ExpertDataParallel(model, mesh)
    elif plan.zero == 3:
        wrapped = apply_fsdp(model, group, **_fsdp_options(plan, recipe))
        # bf16 under FSDP: the fp32 shards are the masters (no second copy); fp16 still needs the scaler's vote
        optimizer = optim.make(wrapped.parameters(), recipe if recipe != "fp32" and recipe.loss_scaling else "fp32",
                               scaler=scaler, vote=mesh, **hyper)
    elif plan.offload_optimizer is not None:      # ZeRO-Offload / the SSD tier: each rank offloads its shard
        from ..memopt.offload import OffloadAdam
        if group.world_size > 1:
            optimizer = ShardedOptimizer(model.parameters(), OffloadAdam, group, stage=plan.zero,
                                         tier=plan.offload_optimizer, **hyper)
        else:
            optimizer = OffloadAdam(model.parameters(), tier=plan.offload_optimizer, **hyper)
    elif plan.zero in (1, 2):
        optimizer = ShardedOptimizer(model.parameters(), optim.optimizer_class(recipe, scaler=scaler, vote=mesh),
                                     group, stage=plan.zero, **hyper)
    elif group.world_size > 1:
        wrapped = apply_dp(model, group, kind=plan.dp_kind)
    if wrapped is not model:
        applied.append(("data parallel / ZeRO", wrapped))
    if optimizer is None:      # over what the wrapper trains (FSDP's shards are its module's parameters then)
        params = (getattr(wrapped, "module", wrapped) if data_parallel is not None else model).parameters()
        optimizer = optim.make(params, recipe, scaler=scaler, vote=mesh, **hyper)
    applied.append(("optimizer", optimizer))
    # what reduces the gradients over dp: a wrapper around the model (DDP, FSDP) or the ZeRO-1/2 optimizer
    reducer = wrapped if wrapped is not model else (
        optimizer if hasattr(optimizer, "finish_gradient_synchronization") else None)
    if pipe is not None:
        pipe.data_parallel = reducer
    elif reducer is not None and reducer is not wrapped and (data_parallel is None or M > 1):
        # ZeRO-1/2: accumulate, then reduce once (a caller's own optimizer-reducer keeps its step() alone when
        # there is nothing to accumulate: the loop it was written for has no 'sync' phase then)
        step_fn = functools.partial(forward_backward, sync=reducer)
    b = tc.batch_size // (plan.dp * M)
    batches = mesh.batches(cfg.seq_len, b, accum_steps=M, seed=tc.data_seed)
    job = Parallelized(wrapped, optimizer, step_fn, batches, plan, mesh, applied=applied)
    job.expected_bytes = _expected_bytes(job, model, cfg, pipe, reducer, b)
    return job


def _fsdp_options(plan: ParallelPlan, recipe) -> dict:
    from ..parallel.fsdp import norms_and_biases
    out = {}
    if recipe != "fp32":
        out["compute_dtype"] = recipe.compute_dtype
    if plan.fsdp_replicate == "norms+biases":
        out["replicate"] = norms_and_biases
    elif plan.fsdp_replicate is not None:
        out["min_shard_numel"] = plan.fsdp_replicate
    return out


def _expected_bytes(job: Parallelized, model, cfg, pipe, reducer, b: int) -> dict:
    """Bytes this rank sends per step on each mesh axis: the one sum of each technique's own formula
    (`parallel.expected.bytes_per_step`), under the ledger's group names."""
    from .expected import bytes_per_step
    return bytes_per_step(cfg, job.plan, job.mesh.coords, micro_batch_size=b,
                          elem=next(model.parameters()).element_size(),
                          pipeline=pipe.plan if pipe is not None else None,
                          recompute_plan=getattr(model, "recompute_plan", None), reducer=reducer,
                          dp_group=job.mesh.group("dp", "cp").name,
                          loss_elem=4 if job.plan.precision is not None else None)   # fp32 logits (precision hook)


__all__ = ["parallelize", "train_parallel", "Parallelized", "ParallelPlan", "PlanError", "ORDER"]
