"""ZeRO stages 0, 1 and 2: data parallelism whose ranks split the optimizer state (stage 1) and the gradients (stage 2).

Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20
(arXiv 1910.02054). Stage 0 is plain data parallelism (DDP), kept here as the baseline; stage 3, where the
parameters are sharded too, is `course_lib.parallel.fsdp`.

Every rank holds the whole model. The trainable parameters are laid end to end in flat buckets; each bucket is
padded with zeros to a multiple of N = world_size and cut into N equal shards. In stages 1 and 2 rank r owns
shard r of every bucket: only rank r keeps optimizer state for it and only rank r updates it.

    bucket (padded to a multiple of N):  | shard 0 | shard 1 | shard 2 | shard 3 |
                                              ▲ rank 0 keeps Adam's m and v for this slice only, steps it,
                                                and all-gathers the updated slices back into every rank's copy

    stage 0  backward fills full gradients → step: all-reduce(gradients) → optimizer on the whole bucket   (DDP)
    stage 1  backward fills full gradients → step: reduce-scatter(gradients) → optimizer on my shard → all-gather
    stage 2  backward: once a bucket's gradients are complete, reduce-scatter it and keep only my shard of it
             step: optimizer on my shard → all-gather

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so stages 0, 1 and 2 move the same bytes; stage 1
merely runs the optimizer between the two halves, on the one shard every rank then holds reduced.

Checked against (fp32 AdamW, the form the toy run uses; Ψ trainable parameters, P = Ψ padded bucket by bucket,
K = number of buckets = tensors the inner optimizer steps, each with AdamW's 4-byte `step` counter):

    bytes each rank sends per step  stage 0: all-reduce 2(N−1)/N·4P;  stages 1, 2: reduce-scatter (N−1)/N·4P +
                                    all-gather (N−1)/N·4P — the same 2(N−1)/N·4P                    (FACTS §2)
    model states per rank           stage 0: 4P + 4P   + 8P   + 4K
                                    stage 1: 4P + 4P   + 8P/N + 4K
                                    stage 2: 4P + 4P/N + 8P/N + 4K      (parameters + gradients + optimizer)
"""
from __future__ import annotations

import torch

from ..dist.collectives import all_gather_ring, all_reduce_ring, broadcast_tree, reduce_scatter_ring
from ..memory import alloc_category


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `world_size`, so that N shards are equal (the padding holds zeros)."""
    return -(-numel // world_size) * world_size


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


class _Bucket:
    """Parameters laid end to end in one flat buffer of `padded` elements; rank r owns elements [r·s, (r+1)·s)."""

    def __init__(self, params: list, comm, sharded: bool):
        if len({p.dtype for p in params}) != 1:
            raise ValueError("ShardedOptimizer: all parameters of a bucket must share one dtype")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = padded_numel(self.numel, comm.world_size)
        self.offsets, o = {}, 0
        for p in params:
            self.offsets[p] = o
            o += p.numel()
        self.flat = torch.zeros(self.padded, dtype=params[0].dtype)
        for p in params:
            self.slot(p, self.flat).copy_(p.detach())
        s = self.padded // comm.world_size
        lo, hi = (comm.rank * s, (comm.rank + 1) * s) if sharded else (0, self.padded)
        self.shard = torch.nn.Parameter(self.flat[lo:hi])     # a view: the optimizer's updates land in flat
        self.grad = None        # the bucket's flat gradient: stages 0, 1 keep it; stage 2 frees it once reduced
        self.arrived = 0        # parameters whose gradient this backward has delivered

    def slot(self, p, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offsets[p]:self.offsets[p] + p.numel()].view_as(p)


class ShardedOptimizer:
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) — or DDP (stage=0) — around any `torch.optim.Optimizer` class:

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.comm, stage=2, lr=3e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    The inner `optimizer_cls(shards, **kwargs)` only ever sees this rank's shards, so its state is 1/N of the
    usual (stage 0: the whole buckets). At construction the parameters are copied into the buckets, broadcast from rank 0 (`sync=True`, so all
    ranks start identical) and turned into views of them. Gradients never stay in `p.grad`: a hook moves each one
    into its bucket as backward produces it. Frozen parameters (`requires_grad=False`) are left alone; a tied
    weight is one parameter and is bucketed, reduced and updated once. Buckets are filled in reverse order of
    `params` (roughly the order backward produces gradients) up to `bucket_numel` elements (None: one bucket);
    stage 2 reduces a bucket as soon as it is complete, so smaller buckets lower its peak gradient memory.
    """

    def __init__(self, params, optimizer_cls, comm, *, stage: int = 1, bucket_numel: int | None = None,
                 sync: bool = True, tag: str = "zero", **optimizer_kwargs):
        if stage not in (0, 1, 2):
            raise ValueError(f"stage must be 0 (DDP), 1 (optimizer state sharded) or 2 (+ gradients), got "
                             f"{stage!r}; stage 3 shards the parameters too: course_lib.parallel.fsdp.FSDP")
        self.comm, self.stage, self.tag = comm, stage, tag
        params = list(dict.fromkeys(p for p in params if p.requires_grad))    # unique: a tied weight once
        if not params:
            raise ValueError("ShardedOptimizer got no trainable parameters")
        self.buckets, group = [], []
        for p in reversed(params):
            if group and bucket_numel and sum(q.numel() for q in group) + p.numel() > bucket_numel:
                self.buckets.append(_Bucket(group, comm, stage > 0))
                group = []
            group.append(p)
        self.buckets.append(_Bucket(group, comm, stage > 0))
        self._bucket_of = {}
        for b in self.buckets:
            if sync:
                broadcast_tree(comm, b.flat, 0, tag=f"{tag}_init")
            for p in b.params:
                p.data = b.slot(p, b.flat)         # the model now reads (and all-gather writes) the bucket itself
                self._bucket_of[p] = b
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
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

    # ---------------------------------------------------------------- gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[p]
        if b.grad is None:    # stage 2: a transient send buffer of the reduce-scatter, not a resident gradient
            with alloc_category("comm" if self.stage == 2 else "gradients"):
                b.grad = torch.zeros(b.padded, dtype=b.flat.dtype)
        b.slot(p, b.grad).add_(p.grad)          # add: several backward passes accumulate, as p.grad would
        p.grad = None
        b.arrived += 1
        if self.stage == 2 and b.arrived == len(b.params):
            self._reduce(b)

    def _reduce(self, b: _Bucket) -> None:
        if b.grad is None:                      # no gradient arrived at all: reduce zeros, every rank does the same
            with alloc_category("gradients"):
                b.grad = torch.zeros(b.padded, dtype=b.flat.dtype)
        b.arrived = 0
        if self.stage == 0:                     # DDP: every rank gets the whole averaged gradient
            b.shard.grad = all_reduce_ring(self.comm, b.grad, "avg", tag=f"{self.tag}_ar")
            return
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
            if self.stage < 2 or b.arrived:     # stage 2: buckets whose last gradient never came (unused params)
                self._reduce(b)
        self.optimizer.step()
        for b in self.buckets if self.stage > 0 else ():   # my updated shard lands in place, the others around it
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

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
