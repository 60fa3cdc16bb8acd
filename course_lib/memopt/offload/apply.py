"""Offload for `train.run` and for the composer: activations on the model's blocks, the optimizer on the host or an
SSD, composed with ZeRO-1/2 over the mesh's dp axis (each rank offloads only the optimizer state of its shard).

    apply_offload   the model (cast, its blocks offloading); `optim.build(model, …)` then builds its optimizer
                    as an `OffloadAdam`, or ZeRO's `ShardedOptimizer` around one
    offload_log     the transfer log of an OffloadAdam, also inside ShardedOptimizer
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...core.handles import attach
from ...distributed.comm import Ledger
from ...distributed.mesh import axis_comm
from ...parallel.zero import apply_zero
from .activations import apply_activation_offload
from .optimizer import OffloadAdam
from .swaps import transfer_log


def apply_offload(model: nn.Module, mesh=None, *, activations: bool = True, optimizer: str | None = "host",
                  dtype: torch.dtype | None = torch.bfloat16, zero_stage: int | None = 2, layers=None,
                  prefetch: bool = True, log: Ledger | None = None, bucket_cap_bytes: int | None = None,
                  **offload_options) -> nn.Module:
    """Offload, for `train.run`; returns the model to train (its optimizer: `course_lib.optim.build(model, …)`):

        dtype        the device keeps the parameters in this precision (None: as they are)
        optimizer    'host' (ZeRO-Offload) | 'disk' (ZeRO-Infinity's SSD tier) | 'device' (the same mixed-precision
                     AdamW without offload) | None (the optimizer stays as the other techniques make it):
                     `optim.build` then builds `OffloadAdam`, with `offload_options` (dpu, offload_dir, chunk_bytes, …)
        zero_stage   with a mesh whose dp axis has more than one rank, ZeRO-`zero_stage` (1 or 2) over it
                     (`parallel.zero.apply_zero`): every rank offloads only the shard it owns; None: the caller
                     applies data parallelism itself (the composer does, in its place in the order)
        activations  offload what `layers` (the model's blocks by default: a GPT's, a pipeline stage's) save, by
                     hooks on the model (`handle_of(model, "activation_offload")` is the handle)

    Activation offload goes on the blocks that run here (after the pipeline split, beside recomputation), the
    optimizer offload inside ZeRO (its inner optimizer). One transfer log (`log`) books both.
    """
    log = transfer_log(getattr(getattr(mesh, "world", None), "rank", 0)) if log is None else log
    if dtype is not None:
        model = model.to(dtype)
    if activations:
        model = apply_activation_offload(model, mesh, layers=layers, prefetch=prefetch, log=log)
    if optimizer is not None:
        attach(model, "optimizer_offload", OptimizerOffload(optimizer, log, offload_options))
        dp = axis_comm(mesh, "dp") if mesh is not None else None
        if zero_stage is not None and dp is not None and dp.world_size > 1:
            if zero_stage not in (1, 2):
                raise ValueError(f"offload composes with ZeRO stage 1 or 2 (each rank offloads the optimizer state "
                                 f"of its shard), got zero_stage={zero_stage!r}; ZeRO-3 offload (parameters too) "
                                 f"is not built here")
            model = apply_zero(model, mesh, zero_stage, bucket_cap_bytes=bucket_cap_bytes)
    return model


class OptimizerOffload:
    """Optimizer offload's handle: where the optimizer state and step live (`tier`), the transfer log, and the rest
    of `OffloadAdam`'s options; `optim.build` asks it for the optimizer class, which replaces the model's own (an
    `OffloadAdam` already keeps fp32 masters of a low-precision model)."""

    def __init__(self, tier: str, log: Ledger, options: dict):
        self.tier, self.log, self.options = tier, log, dict(options)

    def optimizer_class(self, inner):
        return functools.partial(OffloadAdam, tier=self.tier, log=self.log, **self.options)


def offload_log(optimizer) -> Ledger:
    """The transfer log of an `OffloadAdam`, also inside ZeRO's ShardedOptimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, OffloadAdam):
        raise TypeError(f"expected an OffloadAdam (or a ShardedOptimizer around one), got {type(inner).__name__}")
    return inner.log


__all__ = ["apply_offload", "offload_log"]
