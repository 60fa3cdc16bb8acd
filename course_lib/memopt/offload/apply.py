"""Offload for `train.run` and for the composer: activations on the model's blocks, the optimizer on the host or an
SSD, composed with ZeRO-1/2 over the mesh's dp axis (each rank offloads only the optimizer state of its shard).

    apply_offload   (model, optimizer): the model in place (cast, its blocks offloading), the optimizer an
                    `OffloadAdam` or ZeRO's `ShardedOptimizer` around one
    offload_log     the transfer log of an OffloadAdam, also inside ShardedOptimizer
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...distributed.comm import Ledger
from ...distributed.mesh import axis_comm
from ...parallel.zero import apply_zero
from .activations import apply_activation_offload
from .optimizer import OffloadAdam
from .swaps import transfer_log


def apply_offload(model: nn.Module, mesh=None, *, activations: bool = True, optimizer: str | None = "host",
                  dtype: torch.dtype | None = torch.bfloat16, zero_stage: int = 2, layers=None,
                  prefetch: bool = True, log: Ledger | None = None, bucket_cap_bytes: int | None = None,
                  **optimizer_kwargs):
    """(model, optimizer) with offload, for `train.run`:

        dtype        the device keeps the parameters in this precision (None: as they are)
        optimizer    'host' (ZeRO-Offload) | 'disk' (ZeRO-Infinity's SSD tier) | 'device' (the same mixed-precision
                     AdamW without offload) | None (no optimizer: the caller brings one); `optimizer_kwargs` go to
                     `OffloadAdam` (lr, betas, eps, weight_decay, dpu, offload_dir, chunk_bytes, …)
        mesh         with a dp axis of size > 1, ZeRO-`zero_stage` (1 or 2) over it, built by
                     `parallel.zero.apply_zero`: every rank offloads only the shard it owns
        activations  offload what `layers` (the model's blocks by default: a GPT's, a pipeline stage's) save, by
                     hooks on the model: it comes back the same model (`activation_offload_of(model)` is the handle)

    Activation offload goes on the blocks that run here (after the pipeline split, beside recomputation), the
    optimizer offload inside ZeRO (its inner optimizer). One transfer log (`log`) books both.
    """
    log = transfer_log(getattr(getattr(mesh, "world", None), "rank", 0)) if log is None else log
    if dtype is not None:
        model = model.to(dtype)
    opt = None
    if optimizer is not None:
        kwargs = dict(tier=optimizer, log=log, **optimizer_kwargs)
        dp = axis_comm(mesh, "dp") if mesh is not None else None
        if dp is not None and dp.world_size > 1:
            if zero_stage not in (1, 2):
                raise ValueError(f"offload composes with ZeRO stage 1 or 2 (each rank offloads the optimizer state "
                                 f"of its shard), got zero_stage={zero_stage!r}; ZeRO-3 offload (parameters too) "
                                 f"is not built here")
            model, opt = apply_zero(model, mesh, zero_stage, optimizer_cls=OffloadAdam,
                                    bucket_cap_bytes=bucket_cap_bytes, **kwargs)
        else:
            opt = OffloadAdam(model.parameters(), **kwargs)
    if activations:
        model = apply_activation_offload(model, mesh, layers=layers, prefetch=prefetch, log=log)
    return model, opt


def offload_log(optimizer) -> Ledger:
    """The transfer log of an `OffloadAdam`, also inside ZeRO's ShardedOptimizer."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, OffloadAdam):
        raise TypeError(f"expected an OffloadAdam (or a ShardedOptimizer around one), got {type(inner).__name__}")
    return inner.log


__all__ = ["apply_offload", "offload_log"]
