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

Parameters chosen by `replicate=` / `min_shard_numel=` (e.g. norms and biases) are not sharded: they stay whole
and identical on every rank, and their gradients are all-reduced once per unit per backward
(`course_lib.parallel.fsdp.replicate`). P then counts the sharded parameters only; R the replicated ones add
2(N−1)/N·eR bytes sent (ring all-reduce) and e·R + e·R + 8R (+4 per tensor) of model states, in full on every rank.

Checked against (P = Σ over units of N·L: the trainable parameters with each one padded to N·c rows; e bytes per
element of the compute dtype; docs/formulas.md §2):
    bytes each rank sends per step   forward all-gather (N−1)/N·eP + backward all-gather (N−1)/N·eP
                                     + reduce-scatter (N−1)/N·eP = 3(N−1)/N·eP = 1.5 × DDP's 2(N−1)/N·eΨ
    model states per rank            parameters 4P/N, gradients 4P/N, optimizer 8·Ψ_r + 4·n (fp32 AdamW over this
                                     rank's n local shards holding Ψ_r elements, Σ_r Ψ_r = Ψ)

This module is the wrapper (`FSDP`, `apply_fsdp`); its two kinds of parameter group live beside it:

    shard       sharded parameters: one unit's parameters of one kind, each sharded along dim 0, gathered and reduced
    replicate   replicated parameters: left whole on every rank, their gradients all-reduced (`norms_and_biases`)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from ...core.handles import attach
from ...distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from ...distributed.flat import broadcast_tensors
from ...distributed.mesh import axis_comm
from ...memory import saved_tensors_hooks_over
from .replicate import REPLICATION_RULES, ReplicatedGroup, _Replicate, check_names, norms_and_biases, replication_rule  # noqa: F401  (re-exported: `FSDP(…, replicate=…)`)
from .shard import ShardedGroup, Unshard, shard_rows  # noqa: F401  (re-exported: notebook 04 shows them)


def default_units(module: nn.Module) -> list:
    """Each child module that has parameters (a ModuleList/ModuleDict never runs forward, so its children count)."""
    units = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


class _Unit:
    """A module whose parameters are gathered and freed together (the root unit has module None)."""

    def __init__(self, fsdp, module, params, places, replicated=frozenset()):
        self.module = module
        self.groups = []                             # sharded trainable, sharded frozen, replicated ...
        for kind in (ShardedGroup, ReplicatedGroup):
            for rg in (True, False):
                mine = [i for i, p in enumerate(params)
                        if p.requires_grad == rg and (p in replicated) == kind.replicated]
                if mine:
                    self.groups.append(kind(fsdp, self, [params[i] for i in mine], [places[i] for i in mine], rg))

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
            g.set_full((_Replicate if g.replicated else Unshard).apply(g, *g.shards))

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
    replicate      parameters left whole on every rank, their gradients all-reduced instead of reduce-scattered:
                   a predicate (name, param) -> bool (e.g. `norms_and_biases`) or a collection of names as in
                   `module.named_parameters()`. Default None: everything sharded.
    min_shard_numel  also replicate every parameter with fewer elements than this (its all-gather's latency
                   costs more than the (N−1)/N of it that sharding saves).
    Frozen parameters are sharded as well (gathered, never reduced). Outside forward and backward the wrapped
    module's parameters ARE this rank's shards (and the replicated parameters themselves); `full_state_dict()`
    gathers them back.
    """

    def __init__(self, module: nn.Module, comm, *, units=None, compute_dtype: torch.dtype | None = None,
                 prefetch: bool = True, sync_module_states: bool = True, replicate=None,
                 min_shard_numel: int | None = None):
        super().__init__()
        rule = replication_rule(replicate, min_shard_numel)
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
        replicated = set()                           # a tied weight is replicated if any of its names is chosen
        if rule is not None:
            check_names(rule, places)
            replicated = {p for p, pl in places.items() if any(rule(name, p) for _, _, name in pl)}
        if sync_module_states:                       # every rank starts from rank 0's values
            broadcast_tensors(comm, list(places), 0, tag="fsdp_init")
        members = [[] for _ in range(len(units) + 1)]   # the last list is the root
        for p, pl in places.items():
            owners = {owner.get(m) for m, _, _ in pl}
            members[owners.pop() if len(owners) == 1 and None not in owners else -1].append(p)
        self._replicated_names = {name for p in replicated for _, _, name in places[p]}
        self._gathered = {}                          # storage key of a gathered buffer -> its ShardedGroup
        self.units = [_Unit(self, m, members[i], [places[p] for p in members[i]], replicated)
                      for i, m in enumerate(units + [None]) if members[i]]
        for u in self.units:                         # the module's parameters are this rank's shards from now on
            u.reshard()
        self.root = self.units[-1] if self.units[-1].module is None else None
        self._order = [u for u in self.units if u.module is not None]    # forward order
        self._hooks = []
        for i, u in enumerate(self._order):
            nxt = self._order[i + 1] if i + 1 < len(self._order) else None
            pre = u.module.register_forward_pre_hook(lambda mod, args, u=u, nxt=nxt: self._pre_forward(u, nxt))
            self._hooks += [pre, u.module.register_forward_hook(lambda mod, args, out, u=u: u.reshard())]
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
        with saved_tensors_hooks_over(self.pack, self.unpack):
            try:
                if self.root is not None:
                    self._pre_forward(self.root, self._order[0] if self._order else None)
                elif self.prefetch and self._order:
                    self._order[0].gather("fsdp_fwd_ag")
                return self.module(*args, **kwargs)
            finally:
                self.reshard()

    def close(self) -> None:
        """Free what is gathered and take FSDP's hooks off the units (the wrapped module keeps this rank's shards):
        the course's one protocol for a wrapper, also `with FSDP(...) as model:`. Idempotent."""
        self.reshard()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> FSDP:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reshard(self) -> None:
        """Free every gathered parameter (after forward, after backward, after an error)."""
        self._bwd_seen.clear()
        for u in self.units:
            u.reshard()

    # ---------------------------------------------------------------- backward
    def pack(self, t: torch.Tensor):
        group = self._gathered.get(t.untyped_storage()._cdata)
        if group is not None:                    # a gathered weight: keep where it was, not the tensor
            return _Saved(group, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, x):
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
    def _trainable(self, replicated: bool) -> list:
        return [g for u in self.units for g in u.groups if g.replicated == replicated and g.shards[0].requires_grad]

    @property
    def padded_numel(self) -> int:
        """P: the sharded trainable parameters (a tied weight once), each padded to a multiple of N rows: what the
        all-gathers and the reduce-scatter move."""
        return sum(g.padded for g in self._trainable(False))

    @property
    def replicated_numel(self) -> list:
        """[R_u]: the replicated trainable elements of each unit that has any (one all-reduce each per backward)."""
        return [g.numel for g in self._trainable(True)]

    @property
    def local_numel(self) -> int:
        """Ψ_r: the trainable elements this rank keeps (what its optimizer steps): its shards and every replicated
        parameter."""
        return sum(g.local_numel for g in self._trainable(False) + self._trainable(True))

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` (the single-process model's parameter `name`), as it holds that parameter:
        whole if replicated, else its dim-0 rows (`shard_rows`, FSDP2's chunk layout)."""
        if name in self._replicated_names:
            return full
        start, end = shard_rows(full.shape[0], self.comm.world_size, self.comm.rank)
        return full[start:end]

    # FSDP gathers for every forward and backward and reduce-scatters after each: under gradient accumulation
    # (or a pipeline's micro-batches) every micro-batch pays its bytes again — there is no `no_sync` to hold them
    reduces_per_microbatch = True

    def expected_bytes_sent(self, rank: int | None = None) -> int:
        """Bytes `rank` sends per forward + backward over dp: for every sharded group a ring all-gather in forward,
        another in backward and a ring reduce-scatter of its padded elements, in the compute dtype
        (docs/formulas.md §2); for every replicated group one ring all-reduce of its gradients."""
        rank, n = self.comm.rank if rank is None else rank, self.comm.world_size
        out = 0
        for g in self._trainable(False):
            e = (self.compute_dtype or g.shards[0].dtype).itemsize
            out += 2 * ring_all_gather_bytes(g.padded, n, rank, e) + ring_reduce_scatter_bytes(g.padded, n, rank, e)
        for g in self._trainable(True):
            e = (self.compute_dtype or g.shards[0].dtype).itemsize
            out += ring_all_reduce_bytes(g.numel, n, rank, e)
        return out

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
    """ZeRO-3 / FSDP over the dp axis; units default to the model's blocks when it has them (the course GPT).
    Options go to `FSDP`: e.g. `replicate=norms_and_biases` or `min_shard_numel=1024` leave those parameters
    replicated."""
    if units is None and hasattr(model, "blocks"):
        units = model.blocks
    wrapped = FSDP(model, axis_comm(mesh_or_comm, "dp"), units=units, **options)
    attach(wrapped, "data_parallel", wrapped)
    return wrapped
