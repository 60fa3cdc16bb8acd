"""The rank mesh: the world's ranks arranged as a pp × dp × cp × tp grid, with one communicator per axis.

    mesh = Mesh(ctx.comm, dp=2, pp=2, tp=2)      # 8 ranks
    mesh["tp"].all_reduce(...)                    # only the ranks that share this rank's pp and dp coordinates
    ctx.comm.ledger.bytes_sent(group="tp")        # every axis books its traffic under its own name

Axis order, stated once: **pp outermost, then dp, then cp, tp innermost**,

    rank = ((pp_rank · dp_size + dp_rank) · cp_size + cp_rank) · tp_size + tp_rank

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

Context parallelism (`cp`, notebook 12) splits each sequence: the ranks of one cp group hold different tokens of
the same sequences, so their gradients are partial sums and are reduced together with dp's — over the `dp×cp`
group (`mesh.group("dp", "cp")`), as Megatron-LM does. Expert parallelism (`ep`, notebook 12) is a sub-axis of dp:
ep consecutive dp ranks share the experts of every MoE layer (each holds E/ep of them) and exchange tokens with an
all-to-all; the ranks holding the *same* experts form the `edp` group (dp/ep of them), over which expert gradients
are reduced (Lepikhin et al., GShard; DeepSpeed-MoE's expert data parallelism):

    dp = 4, ep = 2:   dp ranks  0 1 | 2 3        ep groups {0,1} {2,3}        edp groups {0,2} {1,3}
"""
from __future__ import annotations

import itertools

from .comm import Communicator

AXES = ("pp", "dp", "cp", "tp")        # outermost → innermost
SUB_AXES = ("ep", "edp")                # inside dp: expert parallel, and the dp ranks holding the same experts


class Mesh:
    """A pp × dp × tp grid over the ranks of `comm` (collective: every rank must build the same mesh).

    dp=None takes whatever the world size leaves: world_size // (pp · tp).
    """

    def __init__(self, comm: Communicator, *, dp: int | None = None, pp: int = 1, tp: int = 1, cp: int = 1,
                 ep: int = 1):
        world = comm.world_size
        for name, value in (("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)) + ((("dp", dp),) if dp is not None else ()):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mesh: {name} must be a positive integer, got {value!r}")
        if dp is None:
            if world % (pp * cp * tp):
                raise ValueError(f"Mesh: pp × cp × tp = {pp} × {cp} × {tp} = {pp * cp * tp} does not divide the world "
                                 f"size {world}; choose sizes whose product divides {world}")
            dp = world // (pp * cp * tp)
        if pp * dp * cp * tp != world:
            raise ValueError(f"Mesh: pp × dp × cp × tp = {pp} × {dp} × {cp} × {tp} = {pp * dp * cp * tp}, but there "
                             f"are {world} ranks; the product of the axis sizes must equal the world size")
        if dp % ep:
            raise ValueError(f"Mesh: ep={ep} must divide dp={dp} (expert parallelism spreads the experts over ep of "
                             f"the dp ranks); use ep in {[k for k in range(1, dp + 1) if dp % k == 0]}")
        self.world = comm
        self.sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        self.sub_sizes = {"ep": ep, "edp": dp // ep}
        self.rank = comm.rank
        self.coords = dict(zip(AXES, self.coords_of(comm.rank)))
        self._comms = {}
        for axis in AXES + SUB_AXES:    # the same order on every rank: new_group is collective
            same = [a for a in self._comms if self.groups(a) == self.groups(axis)]
            self._comms[axis] = (self._comms[same[0]].renamed(axis) if same      # edp = dp when ep = 1: no new group
                                 else self._make(axis, self.groups(axis)))
        self._products = {}

    def _make(self, name: str, groups: list) -> Communicator:
        """This rank's communicator over its group in `groups` (a partition of the world), named `name`."""
        size, world = len(groups[0]), self.world.world_size
        if size == 1:
            return Communicator(name=name, ledger=self.world.ledger, solo=True)
        if size == world:
            return self.world.renamed(name)
        mine = None
        for ranks in groups:
            sub = self.world.new_group(ranks, name=name)
            mine = sub if sub is not None else mine
        return mine

    # ------------------------------------------------------------------ coordinates
    def rank_of(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The world rank at grid coordinates (pp, dp, cp, tp)."""
        for axis, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= v < self.sizes[axis]:
                raise ValueError(f"Mesh: {axis}={v} is outside 0..{self.sizes[axis] - 1}")
        return ((pp * self.sizes["dp"] + dp) * self.sizes["cp"] + cp) * self.sizes["tp"] + tp

    def coords_of(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp) coordinates of a world rank."""
        out = []
        for axis in reversed(AXES):
            rank, c = divmod(rank, self.sizes[axis])
            out.append(c)
        return tuple(reversed(out))

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (or sub-axis 'ep' / 'edp' of dp), as sorted lists of world ranks, in a fixed
        order."""
        if axis in SUB_AXES:
            ep = self.sub_sizes["ep"]
            members = ([list(range(g * ep, (g + 1) * ep)) for g in range(self.sizes["dp"] // ep)] if axis == "ep"
                       else [list(range(i, self.sizes["dp"], ep)) for i in range(ep)])
            return [[r for d in dps for r in [self.rank_of(**{**c, "dp": d})]] for c in self._fixed("dp")
                    for dps in members]
        self._check_axis(axis)
        return [[self.rank_of(**{**c, axis: i}) for i in range(self.sizes[axis])] for c in self._fixed(axis)]

    def _fixed(self, *axes):
        """Every assignment of coordinates to the axes other than `axes`, in a fixed order."""
        others = [a for a in AXES if a not in axes]
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            yield dict(zip(others, fixed))

    def group(self, *axes: str) -> Communicator:
        """A communicator over the product of several axes (e.g. `group("dp", "cp")`, over which context-parallel
        gradients are reduced); made on first use, collectively — every rank must ask for it in the same order."""
        for a in axes:
            self._check_axis(a)
        if len(axes) == 1:
            return self[axes[0]]
        key = tuple(a for a in AXES if a in axes)
        if key not in self._products:
            groups = [sorted(self.rank_of(**{**c, **dict(zip(key, v))})
                             for v in itertools.product(*(range(self.sizes[a]) for a in key)))
                      for c in self._fixed(*key)]
            # dp × cp with cp = 1 IS the dp group (its traffic stays 'dp'); with dp = 1 it has cp's ranks but
            # carries other traffic (the gradients), so it keeps its own name in the ledger — on cp's process group
            name = "×".join(key)
            same = [a for a in AXES if self.groups(a) == groups]
            if all(self.sizes[a] == 1 for a in key[1:]):
                self._products[key] = self._comms[key[0]]
            elif same:
                self._products[key] = self._comms[same[0]].renamed(name)    # the same ranks: no new group
            else:
                self._products[key] = self._make(name, groups)
        return self._products[key]

    def partition_group(self, name: str, groups: list) -> Communicator:
        """A communicator over this rank's group in `groups` (a partition of the world that is no product of axes,
        e.g. expert parallelism's edp × cp), made on first use under `name`, collectively — every rank asks for it
        in the same order. A partition equal to an axis's reuses that axis's process group."""
        if name not in self._products:
            groups = [sorted(g) for g in groups]
            same = [a for a in AXES + SUB_AXES if sorted(map(sorted, self.groups(a))) == sorted(groups)]
            self._products[name] = (self._comms[same[0]].renamed(name) if same
                                    else self._make(name, sorted(groups)))
        return self._products[name]

    def group_of(self, axis: str, rank: int | None = None) -> list[int]:
        """The world ranks in `rank`'s group along `axis` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in self.groups(axis) if rank in g)

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise KeyError(f"Mesh has axes {AXES} (and dp's sub-axes {SUB_AXES}), not {axis!r}")

    # ------------------------------------------------------------------ communicators
    def __getitem__(self, axis: str) -> Communicator:
        """This rank's communicator along `axis` (its ranks are the group's ranks 0..size−1, in grid order)."""
        if axis not in SUB_AXES:
            self._check_axis(axis)
        return self._comms[axis]

    def size(self, axis: str) -> int:
        if axis in SUB_AXES:
            return self.sub_sizes[axis]
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
    def cp_rank(self) -> int:
        return self.coords["cp"]

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
        sizes = " × ".join(f"{a}={self.sizes[a]}" for a in AXES) + (f" (ep={self.sub_sizes['ep']})"
                                                                    if self.sub_sizes["ep"] > 1 else "")
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"Mesh({sizes}; rank {self.rank} at {coords})"


def axis_comm(mesh_or_comm, axis: str = "dp") -> Communicator:
    """The communicator of `axis` from a Mesh, or a Communicator used as it is (a 1-D mesh)."""
    if isinstance(mesh_or_comm, Mesh):
        return mesh_or_comm[axis]
    if isinstance(mesh_or_comm, Communicator):
        return mesh_or_comm
    raise TypeError(f"expected a course_lib.distributed.mesh.Mesh or a Communicator (ctx.comm inside launch), got "
                    f"{type(mesh_or_comm).__name__}")


def data_parallel_batches(mesh_or_comm, seq_len: int, global_batch_size: int, *, accum_steps: int = 1,
                          seed: int = 0, split: str = "train"):
    """This rank's share of each global batch of `global_batch_size` sequences, split over the dp ranks (the one
    batch splitter of the course: every technique, lab check and test gets its data here)."""
    from ..core.data import ShardedBatches
    comm = axis_comm(mesh_or_comm, "dp")
    n = comm.world_size * accum_steps
    if global_batch_size % n:
        raise ValueError(f"global batch {global_batch_size} does not split evenly over {comm.world_size} dp rank(s) × "
                         f"{accum_steps} micro-step(s); use a multiple of {n}")
    dp_rank = mesh_or_comm.dp_rank if isinstance(mesh_or_comm, Mesh) else comm.rank
    return ShardedBatches(seq_len, global_batch_size // n, comm.world_size, dp_rank, accum_steps, seed=seed,
                          split=split)


__all__ = ["Mesh", "AXES", "SUB_AXES", "axis_comm", "data_parallel_batches"]
