"""Collectives built only from the ledger's point-to-point primitives (send / recv / sendrecv).

Algorithms (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005; the ring as in Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009, and NCCL):

    broadcast_tree      binomial tree from `root`, ⌈log₂p⌉ rounds        root sends ⌈log₂p⌉·S
    reduce_tree         binomial tree to `root` (the reverse)              every non-root sends S once
    all_reduce_naive    everyone sends to rank 0, rank 0 reduces and sends the result back
                                                                           rank 0 sends (p−1)·S, the others S
    all_reduce_tree     reduce_tree to 0, then broadcast_tree from 0       2⌈log₂p⌉ steps
    reduce_scatter_ring p−1 steps, each rank passes one chunk right       sends S − |chunk r|
    all_gather_ring     p−1 steps                                          sends S − |chunk (r+1) mod p|
    all_reduce_ring     reduce-scatter + all-gather                        2(p−1)/p·S when p divides n  (formulas §1.1)
    all_reduce_rhd      recursive halving (RS) + recursive doubling (AG) (Rabenseifner); the p − p' ranks above
                        p' = 2^⌊log₂p⌋ fold in first                       2(p'−1)/p'·S in the power-of-two core

Whatever the algorithm, the ranks together send exactly 2(p−1)·S bytes: every rank's S must reach p−1 others,
once reduced. They differ in how that load is spread over the ranks (the busiest rank sets the time on a network
with one link per rank) and in how many steps follow one another (each costs a latency α).

Every function works for any world size and any length: chunks follow `torch.tensor_split` (the first n mod p
chunks are one element longer). Byte counts are measured by the ledger and predicted, rank by rank and exactly,
by the `*_bytes` functions below; tests and notebooks assert the two are equal. `trace_ring_all_reduce` runs the
real ring through a `ChunkTracer` to show which chunk moves where at each step.
"""
from __future__ import annotations

import functools
import time

import torch

from ..memory import alloc_category
from .collective_bytes import (  # noqa: F401
    ALL_REDUCE_BYTES,
    _bounds,
    all_reduce_steps,
    chunk_sizes,
    naive_all_reduce_bytes,
    rhd_all_reduce_bytes,
    rhd_schedule,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
    tree_all_reduce_bytes,
    tree_broadcast_bytes,
    tree_reduce_bytes,
)
from .comm import Communicator

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _releasing(fn):
    """Hand the communicator's finished transfers back when the collective returns, so no buffer stays pinned."""
    @functools.wraps(fn)
    def wrapper(comm, *args, **kwargs):
        try:
            return fn(comm, *args, **kwargs)
        finally:
            comm.release()
    return wrapper


def _prepare(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Validate before any message moves (a rank that fails halfway would leave the others waiting forever)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; use one of {REDUCE_OPS}")
    if op == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("collectives work in place on contiguous tensors; call .contiguous() first")
    return tensor.view(-1)


def _combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        acc.mul_(other)


def _finish(t: torch.Tensor, op: str, p: int) -> torch.Tensor:
    return t.div_(p) if op == "avg" else t


# ============================================================================ trees
@_releasing
def broadcast_tree(comm: Communicator, tensor: torch.Tensor, root: int = 0, *, tag: str = "bcast") -> torch.Tensor:
    """Binomial-tree broadcast in place: ⌈log₂p⌉ rounds; in each round every rank that has the data sends it on."""
    p, r = comm.world_size, comm.rank
    flat = _prepare(tensor)
    v = (r - root) % p                         # rank relative to the root
    mask = 1
    while mask < p:                            # my parent differs from me in my lowest set bit
        if v & mask:
            comm.recv(flat, (v - mask + root) % p, tag=tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:                            # my children: v + every power of two below my lowest set bit
        if v + mask < p:
            comm.send(flat, (v + mask + root) % p, tag=tag)
        mask >>= 1
    return tensor


@_releasing
def reduce_tree(comm: Communicator, tensor: torch.Tensor, root: int = 0, op: str = "sum", *,
                tag: str = "reduce") -> torch.Tensor:
    """Binomial-tree reduce in place: the root ends with the reduction; other ranks are left with partial results."""
    p, r = comm.world_size, comm.rank
    flat = _prepare(tensor, op)
    v = (r - root) % p
    with alloc_category("comm"):
        buf = torch.empty_like(flat)
    mask = 1
    while mask < p:                            # the broadcast's tree, walked from the leaves up
        if v & mask:
            comm.send(flat, (v - mask + root) % p, tag=tag)
            break
        if v + mask < p:
            comm.recv(buf, (v + mask + root) % p, tag=tag)
            _combine(flat, buf, op)
        mask <<= 1
    if r == root:
        _finish(flat, op, p)
    return tensor


@_releasing
def all_reduce_tree(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_tree") -> torch.Tensor:
    """Binomial reduce to rank 0, then binomial broadcast from it: few steps, but every step carries all S bytes."""
    _prepare(tensor, op)
    reduce_tree(comm, tensor, 0, "sum" if op == "avg" else op, tag=tag)
    broadcast_tree(comm, tensor, 0, tag=tag)
    return _finish(tensor, op, comm.world_size)


# ============================================================================ naive
@_releasing
def all_reduce_naive(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *,
                     tag: str = "ar_naive") -> torch.Tensor:
    """Gather to rank 0, reduce there, send the result back to each rank: rank 0's link carries 2(p−1)·S."""
    p, r = comm.world_size, comm.rank
    flat = _prepare(tensor, op)
    if r == 0:
        with alloc_category("comm"):
            buf = torch.empty_like(flat)
        for src in range(1, p):
            comm.recv(buf, src, tag=tag)
            _combine(flat, buf, op)
        _finish(flat, op, p)
        for dst in range(1, p):
            comm.send(flat, dst, tag=tag)
    else:
        comm.send(flat, 0, tag=tag)
        comm.recv(flat, 0, tag=tag)
    return tensor


# ============================================================================ ring
@_releasing
def reduce_scatter_ring(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "rs_ring",
                        inplace: bool = False) -> torch.Tensor:
    """Ring reduce-scatter: returns this rank's chunk (chunk `rank` of tensor_split(p)) of the reduction.

    Step s = 0..p−2: send chunk (r−s−1) mod p to the right, receive chunk (r−s−2) mod p from the left and fold it
    in; after p−1 steps chunk r has passed through every rank. inplace=True accumulates in `tensor` itself
    (returns a view of it; the other chunks are left holding partial results). inplace=False leaves `tensor`
    untouched and needs only two chunk-sized buffers, not a copy of the whole tensor.
    """
    p, r = comm.world_size, comm.rank
    flat = _prepare(tensor, op)
    chunks = flat.tensor_split(p)
    if p == 1:
        return _finish(chunks[0] if inplace else chunks[0].clone(), op, 1)
    with alloc_category("comm"):   # chunk 0 is the largest; out of place, one buffer is sent while the other fills
        bufs = [torch.empty(chunks[0].numel(), dtype=flat.dtype) for _ in range(1 if inplace else 2)]
    right, left = (r + 1) % p, (r - 1) % p
    outgoing = chunks[(r - 1) % p]
    for s in range(p - 1):
        recv_c = (r - s - 2) % p
        incoming = bufs[s % len(bufs)][:chunks[recv_c].numel()]
        comm.sendrecv(outgoing, right, incoming, left, tag=tag)
        if inplace:
            _combine(chunks[recv_c], incoming, op)
            outgoing = chunks[recv_c]
        else:
            _combine(incoming, chunks[recv_c], op)
            outgoing = incoming
    return _finish(outgoing, op, p)                       # the last chunk folded in is chunk r


@_releasing
def all_gather_ring(comm: Communicator, chunk: torch.Tensor, n: int | None = None, *, tag: str = "ag_ring",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Ring all-gather: every rank's chunk (sizes as tensor_split of n over p) → the full (n,) tensor on every rank.

    Step s = 0..p−2: send chunk (r−s) mod p to the right, receive chunk (r−s−1) mod p from the left.
    `out` (n elements, contiguous) receives the result; if `chunk` already is chunk r of `out`, nothing is copied.
    """
    p, r = comm.world_size, comm.rank
    n = chunk.numel() * p if n is None else n
    sizes = chunk_sizes(n, p)
    if chunk.numel() != sizes[r]:
        raise ValueError(f"all_gather_ring: rank {r} holds {chunk.numel()} elements but chunk {r} of n={n} over "
                         f"{p} ranks has {sizes[r]} (chunks follow torch.tensor_split)")
    if out is None:
        with alloc_category("comm"):
            out = torch.empty(n, dtype=chunk.dtype)
    if out.numel() != n or out.dtype != chunk.dtype:
        raise ValueError(f"all_gather_ring: out must hold n={n} elements of {chunk.dtype}, "
                         f"got {out.numel()} of {out.dtype}")
    chunks = _prepare(out).tensor_split(p)
    if chunks[r].data_ptr() != chunk.data_ptr():
        chunks[r].copy_(chunk.reshape(-1))
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        comm.sendrecv(chunks[(r - s) % p], right, chunks[(r - s - 1) % p], left, tag=tag)
    return out


@_releasing
def all_reduce_ring(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_ring") -> torch.Tensor:
    """Ring all-reduce in place = reduce-scatter + all-gather, each rank sending 2(p−1)/p of the buffer."""
    flat = _prepare(tensor, op)
    mine = reduce_scatter_ring(comm, flat, op, tag=tag, inplace=True)   # a view: chunk r of flat itself
    all_gather_ring(comm, mine, flat.numel(), tag=tag, out=flat)
    return tensor


def ring_message_seconds(ctx_or_comm, repeats: int, numel: int = 256, *, between=None,
                         tag: str = "ring message") -> list[float]:
    """Seconds per message of each of `repeats` ring all-reduces of `numel` float32 on every rank of the group
    (`all_reduce_ring`, 2(p − 1) messages each: each call's time ÷ its messages), after one dropped call that opens
    the connections. `between`: a function run, untimed, before each call (e.g. a forward + backward), so the
    messages follow compute as they do in a training step; without it the calls are back to back. Call it on every
    rank (`launch(ring_message_seconds, p, 20)`); one rank alone sends nothing: [].

    What a message costs inside the course's collectives: each ring step starts only when its neighbours have
    finished the previous one, so it also waits for the slowest rank, and it carries the ring's own work (the
    chunk's copy and reduction in Python). On a shared machine with as many ranks as cores the mean is several times
    the ping-pong's fastest one-way time (its α), with a long tail — longer still after compute, when each core has
    just been busy with a rank's main thread and gloo's I/O thread must wait to be scheduled. A training step pays
    the mean cost of each of its messages (the expectation of their sum), not the fastest: keep every sample."""
    comm = getattr(ctx_or_comm, "comm", ctx_or_comm)
    p = comm.world_size
    if p == 1:
        return []
    x, out = torch.zeros(numel), []
    for i in range(repeats + 1):
        if between is not None:
            between()
        t0 = time.perf_counter()
        all_reduce_ring(comm, x, "sum", tag=tag)
        comm.release()
        if i:
            out.append((time.perf_counter() - t0) / (2 * (p - 1)))
    return out


# ============================================================================ recursive halving-doubling
@_releasing
def all_reduce_rhd(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_rhd") -> torch.Tensor:
    """Rabenseifner: recursive-halving reduce-scatter then recursive-doubling all-gather over p' = 2^⌊log₂p⌋ ranks.

    The p − p' extra ranks fold in first (even rank 2i < 2(p−p') sends everything to 2i+1 and sits out) and get
    the result at the end. Latency 2·log₂p'·α instead of the ring's 2(p−1)·α; same bandwidth term when p = p'.
    """
    p, r = comm.world_size, comm.rank
    flat = _prepare(tensor, op)
    red = "sum" if op == "avg" else op
    pp = 1 << (p.bit_length() - 1)              # largest power of two <= p
    extra = p - pp
    with alloc_category("comm"):
        buf = torch.empty_like(flat)
    if r < 2 * extra:                           # fold: of each pair (2i, 2i+1) the odd one carries on
        if r % 2 == 0:
            comm.send(flat, r + 1, tag=tag)
            comm.recv(flat, r + 1, tag=tag)
            return _finish(tensor, op, p)
        comm.recv(buf, r - 1, tag=tag)
        _combine(flat, buf, red)
        v = r // 2
    else:
        v = r - extra

    def real(vr: int) -> int:                   # virtual rank -> group rank
        return 2 * vr + 1 if vr < extra else vr + extra

    b = _bounds(flat.numel(), pp)
    steps = rhd_schedule(v, pp)
    for partner, (k0, k1), (g0, g1) in steps:   # halving: give away half of what I hold, fold in the other half
        incoming = buf[:b[k1] - b[k0]]
        comm.sendrecv(flat[b[g0]:b[g1]], real(partner), incoming, real(partner), tag=tag)
        _combine(flat[b[k0]:b[k1]], incoming, red)
    for partner, (k0, k1), (g0, g1) in reversed(steps):   # doubling: swap the reduced halves back
        comm.sendrecv(flat[b[k0]:b[k1]], real(partner), flat[b[g0]:b[g1]], real(partner), tag=tag)
    if r < 2 * extra:                           # unfold: hand the result to my even partner
        comm.send(flat, r - 1, tag=tag)
    return _finish(tensor, op, p)


ALL_REDUCE = {"naive": all_reduce_naive, "ring": all_reduce_ring, "rhd": all_reduce_rhd, "tree": all_reduce_tree}


def all_reduce(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "ring",
               tag: str | None = None) -> torch.Tensor:
    """Dispatch to one of ALL_REDUCE's algorithms (or 'backend' for torch.distributed's own, nominal bytes)."""
    _prepare(tensor, op)
    if algorithm == "backend":
        return comm.all_reduce(tensor, op, tag=tag or "ar_backend")
    try:
        fn = ALL_REDUCE[algorithm]
    except KeyError:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; "
                         f"use one of {sorted(ALL_REDUCE) + ['backend']}") from None
    return fn(comm, tensor, op, tag=tag or f"ar_{algorithm}")


# ============================================================================ the ring, step by step
class ChunkTracer:
    """Stands in for a Communicator (forwards every call) and records, at each `sendrecv`, which chunk of `base`
    this rank sends and what every chunk of `base` holds at that moment; `snapshot()` adds a last state.

    Run the real algorithm through it, with `base` = 1 << rank in int64 and op='sum': a chunk's value is then the
    bit set of the ranks whose contribution it already holds (the picture of the ring step by step).
    """

    def __init__(self, comm: Communicator, base: torch.Tensor):
        self.comm, self.base, self.rank, self.world_size = comm, base, comm.rank, comm.world_size
        self.starts = _bounds(base.numel(), comm.world_size)[:-1]
        self.steps: list[dict] = []

    def _chunk_of(self, t: torch.Tensor) -> int | None:
        off = (t.data_ptr() - self.base.data_ptr()) // self.base.element_size()
        return self.starts.index(off) if off in self.starts else None   # None: sent from a scratch buffer

    def snapshot(self) -> list[int]:
        return [int(self.base[s]) for s in self.starts]

    def sendrecv(self, send_tensor, dst, recv_tensor, src, *, tag=""):
        self.steps.append({"chunk": self._chunk_of(send_tensor), "dst": dst, "src": src, "holds": self.snapshot()})
        return self.comm.sendrecv(send_tensor, dst, recv_tensor, src, tag=tag)

    def __getattr__(self, name):                # send, recv, ledger, ...: the real communicator's
        return getattr(self.comm, name)


def trace_ring_all_reduce(comm: Communicator, chunk_len: int = 1) -> dict:
    """Run all_reduce_ring through a ChunkTracer on p·chunk_len elements; return the sends and states per step."""
    p, r = comm.world_size, comm.rank
    x = torch.full((p * chunk_len,), 1 << r, dtype=torch.int64)
    tracer = ChunkTracer(comm, x)
    all_reduce_ring(tracer, x, "sum", tag="ar_ring_trace")
    return {"rank": r, "sent": [s["chunk"] for s in tracer.steps], "dst": [s["dst"] for s in tracer.steps],
            "holds": [s["holds"] for s in tracer.steps] + [tracer.snapshot()]}
