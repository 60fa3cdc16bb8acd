"""FSDP's sharded parameters: one unit's parameters of one kind, each sharded along dim 0, gathered and reduced.

The layout and the all-gather / reduce-scatter are described in `course_lib.parallel.fsdp` (the wrapper that
uses them): with N = world_size and d0 rows, rank r keeps rows [r·c, min((r+1)·c, d0)) with c = ⌈d0/N⌉; one
all-gather moves a whole group, each rank's shards laid end to end and padded to c rows (L elements per rank,
N·L in all), and the reduce-scatter runs the same layout backwards — each rank sends (N−1)/N · e·N·L bytes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...distributed.collectives import reduce_scatter_ring
from ...distributed.comm import wait_all
from ...distributed.flat import FlatBuffer
from ...memory import alloc_category


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the dim-0 rows rank `rank` keeps: chunks of ⌈rows/N⌉ (FSDP2's `torch.chunk` layout)."""
    c = -(-rows // world_size)
    return min(rank * c, rows), min((rank + 1) * c, rows)


def _set_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    module.__dict__.pop(attr, None)
    module._parameters[attr] = param


def _set_tensor(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """A plain tensor in a parameter's place while the unit computes (nn.Module refuses it through setattr)."""
    module._parameters.pop(attr, None)
    object.__setattr__(module, attr, tensor)


class Placed:
    """What a group of FSDP parameters puts into the module: the full tensors for compute (`set_full`), or the
    parameters it keeps between steps (`set_shards`), in every place each sits (`places`; a tied weight has two)."""

    def set_full(self, views) -> None:
        for view, places in zip(views, self.places):
            for module, attr, _ in places:         # a tied weight: the same view in every place it is used
                _set_tensor(module, attr, view)

    def set_shards(self) -> None:
        for shard, places in zip(self.shards, self.places):
            for module, attr, _ in places:
                _set_param(module, attr, shard)


class ShardedGroup(Placed):
    """One unit's parameters of one kind (trainable or frozen), each sharded along dim 0 over the ranks."""

    replicated = False

    def __init__(self, fsdp, unit, params, places, requires_grad: bool):
        comm = fsdp.comm
        N, r = comm.world_size, comm.rank
        self.fsdp, self.unit, self.places = fsdp, unit, places   # places[i]: [(module, attr, name), ...] of param i
        self.shapes = [p.shape if p.dim() else torch.Size([1]) for p in params]
        self.row_numel = [max(1, s.numel() // s[0]) if s[0] else 0 for s in self.shapes]
        self.chunk_rows = [-(-s[0] // N) for s in self.shapes]
        self.bounds = [shard_rows(s[0], N, r) for s in self.shapes]
        # the all-gather input: every parameter's chunk padded to c rows, end to end (equal size L on every rank)
        self.input_layout = FlatBuffer(shapes=[c * rn for c, rn in zip(self.chunk_rows, self.row_numel)],
                                       dtype=params[0].dtype)
        self.L = self.input_layout.numel
        self.full_layout = FlatBuffer(params)           # the unit's full parameters, unpadded, one after another
        with alloc_category("parameters"):
            self.local = self.input_layout.new(params[0].dtype)      # this rank's shards (fp32 master weights)
        self.shards = []
        for i, p in enumerate(params):
            lo, hi = self.bounds[i]
            mine = self.input_layout.view(self.local, i)[:(hi - lo) * self.row_numel[i]]
            mine.copy_(p.detach().reshape(self.shapes[i])[lo:hi].reshape(-1))
            shard = nn.Parameter(mine.view(hi - lo, *self.shapes[i][1:]), requires_grad=requires_grad)
            self.shards.append(shard)
        self.full, self.staging, self.handles = None, None, []    # gathered parameters; all-gather output; messages

    @property
    def padded(self) -> int:
        """N·L: what one all-gather assembles (this group's part of P)."""
        return self.L * self.fsdp.comm.world_size

    @property
    def local_numel(self) -> int:
        """Ψ_r: real (unpadded) elements this rank keeps."""
        return sum(s.numel() for s in self.shards)

    def gather(self, tag: str) -> None:
        """Post the all-gather of this group (returns at once; `wait` completes it)."""
        if self.full is not None or self.staging is not None:
            return
        comm, dtype = self.fsdp.comm, self.fsdp.compute_dtype or self.local.dtype
        with alloc_category("comm"):
            self.staging = torch.empty(self.padded, dtype=dtype)
        p, r = comm.world_size, comm.rank
        chunks = self.staging.chunk(p)
        chunks[r].copy_(self.local)                # with a compute dtype the cast happens here, before communication
        for k in range(1, p):                      # direct exchange: my input to every rank, theirs into place;
            self.handles.append(comm.isend(chunks[r], (r + k) % p, tag=tag))      # the ring's bytes, all posted
            self.handles.append(comm.irecv(chunks[(r - k) % p], (r - k) % p, tag=tag))   # at once (overlappable)

    def wait(self) -> None:
        """Complete the all-gather and copy the output out into the unit's full parameters."""
        if self.staging is None:
            return
        wait_all(self.handles)
        self.handles = []
        self.fsdp.comm.release()                   # finished transfers would otherwise keep the buffer alive
        with alloc_category("parameters"):
            self.full = self.full_layout.new(self.staging.dtype)
        for i, full in enumerate(self.full_layout.views(self.full)):
            self.copy_rows(full.view(self.shapes[i][0], -1), self._slots(self.staging, i), into_rows=True)
        self.staging = None
        self.fsdp._gathered[self.full.untyped_storage()._cdata] = self

    def free(self) -> None:
        self.wait()
        if self.full is not None:
            del self.fsdp._gathered[self.full.untyped_storage()._cdata]
            self.full = None

    def views(self) -> list:
        return self.full_layout.views(self.full)

    def reduce_scatter(self, grads) -> list:
        """The unit's full gradients (None if unused) → this rank's averaged shard gradients, in the master dtype."""
        dtype = self.fsdp.compute_dtype or self.local.dtype
        with alloc_category("comm"):
            send = torch.zeros(self.padded, dtype=dtype)
        for i, g in enumerate(grads):
            if g is not None:                      # rank r's rows into rank r's slot, padding left zero
                self.copy_rows(g.reshape(self.shapes[i][0], -1), self._slots(send, i), into_rows=False)
        self.unit.free()                           # its backward is done: drop the gathered parameters first
        mine = reduce_scatter_ring(self.fsdp.comm, send, "avg", tag="fsdp_rs", inplace=True)
        with alloc_category("gradients"):
            mine = mine.to(self.local.dtype, copy=True)
        out = []
        for i, shard in enumerate(self.shards):
            out.append(self.input_layout.view(mine, i)[:shard.numel()].view(shard.shape))
        return out

    def _slots(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slot of every rank in an all-gather output `buf` (N·L), as one (N, c, row numel) view:
        [r] is rank r's c rows (shard_rows: the first ones hold c real rows, the last ones fewer or none)."""
        c, rn, o = self.chunk_rows[i], self.row_numel[i], self.input_layout.offsets[i]
        return buf.view(-1, self.L)[:, o:o + c * rn].unflatten(1, (c, rn))

    @staticmethod
    def copy_rows(rows: torch.Tensor, slots: torch.Tensor, *, into_rows: bool) -> None:
        """Copy a parameter's d0 rows (d0, row numel) into every rank's slot (N, c, row numel), or back: the ranks
        that hold c real rows in one copy, the one that holds the rest in another (not one copy per rank)."""
        c = slots.shape[1]
        k, rem = divmod(rows.shape[0], c) if c else (0, 0)
        pairs = ([(rows[:k * c].view(k, c, rows.shape[1]), slots[:k])]
                 + ([(rows[k * c:], slots[k, :rem])] if rem else []))
        for held, slot in pairs:
            held.copy_(slot) if into_rows else slot.copy_(held)



class Unshard(torch.autograd.Function):
    """forward: a group's local shards → the unit's full parameters (all-gather + copy-out), one view per parameter.
    backward: the gradients of those views → each shard's gradient (reduce-scatter)."""

    @staticmethod
    def forward(ctx, group, *shards):
        group.gather("fsdp_fwd_ag")
        group.wait()
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(group.views())

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.group.reduce_scatter(grads))
