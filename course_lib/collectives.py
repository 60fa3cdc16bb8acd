"""Collectives built only from the ledger's point-to-point primitives (send / recv / isend / irecv).

Algorithms (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005; ring all-reduce as in Baidu's allreduce and NCCL):

    broadcast_tree      binomial tree from `root`                         root sends ⌈log₂p⌉·S, others ≤ that
    reduce_tree         binomial tree to `root` (the reverse)
    all_reduce_naive    everyone sends to rank 0, rank 0 reduces and sends the result to everyone
                        rank 0 sends and receives (p−1)·S; the others S each way
    reduce_scatter_ring p−1 steps, each rank passes one chunk right     sends S − |own chunk|
    all_gather_ring     p−1 steps                                        sends S − |chunk (r+1) mod p|
    all_reduce_ring     reduce-scatter + all-gather                      2(p−1)/p·S when p divides S   (FACTS §1)
    all_reduce_rhd      recursive halving (RS) + recursive doubling (AG) (Rabenseifner); non-powers of two fold the
                        extra ranks in first                             2(p'−1)/p'·S, p' = 2^⌊log₂p⌋
    all_reduce_tree     binomial reduce to 0 + binomial broadcast from 0 latency-friendly: 2⌈log₂p⌉ steps

Every function works for any world size and any length (chunks follow `torch.tensor_split`: the first n mod p
chunks are one element longer). Byte counts are measured by the ledger (point-to-point entries) and predicted,
rank by rank, by the `*_bytes` functions below; tests and notebooks assert the two are equal.
"""
from __future__ import annotations

import math

import torch

from .comm import Communicator
from .memory import alloc_category

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    elif op == "product":
        acc.mul_(other)
    else:
        raise ValueError(f"unknown reduction {op!r}; use one of {REDUCE_OPS}")


def _finish(t: torch.Tensor, op: str, p: int) -> torch.Tensor:
    if op == "avg":
        if not t.is_floating_point():
            raise ValueError("op='avg' needs a floating-point tensor")
        t.div_(p)
    return t


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("collectives work in place on contiguous tensors; call .contiguous() first")
    return t.view(-1)


def chunk_sizes(n: int, p: int) -> list[int]:
    """Element counts of `torch.tensor_split(range(n), p)`: the first n mod p chunks get one extra element."""
    base, extra = divmod(n, p)
    return [base + (1 if i < extra else 0) for i in range(p)]


# ============================================================================ trees
def broadcast_tree(comm: Communicator, tensor: torch.Tensor, root: int = 0, *, tag: str = "bcast") -> torch.Tensor:
    """Binomial-tree broadcast in place: ⌈log₂p⌉ rounds; in round k every rank that has the data sends it on."""
    p, r = comm.world_size, comm.rank
    flat = _flat(tensor)
    v = (r - root) % p                         # rank relative to the root
    mask = 1
    while mask < p:                            # find my parent: the lowest set bit of v
        if v & mask:
            comm.recv(flat, (v - mask + root) % p, tag=tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:                            # send to children v + mask for every mask below my lowest bit
        if v + mask < p:
            comm.send(flat, (v + mask + root) % p, tag=tag)
        mask >>= 1
    return tensor


def reduce_tree(comm: Communicator, tensor: torch.Tensor, root: int = 0, op: str = "sum", *,
                tag: str = "reduce") -> torch.Tensor:
    """Binomial-tree reduce in place: the root ends with the reduction; other ranks' tensors hold partial sums."""
    p, r = comm.world_size, comm.rank
    flat = _flat(tensor)
    v = (r - root) % p
    with alloc_category("comm"):
        buf = torch.empty_like(flat)
    mask = 1
    while mask < p:
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


def binomial_children(v: int, p: int) -> int:
    """How many ranks rank v (relative to the root) sends to in a binomial-tree broadcast over p ranks."""
    low = v & -v if v else 1 << max(0, math.ceil(math.log2(p)) if p > 1 else 0)
    return sum(1 for k in range(64) if (1 << k) < low and v + (1 << k) < p)


def all_reduce_tree(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_tree") -> torch.Tensor:
    reduce_tree(comm, tensor, 0, "sum" if op == "avg" else op, tag=tag)
    broadcast_tree(comm, tensor, 0, tag=tag)
    return _finish(tensor, op, comm.world_size)


# ============================================================================ naive
def all_reduce_naive(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_naive") -> torch.Tensor:
    """Gather to rank 0, reduce there, send the result back to each rank: rank 0's link carries 2(p−1)·S."""
    p, r = comm.world_size, comm.rank
    flat = _flat(tensor)
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
def reduce_scatter_ring(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "rs_ring",
                        inplace: bool = False) -> torch.Tensor:
    """Ring reduce-scatter: returns this rank's chunk (chunk `rank` of tensor_split(p)) of the reduction.

    Step s = 0..p−2: send chunk (r−s−1) mod p to the right, receive chunk (r−s−2) mod p from the left and fold it
    in. After p−1 steps chunk r has passed through every rank. With inplace=False the input is left untouched.
    """
    p, r = comm.world_size, comm.rank
    with alloc_category("comm"):
        flat = _flat(tensor) if inplace else _flat(tensor).clone()
        chunks = flat.tensor_split(p)
        buf = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_c, recv_c = (r - s - 1) % p, (r - s - 2) % p
        incoming = buf[:chunks[recv_c].numel()]
        comm.sendrecv(chunks[send_c], right, incoming, left, tag=tag)
        _combine(chunks[recv_c], incoming, op)
    return _finish(chunks[r], op, p)


def all_gather_ring(comm: Communicator, chunk: torch.Tensor, n: int | None = None, *, tag: str = "ag_ring",
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Ring all-gather: every rank's chunk (sizes as tensor_split of n over p) → the full (n,) tensor on every rank.

    Step s = 0..p−2: send chunk (r−s) mod p to the right, receive chunk (r−s−1) mod p from the left.
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
    flat = _flat(out)
    chunks = flat.tensor_split(p)
    if chunks[r].data_ptr() != chunk.data_ptr():
        chunks[r].copy_(chunk.reshape(-1))
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        comm.sendrecv(chunks[(r - s) % p], right, chunks[(r - s - 1) % p], left, tag=tag)
    return out


def all_reduce_ring(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_ring") -> torch.Tensor:
    """Ring all-reduce in place = reduce-scatter + all-gather, each rank sending 2(p−1)/p of the buffer."""
    if comm.world_size == 1:
        return _finish(tensor, op, 1)
    flat = _flat(tensor)
    mine = reduce_scatter_ring(comm, flat, op, tag=tag, inplace=True)   # lands in chunk r of flat itself
    all_gather_ring(comm, mine, flat.numel(), tag=tag, out=flat)
    return tensor


# ============================================================================ recursive halving-doubling
def all_reduce_rhd(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, tag: str = "ar_rhd") -> torch.Tensor:
    """Rabenseifner: recursive-halving reduce-scatter then recursive-doubling all-gather over p' = 2^⌊log₂p⌋ ranks.

    The r = p − p' extra ranks fold in first (even rank 2i < 2r sends everything to 2i+1 and sits out) and get the
    result at the end. Latency 2·log₂p'·α instead of the ring's 2(p−1)·α, same bandwidth term.
    """
    p, r = comm.world_size, comm.rank
    flat = _flat(tensor)
    red = "sum" if op == "avg" else op
    pp = 1 << (p.bit_length() - 1)              # largest power of two <= p
    extra = p - pp
    with alloc_category("comm"):
        buf = torch.empty_like(flat)
    # fold: ranks 0..2·extra−1 pair up; the odd one of each pair carries on
    if r < 2 * extra:
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

    bounds = [0]
    for size in chunk_sizes(flat.numel(), pp):
        bounds.append(bounds[-1] + size)
    lo, hi = 0, pp                              # the block range [lo, hi) this rank is still responsible for
    steps = []
    mask = pp >> 1
    while mask:                                 # recursive halving: keep the half containing my own block
        partner = v ^ mask
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
        k0, k1, g0, g1 = bounds[keep[0]], bounds[keep[1]], bounds[give[0]], bounds[give[1]]
        incoming = buf[:k1 - k0]
        comm.sendrecv(flat[g0:g1], real(partner), incoming, real(partner), tag=tag)
        _combine(flat[k0:k1], incoming, red)
        steps.append((partner, keep, give))
        lo, hi = keep
        mask >>= 1
    for partner, keep, give in reversed(steps):  # recursive doubling: swap halves back
        k0, k1, g0, g1 = bounds[keep[0]], bounds[keep[1]], bounds[give[0]], bounds[give[1]]
        comm.sendrecv(flat[k0:k1], real(partner), flat[g0:g1], real(partner), tag=tag)
    if r < 2 * extra:                            # unfold: hand the result to my even partner
        comm.send(flat, r - 1, tag=tag)
    return _finish(tensor, op, p)


ALL_REDUCE = {"naive": all_reduce_naive, "ring": all_reduce_ring, "rhd": all_reduce_rhd, "tree": all_reduce_tree}


def all_reduce(comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "ring",
               tag: str | None = None) -> torch.Tensor:
    """Dispatch to one of ALL_REDUCE's algorithms (or 'backend' for torch.distributed's own, nominal bytes)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; use one of {REDUCE_OPS}")
    if algorithm == "backend":
        return comm.all_reduce(tensor, op, tag=tag or "ar_backend")
    try:
        fn = ALL_REDUCE[algorithm]
    except KeyError:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use one of {sorted(ALL_REDUCE) + ['backend']}") from None
    return fn(comm, tensor, op, tag=tag or f"ar_{algorithm}")


# ============================================================================ closed forms (bytes this rank SENDS)
def ring_reduce_scatter_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return 0 if p == 1 else (n - chunk_sizes(n, p)[rank]) * elem


def ring_all_gather_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return 0 if p == 1 else (n - chunk_sizes(n, p)[(rank + 1) % p]) * elem


def ring_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    """2(p−1)/p · n·elem when p divides n; in general n·elem counted twice less one chunk each time."""
    return ring_reduce_scatter_bytes(n, p, rank, elem) + ring_all_gather_bytes(n, p, rank, elem)


def naive_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return (p - 1) * n * elem if rank == 0 else n * elem


def tree_broadcast_bytes(n: int, p: int, rank: int, elem: int, root: int = 0) -> int:
    return binomial_children((rank - root) % p, p) * n * elem


def tree_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return (n * elem if rank != 0 else 0) + tree_broadcast_bytes(n, p, rank, elem)


def rhd_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    """Exact when p' = 2^⌊log₂p⌋ divides n: 2(p'−1)/p'·S for ranks in the power-of-two core, S for folded ranks."""
    pp = 1 << (p.bit_length() - 1)
    extra = p - pp
    if rank < 2 * extra and rank % 2 == 0:
        return n * elem
    core = 2 * (pp - 1) * n * elem // pp
    return core + (n * elem if rank < 2 * extra else 0)


ALL_REDUCE_BYTES = {"naive": naive_all_reduce_bytes, "ring": ring_all_reduce_bytes, "rhd": rhd_all_reduce_bytes,
                    "tree": tree_all_reduce_bytes}
