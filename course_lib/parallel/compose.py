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
    offload (notebook 07, `course_lib.memopt.offload.apply_offload`): activations at 3, the optimizer inside 5
"""
from __future__ import annotations

import torch.nn as nn

from ..dist.mesh import axis_comm, data_parallel_batches  # noqa: F401  (re-exported: notebooks import them here)
from ..memopt.precision import apply_precision  # noqa: F401  step 4 (notebook 09), re-exported for the capstone
from ..memopt.recompute import apply_recompute  # noqa: F401  step 3 (notebook 08), re-exported for the capstone
from .dp import DP_KINDS, apply_dp  # noqa: F401  5. data parallelism over dp (notebook 03)
from .fsdp import apply_fsdp  # noqa: F401  5. ZeRO-3 / FSDP over dp (notebook 04)
from .pipeline import apply_pipeline  # 2. pipeline split over pp (notebook 05): (stage, step_fn for train.run)
from .zero import STAGE_NAMES, apply_zero  # noqa: F401  5. ZeRO stages 0-3 over dp (notebook 04)


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


from .tensor import apply_tp  # noqa: E402  (step 1 above: tensor parallelism over tp, course_lib.parallel.tensor)
from ..memopt.offload import apply_offload  # noqa: E402  (offload: activations at 3, ZeRO's inner optimizer at 5)

__all__ = ["apply_dp", "apply_fsdp", "apply_precision", "apply_recompute", "apply_zero", "apply_tp", "apply_pipeline",
           "apply_offload", "axis_comm", "data_parallel_batches", "train_parallel", "DP_KINDS", "STAGE_NAMES"]
