"""What each collective of `course_lib.distributed.collectives` sends, rank by rank and exactly, in closed form; and the
chunk layout and recursive-halving schedule the algorithms and these formulas share (one source for both).

Every formula counts the bytes rank `rank` SENDS for n elements of `elem` bytes over p ranks, with chunks as
`torch.tensor_split` makes them (the first n mod p one element longer): e.g. the ring all-reduce sends n less one
chunk, twice — 2(p−1)/p · n·elem when p divides n (docs/formulas.md §1.1). Tests and notebooks assert that the
ledger measures exactly these numbers.
"""
from __future__ import annotations


def chunk_sizes(n: int, p: int) -> list[int]:
    """Element counts of `torch.tensor_split(range(n), p)`: the first n mod p chunks get one extra element."""
    base, extra = divmod(n, p)
    return [base + (1 if i < extra else 0) for i in range(p)]


def _bounds(n: int, p: int) -> list[int]:
    """Start offsets of the p chunks, plus n at the end."""
    out = [0]
    for size in chunk_sizes(n, p):
        out.append(out[-1] + size)
    return out


def rhd_schedule(v: int, pp: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Recursive halving for virtual rank v of pp (a power of two): per step (partner, kept blocks, given blocks).

    Blocks are the pp chunks of tensor_split; after the last step v keeps block v alone. The doubling phase
    walks the same steps backwards, sending what was kept and receiving what was given.
    """
    steps, lo, hi, mask = [], 0, pp, pp >> 1
    while mask:
        partner, mid = v ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
        steps.append((partner, keep, give))
        lo, hi = keep
        mask >>= 1
    return steps


# ============================================================================ closed forms (bytes this rank SENDS)
def ring_reduce_scatter_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return 0 if p == 1 else (n - chunk_sizes(n, p)[rank]) * elem


def ring_all_gather_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return 0 if p == 1 else (n - chunk_sizes(n, p)[(rank + 1) % p]) * elem


def ring_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    """2(p−1)/p · n·elem when p divides n; in general n less one chunk, twice."""
    return ring_reduce_scatter_bytes(n, p, rank, elem) + ring_all_gather_bytes(n, p, rank, elem)


def naive_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return (p - 1) * n * elem if rank == 0 else n * elem


def tree_broadcast_bytes(n: int, p: int, rank: int, elem: int, root: int = 0) -> int:
    """n·elem per child in the binomial tree: v + 2^k for every 2^k below v's lowest set bit (all of them for v=0)."""
    v = (rank - root) % p
    low = v & -v or p
    return sum(1 for k in range(p.bit_length()) if (1 << k) < low and v + (1 << k) < p) * n * elem


def tree_reduce_bytes(n: int, p: int, rank: int, elem: int, root: int = 0) -> int:
    return 0 if rank == root else n * elem


def tree_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    return tree_reduce_bytes(n, p, rank, elem) + tree_broadcast_bytes(n, p, rank, elem)


def rhd_all_reduce_bytes(n: int, p: int, rank: int, elem: int) -> int:
    """Folded (even, < 2(p−p')) ranks send S; the core sends what it gives while halving and what it keeps while
    doubling (2(p'−1)/p'·S when p' divides n), plus S for the odd ranks that hand the result back."""
    pp = 1 << (p.bit_length() - 1)
    extra = p - pp
    if rank < 2 * extra and rank % 2 == 0:
        return n * elem
    v = rank // 2 if rank < 2 * extra else rank - extra
    b = _bounds(n, pp)
    core = sum(b[g1] - b[g0] + b[k1] - b[k0] for _, (k0, k1), (g0, g1) in rhd_schedule(v, pp))
    return (core + (n if rank < 2 * extra else 0)) * elem


ALL_REDUCE_BYTES = {"naive": naive_all_reduce_bytes, "ring": ring_all_reduce_bytes, "rhd": rhd_all_reduce_bytes,
                    "tree": tree_all_reduce_bytes}


def all_reduce_steps(algorithm: str, p: int) -> int:
    """Messages one after another on the critical path (each costs α): what the α–β model charges for latency."""
    if p == 1:
        return 0
    pp = 1 << (p.bit_length() - 1)
    return {"ring": 2 * (p - 1), "naive": 2 * (p - 1), "tree": 2 * (p - 1).bit_length(),
            "rhd": 2 * (pp.bit_length() - 1) + (2 if pp < p else 0)}[algorithm]
