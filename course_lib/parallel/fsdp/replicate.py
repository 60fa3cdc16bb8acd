"""FSDP's replicated parameters: left whole and identical on every rank, their gradients all-reduced.

Sharding a parameter saves (N−1)/N of its bytes but costs an all-gather before every use (forward and backward)
and a reduce-scatter after it: for a LayerNorm weight or a bias of a few hundred elements, the 2(N−1) latency
steps of each collective cost more than the memory is worth. Practitioners leave such parameters replicated:
PyTorch FSDP2 keeps `ignored_params` out of `fully_shard` and replicates them with DDP; Megatron-LM's distributed
optimizer all-reduces what it does not shard. Here a replicated group lives beside the sharded groups of its unit:

    forward    the module's own parameters are used as they are (cast to the compute dtype if one is set);
               nothing moves
    backward   the unit's replicated gradients, laid end to end in one flat buffer, are averaged by the course's
               ring all-reduce (`distributed.collectives.all_reduce_ring`, tag "fsdp_ar"); every rank gets the same bits
    step       every rank's optimizer steps the whole replicated parameters with the same gradients and the same
               state: they stay bitwise identical without any further communication

Checked against (R_u: the replicated trainable elements of unit u, e bytes per element; docs/formulas.md §1.1):
    bytes each rank sends per backward   Σ_u ring all-reduce of R_u = Σ_u 2(N−1)/N · e·R_u  (exactly when N | R_u;
                                         `ring_all_reduce_bytes` gives each rank's exact count otherwise)
    model states per rank                parameters e·R, gradients e·R, AdamW 8·R + 4 per tensor — in full, as DDP
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...distributed.collectives import all_reduce_ring
from ...distributed.flat import FlatBuffer
from ...memory import alloc_category
from .shard import Placed


def norms_and_biases(name: str, param: nn.Parameter) -> bool:
    """The usual choice of what to replicate: every 1-D parameter (LayerNorm weights and biases, every bias)."""
    return param.dim() <= 1


REPLICATION_RULES = {"norms+biases": norms_and_biases}     # the rules a plan names (ParallelPlan.fsdp_replicate)


def replication_rule(replicate=None, min_shard_numel: int | None = None):
    """One predicate (name, param) -> bool from FSDP's `replicate=` (a predicate, or a collection of parameter
    names) and `min_shard_numel=` (replicate every parameter with fewer elements); None when nothing is replicated."""
    if min_shard_numel is not None and (not isinstance(min_shard_numel, int) or isinstance(min_shard_numel, bool)
                                        or min_shard_numel < 0):
        raise ValueError(f"FSDP: min_shard_numel must be a non-negative integer (elements), got {min_shard_numel!r}")
    if replicate is None or callable(replicate):
        by_rule = replicate
    elif isinstance(replicate, str) or not all(isinstance(n, str) for n in replicate):
        raise ValueError("FSDP: replicate= takes a predicate (name, param) -> bool or a collection of parameter "
                         f"names (e.g. {{'ln_f.weight'}}), got {replicate!r}")
    else:
        names = frozenset(replicate)
        by_rule = lambda name, p: name in names                     # noqa: E731
        by_rule.names = names                                       # checked against the model by `check_names`
    if by_rule is None and not min_shard_numel:
        return None

    def rule(name, p):
        return bool((by_rule is not None and by_rule(name, p)) or (min_shard_numel and p.numel() < min_shard_numel))
    rule.names = getattr(by_rule, "names", frozenset())
    return rule


def check_names(rule, places: dict) -> None:
    """A name in `replicate=` that is not one of the model's parameters is a typo: say so before anything moves."""
    known = {name for pl in places.values() for _, _, name in pl}
    unknown = sorted(getattr(rule, "names", frozenset()) - known)
    if unknown:
        raise ValueError(f"FSDP: replicate= names {unknown} are not parameters of the model; use names from "
                         f"model.named_parameters(), e.g. {sorted(known)[:3]}")


class ReplicatedGroup(Placed):
    """One unit's replicated parameters of one kind (trainable or frozen): whole on every rank. It answers the
    same calls as a `ShardedGroup`, so the unit treats both alike; gathering and freeing are no-ops."""

    replicated = True

    def __init__(self, fsdp, unit, params, places, requires_grad: bool):
        self.fsdp, self.unit, self.places = fsdp, unit, places
        self.shards = list(params)                     # "this rank's part" of a replicated parameter is all of it
        self.shapes = [p.shape for p in self.shards]
        rows = [s[0] if len(s) else 1 for s in self.shapes]
        self.bounds = [(0, d0) for d0 in rows]          # the rows this rank holds: every one
        self.row_numel = [s.numel() // d0 if d0 else 0 for s, d0 in zip(self.shapes, rows)]
        self.layout = FlatBuffer(self.shards)           # the gradients' all-reduce buffer, parameter after parameter
        self.requires_grad = requires_grad

    @property
    def numel(self) -> int:
        return self.layout.numel

    local_numel = numel                                 # what this rank's optimizer steps: everything

    def gather(self, tag: str) -> None:
        """Nothing to gather."""

    def wait(self) -> None:
        """Nothing to wait for."""

    def free(self) -> None:
        """Nothing gathered to free: the parameters themselves stay."""

    def views(self) -> list:
        return self.shards

    def compute_views(self) -> tuple:
        """The parameters as forward uses them: themselves, or cast to the compute dtype (one copy each)."""
        dtype = self.fsdp.compute_dtype
        if dtype is None or dtype == self.shards[0].dtype:
            return tuple(p.view_as(p) for p in self.shards)
        with alloc_category("parameters"):
            return tuple(p.to(dtype) for p in self.shards)

    def all_reduce(self, grads) -> list:
        """This backward's gradients of the unit's replicated parameters (None if unused) → their average over the
        ranks, one ring all-reduce of one flat buffer, returned in the parameters' own dtype."""
        dtype = self.fsdp.compute_dtype or self.shards[0].dtype
        with alloc_category("comm"):
            flat = self.layout.pack(torch.empty(self.numel, dtype=dtype),
                                    [None if g is None else g.reshape(s) for g, s in zip(grads, self.shapes)])
        all_reduce_ring(self.fsdp.comm, flat, "avg", tag="fsdp_ar")
        with alloc_category("gradients"):
            mine = flat.to(self.shards[0].dtype, copy=True)
        return self.layout.views(mine)



class _Replicate(torch.autograd.Function):
    """forward: a group's replicated parameters → the tensors the unit computes with (views, or compute-dtype
    casts). backward: their gradients → the same gradients averaged over the ranks (ring all-reduce)."""

    @staticmethod
    def forward(ctx, group, *params):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return group.compute_views()

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.group.all_reduce(grads))
