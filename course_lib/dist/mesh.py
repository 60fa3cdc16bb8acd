"""The rank mesh: the world's ranks arranged as a pp × dp × tp grid, with one communicator per axis.

    mesh = Mesh(ctx.comm, dp=2, pp=2, tp=2)      # 8 ranks
    mesh["tp"].all_reduce(...)                    # only the ranks that share this rank's pp and dp coordinates
    ctx.comm.ledger.bytes_sent(group="tp")        # every axis books its traffic under its own name

Axis order, stated once: **pp outermost, then dp, tp innermost**,

    rank = (pp_rank · dp_size + dp_rank) · tp_size + tp_rank

so the ranks of one tensor-parallel group are neighbours (on a real cluster: GPUs of one node, joined by NVLink —
tensor parallelism talks in every layer, forward and backward, and needs the fastest link), data-parallel groups
stride over them (one gradient reduction per step, overlappable), and pipeline stages are farthest apart (only
activations cross a stage boundary, point to point). This is Megatron-LM's and torchtitan's order
(Narayanan et al., SC'21 §3; torchtitan's `ParallelDims`), and picotron's grid.

    8 ranks, pp=2 × dp=2 × tp=2:

             dp 0        dp 1
    pp 0   [ 0   1 ]   [ 2   3 ]        tp groups:  {0,1} {2,3} {4,5} {6,7}
    pp 1   [ 4   5 ]   [ 6   7 ]        dp groups:  {0,2} {1,3} {4,6} {5,7}
                                        pp groups:  {0,4} {1,5} {2,6} {3,7}

An axis of size 1 costs nothing: its communicator is a group of one (no process group is created and every
collective returns at once). An axis that spans the whole world reuses the world's process group under its own name.
The mesh is passed explicitly to whatever needs it (never a global), and data is split by **dp** rank only: the
ranks of one tp or pp group see the same micro-batches.
"""
from __future__ import annotations

import itertools

from .comm import Communicator

AXES = ("pp", "dp", "tp")        # outermost → innermost


class Mesh:
    """A pp × dp × tp grid over the ranks of `comm` (collective: every rank must build the same mesh).

    dp=None takes whatever the world size leaves: world_size // (pp · tp).
    """

    def __init__(self, comm: Communicator, *, dp: int | None = None, pp: int = 1, tp: int = 1):
        world = comm.world_size
        for name, value in (("pp", pp), ("tp", tp)) + ((("dp", dp),) if dp is not None else ()):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mesh: {name} must be a positive integer, got {value!r}")
        if dp is None:
            if world % (pp * tp):
                raise ValueError(f"Mesh: pp × tp = {pp} × {tp} = {pp * tp} does not divide the world size {world}; "
                                 f"choose pp and tp whose product divides {world}")
            dp = world // (pp * tp)
        if pp * dp * tp != world:
            raise ValueError(f"Mesh: pp × dp × tp = {pp} × {dp} × {tp} = {pp * dp * tp}, but there are {world} ranks; "
                             f"the product of the axis sizes must equal the world size")
        self.world = comm
        self.sizes = {"pp": pp, "dp": dp, "tp": tp}
        self.rank = comm.rank
        self.coords = dict(zip(AXES, self.coords_of(comm.rank)))
        self._comms = {}
        for axis in AXES:               # the same order on every rank: new_group is collective
            size = self.sizes[axis]
            if size == 1:
                self._comms[axis] = Communicator(name=axis, ledger=comm.ledger, solo=True)
            elif size == world:
                self._comms[axis] = comm.renamed(axis)
            else:
                mine = None
                for ranks in self.groups(axis):
                    sub = comm.new_group(ranks, name=axis)
                    mine = sub if sub is not None else mine
                self._comms[axis] = mine

    # ------------------------------------------------------------------ coordinates
    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The world rank at grid coordinates (pp, dp, tp)."""
        for axis, v in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= v < self.sizes[axis]:
                raise ValueError(f"Mesh: {axis}={v} is outside 0..{self.sizes[axis] - 1}")
        return (pp * self.sizes["dp"] + dp) * self.sizes["tp"] + tp

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a world rank."""
        tp = self.sizes["tp"]
        dp = self.sizes["dp"]
        return rank // (dp * tp), (rank // tp) % dp, rank % tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as sorted lists of world ranks, in a fixed order."""
        self._check_axis(axis)
        others = [a for a in AXES if a != axis]
        out = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, fixed))
            out.append([self.rank_of(**{**coords, axis: i}) for i in range(self.sizes[axis])])
        return out

    def group_of(self, axis: str, rank: int | None = None) -> list[int]:
        """The world ranks in `rank`'s group along `axis` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in self.groups(axis) if rank in g)

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise KeyError(f"Mesh has axes {AXES}, not {axis!r}")

    # ------------------------------------------------------------------ communicators
    def __getitem__(self, axis: str) -> Communicator:
        """This rank's communicator along `axis` (its ranks are the group's ranks 0..size−1, in grid order)."""
        self._check_axis(axis)
        return self._comms[axis]

    def size(self, axis: str) -> int:
        self._check_axis(axis)
        return self.sizes[axis]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def ledger(self):
        return self.world.ledger

    def batches(self, seq_len: int, micro_batch_size: int, *, accum_steps: int = 1, seed: int = 0,
                split: str = "train"):
        """This rank's share of every global batch of dp_size × accum_steps micro-batches of `micro_batch_size`
        sequences: split by dp rank only (tp and pp peers get the same data). `data_parallel_batches` with the
        global batch instead."""
        return data_parallel_batches(self, seq_len, micro_batch_size * self.sizes["dp"] * accum_steps,
                                     accum_steps=accum_steps, seed=seed, split=split)

    def __repr__(self) -> str:
        sizes = " × ".join(f"{a}={self.sizes[a]}" for a in AXES)
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"Mesh({sizes}; rank {self.rank} at {coords})"


def axis_comm(mesh_or_comm, axis: str = "dp") -> Communicator:
    """The communicator of `axis` from a Mesh, or a Communicator used as it is (a 1-D mesh)."""
    if isinstance(mesh_or_comm, Mesh):
        return mesh_or_comm[axis]
    if isinstance(mesh_or_comm, Communicator):
        return mesh_or_comm
    raise TypeError(f"expected a course_lib.dist.mesh.Mesh or a Communicator (ctx.comm inside launch), got "
                    f"{type(mesh_or_comm).__name__}")


def data_parallel_batches(mesh_or_comm, seq_len: int, global_batch_size: int, *, accum_steps: int = 1,
                          seed: int = 0, split: str = "train"):
    """This rank's share of each global batch of `global_batch_size` sequences, split over the dp ranks (the one
    batch splitter of the course: every technique, lab check and test gets its data here)."""
    from ..data import ShardedBatches
    comm = axis_comm(mesh_or_comm, "dp")
    n = comm.world_size * accum_steps
    if global_batch_size % n:
        raise ValueError(f"global batch {global_batch_size} does not split evenly over {comm.world_size} dp rank(s) × "
                         f"{accum_steps} micro-step(s); use a multiple of {n}")
    dp_rank = mesh_or_comm.dp_rank if isinstance(mesh_or_comm, Mesh) else comm.rank
    return ShardedBatches(seq_len, global_batch_size // n, comm.world_size, dp_rank, accum_steps, seed=seed,
                          split=split)


__all__ = ["Mesh", "AXES", "axis_comm", "data_parallel_batches"]
