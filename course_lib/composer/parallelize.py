"""`parallelize(model, mesh, plan)`: every technique of the course on one rank, in the one order they compose in.

    plan = ParallelPlan(pp=2, dp=2, tp=2, zero=1, num_microbatches=4, recompute="selective", precision="bf16")
    with parallelize(GPT(cfg, seed=0), Mesh(ctx.comm, pp=2, dp=2, tp=2), plan, train_config=tc) as job:
        run = job.train(steps=2, probes=[LedgerProbe(ctx.comm)])
        job.expected_bytes          # {'pp': …, 'dp': …, 'tp': …} per step, from each technique's formula
        job.expected_bytes_per_step(2)   # the same per step, + with experts the ep all-to-alls' from the routing

    run, ddp = train_parallel(ctx.comm, cfg, tc, wrap)   # the one-axis form: a hand-written DP wrapper over dp

The plan is checked first (`ParallelPlan.check`: sizes, divisibility, supported combinations), on every rank and
before any rank talks to another. Then each technique is applied to the model the previous one left, by one
contract: `model = apply_<technique>(model, mesh, *, options)` changes the model in place or returns a model
wrapping it, so the next one sees a model it understands (picotron swaps modules inside the model the same way;
torchtitan's `parallelize_llama` fixes the order), and leaves its handle on it (`core.handles.handle_of(model,
technique)`: the pipeline's executor, the recomputation plan, what reduces the gradients, …). The optimizer is
built last, by the one factory (`optim.build`), from what the techniques left. The order, with each step's
technique, and why each sits where it does:
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .. import optim
from ..core.handles import handle_of, handles
from ..core.model import GPT
from ..core.moe import attach_aux_losses
from ..distributed.mesh import Mesh, axis_comm
from ..memopt.offload import apply_offload
from ..memopt.precision import apply_precision
from ..memopt.recompute import apply_recompute
from ..parallel.context import apply_cp
from ..parallel.expert import apply_ep, apply_expert_zero, ep_bytes_per_step
from ..parallel.fsdp import REPLICATION_RULES
from ..parallel.pipeline import apply_pipeline
from ..parallel.tensor import apply_tp
from ..parallel.zero import apply_zero
from ..train import TrainConfig, forward_backward, optimizer_kwargs, run
from .expected import bytes_per_step
from .plan import ParallelPlan, PlanError

ORDER = (
    ("context_parallel", "decides which tokens of every sequence this rank holds (and their positions): every "
                         "later technique sees this rank's T/cp tokens"),
    ("tensor_parallel", "rewrites the layers themselves (which rows or columns of each weight this rank holds), so "
                        "it must see whole layers; the stages cut next hold TP's layers, embedding, head and loss"),
    ("pipeline", "keeps this rank's blocks (and the embedding or the head); everything after it touches only what "
                 "runs here"),
    ("expert_parallel", "replaces each MoE layer by this rank's experts and the all-to-all that feeds them"),
    ("recompute", "hooks on the blocks that run here, after TP changed their insides: the replay re-runs TP's "
                  "collectives with the block"),
    ("offload", "hooks on the same blocks: what recomputation still keeps is what moves off the device; the "
                "optimizer's state and step go to the host or disk when the optimizer is built"),
    ("precision", "casts what this rank holds to the compute dtype: what ZeRO shards and DP reduces is then in it"),
    ("data_parallel", "outermost: reduces or shards whatever parameters this rank now has, over dp (× cp: cp ranks "
                      "hold partial gradients; expert weights over edp); a TP shard of one stage's weight is just "
                      "a tensor to it"),
    ("optimizer", "built once, last, over exactly what this rank updates (fp32 masters under mixed precision, its "
                  "shard under ZeRO, on the host or disk under offload)"),
)
__doc__ += "\n" + "\n".join(f"    {i}. {name:<18}{why}" for i, (name, why) in enumerate(ORDER, 1)) + "\n"


def parallelize(model, mesh: Mesh, plan: ParallelPlan, *, train_config: TrainConfig | None = None) -> Parallelized:
    """Apply `plan` to `model` (the course GPT, the same seed on every rank) on this rank of `mesh`; see the module
    docstring. `train_config`: the optimizer's hyper-parameters, the global batch and the data seed."""
    tc = train_config or TrainConfig()
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize needs a course_lib.distributed.mesh.Mesh, got {type(mesh).__name__}; build "
                        f"one with Mesh(ctx.comm, pp=…, dp=…, tp=…)")
    plan.check(model.config, mesh.world.world_size, batch_size=tc.batch_size)
    sizes = {a: mesh.size(a) for a in ("pp", "dp", "cp", "tp", "ep")}
    want = {a: getattr(plan, a) for a in sizes}
    if sizes != want:
        raise PlanError(f"the mesh has {sizes} but the plan asks for {want}; build "
                        f"Mesh(comm, {', '.join(f'{a}={v}' for a, v in want.items())})")
    return Parallelized(apply_plan(model, mesh, plan), model.config, tc, plan, mesh)


def apply_plan(model, mesh: Mesh, plan: ParallelPlan):
    """Every technique of `plan`, in ORDER, on this rank's model: the model to train (its optimizer: `optim.build`)."""
    cfg = model.config
    if plan.cp > 1:
        model = apply_cp(model, mesh, layout=plan.cp_layout)
    if plan.tp > 1:
        model = apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel)
    if plan.pp > 1:
        model = apply_pipeline(model, mesh, num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                               chunks=plan.chunks, layers=plan.layers)
    if plan.pp > 1 and cfg.n_expert:   # the stages' load-balancing losses enter through backward (Megatron), each
        attach_aux_losses(model, cfg.aux_loss_coef / (cfg.n_layer * plan.num_microbatches            # coef × the mean
                                                      * (plan.tp if plan.sequence_parallel else 1)))  # over layers
    if plan.ep > 1:
        model = apply_ep(model, mesh)
    if plan.recompute is not None:
        model = apply_recompute(model, mesh, policy=plan.recompute)
    if plan.offload_activations or plan.offload_optimizer is not None:
        model = apply_offload(model, mesh, activations=plan.offload_activations, optimizer=plan.offload_optimizer,
                              dtype=None, zero_stage=None)
    if plan.precision is not None:
        model = apply_precision(model, mesh, recipe=plan.precision, cast=plan.zero != 3)  # FSDP casts its gathers
    if cfg.n_expert:                   # replicated parameters over dp, experts over edp, each its own ZeRO
        return apply_expert_zero(model, mesh, plan.zero)
    return apply_zero(model, mesh, plan.zero, kind=plan.dp_kind, fsdp_options=_fsdp_options(plan, model))


def _fsdp_options(plan: ParallelPlan, model) -> dict:
    if plan.zero != 3:
        return {}
    out = {}
    if plan.precision is not None:
        out["compute_dtype"] = handle_of(model, "precision").recipe.compute_dtype
    if plan.fsdp_replicate in REPLICATION_RULES:
        out["replicate"] = REPLICATION_RULES[plan.fsdp_replicate]
    elif plan.fsdp_replicate is not None:
        out["min_shard_numel"] = plan.fsdp_replicate
    return out


class Parallelized:
    """This rank's share of a composed training job: the model every technique of the plan was applied to, its
    optimizer (built last, `optim.build`), this rank's batches; train it with `train()` (THE training loop)."""

    def __init__(self, model, config, train_config: TrainConfig, plan: ParallelPlan, mesh: Mesh):
        self.model, self.config, self.plan, self.mesh = model, config, plan, mesh
        self.optimizer = optim.build(model, **optimizer_kwargs(train_config))
        self.step_fn = step_function(model, self.optimizer, plan.num_microbatches)
        b = train_config.batch_size // (plan.dp * plan.num_microbatches)
        cfg = config
        self.batches = mesh.batches(cfg.seq_len, b, num_microbatches=plan.num_microbatches, seed=train_config.data_seed)
        self.expected_bytes = self._expected_bytes(cfg, b)

    @property
    def handles(self) -> dict:
        """{technique: handle} of every technique the plan applied (`core.handles`), the optimizer last."""
        return {**handles(self.model), "optimizer": self.optimizer}

    def expected_bytes_per_step(self, steps: int) -> list:
        """`expected_bytes` for each of the `steps` steps trained so far — with experts over ep > 1, plus the ep
        axis's all-to-all bytes from the routing counts each step's routers produced (`expert.ep_bytes_per_step`),
        which no formula knows before the router has run."""
        out = [dict(self.expected_bytes) for _ in range(steps)]
        if self.plan.ep > 1:
            elem = next(p for _, p in self.named_parameters()).element_size()
            ep = ep_bytes_per_step(handle_of(self.model, "expert_parallel"), self.mesh["ep"].rank, elem,
                                   self.plan.num_microbatches)
            if len(ep) != steps:
                raise ValueError(f"the MoE layers logged {len(ep)} steps of routing, not {steps}")
            for step, n in zip(out, ep):
                step[self.mesh["ep"].name] = n
        return out

    @property
    def pipeline(self):
        """This pp rank's executor (`course_lib.parallel.pipeline.Pipeline`; its `.stage`), or None without pp."""
        return handle_of(self.model, "pipeline")

    def named_model(self) -> torch.nn.Module:
        """The model inside every wrapper: its parameters have the single-process model's names."""
        inner = self.model
        while isinstance(getattr(inner, "module", None), torch.nn.Module) and inner.module is not inner:
            inner = inner.module
        return inner

    def named_parameters(self):
        """This rank's parameters under the single-process model's names (what it holds of each)."""
        return self.named_model().named_parameters()

    def train(self, steps: int, *, probes=(), keep_params: bool = False, progress: bool = False):
        return run(self.model, self.optimizer, self.batches, steps=steps, probes=probes, step_fn=self.step_fn,
                   keep_params=keep_params, progress=progress)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of `full` (a parameter of the single-process model named `name`) that this rank holds: each
        technique that split it (TP's rows or columns, then FSDP's dim-0 shard) cuts it as it cut the parameter."""
        seen = set()
        for obj in self.handles.values():    # one object may be the handle of several techniques: cut once
            cut = getattr(obj, "local_shard", None)
            if cut is not None and id(obj) not in seen:
                seen.add(id(obj))
                full = cut(name, full)
        return full

    def close(self) -> None:
        """Stop what the techniques started (communication threads, offload files), in reverse order."""
        seen = set()
        for obj in reversed(list(self.handles.values())):
            if isinstance(obj, contextlib.AbstractContextManager) and id(obj) not in seen:
                seen.add(id(obj))
                obj.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _expected_bytes(self, cfg, b: int) -> dict:
        """Bytes this rank sends per step on each mesh axis: the one sum of each technique's own formula
        (`composer.expected.bytes_per_step`), under the ledger's group names."""
        pipe = self.pipeline
        return bytes_per_step(cfg, self.plan, self.mesh.coords, micro_batch_size=b,
                              elem=next(self.named_model().parameters()).element_size(),
                              pipeline=pipe.plan if pipe is not None else None,
                              recompute_plan=handle_of(self.model, "recompute"),
                              reducer=handle_of(self.model, "data_parallel"),
                              dp_group=self.mesh.group("dp", "cp").name,
                              loss_elem=4 if self.plan.precision is not None else None)   # fp32 logits


def step_function(model, optimizer, num_microbatches: int):
    """`train.run`'s step for `model` as the techniques left it: the pipeline's executor (handed what reduces the
    gradients over dp) or forward and backward of every micro-batch; then the gradients reduced once — by a wrapper
    around the model (DDP, FSDP) as `forward_backward` does by default, else by the reducer (ZeRO-1/2's
    optimizer, or an optimizer of one's own that reduces, when there are micro-batches to accumulate); under the
    fp16 recipe, all of it in fp32 accumulation."""
    pipe, reducer = handle_of(model, "pipeline"), handle_of(model, "data_parallel")
    if reducer is None and hasattr(optimizer, "finish_gradient_synchronization") and num_microbatches > 1:
        reducer = optimizer
    if pipe is not None:
        pipe.data_parallel = reducer
        step = pipe
    elif reducer is not None and reducer is not model:
        step = functools.partial(forward_backward, sync=reducer)
    else:
        step = forward_backward
    precision = handle_of(model, "precision")
    return precision.step_fn(step) if precision is not None and precision.recipe.loss_scaling else step


def train_parallel(mesh_or_comm, cfg, tc, wrap=None, *, model=None, probes=(), num_microbatches: int = 1,
                   keep_params: bool = False, progress: bool = False):
    """Data parallelism alone, with a reducer of one's own: train the course GPT (or `model`, a module of one's own
    whose data `cfg` describes) over all ranks as dp, `wrap(model, comm)` reducing the gradients (a wrapper, or a
    (model, optimizer) pair; None: `apply_zero(model, comm, 0)`, the bucketed DDP), each rank's share of every
    global batch of `tc.batch_size` sequences in `num_microbatches` micro-steps, `tc.steps` steps of `train.run`.
    Returns (train.Run, the wrapped model); compare with `train.train_reference(cfg, tc)`."""
    comm = axis_comm(mesh_or_comm, "dp")
    ParallelPlan(dp=comm.world_size, num_microbatches=num_microbatches).check(cfg, comm.world_size,
                                                                          batch_size=tc.batch_size)
    model = GPT(cfg, seed=tc.seed) if model is None else model
    out = apply_zero(model, comm, 0) if wrap is None else wrap(model, comm)
    wrapped, optimizer = out if isinstance(out, tuple) else (out, None)
    own_step = optimizer is not None and num_microbatches == 1
    if optimizer is None:
        optimizer = optim.build(wrapped, **optimizer_kwargs(tc))
    if own_step or (handle_of(wrapped, "data_parallel") is None and wrapped is not model):
        # a wrapper of one's own reduces the gradients when forward_backward calls it (its default `sync`); an
        # optimizer of one's own that reduces keeps its step() alone when there is nothing to accumulate (the loop
        # it was written for has no 'sync' phase then)
        step = forward_backward
    else:
        step = step_function(wrapped, optimizer, num_microbatches)
    mesh = mesh_or_comm if isinstance(mesh_or_comm, Mesh) else Mesh(comm, dp=comm.world_size)
    b = tc.batch_size // (comm.world_size * num_microbatches)
    batches = mesh.batches(cfg.seq_len, b, num_microbatches=num_microbatches, seed=tc.data_seed)
    return run(wrapped, optimizer, batches, steps=tc.steps, probes=probes, step_fn=step, keep_params=keep_params,
               progress=progress), wrapped


__all__ = ["parallelize", "apply_plan", "train_parallel", "step_function", "Parallelized", "ParallelPlan", "PlanError",
           "ORDER"]
