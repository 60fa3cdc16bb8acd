"""ZeRO stage 3 / fully sharded data parallelism (FSDP): parameters, gradients and optimizer state all sharded.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20 (stage 3,
P_os+g+p); Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023
(arXiv 2304.11277); the per-parameter layout of PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

The model is cut into units (`units=`, default: each child module) plus the root (every parameter no unit owns).
Every parameter is sharded on its own along dim 0, as FSDP2 does: with N = world_size and d0 rows,

    c = ⌈d0/N⌉ rows per rank;  rank r keeps rows [r·c, min((r+1)·c, d0))   (the last ranks may keep fewer, or none)

and the module keeps those local shards as its parameters — `named_parameters()`, an optimizer built from them,
`state_dict()` and checkpoint code all see real tensors, each rank its own rows. Around every unit:

    forward   all-gather the unit's parameters (the next unit's all-gather is posted before this one computes:
              prefetch) → compute → free them
    backward  all-gather them again when autograd first needs a weight it saved → compute → reduce-scatter the
              unit's gradients → free                                                (PyTorch's FULL_SHARD)

One all-gather moves a whole unit: each rank lays its shards end to end, each padded to c rows (the all-gather
input, L elements, a flat buffer); the output holds N such inputs rank after rank, and is copied out into the
unit's full parameters (FSDP2's copy-in / copy-out). The reduce-scatter runs the same layout backwards.

    parameter a (5 rows), b (2 rows), N = 2:   c_a = 3, c_b = 1
    rank 0 input: [a0 a1 a2 | b0]     rank 1 input: [a3 a4 0 | b1]      (0: padding)
    all-gather output: [a0 a1 a2 b0 a3 a4 0 b1]  →  copy out  →  a = [a0..a4], b = [b0 b1]

Autograd machinery: a custom Function turns the local shards into the unit's full parameters (forward: all-gather;
backward: reduce-scatter), and saved-tensor hooks store a weight that autograd keeps for backward as a reference
(unit, shape, offset) instead of the tensor, so that freeing after forward really frees and backward re-gathers.

Checked against (P = Σ over units of N·L: the trainable parameters with each one padded to N·c rows; e bytes per
element of the compute dtype; docs/formulas.md §2):
    bytes each rank sends per step   forward all-gather (N−1)/N·eP + backward all-gather (N−1)/N·eP
                                     + reduce-scatter (N−1)/N·eP = 3(N−1)/N·eP = 1.5 × DDP's 2(N−1)/N·eΨ
    model states per rank            parameters 4P/N, gradients 4P/N, optimizer 8·Ψ_r + 4·n (fp32 AdamW over this
                                     rank's n local shards holding Ψ_r elements, Σ_r Ψ_r = Ψ)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from ..dist.collectives import reduce_scatter_ring
from ..dist.comm import wait_all
from ..dist.flat import FlatBuffer, broadcast_tensors
from ..dist.mesh import axis_comm
from ..memory import alloc_category, saved_tensors_hooks_over


def default_units(module: nn.Module) -> list:
    """Each child module that has parameters (a ModuleList/ModuleDict never runs forward, so its children count)."""
    units = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


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


class ShardedGroup:
    """One unit's parameters of one kind (trainable or frozen), each sharded along dim 0 over the ranks."""

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
            self._copy_rows(full.view(self.shapes[i][0], -1), self._slots(self.staging, i), into_rows=True)
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
                self._copy_rows(g.reshape(self.shapes[i][0], -1), self._slots(send, i), into_rows=False)
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
    def _copy_rows(rows: torch.Tensor, slots: torch.Tensor, *, into_rows: bool) -> None:
        """Copy a parameter's d0 rows (d0, row numel) into every rank's slot (N, c, row numel), or back: the ranks
        that hold c real rows in one copy, the one that holds the rest in another (not one copy per rank)."""
        c = slots.shape[1]
        k, rem = divmod(rows.shape[0], c) if c else (0, 0)
        pairs = [(rows[:k * c].view(k, c, rows.shape[1]), slots[:k])] + ([(rows[k * c:], slots[k, :rem])] if rem else [])
        for held, slot in pairs:
            held.copy_(slot) if into_rows else slot.copy_(held)

    def set_full(self, views) -> None:
        for view, places in zip(views, self.places):
            for module, attr, _ in places:         # a tied weight: the same view in every place it is used
                _set_tensor(module, attr, view)

    def set_shards(self) -> None:
        for shard, places in zip(self.shards, self.places):
            for module, attr, _ in places:
                _set_param(module, attr, shard)


class _Unshard(torch.autograd.Function):
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


class _Unit:
    """A module whose parameters are gathered and freed together (the root unit has module None)."""

    def __init__(self, fsdp, module, params, places):
        self.module = module
        self.groups = [ShardedGroup(fsdp, self, [p for p in params if p.requires_grad == rg],
                                    [pl for p, pl in zip(params, places) if p.requires_grad == rg], rg)
                       for rg in (True, False) if any(p.requires_grad == rg for p in params)]

    def gather(self, tag: str) -> None:
        for g in self.groups:
            g.gather(tag)

    def wait(self) -> None:
        for g in self.groups:
            g.wait()

    def free(self) -> None:
        for g in self.groups:
            g.free()

    def unshard_into_module(self) -> None:
        for g in self.groups:
            g.set_full(_Unshard.apply(g, *g.shards))

    def reshard(self) -> None:
        for g in self.groups:
            g.set_shards()
        self.free()


class _Saved(NamedTuple):      # what autograd keeps instead of a gathered weight
    group: ShardedGroup
    size: torch.Size
    stride: tuple
    offset: int


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper of any nn.Module: `model = FSDP(module, ctx.comm, units=module.blocks)`,
    then `torch.optim.AdamW(model.parameters())` steps this rank's shards only (no communication in the step).

    units          modules gathered and freed together, in forward order (default: `default_units`); every
                   parameter outside them, and any parameter shared by two units (tied weights), forms the root
                   unit, gathered for the whole forward. Units must not nest.
    compute_dtype  e.g. torch.bfloat16: parameters are cast before the all-gather, compute and gradient
                   reduce-scatter run in it, the shards (master weights) and their gradients stay fp32.
    prefetch       post the next unit's all-gather before the current unit computes (forward and backward).
    sync_module_states  broadcast rank 0's parameters at wrap time (else each rank shards its own copy, which
                   must then be identical, e.g. built from the same seed).
    Frozen parameters are sharded as well (gathered, never reduced). Outside forward and backward the wrapped
    module's parameters ARE this rank's shards; `full_state_dict()` gathers them back.
    """

    def __init__(self, module: nn.Module, comm, *, units=None, compute_dtype: torch.dtype | None = None,
                 prefetch: bool = True, sync_module_states: bool = True):
        super().__init__()
        self.module, self.comm = module, comm
        self.compute_dtype, self.prefetch = compute_dtype, prefetch
        self._state_dict_keys = list(module.state_dict().keys())
        units = default_units(module) if units is None else list(units)
        owner = {}                                   # submodule -> index of the unit that contains it
        for i, u in enumerate(units):
            for m in u.modules():
                if owner.setdefault(m, i) != i:
                    raise ValueError("FSDP: units overlap (one contains another); pass disjoint modules")
        places = {}                                  # parameter -> every (module, attr, name) it sits in
        for name, m in module.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is not None and (m, attr) not in [pl[:2] for pl in places.get(p, [])]:
                    places.setdefault(p, []).append((m, attr, f"{name}.{attr}" if name else attr))
        if not places:
            raise ValueError("FSDP: the module has no parameters to shard")
        if sync_module_states:                       # every rank starts from rank 0's values
            broadcast_tensors(comm, list(places), 0, tag="fsdp_init")
        members = [[] for _ in range(len(units) + 1)]   # the last list is the root
        for p, pl in places.items():
            owners = {owner.get(m) for m, _, _ in pl}
            members[owners.pop() if len(owners) == 1 and None not in owners else -1].append(p)
        self._gathered = {}                          # storage key of a gathered buffer -> its ShardedGroup
        self.units = [_Unit(self, m, members[i], [places[p] for p in members[i]])
                      for i, m in enumerate(units + [None]) if members[i]]
        for u in self.units:                         # the module's parameters are this rank's shards from now on
            u.reshard()
        self.root = self.units[-1] if self.units[-1].module is None else None
        self._order = [u for u in self.units if u.module is not None]    # forward order
        for i, u in enumerate(self._order):
            nxt = self._order[i + 1] if i + 1 < len(self._order) else None
            u.module.register_forward_pre_hook(lambda mod, args, u=u, nxt=nxt: self._pre_forward(u, nxt))
            u.module.register_forward_hook(lambda mod, args, out, u=u: u.reshard())
        self._bwd_order = ([self.root] if self.root else []) + self._order[::-1]
        self._bwd_seen = set()

    # ---------------------------------------------------------------- forward
    def _pre_forward(self, unit, nxt) -> None:
        unit.unshard_into_module()
        if self.prefetch and nxt is not None:
            nxt.gather("fsdp_fwd_ag")

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:       # floating inputs follow the parameters' dtype
            args = tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
        self.reshard()
        # A MemoryTracker labelling activations (or any enclosing saved-tensor hooks) keeps seeing every tensor
        # that is not a gathered weight.
        with saved_tensors_hooks_over(self._pack, self._unpack):
            try:
                if self.root is not None:
                    self._pre_forward(self.root, self._order[0] if self._order else None)
                elif self.prefetch and self._order:
                    self._order[0].gather("fsdp_fwd_ag")
                return self.module(*args, **kwargs)
            finally:
                self.reshard()

    def reshard(self) -> None:
        """Free every gathered parameter (after forward, after backward, after an error)."""
        self._bwd_seen.clear()
        for u in self.units:
            u.reshard()

    # ---------------------------------------------------------------- backward
    def _pack(self, t: torch.Tensor):
        group = self._gathered.get(t.untyped_storage()._cdata)
        if group is not None:                    # a gathered weight: keep where it was, not the tensor
            return _Saved(group, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, x):
        if not isinstance(x, _Saved):
            return x
        unit = x.group.unit
        if unit not in self._bwd_seen:           # first use of this unit in this backward
            if not self._bwd_seen:               # once per backward: free whatever is left at its end
                torch.autograd.Variable._execution_engine.queue_callback(self.reshard)
            self._bwd_seen.add(unit)
            unit.gather("fsdp_bwd_ag")
            if self.prefetch:
                i = self._bwd_order.index(unit)
                for nxt in self._bwd_order[i + 1:i + 2]:
                    nxt.gather("fsdp_bwd_ag")
        unit.wait()
        return x.group.full.as_strided(x.size, x.stride, x.offset)

    # ---------------------------------------------------------------- sizes and the full state dict
    @property
    def padded_numel(self) -> int:
        """P: the trainable parameters (a tied weight once), each padded to a multiple of N rows: what the
        all-gathers and the reduce-scatter move."""
        return sum(g.padded for u in self.units for g in u.groups if g.shards[0].requires_grad)

    @property
    def local_numel(self) -> int:
        """Ψ_r: the trainable elements this rank keeps (what its optimizer steps)."""
        return sum(g.local_numel for u in self.units for g in u.groups if g.shards[0].requires_grad)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """Every parameter gathered in full (the fp32 master values) and every buffer, keyed as the wrapped
        module's state_dict(). Every rank gets it (one all-gather per group, outside the training tag)."""
        out = dict(self.module.state_dict())     # buffers (and the local shards, replaced below)
        saved = self.compute_dtype
        self.compute_dtype = None                # gather the fp32 masters, not a low-precision cast
        try:
            for u in self.units:
                for g in u.groups:
                    g.gather("fsdp_state_dict")
                    g.wait()
                    for view, places in zip(g.views(), g.places):
                        for _, _, name in places:
                            out[name] = view.clone()
                    g.free()
        finally:
            self.compute_dtype = saved
        return {k: out[k] for k in self._state_dict_keys}


def apply_fsdp(model: nn.Module, mesh_or_comm, *, units=None, **options) -> FSDP:
    """ZeRO-3 / FSDP over the dp axis; units default to the model's blocks when it has them (the course GPT)."""
    if units is None and hasattr(model, "blocks"):
        units = model.blocks
    return FSDP(model, axis_comm(mesh_or_comm, "dp"), units=units, **options)
