"""ZeRO stages 1 and 2: data parallelism whose ranks split the optimizer state (stage 1) and the gradients (stage 2).

Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20
(arXiv 1910.02054). Stage 0 — plain data parallelism — is `course_lib.parallel.dp`; stage 3, where the parameters
are sharded too, is `course_lib.parallel.fsdp`; `course_lib.parallel.zero.apply_zero` builds any of them.

Every rank holds the whole model. The trainable parameters are laid end to end in flat buckets (the course's one
bucketing rule, `course_lib.distributed.flat`); each bucket is padded with zeros to a multiple of N = world_size and cut
into N equal shards. Rank r owns shard r of every bucket: only rank r keeps optimizer state for it and updates it.

    bucket (padded to a multiple of N):  | shard 0 | shard 1 | shard 2 | shard 3 |
                                              ▲ rank 0 keeps Adam's m and v for this slice only, steps it,
                                                and all-gathers the updated slices back into every rank's copy

    DDP      backward fills full gradients → all-reduce(gradients) → optimizer on everything        (parallel/dp.py)
    stage 1  backward fills full gradients → step: reduce-scatter(gradients) → optimizer on my shard → all-gather
    stage 2  backward: once a bucket's gradients are complete, reduce-scatter it and keep only my shard of it
             step: optimizer on my shard → all-gather

Gradient accumulation and pipelines (many backward passes per step) reduce ONCE per step, as DDP does: under
`no_sync()` the gradients only add up in the buckets (stage 2 then holds the whole gradient until the step, as
Megatron's distributed optimizer does), and `finish_gradient_synchronization()` — or the last backward outside
`no_sync`, or `step()` — reduce-scatters each bucket once.

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so DDP and stages 1 and 2 move the same bytes;
stage 1 merely runs the optimizer between the two halves, on the one shard every rank then holds reduced.

Checked against (fp32 AdamW, the form the toy run uses; Ψ trainable parameters, P = Ψ padded bucket by bucket,
K = number of buckets = tensors the inner optimizer steps, each with AdamW's 4-byte `step` counter):

    bytes each rank sends per step  reduce-scatter (N−1)/N·4P + all-gather (N−1)/N·4P = 2(N−1)/N·4P, DDP's bytes
                                    on the padded buckets                                (docs/formulas.md §2)
    model states per rank           stage 1: 4P + 4P   + 8P/N + 4K
                                    stage 2: 4P + 4P/N + 8P/N + 4K      (parameters + gradients + optimizer)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..distributed.collectives import (all_gather_ring, reduce_scatter_ring, ring_all_gather_bytes,
                                ring_reduce_scatter_bytes)
from ..distributed.flat import FlatBuffer, broadcast_tensors, bucket_params, padded_numel  # noqa: F401 (padded_numel: API)
from ..distributed.mesh import Mesh, axis_comm
from ..memory import alloc_category
from ..optim.master import kept_master, set_master
from ..core.handles import attach
from .dp import apply_dp
from .fsdp import apply_fsdp
from .pipeline.stage import PipelineStage

DEFAULT_BUCKET_CAP_BYTES = 256 * 1024


def model_state_bytes(psi: int, world_size: int, stage: int, *, param: int = 4, grad: int = 4,
                      optim: int = 8) -> dict:
    """ZeRO's model states per rank (paper §5.1, Fig. 1), bytes by category: stage 0 is DDP, stage k ≥ 1 divides
    the optimizer state, then also the gradients (k ≥ 2), then also the parameters (k = 3) by N. Defaults: fp32
    AdamW (4 + 4 + 8); the paper's mixed-precision Adam is param=2, grad=2, optim=12 (fp32 master, m, v).
    Exact for our runs with psi = P (padded) plus AdamW's 4-byte step counter per tensor, which this omits."""
    n = world_size
    return {"parameters": param * psi // (n if stage >= 3 else 1),
            "gradients": grad * psi // (n if stage >= 2 else 1),
            "optimizer": optim * psi // (n if stage >= 1 else 1)}


def zero_bytes_per_step(padded_numels, world_size: int, rank: int, elem_bytes: int) -> int:
    """Bytes dp rank `rank` sends per step in ZeRO-1 or ZeRO-2 reducing once per step: per bucket of P elements
    (padded to a multiple of N), a ring reduce-scatter of the gradients and a ring all-gather of the updated
    parameters, (N−1)/N·P·e each — DDP's 2(N−1)/N·P·e."""
    return sum(ring_reduce_scatter_bytes(n, world_size, rank, elem_bytes)
               + ring_all_gather_bytes(n, world_size, rank, elem_bytes) for n in padded_numels)


class _Bucket:
    """Parameters laid end to end in one flat buffer of `padded` elements; rank r owns elements [r·s, (r+1)·s)."""

    def __init__(self, params: list, comm):
        self.params = params
        self.layout = FlatBuffer(params, shards=comm.world_size)
        with alloc_category("parameters"):
            self.flat = self.layout.pack(self.layout.new(), [p.detach() for p in params])
        # a view: the optimizer's updates land in flat, and so in the model
        self.shard = torch.nn.Parameter(self.layout.shard(self.flat, comm.rank))
        kept = [kept_master(p) for p in params]     # mixed precision: the exact fp32 values apply_precision kept
        if any(m is not None for m in kept):
            with alloc_category("optimizer"):
                flat32 = self.layout.pack(self.layout.new(torch.float32),
                                          [m if m is not None else p.detach().float() for p, m in zip(params, kept)])
                set_master(self.shard, self.layout.shard(flat32, comm.rank).clone())
        self.grad = None        # the bucket's flat gradient: stage 1 keeps it; stage 2 frees it once reduced
        self.arrived = 0        # parameters whose gradient this backward has delivered

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded(self) -> int:
        return self.layout.padded


class ShardedOptimizer:
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) around any `torch.optim.Optimizer` class:

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.comm, stage=2, lr=3e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    The inner `optimizer_cls(shards, **kwargs)` only ever sees this rank's shards, so its state is 1/N of the
    usual. At construction the parameters are copied into the buckets, broadcast from rank 0 (`sync=True`, so all
    ranks start identical) and turned into views of them. Gradients never stay in `p.grad`: a hook moves each one
    into its bucket as backward produces it. Frozen parameters (`requires_grad=False`) are left alone; a tied
    weight is one parameter and is bucketed, reduced and updated once. Buckets follow the course's one rule
    (`flat.bucket_params`: reverse order, close at ≥ `bucket_cap_bytes`; None: one bucket); stage 2 reduces a
    bucket as soon as it is complete, so smaller buckets lower its peak gradient memory.
    """

    def __init__(self, params, optimizer_cls, comm, *, stage: int = 1,
                 bucket_cap_bytes: int | None = DEFAULT_BUCKET_CAP_BYTES, sync: bool = True, tag: str = "zero",
                 **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (+ gradients), got {stage!r}; plain "
                             f"data parallelism is course_lib.parallel.dp, stage 3 course_lib.parallel.fsdp.FSDP "
                             f"(course_lib.parallel.zero.apply_zero builds any stage)")
        self.comm, self.stage, self.tag = comm, stage, tag
        self.require_backward_grad_sync = True     # False inside no_sync(): accumulate only, reduce later
        params = list(dict.fromkeys(p for p in params if p.requires_grad))    # unique: a tied weight once
        if not params:
            raise ValueError("ShardedOptimizer got no trainable parameters")
        self.buckets = [_Bucket(group, comm) for group in bucket_params(params, bucket_cap_bytes)]
        if sync:
            broadcast_tensors(comm, [b.flat for b in self.buckets], 0, tag=f"{tag}_init")
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                p.data = b.layout.view(b.flat, p)   # the model now reads (and all-gather writes) the bucket itself
                self._bucket_of[p] = b
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in params]
        self.optimizer = optimizer_cls([b.shard for b in self.buckets], **optimizer_kwargs)

    # ---------------------------------------------------------------- sizes the formulas need
    @property
    def numel(self) -> int:
        """Ψ: trainable parameters (a tied weight counted once)."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        """P: Ψ plus the zero padding that makes every bucket split evenly over the ranks."""
        return sum(b.padded for b in self.buckets)

    @property
    def num_shards(self) -> int:
        """K: shard tensors the inner optimizer holds state for (one per bucket)."""
        return len(self.buckets)

    def expected_bytes_sent(self, rank: int | None = None) -> int:
        """Closed form of the bytes `rank` sends over dp per step (`zero_bytes_per_step` of these buckets)."""
        rank = self.comm.rank if rank is None else rank
        return zero_bytes_per_step([b.padded for b in self.buckets], self.comm.world_size, rank,
                                   self.buckets[0].flat.element_size())

    # ---------------------------------------------------------------- gradients
    def on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[p]
        sync = self.require_backward_grad_sync
        if b.grad is None:    # stage 2: a transient send buffer of the reduce-scatter, unless it accumulates
            with alloc_category("comm" if self.stage == 2 and sync else "gradients"):
                b.grad = b.layout.new()
        b.layout.view(b.grad, p).add_(p.grad)   # add: several backward passes accumulate, as p.grad would
        p.grad = None
        if not sync:                            # no_sync: the arrivals of a synchronized backward are counted
            return
        b.arrived += 1
        if self.stage == 2 and b.arrived == len(b.params):
            self.reduce_bucket(b)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation (and pipeline micro-batches): inside this block gradients only add up in the
        buckets; the first synchronized backward after it, `finish_gradient_synchronization()` or `step()`
        reduces their sum once — the same interface as the DDP wrappers'."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Stage 2: reduce-scatter every bucket still holding gradients (those accumulated under no_sync); stage 1
        reduces in `step()`. Nothing inside no_sync."""
        if self.require_backward_grad_sync and self.stage == 2:
            for b in self.buckets:
                if b.grad is not None:
                    self.reduce_bucket(b)

    def reduce_bucket(self, b: _Bucket) -> None:
        if b.grad is None:                      # no gradient arrived at all: reduce zeros, every rank does the same
            with alloc_category("gradients"):
                b.grad = b.layout.new()
        b.arrived = 0
        mine = reduce_scatter_ring(self.comm, b.grad, "avg", tag=f"{self.tag}_rs", inplace=True)
        if self.stage == 1:
            b.shard.grad = mine                 # a view into the full gradient buffer, which stage 1 keeps
        else:
            with alloc_category("gradients"):
                b.shard.grad = mine.clone() if b.shard.grad is None else b.shard.grad.add_(mine)
            b.grad = None                       # of the whole bucket's gradient only my shard survives

    # ---------------------------------------------------------------- the optimizer interface
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        for b in self.buckets:
            if self.stage == 1 or b.grad is not None:   # stage 2: what no bucket-complete reduction took yet
                self.reduce_bucket(b)
        self.optimizer.step()
        for b in self.buckets:                  # my updated shard lands in place, the others around it
            all_gather_ring(self.comm, b.shard.detach(), b.padded, tag=f"{self.tag}_ag", out=b.flat)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free every gradient buffer (set_to_none=False is treated the same: there is nothing to keep)."""
        for b in self.buckets:
            b.grad, b.shard.grad, b.arrived = None, None, 0

    @property
    def param_groups(self):         # so learning-rate schedulers work
        return self.optimizer.param_groups

    @property
    def state(self):                # so MemoryTracker.watch(model, opt) labels the optimizer state
        return self.optimizer.state

    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Close the optimizer it shards for, where that one owns a thread or files (ZeRO-Offload's `OffloadAdam`:
        its SSD tier's files would outlive a forked rank, which ends without running finalizers)."""
        if isinstance(self.optimizer, contextlib.AbstractContextManager):
            self.optimizer.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def apply_zero(model: nn.Module, mesh_or_comm, stage: int, *, kind: str = "bucket",
               bucket_cap_bytes: int | None = DEFAULT_BUCKET_CAP_BYTES, fsdp_options: dict | None = None) -> nn.Module:
    """ZeRO stage 0 (= DDP), 1, 2 or 3 (= FSDP) over the data-parallel ranks — the one place the course builds a
    ZeRO stage. Returns the model to train: a DDP (`kind`) or FSDP wrapper for stages 0 and 3; for stages 1 and 2
    the model itself, its optimizer to be sharded when `course_lib.optim.build(model, …)` builds it (a model with
    experts: `expert.apply_expert_zero`). Either way `handle_of(model, "data_parallel")` is what reduces the
    gradients: hand it to `forward_backward(sync=…)` or a pipeline's `data_parallel`.

    The data-parallel ranks are the mesh's dp × cp group (context-parallel ranks hold partial gradients of the same
    weights), or the Communicator given. Single rank (no mesh, one dp rank, stage 0): the model as it is."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if stage == 3 and isinstance(model, PipelineStage):
        raise ValueError("ZeRO-3 does not compose with a pipeline stage here: it would all-gather the parameters "
                         "in every micro-batch's forward and backward; use zero stage 1 or 2 with pipelines")
    comm = _dp_group(mesh_or_comm)
    if stage == 0:
        if comm is None or comm.world_size == 1:
            return model
        cap = bucket_cap_bytes or _whole(model)
        return apply_dp(model, comm, kind=kind, **({"bucket_cap_bytes": cap} if kind != "naive" else {}))
    if stage == 3:
        return apply_fsdp(model, comm, **(fsdp_options or {}))
    attach(model, "data_parallel", ZeroShards(lambda params, cls, **kw: ShardedOptimizer(
        params, cls, comm, stage=stage, bucket_cap_bytes=bucket_cap_bytes, **kw)))
    return model


class ZeroShards:
    """ZeRO-1/2's handle before and after its optimizer exists: `build_optimizer` makes the sharded optimizer (the
    optimizer factory calls it with the class the other techniques chose), and from then on this reduces the
    gradients as that optimizer does — `no_sync`, `finish_gradient_synchronization` and the bytes it sends are the
    optimizer's own."""

    def __init__(self, make):
        self.make = make                    # (params, optimizer_cls, **hyper) -> the sharded optimizer
        self.optimizer = None

    def build_optimizer(self, params, optimizer_cls, **optimizer_kwargs):
        self.optimizer = self.make(params, optimizer_cls, **optimizer_kwargs)
        return self.optimizer

    def __getattr__(self, name):
        if name.startswith("__") or name in ("make", "optimizer"):
            raise AttributeError(name)
        if self.optimizer is None:
            raise AttributeError(f"ZeRO-1/2 reduces the gradients in its optimizer, which is not built yet: "
                                 f"build it first (course_lib.optim.build(model, …)); asked for {name!r}")
        return getattr(self.optimizer, name)


def _dp_group(mesh_or_comm):
    """The ranks that reduce gradients: a Mesh's dp × cp group, a Communicator as it is, None for no mesh."""
    if mesh_or_comm is None:
        return None
    if isinstance(mesh_or_comm, Mesh):
        return mesh_or_comm.group("dp", "cp")
    return axis_comm(mesh_or_comm, "dp")


def _whole(model: nn.Module) -> int:
    """A cap that puts every parameter into one bucket."""
    return max(1, sum(p.numel() * p.element_size() for p in model.parameters()))
