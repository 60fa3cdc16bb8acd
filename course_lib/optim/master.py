"""fp32 master weights for a model whose parameters are a low-precision compute copy (Micikevicius et al., "Mixed
Precision Training", ICLR 2018, §3.1), and the overflow vote that makes every rank skip the same steps.

    step():  g32 = compute-copy gradient in fp32, ÷ S        (dynamic loss scaling, if a scaler is given)
             inf/NaN anywhere, on ANY rank?  skip, S ← S/2   (`overflow_vote` over every axis of the mesh)
             else  inner optimizer step on the masters, then compute copy ← round(master)

The inner optimizer is any class over the fp32 masters (the course's `AdamW`, 8-bit Adam, torch's own); this
optimizer only adds the master copy, the unscale and the vote. It works over whole parameters (one process, DDP)
and as ZeRO-1/2's inner optimizer over this rank's flat bf16 shards (`parallel.zero.ShardedOptimizer`): each rank
then unscales and checks only its shard, which is why the vote must include the dp axis.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .adamw import AdamW

_MASTERS = WeakIdKeyDictionary()       # parameter -> its fp32 master, kept from before the cast to low precision


def set_master(param: torch.Tensor, master: torch.Tensor) -> None:
    """Remember `master` (fp32, param's shape) as `param`'s master copy, for the optimizer built later."""
    if master.dtype != torch.float32 or master.shape != param.shape:
        raise ValueError(f"a master copy is fp32 of the parameter's shape {tuple(param.shape)}; got {master.dtype} "
                         f"{tuple(master.shape)}")
    _MASTERS[param] = master


def kept_master(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master `set_master` kept for `param` (the exact fp32 originals, as `apply_precision` keeps them
    before casting), or None. A sharder that repacks parameters (ZeRO) packs these, and keeps them for its shards."""
    return _MASTERS.get(param)


def master_of(param: torch.Tensor) -> torch.Tensor:
    """`param`'s master copy: the kept one; else an fp32 parameter is its own master (FSDP's fp32 shards, which it
    casts itself); else a new fp32 copy of param's low-precision values (ZeRO's shards, when nothing was kept)."""
    m = _MASTERS.get(param)
    if m is not None:
        return m
    return param.detach() if param.dtype == torch.float32 else param.detach().float().clone()


def overflow_vote(found_inf: bool, over=None) -> bool:
    """True if any rank of `over` found an inf/NaN: a 4-byte flag all-reduced with max.

    over: None (this process alone) | a Mesh (its world communicator: every rank of every axis — pp, dp and tp —
    votes; one all-reduce instead of one per axis) | a Communicator | a list of Communicators (one after the other).
    Every rank of `over` must call this at the same step.
    """
    if over is None:
        return bool(found_inf)
    comms = [over.world] if hasattr(over, "world") else list(over) if isinstance(over, (list, tuple)) else [over]
    flag = torch.tensor([float(found_inf)])
    for comm in comms:
        if comm.world_size > 1:
            comm.all_reduce(flag, "max", tag="found_inf")
    return bool(flag.item())


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """An optimizer over fp32 master weights for parameters held in a low precision (see the module docstring).

    params: the compute copy (fp16/bf16 Parameters, or ZeRO's shards of them); masters: their fp32 masters (default:
    `master_of(p)` for each); optimizer_cls(masters, **kwargs): the inner optimizer; scaler: a DynamicLossScaler
    (or None: no loss scaling, but a non-finite gradient still skips the step); vote: who agrees on skipping
    (`overflow_vote`'s `over`). The fp32 gradient copies live only during step(). Memory after a step: compute
    copy and its gradients 2Ψ each (fp16/bf16), masters 4Ψ, plus the inner optimizer's state; `state[p]` holds p's
    master and the inner state, so a memory accountant finds all of it.
    """

    def __init__(self, params, optimizer_cls=AdamW, *, masters=None, scaler=None, vote=None, **optimizer_kwargs):
        params = list(params)
        masters = [master_of(p) for p in params] if masters is None else list(masters)
        if len(params) != len(masters):
            raise ValueError(f"{len(params)} parameters but {len(masters)} master copies")
        for p, m in zip(params, masters):
            if p.shape != m.shape or m.dtype != torch.float32:
                raise ValueError(f"master copy {tuple(m.shape)} {m.dtype} does not match parameter {tuple(p.shape)}")
        self.masters = masters
        self.optimizer = optimizer_cls(self.masters, **optimizer_kwargs)
        super().__init__(params, {k: v for k, v in self.optimizer.defaults.items()})
        for p, m in zip(params, self.masters):
            self.state[p]["master"] = m
        self.scaler, self.vote = scaler, vote
        self.skipped = 0

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        for p, m in zip(params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()       # (n,) fp32 copy of the compute gradient
        grads = [m.grad for m in self.masters]
        if self.scaler is not None:
            found_inf = self.scaler.unscale_(grads)
        else:
            found_inf = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        found_inf = overflow_vote(found_inf, self.vote)               # every rank skips the same steps
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped += 1
        else:
            for mine, inner in zip(self.param_groups, self.optimizer.param_groups):   # a scheduler's lr reaches it
                inner.update((k, v) for k, v in mine.items() if k != "params")
            self.optimizer.step()
            for p, m in zip(params, self.masters):
                p.copy_(m)                                            # round the master to the compute dtype
        for p, m in zip(params, self.masters):
            m.grad = None
            self.state[p].update((k, v) for k, v in self.optimizer.state[m].items())
        return None


__all__ = ["set_master", "kept_master", "master_of", "overflow_vote", "MixedPrecisionOptimizer"]
