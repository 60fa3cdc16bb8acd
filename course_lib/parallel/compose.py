"""Composing techniques: `apply_<technique>(model, mesh, ...)`, in one place, and the order they go in.

Every technique takes the model as it is after the previous ones and the rank mesh (`course_lib.dist.mesh.Mesh`),
and uses the axis it owns: data parallelism and ZeRO/FSDP the `dp` axis, tensor parallelism `tp`, pipelines `pp`.
The order matters, innermost first (torchtitan's `parallelize` applies them the same way):

    1. tensor parallelism     rewrites the layers themselves (which rows or columns of each weight this rank
                              holds), so it must see the plain model
    2. pipeline split         keeps only this stage's layers
    3. recomputation          wraps the blocks that will actually run here, after TP changed their insides
    4. precision              decides the dtype of what the remaining steps shard and communicate (`apply_precision`)
    5. data parallel / ZeRO   outermost: reduces or shards whatever parameters the model now has, over `dp`

Data parallelism goes last because it is the only one that is indifferent to what a parameter is: it reduces (or
shards) the gradients of whatever this rank holds — a TP shard of a weight of one pipeline stage is just a tensor.
Later notebooks add their `apply_*` here.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..dist.comm import Communicator
from ..dist.mesh import Mesh
from ..memopt.precision import apply_precision  # noqa: F401  step 4 (notebook 09), re-exported for the capstone
from ..memopt.recompute import apply_recompute  # noqa: F401  step 3 (notebook 08), re-exported for the capstone
from . import dp as D
from .fsdp import FSDP
from .pipeline import apply_pipeline  # 2. pipeline split over pp (notebook 05): (stage, step_fn for train.run)
from .zero import DEFAULT_BUCKET_CAP_BYTES, ShardedOptimizer

DP_KINDS = {"naive": D.DataParallelNaive, "bucket": D.DataParallelBucket, "overlap": D.DataParallelOverlap}
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def axis_comm(mesh_or_comm, axis: str = "dp") -> Communicator:
    """The communicator of `axis` from a Mesh, or a Communicator used as it is (a 1-D mesh)."""
    if isinstance(mesh_or_comm, Mesh):
        return mesh_or_comm[axis]
    if isinstance(mesh_or_comm, Communicator):
        return mesh_or_comm
    raise TypeError(f"expected a course_lib.dist.mesh.Mesh or a Communicator (ctx.comm inside launch), got "
                    f"{type(mesh_or_comm).__name__}")


def data_parallel_batches(mesh_or_comm, seq_len: int, global_batch_size: int, *, accum_steps: int = 1,
                          seed: int = 0):
    """This rank's share of each global batch of `global_batch_size` sequences, split over the dp ranks."""
    from ..data import ShardedBatches
    comm = axis_comm(mesh_or_comm, "dp")
    n = comm.world_size * accum_steps
    if global_batch_size % n:
        raise ValueError(f"global batch {global_batch_size} does not split evenly over {comm.world_size} dp rank(s) × "
                         f"{accum_steps} micro-step(s); use a multiple of {n}")
    dp_rank = mesh_or_comm.dp_rank if isinstance(mesh_or_comm, Mesh) else comm.rank
    return ShardedBatches(seq_len, global_batch_size // n, comm.world_size, dp_rank, accum_steps, seed=seed)


def apply_dp(model: nn.Module, mesh_or_comm, *, kind: str = "bucket", **options) -> nn.Module:
    """Data parallelism over the dp axis: kind 'naive' | 'bucket' | 'overlap' (course_lib.parallel.dp)."""
    try:
        cls = DP_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown data-parallel kind {kind!r}; use one of {sorted(DP_KINDS)}") from None
    return cls(model, axis_comm(mesh_or_comm, "dp"), **options)


def apply_fsdp(model: nn.Module, mesh_or_comm, *, units=None, **options) -> FSDP:
    """ZeRO-3 / FSDP over the dp axis; units default to the model's blocks when it has them (the course GPT)."""
    if units is None and hasattr(model, "blocks"):
        units = model.blocks
    return FSDP(model, axis_comm(mesh_or_comm, "dp"), units=units, **options)


def apply_zero(model: nn.Module, mesh_or_comm, stage: int, *, optimizer_cls=torch.optim.AdamW,
               bucket_cap_bytes: int | None = DEFAULT_BUCKET_CAP_BYTES, fsdp_options: dict | None = None,
               **optimizer_kwargs):
    """(model, optimizer) for ZeRO stage 0 (= DDP, bucketed), 1, 2 or 3 (= FSDP) over the dp axis — the one place
    the course builds a ZeRO stage. Train with `course_lib.train.run(model, optimizer, batches, ...)`."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    comm = axis_comm(mesh_or_comm, "dp")
    if stage == 0:
        model = D.DataParallelBucket(model, comm, bucket_cap_bytes=bucket_cap_bytes or _whole(model))
    elif stage == 3:
        model = apply_fsdp(model, comm, **(fsdp_options or {}))
    else:
        opt = ShardedOptimizer(model.parameters(), optimizer_cls, comm, stage=stage, bucket_cap_bytes=bucket_cap_bytes,
                               **optimizer_kwargs)
        return model, opt
    return model, optimizer_cls(model.parameters(), **optimizer_kwargs)


def train_parallel(mesh_or_comm, cfg, tc, wrap, *, model: nn.Module | None = None, probes=(), accum_steps: int = 1,
                   keep_params: bool = False, progress: bool = False):
    """Train the course GPT (or `model`) on this rank with `train.run`: `wrap(model, comm)` returns the wrapped
    model (its optimizer is then the course's AdamW over its parameters) or a (model, optimizer) pair; the data is
    this dp rank's share of each global batch of `tc.batch_size` sequences, in `accum_steps` micro-steps. Returns
    (train.Run, the wrapped model). Comparable with `train.train_reference(cfg, tc)` on one process."""
    from ..model import GPT
    from ..train import make_optimizer, run
    comm = axis_comm(mesh_or_comm, "dp")
    model = GPT(cfg, seed=tc.seed) if model is None else model
    wrapped = wrap(model, comm)
    wrapped, optimizer = wrapped if isinstance(wrapped, tuple) else (wrapped, None)
    if optimizer is None:
        optimizer = make_optimizer(getattr(wrapped, "module", wrapped).parameters(), tc)
    batches = data_parallel_batches(mesh_or_comm, model.config.seq_len if hasattr(model, "config") else cfg.seq_len,
                                    tc.batch_size, accum_steps=accum_steps, seed=tc.data_seed)
    try:
        out = run(wrapped, optimizer, batches, steps=tc.steps, probes=probes, keep_params=keep_params,
                  progress=progress)
    finally:
        if hasattr(wrapped, "close"):      # the overlapped DDP's communication thread
            wrapped.close()
    return out, wrapped


def _whole(model: nn.Module) -> int:
    """A cap that puts every parameter into one bucket."""
    return max(1, sum(p.numel() * p.element_size() for p in model.parameters()))


from .tensor import apply_tp  # noqa: E402  (step 1 above: tensor parallelism over tp, course_lib.parallel.tensor)

__all__ = ["apply_dp", "apply_fsdp", "apply_precision", "apply_recompute", "apply_zero", "apply_tp", "apply_pipeline",
           "axis_comm", "data_parallel_batches", "train_parallel", "DP_KINDS", "STAGE_NAMES"]
