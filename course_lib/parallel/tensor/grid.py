"""Tensor parallelism beyond 1D: matrix multiplication on 2D (SUMMA / Optimus), 2.5D (Tesseract) and 3D rank grids,
from the broadcast/reduce trees and ring all-gather/reduce-scatter of `course_lib.distributed.collectives`, and a linear
layer Y = X·W (no bias) on each, forward and backward.

    2D, q×q (van de Geijn & Watts, SUMMA, 1997; Xu et al., Optimus, arXiv 2104.05343): rank (i, j) holds block
        (i, j) of X, W and Y. Forward, for k = 0…q−1: broadcast X_ik along row i, W_kj down column j, add X_ik·W_kj.
        Backward: dX = dY·Wᵀ (broadcast W down columns, reduce partial products along rows) and dW = Xᵀ·dY
        (broadcast X along rows, reduce down columns).
    2.5D, q×q×d (Wang et al., Tesseract, ICPP 2022, arXiv 2105.14500): d layers of a q×q grid; layer l runs 2D on
        its own rows of X (R/d of them) with the same W, and the d partial dW are all-reduced across layers.
    3D, q×q×q (Agarwal et al. 1995; Bian et al., arXiv 2105.14450): rank (i, j, k) holds a 1/q slice of X's block
        (i, k), of W's block (k, j) and of Y's block (i, j). Forward: all-gather X_ik along j, W_kj along i, multiply,
        reduce-scatter along k. Backward: all-gather dY_ij along k, reduce-scatter dX along j and dW along i.

Exact bytes each rank sends (e bytes per element; X is R×K, W is K×N, Y is R×N), derived from the collectives:
    1D  (P ranks)   f's all-reduce of dX in backward:   ring_all_reduce_bytes(R·K, P)  = 2(P−1)/P · RK·e
    2D  (q²)        3 SUMMAs × 2 operands: over the q steps of one SUMMA each rank is the root of one row (column)
                    broadcast, and a binomial tree's ranks together send one message per non-root, so each rank
                    sends q−1 blocks per operand (a reduce: every non-root sends its block once per step, q−1 in all):
                                                        3(q−1)·(RK + KN)/q² · e
    2.5D (q²d)      the same on R/d rows, plus the ring all-reduce of dW's block across the d layers:
                                                        3(q−1)·(RK/d + KN)/q² · e + ring_all_reduce_bytes(KN/q², d)
    3D  (q³)        6 ring collectives, each sending (q−1)/q of a block of 1/q² of its matrix:
                                                        2(q−1)·(RK + KN + RN)/q³ · e
Colossal-AI's efficiency table (docs/formulas.md §4.4) gives O(2(P−1)/P), O(6(q−1)/q), O(3(q−1)(d+1)/(dq)),
O(6(q−1)/q³); with R = K = N (S = RK elements) ours are exactly 1D's and 3D's times S·e, and 2D's and 2.5D's
times S·e/q (plus 2.5D's depth all-reduce, which the table leaves out) — `colossal_bandwidth`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ...distributed.collectives import (
    all_gather_ring,
    all_reduce_ring,
    broadcast_tree,
    reduce_scatter_ring,
    reduce_tree,
    ring_all_reduce_bytes,
)
from ...distributed.mesh import Mesh
from .megatron import f

KINDS = ("1D", "2D", "2.5D", "3D")


# ============================================================================================ grids
@dataclass
class Grid:
    """A rank grid over the whole world: `kind`, side q, depth d, this rank's coordinates and one communicator
    per axis (on the world's ledger, traffic booked under the axis name)."""
    kind: str
    q: int
    d: int
    coords: dict
    comms: dict = field(repr=False)

    def __getitem__(self, axis: str):
        return self.comms[axis]

    def divisors(self, role: str) -> tuple[int, int]:
        """What the rows and the columns of a matrix in `role` must be multiples of, to split evenly here."""
        q, d = self.q, self.d
        return {"1D": {"input": (1, 1), "weight": (1, q), "output": (1, q)},
                "2D": {"input": (q, q), "weight": (q, q), "output": (q, q)},
                "2.5D": {"input": (d * q, q), "weight": (q, q), "output": (d * q, q)},
                "3D": {"input": (q * q, q), "weight": (q * q, q), "output": (q * q, q)}}[self.kind][role]

    def layout(self, role: str, shape) -> tuple[slice, slice]:
        """The rows and columns of a full matrix of `shape` this rank holds as `role` ('input' X, 'weight' W,
        'output' Y). Raises if the matrix does not split evenly on this grid."""
        rows, cols = shape
        for what, n, m in (("rows", rows, self.divisors(role)[0]), ("columns", cols, self.divisors(role)[1])):
            if n % m:
                raise ValueError(f"{self.kind} on this grid splits the {what} of the {role} ({n}) into {m} equal "
                                 f"parts; use a multiple of {m} (X is tokens × in_features, W in × out_features)")
        q, c = self.q, self.coords
        if self.kind == "1D":                        # X whole; W and Y split by columns
            if role == "input":
                return slice(0, rows), slice(0, cols)
            n = cols // q
            return slice(0, rows), slice(c["p"] * n, (c["p"] + 1) * n)
        if self.kind in ("2D", "2.5D"):              # block (i, j); X and Y: row block l·q + i of d·q
            rq = rows // self.divisors(role)[0]
            r0 = ((0 if role == "weight" else c["l"]) * q + c["i"]) * rq
            return slice(r0, r0 + rq), slice(c["j"] * cols // q, (c["j"] + 1) * cols // q)
        a, b, s = {"input": ("i", "k", "j"), "weight": ("k", "j", "i"), "output": ("i", "j", "k")}[role]
        rb, cb = rows // q, cols // q                # 3D: block (a, b), then slice s of its rows
        r0 = c[a] * rb + c[s] * rb // q
        return slice(r0, r0 + rb // q), slice(c[b] * cb, (c[b] + 1) * cb)

    def piece(self, full: torch.Tensor, role: str) -> torch.Tensor:
        rows, cols = self.layout(role, full.shape)
        return full[rows, cols]


def _isqrt_exact(n: int) -> int | None:
    r = math.isqrt(n)
    return r if r * r == n else None


def grid_shape(kind: str, world_size: int, *, depth: int = 1) -> tuple[int, int]:
    """(q, d) of the grid of `kind` on `world_size` ranks; one clear error if they do not form one."""
    P = world_size
    if kind not in KINDS:
        raise ValueError(f"unknown grid {kind!r}; use one of {KINDS}")
    if kind == "1D":
        return P, 1
    if kind == "2D":
        if _isqrt_exact(P) is None:
            raise ValueError(f"2D tensor parallelism needs a square number of ranks (q×q: 4, 9, 16, …); got {P}. "
                             f"Launch 4 or 9 ranks, or use 2.5D (q×q×depth ranks)")
        return _isqrt_exact(P), 1
    if kind == "2.5D":
        if not isinstance(depth, int) or depth < 1 or P % depth or _isqrt_exact(P // depth) is None:
            raise ValueError(f"2.5D tensor parallelism needs q×q×depth ranks; {P} ranks with depth={depth!r} is not "
                             f"a square times the depth (e.g. 8 ranks: q=2, depth=2)")
        return _isqrt_exact(P // depth), depth
    q = round(P ** (1 / 3))
    if q ** 3 != P:
        raise ValueError(f"3D tensor parallelism needs a cube number of ranks (q×q×q: 8, 27, …); got {P}")
    return q, 1


def grid_of(kind: str, world_size: int, rank: int, *, depth: int = 1) -> Grid:
    """Rank `rank`'s place on the grid, without communicators (what `layout` needs: for pictures and checks).
    Ranks are numbered with the last coordinate fastest: 2D (i, j), 2.5D (l, i, j), 3D (i, j, k)."""
    q, d = grid_shape(kind, world_size, depth=depth)
    if kind == "1D":
        coords = {"p": rank}
    elif kind == "3D":
        coords = {"i": rank // (q * q), "j": rank // q % q, "k": rank % q}
    else:
        coords = {"l": rank // (q * q), "i": rank // q % q, "j": rank % q}
    return Grid(kind, q, d, coords, {})


def make_grid(comm, kind: str, *, depth: int = 1) -> Grid:
    """The grid of `kind` over every rank of `comm` (the world: every rank must call this, with the same
    arguments), with one communicator per axis. Raises before any group is made if the ranks do not form it."""
    grid = grid_of(kind, comm.world_size, comm.rank, depth=depth)
    q, d = grid.q, grid.d
    if kind == "1D":
        grid.comms = {"p": comm}
    elif kind == "3D":                               # the mesh's (pp, dp, tp) are the grid's (i, j, k)
        mesh = Mesh(comm, pp=q, dp=q, tp=q)
        grid.comms = {"i": mesh["pp"].renamed("i"), "j": mesh["dp"].renamed("j"), "k": mesh["tp"].renamed("k")}
    else:                                            # (pp, dp, tp) are (l, i, j): rows, columns, depth
        mesh = Mesh(comm, pp=d, dp=q, tp=q)
        grid.comms = {"row": mesh["tp"].renamed("row"), "col": mesh["dp"].renamed("col"),
                      "depth": mesh["pp"].renamed("depth")}
    return grid


# ============================================================================================ SUMMA (2D, 2.5D)
def _bcast(comm, block, root, tag):
    """The block at group rank `root`, on every rank of comm (a binomial tree: notebook 02's broadcast_tree)."""
    buf = block if comm.rank == root else torch.empty_like(block)
    return broadcast_tree(comm, buf, root, tag=tag)


def summa(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str = "summa") -> torch.Tensor:
    """C = A·B on a q×q layer: C_ij = Σ_k A_ik·B_kj, with A_ik broadcast along row i and B_kj down column j."""
    a, b = a.contiguous(), b.contiguous()                         # the roots send them as they are
    c = a.new_zeros(a.shape[0], b.shape[1])
    for k in range(grid.q):
        c += _bcast(grid["row"], a, k, tag) @ _bcast(grid["col"], b, k, tag)     # (R/q, K/q) @ (K/q, N/q)
    return c


def bcast_reduce(grid: Grid, block, along: str, product, across: str, mine: str, tag: str) -> torch.Tensor:
    """For l = 0…q−1: broadcast `block` from group rank l `along` one axis, form product(received), and reduce the
    products `across` the other axis to group rank l. Returns the sum this rank is the root of (coordinate `mine`)."""
    out = None
    for l in range(grid.q):
        partial = product(_bcast(grid[along], block.contiguous(), l, tag))
        reduce_tree(grid[across], partial, l, tag=tag)
        out = partial if grid.coords[mine] == l else out
    return out


def summa_abt(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str = "summa_abt") -> torch.Tensor:
    """C = A·Bᵀ: for l = 0…q−1, B_lj goes down column j, each rank forms A_ij·B_ljᵀ and row i reduces the sum to
    rank (i, l), which owns C_il."""
    return bcast_reduce(grid, b, "col", lambda b_lj: a @ b_lj.T, "row", "j", tag)   # (R/q, N/q) @ (N/q, K/q)


def summa_atb(grid: Grid, a: torch.Tensor, b: torch.Tensor, tag: str = "summa_atb") -> torch.Tensor:
    """C = Aᵀ·B: for l = 0…q−1, A_il goes along row i, each rank forms A_ilᵀ·B_ij and column j reduces the sum to
    rank (l, j), which owns C_lj."""
    return bcast_reduce(grid, a, "row", lambda a_il: a_il.T @ b, "col", "i", tag)   # (K/q, R/q) @ (R/q, N/q)


class Summa(torch.autograd.Function):
    """Y = X·W by SUMMA on this rank's layer; backward by the A·Bᵀ and Aᵀ·B forms, then (2.5D) the dW blocks of
    the d layers are summed across the depth axis. Saves only this rank's blocks of X and W."""

    @staticmethod
    def forward(ctx, x, w, grid):
        ctx.grid = grid
        ctx.save_for_backward(x, w)
        return summa(grid, x, w, "fwd")

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        grid = ctx.grid
        dx = summa_abt(grid, dy, w, "bwd_dx")                     # dX = dY·Wᵀ
        dw = summa_atb(grid, x, dy, "bwd_dw")                     # dW = Xᵀ·dY, this layer's rows only
        all_reduce_ring(grid["depth"], dw, tag="bwd_dw_depth")    # Σ over the d layers (2D: a group of one)
        return dx, dw, None


# ============================================================================================ 3D
def _gather_rows(comm, piece, tag):
    """Every rank's row slice of a block along `comm`, stacked in rank order (allocated here, not as a comm
    buffer: the result is kept for backward, so the memory accountant must see it as an activation)."""
    out = piece.new_empty(piece.shape[0] * comm.world_size, *piece.shape[1:])
    all_gather_ring(comm, piece.contiguous().view(-1), out=out.view(-1), tag=tag)
    return out


def _scatter_rows(comm, block, tag):
    """The sum of `block` over comm, this rank keeping its 1/q slice of the rows."""
    out = reduce_scatter_ring(comm, block.contiguous().view(-1), tag=tag)
    return out.view(block.shape[0] // comm.world_size, *block.shape[1:])


class Cube(torch.autograd.Function):
    """Y = X·W on a q×q×q grid (3D): gather the blocks X_ik (along j) and W_kj (along i), multiply, reduce-scatter
    along k. Saves the gathered blocks (as Colossal-AI's `_Linear3D` does), so backward needs no second gather."""

    @staticmethod
    def forward(ctx, x, w, grid):
        ctx.grid = grid
        a = _gather_rows(grid["j"], x, "fwd_x")                   # X_ik  (R/q, K/q)
        b = _gather_rows(grid["i"], w, "fwd_w")                   # W_kj  (K/q, N/q)
        ctx.save_for_backward(a, b)
        return _scatter_rows(grid["k"], a @ b, "fwd_y")           # (R/q², N/q): slice k of Y_ij

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        grid = ctx.grid
        dy = _gather_rows(grid["k"], dy, "bwd_dy")                 # dY_ij (R/q, N/q)
        dx = _scatter_rows(grid["j"], dy @ b.T, "bwd_dx")         # Σ_j dY_ij·W_kjᵀ → slice j of dX_ik
        dw = _scatter_rows(grid["i"], a.T @ dy, "bwd_dw")         # Σ_i X_ikᵀ·dY_ij → slice i of dW_kj
        return dx, dw, None


# ============================================================================================ the layer
class GridLinear(nn.Module):
    """Y = X·W (nn.Linear without bias: W = linear.weight.T, K×N) with X, W and Y split over `grid` as
    `grid.layout` says. Every rank builds it from the same nn.Linear and keeps its piece of W."""

    def __init__(self, linear: nn.Linear, grid: Grid):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("GridLinear implements Y = X·W; pass nn.Linear(..., bias=False)")
        K, N = linear.in_features, linear.out_features
        self.grid, self.in_features, self.out_features = grid, K, N
        self.weight = nn.Parameter(grid.piece(linear.weight.detach().T, "weight").contiguous().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.grid.kind
        if kind == "1D":                                          # Megatron's column-parallel linear
            return f.apply(x, self.grid["p"], "f") @ self.weight
        return (Cube if kind == "3D" else Summa).apply(x.contiguous(), self.weight, self.grid)


# ============================================================================================ closed forms
def grid_bytes(kind: str, R: int, K: int, N: int, *, q: int, d: int = 1, rank: int = 0, elem: int = 4) -> int:
    """Bytes one rank sends for one forward + backward of GridLinear (exact; see the module docstring). For 1D,
    q is the number of ranks P and `rank` matters only when P does not divide R·K; for 2.5D, `rank` is the rank in
    its depth group (its layer l)."""
    if kind == "1D":
        return ring_all_reduce_bytes(R * K, q, rank, elem)
    if kind in ("2D", "2.5D"):
        return (3 * (q - 1) * (R * K // d + K * N) // q ** 2) * elem + \
            ring_all_reduce_bytes(K * N // q ** 2, d, rank, elem)
    if kind == "3D":
        return 2 * (q - 1) * (R * K + K * N + R * N) // q ** 3 * elem
    raise ValueError(f"unknown grid {kind!r}; use one of {KINDS}")


def grid_memory(kind: str, R: int, K: int, N: int, *, q: int, d: int = 1, elem: int = 4) -> dict:
    """Bytes per rank of GridLinear: its piece of W ('parameters') and what forward saves for backward
    ('activations'): 1D the whole X; 2D and 2.5D this rank's block of X; 3D the gathered blocks of X and W."""
    params = {"1D": K * N // q, "2D": K * N // q ** 2, "2.5D": K * N // q ** 2, "3D": K * N // q ** 3}[kind]
    saved = {"1D": R * K, "2D": R * K // q ** 2, "2.5D": R * K // (d * q ** 2),
             "3D": (R * K + K * N) // q ** 2}[kind]
    return {"parameters": params * elem, "activations": saved * elem}


COLOSSAL_BANDWIDTH = {"1D": "2(P−1)/P", "2D": "6(q−1)/q", "2.5D": "3(q−1)(d+1)/(dq)", "3D": "6(q−1)/q³"}


def colossal_bandwidth(kind: str, *, q: int, d: int = 1) -> float:
    """The Colossal-AI table's bandwidth form (docs/formulas.md §4.4) at this grid (for 1D, q = P)."""
    return {"1D": 2 * (q - 1) / q, "2D": 6 * (q - 1) / q, "2.5D": 3 * (q - 1) * (d + 1) / (d * q),
            "3D": 6 * (q - 1) / q ** 3}[kind]


__all__ = ["Grid", "make_grid", "grid_of", "grid_shape", "summa", "summa_abt", "summa_atb", "GridLinear", "grid_bytes",
           "grid_memory", "colossal_bandwidth", "COLOSSAL_BANDWIDTH", "KINDS"]
