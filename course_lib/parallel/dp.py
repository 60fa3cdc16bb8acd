"""Data parallelism from scratch (DDP): every rank holds the whole model, computes gradients on its own slice of the
global batch, and the ranks average their gradients with an all-reduce before each optimizer step.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020 (arXiv 2006.15704):
the naive per-tensor all-reduce, gradient bucketing, overlap of communication with backward through autograd hooks,
and `no_sync` for gradient accumulation are that paper's design (§3). Goyal et al. 2017 (arXiv 1706.02677) and
Sergeev & Del Balso 2018 (Horovod, arXiv 1802.05799) are the large-batch and ring-all-reduce background.

Three wrappers for ANY `nn.Module`, naive beside optimized (picotron's `DataParallelNaive` / `DataParallelBucket`):

    DataParallelNaive     after backward, one all-reduce per gradient tensor
    DataParallelBucket    after backward, one all-reduce per flattened bucket of about `bucket_cap_bytes`
    DataParallelOverlap   during backward: a gradient hook launches each bucket's all-reduce as soon as the bucket
                          is full, on a communication thread; `finish_gradient_synchronization()` waits for them

Every wrapper broadcasts parameters and buffers from rank 0 when it wraps (so ranks start identical), skips frozen
parameters, reduces a tied weight once (`module.parameters()` yields it once, and autograd sums both uses into one
`.grad` before its hook fires), keeps the model at `.module`, and offers `no_sync()`.

Checked against (FACTS.md §1, §2): with the ring all-reduce, the gradient bytes one rank sends per step are

    2(N−1)/N · Ψ · bytes per element          (Ψ = trainable parameters, N = world_size)

exactly when N divides every bucket; otherwise rank r sends, per bucket of n elements, n less chunk r (reduce-scatter)
plus n less chunk r+1 (all-gather), so ranks differ by a few elements, but their SUM is exactly 2(N−1)·Ψ·bytes.
Each bucket costs 2(N−1) messages per rank, so the message count falls as the bucket size grows.

Which all-reduce: `algorithm="ring"` (default) runs `collectives.all_reduce_ring`, built on the ledger's send/recv,
so every byte in the ledger is measured; any other key of `collectives.ALL_REDUCE` works too. `algorithm="backend"`
calls torch.distributed's own all-reduce through `comm.all_reduce` (one C++ call per bucket, nominal ledger bytes):
use it to time the wrappers without the cost of a ring driven from Python.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..dist import collectives
from ..dist.collectives import chunk_sizes
from ..dist.comm import Communicator
from ..memory import alloc_category

GRAD_TAG = "ddp_grad"            # ledger tag of the per-step gradient all-reduces
BROADCAST_TAG = "ddp_broadcast"  # ledger tag of the one-time broadcast at wrap time
# torch DDP's default is 25 MiB, which would put a whole toy model (~1 MB for "micro") into one bucket and leave
# nothing to overlap; 32 KiB gives the "nano" preset 5 buckets and "micro" 19.
DEFAULT_BUCKET_CAP_BYTES = 32 * 1024
ALGORITHMS = tuple(collectives.ALL_REDUCE) + ("backend",)


# ============================================================================================ buckets
@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer: `buffer[offsets[i]:][:numel]` is params[i]."""
    index: int
    params: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def pack(self) -> torch.Tensor:
        """Copy every gradient into the flat buffer (a missing gradient counts as zeros)."""
        for p, off in zip(self.params, self.offsets):
            view = self.buffer[off:off + p.numel()]
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
        return self.buffer

    def unpack(self) -> None:
        """Copy the reduced buffer back into each `.grad` (a copy, so the buffer can be reused next step)."""
        for p, off in zip(self.params, self.offsets):
            reduced = self.buffer[off:off + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)


def make_buckets(params, bucket_cap_bytes: int) -> list[Bucket]:
    """Greedy buckets in REVERSE registration order (backward produces the last layers' gradients first, as in
    torch DDP); a bucket closes once it holds at least `bucket_cap_bytes`; one dtype per bucket (it is one flat
    buffer). A parameter larger than the cap gets a bucket of its own."""
    if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) or bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be a positive number of bytes, got {bucket_cap_bytes!r}")
    done, open_ = [], {}                        # open_: dtype -> the bucket being filled
    for p in reversed(list(params)):
        b = open_.setdefault(p.dtype, Bucket(index=-1))
        b.params.append(p)
        b.offsets.append(b.numel)
        b.numel += p.numel()
        if b.nbytes >= bucket_cap_bytes:
            done.append(open_.pop(p.dtype))
    done += [b for b in open_.values() if b.params]
    for i, b in enumerate(done):
        b.index = i
        with alloc_category("comm"):
            b.buffer = torch.zeros(b.numel, dtype=b.params[0].dtype, device=b.params[0].device)
    return done


# ============================================================================================ closed forms
def ring_all_reduce_messages(n: int, p: int, rank: int) -> int:
    """Messages rank `rank` sends in `collectives.all_reduce_ring` of n elements: 2(p−1), less any step whose chunk
    is empty (only when n < p). RS step s sends chunk (r−s−1) mod p, AG step s sends chunk (r−s) mod p."""
    if p == 1:
        return 0
    sizes = chunk_sizes(n, p)
    return sum(1 for s in range(p - 1) for c in ((rank - s - 1) % p, (rank - s) % p) if sizes[c] > 0)


def ddp_bytes_per_step(bucket_numels, world_size: int, rank: int, elem_bytes: int, algorithm: str = "ring") -> int:
    """Gradient bytes `rank` sends per synchronized step: the all-reduce of each bucket (ledger-exact for the
    from-scratch algorithms; the ledger's nominal 2(p−1)/p·S for 'backend')."""
    if algorithm == "backend":
        p = world_size
        return sum(round(2 * (p - 1) * n * elem_bytes / p) for n in bucket_numels)
    return sum(collectives.ALL_REDUCE_BYTES[algorithm](n, world_size, rank, elem_bytes) for n in bucket_numels)


def ddp_messages_per_step(bucket_numels, world_size: int, rank: int, algorithm: str = "ring") -> int:
    """Messages `rank` sends per synchronized step (ring: 2(N−1) per bucket; backend: one ledger entry per call)."""
    if algorithm == "backend":
        return len(bucket_numels) if world_size > 1 else 0
    if algorithm != "ring":
        raise ValueError(f"message counts are worked out here for 'ring' and 'backend' only, not {algorithm!r}")
    return sum(ring_all_reduce_messages(n, world_size, rank) for n in bucket_numels)


# ============================================================================================ the wrappers
class DataParallelNaive(nn.Module):
    """Data parallelism, simplest form: after `loss.backward()`, `finish_gradient_synchronization()` all-reduces
    every gradient tensor on its own (one all-reduce per parameter tensor) and divides by world_size.

        rank r:  forward(x_r) → backward → [all-reduce g₁] [all-reduce g₂] … [all-reduce g_k] → optimizer.step()

    Averaging (sum, then ÷N) reproduces the single-process gradient because the loss is a mean and every rank holds
    the same number of tokens: mean over N·b = (1/N)·Σ_r mean over b_r. With uneven shards this weighting is wrong.
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, algorithm: str = "ring", broadcast: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"data parallelism wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a course_lib.dist.comm.Communicator (ctx.comm inside launch), got "
                            f"{type(comm).__name__}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use one of {ALGORITHMS}")
        self.module = module
        self.comm = comm
        self.algorithm = algorithm
        # parameters() yields a tied (shared) weight once, so it is reduced once; frozen ones need no reduction.
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no parameter with requires_grad=True: there is nothing to synchronize")
        self.require_backward_grad_sync = True
        if broadcast:
            self.broadcast_from(0)

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def psi(self) -> int:
        """Ψ: trainable parameters (elements) whose gradients are averaged every step."""
        return sum(p.numel() for p in self.params)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def broadcast_from(self, src: int = 0) -> None:
        """Make every rank's parameters and buffers equal to rank `src`'s: one byte buffer, one broadcast."""
        tensors = [t for t in [*self.module.parameters(), *self.module.buffers()] if t.numel()]
        if self.world_size == 1 or not tensors:
            return
        with alloc_category("comm"):
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])   # (total bytes,)
        if self.algorithm == "backend":
            self.comm.broadcast(flat, src, tag=BROADCAST_TAG)
        else:
            collectives.broadcast_tree(self.comm, flat, src, tag=BROADCAST_TAG)
        if self.comm.rank != src:
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.copy_(flat[off:off + n].view(t.dtype).view_as(t))
                off += n

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: inside this block backward only accumulates local gradients and
        `finish_gradient_synchronization()` does nothing; the first synchronized step after it averages the sum.
        Scale each micro-step's loss by 1/accum_steps so the sum is the mean over the whole global batch."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(self.comm, flat, "avg", algorithm=self.algorithm, tag=GRAD_TAG)

    def bucket_numels(self) -> list[int]:
        """Elements of each all-reduce one step launches (here: one per parameter tensor)."""
        return [p.numel() for p in self.params]

    def expected_bytes_sent(self, rank: int | None = None) -> int:
        """Closed form of the gradient bytes `rank` sends per synchronized step (what the ledger must show)."""
        rank = self.comm.rank if rank is None else rank
        return ddp_bytes_per_step(self.bucket_numels(), self.world_size, rank, self.params[0].element_size(),
                                  self.algorithm)

    def expected_messages(self, rank: int | None = None) -> int:
        rank = self.comm.rank if rank is None else rank
        return ddp_messages_per_step(self.bucket_numels(), self.world_size, rank, self.algorithm)

    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the ranks (call after backward, before optimizer.step())."""
        if not self.require_backward_grad_sync:
            return
        for p in self.params:
            if p.grad is None:                  # unused on this rank: contribute zeros (the others may have used it)
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            self._all_reduce(p.grad)


class DataParallelBucket(DataParallelNaive):
    """Bucketed: gradients are copied into flat buffers of about `bucket_cap_bytes` and each buffer is all-reduced
    with one collective, after backward. Same bytes as the naive form, far fewer messages: every message pays a
    latency α, so k tensors cost 2(N−1)·k·α in the ring, a few buckets only 2(N−1)·#buckets·α (FACTS §1).

        params (reverse order):  [ lm_head | ln_f | fc_out fc_in … ] [ … wq ln1 ] … [ wpe wte ]
        buckets:                 └────── bucket 0 ──────┘ └─ bucket 1 ─┘     └ bucket k−1 ┘
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 algorithm: str = "ring", broadcast: bool = True):
        super().__init__(module, comm, algorithm=algorithm, broadcast=broadcast)
        self.bucket_cap_bytes = bucket_cap_bytes
        self.buckets = make_buckets(self.params, bucket_cap_bytes)

    def bucket_numels(self) -> list[int]:
        return [b.numel for b in self.buckets]

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """All-reduce one packed bucket in place (a subclass can change how a bucket is reduced)."""
        self._all_reduce(bucket.buffer)

    def finish_gradient_synchronization(self) -> None:
        if not self.require_backward_grad_sync:
            return
        for b in self.buckets:
            with self.comm.compute(f"pack {b.index}"):
                b.pack()
            self._reduce_bucket(b)
            b.unpack()


class DataParallelOverlap(DataParallelBucket):
    """Bucketed AND overlapped with backward. A post-accumulate-grad hook on every parameter counts down its
    bucket; when the buckets at the front of the launch order are complete, they are packed and handed to a
    communication thread, which all-reduces them in bucket order while autograd goes on computing earlier layers.
    `finish_gradient_synchronization()` launches what is left, waits, and copies the averages into `.grad`.

        main thread  │ fwd │ bwd: lm_head … block 3 │ block 2 … │ block 1 … wte │ wait │ step │
        comm thread  │     │                        │ AR bkt 0  │ AR bkt 1  …   │ AR k−1│     │

    Why a thread: the from-scratch ring (`collectives.all_reduce_ring`) is Python code that blocks in send/recv, so
    it needs its own thread to run beside backward (the role a CUDA communication stream plays for NCCL). One
    thread keeps the buckets in the same order on every rank, which a ring needs (all ranks must reduce bucket i
    together). algorithm='backend' runs torch.distributed's own all-reduce on that thread instead (fewer Python
    steps; nominal ledger bytes).

    Buckets launch strictly in order, so a parameter that is unused in backward holds its bucket (and every later
    one) back until `finish_gradient_synchronization()`; the result is still correct.
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 algorithm: str = "ring", broadcast: bool = True):
        super().__init__(module, comm, bucket_cap_bytes=bucket_cap_bytes, algorithm=algorithm, broadcast=broadcast)
        self._bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-comm")   # the "comm stream"
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b.params) for b in self.buckets]   # gradients each bucket still waits for
        self._ready: set[int] = set()
        self._next = 0                                          # next bucket to launch
        self._inflight = []                                     # futures of launched all-reduces

    def _on_grad_ready(self, p: torch.Tensor) -> None:          # autograd calls it once p.grad is final
        if not self.require_backward_grad_sync:
            return
        if id(p) in self._ready:
            raise RuntimeError("a parameter's gradient became ready twice in one synchronized step: call "
                               "finish_gradient_synchronization() after each backward() that is not under no_sync()")
        self._ready.add(id(p))
        self._missing[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        with self.comm.compute(f"pack {bucket.index}"):   # on the autograd thread: these gradients are final
            bucket.pack()
        self._inflight.append(self._executor.submit(self._reduce_bucket, bucket))
        self._next += 1

    def finish_gradient_synchronization(self) -> None:
        if not self.require_backward_grad_sync:
            return
        try:
            while self._next < len(self.buckets):   # buckets the hooks did not launch (unused params, no_sync)
                self._launch(self.buckets[self._next])
            for f in self._inflight:
                f.result()                      # re-raises a failure of the communication thread
            for b in self.buckets:
                b.unpack()
        finally:
            self._reset()

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._executor.shutdown(wait=True)


# ============================================================================================ a training run on ranks
@dataclass
class DDPRun:
    """What one rank returns from `run_data_parallel` (picklable, so `launch` hands it to the caller)."""
    losses: list                 # this rank's loss per step, on its own micro-batch
    params: dict = field(repr=False)   # name -> final parameter (of `.module`)
    ledger: object = field(repr=False)  # this rank's course_lib.dist.comm.Ledger
    windows: list = field(repr=False)   # (t0, t1) of each step, time.perf_counter()
    bucket_numels: list = field(default_factory=list)   # elements of each all-reduce a step launches ([] for torch's)
    algorithm: str = ""
    first_grads: dict = field(default_factory=dict, repr=False)   # the synchronized gradients step 0's optimizer saw

    @property
    def n_buckets(self) -> int:
        return len(self.bucket_numels)

    def expected_bytes_sent(self) -> int:
        """The closed form of the gradient bytes this rank sends per step (`ddp_bytes_per_step`)."""
        return ddp_bytes_per_step(self.bucket_numels, self.ledger.world_size, self.ledger.rank,
                                  self.params[next(iter(self.params))].element_size(), self.algorithm)

    def expected_messages(self) -> int:
        return ddp_messages_per_step(self.bucket_numels, self.ledger.world_size, self.ledger.rank, self.algorithm)

    @property
    def step_seconds(self) -> list:
        return [t1 - t0 for t0, t1 in self.windows]

    def buckets_launched_during_backward(self, step: int) -> int:
        """How many buckets were packed (and so handed to communication) before backward ended, in `step`."""
        events = self.step_ledger(step).events
        bwd = next(e for e in events if e.kind == "compute" and e.op == "backward")
        return sum(1 for e in events if e.kind == "compute" and e.op.startswith("pack ") and e.t1 <= bwd.t1)

    def step_ledger(self, step: int):
        """This rank's ledger cut to the events of one step (for `plots.plot_timeline`)."""
        from ..dist.comm import Ledger
        t0, t1 = self.windows[step]
        return Ledger(self.ledger.rank, self.ledger.world_size,
                      [e for e in self.ledger.events if e.t0 >= t0 and e.t1 <= t1])


def run_data_parallel(ctx, wrap, cfg="micro", tc=None, *, model: nn.Module | None = None) -> DDPRun:
    """Train on this rank: `wrap(module, ctx.comm)` makes the data-parallel model (any wrapper of this file, or
    torch's DistributedDataParallel); each rank takes its tc.batch_size/world_size slice of every global batch, so
    the run is comparable with `train.train_reference(cfg, tc)`. Forward, backward and the optimizer step are
    marked as compute spans in the ledger; the gradient all-reduces appear under GRAD_TAG."""
    import time

    from ..data import ShardedBatches
    from ..model import GPT, get_config
    from ..train import TrainConfig, make_optimizer

    cfg, tc = get_config(cfg), tc or TrainConfig()
    n = ctx.world_size
    if tc.batch_size % n:
        raise ValueError(f"global batch {tc.batch_size} does not split evenly over world_size={n}; "
                         f"use a multiple of {n}")
    module = GPT(cfg, seed=tc.seed) if model is None else model
    ddp = wrap(module, ctx.comm)
    optimizer = make_optimizer(ddp.module.parameters(), tc)
    batches = ShardedBatches(cfg.seq_len, tc.batch_size // n, n, ctx.rank, seed=tc.data_seed)
    first_grads: dict = {}

    def keep_first_grads(opt, args, kwargs):   # what the optimizer is handed: the averaged gradient
        if not first_grads:
            first_grads.update({k: p.grad.detach().clone() for k, p in ddp.module.named_parameters()
                                if p.grad is not None})
    hook = optimizer.register_step_pre_hook(keep_first_grads)
    comm, losses, windows = ctx.comm, [], []
    finish = getattr(ddp, "finish_gradient_synchronization", lambda: None)   # torch DDP syncs inside backward
    for step in range(tc.steps):
        x, y = batches.get(step)
        t0 = time.perf_counter()
        with comm.compute("forward"):
            _, loss = ddp(x, y)
        with comm.compute("backward"):
            loss.backward()
        finish()
        with comm.compute("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        windows.append((t0, time.perf_counter()))
        losses.append(loss.item())
    hook.remove()
    if hasattr(ddp, "close"):
        ddp.close()
    params = {k: v.detach().clone() for k, v in ddp.module.named_parameters()}
    numels = ddp.bucket_numels() if hasattr(ddp, "bucket_numels") else []
    return DDPRun(losses, params, comm.ledger, windows, numels, getattr(ddp, "algorithm", "backend"), first_grads)


__all__ = ["DataParallelNaive", "DataParallelBucket", "DataParallelOverlap", "Bucket", "make_buckets",
           "ring_all_reduce_messages", "ddp_bytes_per_step", "ddp_messages_per_step", "DEFAULT_BUCKET_CAP_BYTES",
           "GRAD_TAG", "BROADCAST_TAG", "ALGORITHMS", "DDPRun", "run_data_parallel"]
