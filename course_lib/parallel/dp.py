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
`.grad` before its hook fires), keeps the model at `.module`, and offers `no_sync()`. Buckets are flat buffers
(`course_lib.distributed.flat`, one bucketing rule for the whole course); after a synchronized step every `.grad` is a
view into its bucket, as with PyTorch DDP's `gradient_as_bucket_view=True`, so the buckets ARE the gradients' memory.

Checked against (docs/formulas.md §1, §2): with the ring all-reduce, the gradient bytes one rank sends per step are

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

import torch
import torch.nn as nn

from ..core.handles import attach
from ..distributed import collectives
from ..distributed.collectives import chunk_sizes
from ..distributed.comm import Communicator
from ..distributed.flat import FlatBuffer, broadcast_tensors, bucket_params
from ..distributed.mesh import axis_comm
from ..memory import alloc_category, carry_tracking

GRAD_TAG = "ddp_grad"            # ledger tag of the per-step gradient all-reduces
BROADCAST_TAG = "ddp_broadcast"  # ledger tag of the one-time broadcast at wrap time
# torch DDP's default is 25 MiB, which would put a whole toy model (~1 MB for "micro") into one bucket and leave
# nothing to overlap; 32 KiB gives the "nano" preset 5 buckets and "micro" 19.
DEFAULT_BUCKET_CAP_BYTES = 32 * 1024
ALGORITHMS = tuple(collectives.ALL_REDUCE) + ("backend",)


# ============================================================================================ buckets
class Bucket:
    """Parameters whose gradients travel together: a `FlatBuffer` layout plus the flat gradient buffer itself.

    The buffer is labelled 'gradients': after a synchronized step each parameter's `.grad` is a view of its slot,
    so the averaged gradients live in the buckets (no second copy).
    """

    def __init__(self, index: int, params: list):
        self.index = index
        self.params = params
        self.layout = FlatBuffer(params)
        with alloc_category("gradients"):
            self.buffer = self.layout.new()

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def pack(self) -> torch.Tensor:
        """Copy every gradient into the flat buffer (a missing gradient counts as zeros)."""
        return self.layout.pack(self.buffer, [p.grad for p in self.params])

    def unpack(self) -> None:
        """Point every `.grad` at its slot of the reduced buffer (the gradients autograd made are dropped)."""
        for p, slot in zip(self.params, self.layout.views(self.buffer)):
            p.grad = slot


def make_buckets(params, bucket_cap_bytes: int) -> list[Bucket]:
    """Buckets by the course's one rule (`flat.bucket_params`): reverse registration order, a bucket closes once it
    holds at least `bucket_cap_bytes`, one dtype per bucket; a parameter larger than the cap gets one of its own."""
    return [Bucket(i, ps) for i, ps in enumerate(bucket_params(params, bucket_cap_bytes))]


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
            raise TypeError(f"comm must be a course_lib.distributed.comm.Communicator (ctx.comm inside launch), got "
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

    def broadcast_from(self, src: int = 0) -> None:
        """Make every rank's parameters and buffers equal to rank `src`'s: one byte buffer, one broadcast."""
        broadcast_tensors(self.comm, [*self.module.parameters(), *self.module.buffers()], src, tag=BROADCAST_TAG,
                          backend=self.algorithm == "backend")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: inside this block backward only accumulates local gradients and
        `finish_gradient_synchronization()` does nothing; the first synchronized step after it averages the sum.
        Scale each micro-step's loss by 1/num_microbatches so the sum is the mean over the whole global batch."""
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

    def close(self) -> None:
        """Release what the wrapper owns (the overlapped kind: hooks and a communication thread; here nothing).
        Every DDP kind is a context manager: `with apply_dp(model, mesh) as ddp: …` closes it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
    latency α, so k tensors cost 2(N−1)·k·α in the ring, a few buckets only 2(N−1)·#buckets·α (formulas §1.1).

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

    def reduce_bucket(self, bucket: Bucket) -> None:
        """All-reduce one packed bucket in place (a subclass can change how a bucket is reduced)."""
        self._all_reduce(bucket.buffer)

    def finish_gradient_synchronization(self) -> None:
        if not self.require_backward_grad_sync:
            return
        for b in self.buckets:
            with self.comm.compute(f"pack {b.index}"):
                b.pack()
            self.reduce_bucket(b)
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
        for p in bucket.params:     # the bucket holds them now: free autograd's copies during backward, not after
            p.grad = None
        # carry_tracking: a memory accountant active here also counts what the communication thread allocates
        self._inflight.append(self._executor.submit(carry_tracking(self.reduce_bucket), bucket))
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


# ============================================================================================ reading a run
def packs_before_backward_end(events) -> int:
    """How many buckets were packed (and so handed to communication) before backward ended, among ledger `events`
    of one step (the compute spans 'backward' and 'pack i' that `train.LedgerProbe` and the wrappers record)."""
    bwd = [e for e in events if e.kind == "compute" and e.op == "backward"]
    if not bwd:
        raise ValueError("no 'backward' span among these events: run with train.LedgerProbe(comm, spans=True)")
    end = bwd[-1].t1
    return sum(1 for e in events if e.kind == "compute" and e.op.startswith("pack ") and e.t1 <= end)


DP_KINDS = {"naive": DataParallelNaive, "bucket": DataParallelBucket, "overlap": DataParallelOverlap}


def apply_dp(model: nn.Module, mesh_or_comm, *, kind: str = "bucket", **options) -> nn.Module:
    """Data parallelism over the dp axis: kind 'naive' | 'bucket' | 'overlap' (course_lib.parallel.dp)."""
    try:
        cls = DP_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown data-parallel kind {kind!r}; use one of {sorted(DP_KINDS)}") from None
    wrapped = cls(model, axis_comm(mesh_or_comm, "dp"), **options)
    attach(wrapped, "data_parallel", wrapped)
    return wrapped


__all__ = ["apply_dp", "DP_KINDS", "DataParallelNaive", "DataParallelBucket", "DataParallelOverlap", "Bucket",
           "make_buckets", "ring_all_reduce_messages", "ddp_bytes_per_step", "ddp_messages_per_step",
           "DEFAULT_BUCKET_CAP_BYTES", "GRAD_TAG", "BROADCAST_TAG", "ALGORITHMS", "packs_before_backward_end"]
