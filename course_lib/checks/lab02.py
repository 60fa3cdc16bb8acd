"""Checks for Lab 02 (hierarchical all-reduce on a rank mesh): the nodes × GPUs mesh, correctness on real ranks,
exact bytes per mesh axis from the ledger, and the α–β time of the three phases.

The cluster is a `Mesh(comm, dp=N, tp=L)`: the L GPUs of a node are a tp group (tp is the innermost axis, so they are
consecutive ranks) and GPU l of every node forms a dp group, a rail. Each check runs the learner's functions on real
gloo ranks (a 2 × 2 "cluster" of 4 ranks and a 3 × 2 one of 6), compares the result with
`torch.distributed.all_reduce`, and reads from the shared ledger what each rank sent on each axis
(`ledger.bytes_sent(group="tp")`, `group="dp"`). The targets are the ring closed forms (docs/formulas.md §1.1):

    tp (inside the node)  = ring_reduce_scatter_bytes(n, L, l) + ring_all_gather_bytes(n, L, l)  = 2(L−1)/L · S
    dp (across nodes)     = ring_all_reduce_bytes(|shard l|, N, k)                               = 2(N−1)/N · S/L

for the rank at node k, local index l (the right-hand sides when L and N·L divide n).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..core import costmodel
from ..distributed import collectives
from ..distributed.collectives import (
    chunk_sizes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)
from ..distributed.mesh import Mesh
from . import NOT_IMPLEMENTED, check, run_ranks

CLUSTERS = ((2, 2), (3, 2))                 # (nodes, gpus_per_node) run on real ranks
TIMEOUT = 30                # seconds per launch: a correct run takes a few; a hang is a bug
AXIS_HINT = ("the reduce-scatter and the all-gather belong inside the node, on mesh['tp']; only this rank's shard "
             "crosses nodes, in a ring all-reduce on mesh['dp']")


def reference_mesh(comm, gpus_per_node: int) -> Mesh:
    """The nodes × GPUs grid: a node's GPUs on the (innermost) tp axis, the nodes on dp."""
    return Mesh(comm, tp=gpus_per_node)


def axis_bytes_reference(n: int, nodes: int, gpus_per_node: int, rank: int, elem: int) -> dict:
    """{'tp': bytes `rank` sends inside its node, 'dp': bytes it sends to other nodes}, hierarchical all-reduce."""
    local, node = rank % gpus_per_node, rank // gpus_per_node
    return {"tp": ring_reduce_scatter_bytes(n, gpus_per_node, local, elem)
            + ring_all_gather_bytes(n, gpus_per_node, local, elem),
            "dp": ring_all_reduce_bytes(chunk_sizes(n, gpus_per_node)[local], nodes, node, elem)}


def hierarchical_time_reference(intra_link, inter_link, nbytes: float, nodes: int, gpus_per_node: int) -> float:
    return (costmodel.ring_reduce_scatter_time(intra_link, nbytes, gpus_per_node)
            + costmodel.ring_all_reduce_time(inter_link, nbytes / gpus_per_node, nodes)
            + costmodel.ring_all_gather_time(intra_link, nbytes, gpus_per_node))


# ----------------------------------------------------------------------------------------- running learner code
def _run(c, worker, world_size: int, *args):
    return run_ranks(c, worker, world_size, *args, timeout=TIMEOUT,
                     hang_hint="every rank must build the same mesh and call the same collectives on the same "
                               "axes, in the same order; every send needs its matching recv")


def _mesh_worker(ctx, make_mesh, gpus_per_node):
    try:
        mesh = make_mesh(ctx.comm, gpus_per_node)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    if not isinstance(mesh, Mesh):
        return {"type": type(mesh).__name__}
    return {"type": "Mesh", "sizes": dict(mesh.sizes), "tp": mesh.group_of("tp"), "dp": mesh.group_of("dp")}


def _all_reduce_worker(ctx, hier, gpus_per_node, cases):
    comm, r = ctx.comm, ctx.rank
    mesh = reference_mesh(comm, gpus_per_node)
    out = []
    for seed, (n, dtype, op) in enumerate(cases):
        g = torch.Generator().manual_seed(100 * seed + r)
        x = (torch.randn(n, generator=g, dtype=torch.float64) if dtype == "float64"
             else torch.randint(-1000, 1000, (n,), generator=g))
        ref = x.clone()
        dist.all_reduce(ref, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        node_only = collectives.all_reduce_ring(mesh["tp"], x.clone(), op)   # what skipping the dp phase gives
        y = x.clone()
        comm.ledger.reset()
        try:
            hier(mesh, y, op)
        except NotImplementedError:
            return NOT_IMPLEMENTED
        L = comm.ledger
        out.append(dict(n=n, dtype=dtype, op=op, got=y, ref=ref, node_only=node_only,
                        shard=mesh.tp_rank, tp=L.bytes_sent(group="tp"), dp=L.bytes_sent(group="dp"),
                        world=L.bytes_sent(group="world"), nominal=sum(e.sent for e in L.events if e.nominal),
                        elem=x.element_size()))
    return out


_RUNS: dict = {}     # (hierarchical_all_reduce, nodes, gpus_per_node) -> results: two checks read one run


def _all_reduce_runs(c, hier, nodes: int, gpn: int):
    key = (hier, nodes, gpn)
    if key not in _RUNS:
        for old in [k for k in _RUNS if k[0] is not hier]:     # keep only the latest function's runs
            del _RUNS[old]
        p = nodes * gpn
        _RUNS[key] = _run(c, _all_reduce_worker, p, hier, gpn, _cases(p))
    return _RUNS[key]


def _cases(p: int):
    return [(1001, "float64", "sum"), (1001, "int64", "sum"), (257, "float64", "max"), (p - 1, "int64", "sum"),
            (24 * p, "float64", "sum")]


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- the checks
def check_cluster_mesh(cluster_mesh) -> None:
    """cluster_mesh(comm, gpus_per_node) -> Mesh with the node on tp and the rails on dp, on 2×2 and 3×2 clusters."""
    with check("cluster_mesh") as c:
        for nodes, gpn in CLUSTERS:
            p = nodes * gpn
            for r, res in enumerate(_run(c, _mesh_worker, p, cluster_mesh, gpn)):
                c.expect(res["type"] == "Mesh", f"{nodes}×{gpn}: cluster_mesh returned a {res['type']}, not a Mesh",
                         hint="return course_lib.distributed.mesh.Mesh(comm, …): it builds every group for you")
                node, local = divmod(r, gpn)
                want_tp, want_dp = list(range(node * gpn, (node + 1) * gpn)), list(range(local, p, gpn))
                c.expect(res["sizes"]["pp"] == 1, f"{nodes}×{gpn}: your mesh has pp = {res['sizes']['pp']}",
                         hint="a cluster of nodes × GPUs needs two axes only: leave pp at 1")
                swapped = (res["sizes"]["tp"], res["sizes"]["dp"]) == (nodes, gpn) and gpn != nodes
                c.expect(res["tp"] == want_tp,
                         f"{nodes}×{gpn}: rank {r}'s mesh['tp'] holds ranks {res['tp']}, but its node holds {want_tp}",
                         hint=("dp and tp are swapped: tp is the innermost axis (consecutive ranks), so the "
                               f"{gpn} GPUs of a node must be the tp axis — Mesh(comm, tp=gpus_per_node)")
                         if swapped else "tp is the innermost axis: Mesh(comm, tp=gpus_per_node) puts each node's "
                                         "consecutive ranks in one tp group, and dp takes what is left: the nodes")
                c.expect(res["dp"] == want_dp,
                         f"{nodes}×{gpn}: rank {r}'s mesh['dp'] holds ranks {res['dp']}, but its rail is {want_dp}",
                         hint="the rail joins the ranks with the same rank % gpus_per_node: the dp axis")
        c.passed(f"mesh['tp'] = the node, mesh['dp'] = the rail, on {', '.join(f'{n}×{g}' for n, g in CLUSTERS)} "
                 f"clusters")


def check_hierarchical_all_reduce(hierarchical_all_reduce) -> None:
    """hierarchical_all_reduce(mesh, tensor, op) in place == torch.distributed.all_reduce, on real ranks."""
    with check("hierarchical_all_reduce") as c:
        for nodes, gpn in CLUSTERS:
            results = _all_reduce_runs(c, hierarchical_all_reduce, nodes, gpn)
            for r, res in enumerate(results):
                for i, case in enumerate(res):
                    what = f"{nodes}×{gpn} rank {r}, {case['dtype']} {case['op']} of n={case['n']}"
                    exact = case["dtype"] == "int64" or case["op"] == "max"
                    got, ref = case["got"], case["ref"]
                    if not _same(got, ref, exact):
                        err = (got.double() - ref.double()).abs().max().item() if case["n"] else 0.0
                        shard_ok = _same(got.tensor_split(gpn)[case["shard"]], ref.tensor_split(gpn)[case["shard"]],
                                         exact)
                        if _same(got, case["node_only"], exact) and nodes > 1:
                            hint = ("your result is the reduction over this node only: between the reduce-scatter "
                                    "and the all-gather, all-reduce the shard across nodes on mesh['dp']")
                        elif shard_ok:
                            hint = ("only this rank's own shard is right: all-gather it on mesh['tp'] into the whole "
                                    "tensor (all_gather_ring(mesh['tp'], shard, n, out=flat))")
                        else:
                            hint = ("reduce-scatter inside the node (inplace=True gives chunk tp_rank of the node's "
                                    "reduction), all-reduce that chunk across nodes on mesh['dp'], then all-gather "
                                    "it inside the node into the whole tensor (out=)")
                        c.expect(False, f"{what}: your tensor differs from torch.distributed.all_reduce by up to "
                                        f"{err:.3g}", hint=hint)
                    c.expect(torch.equal(got, results[0][i]["got"]), f"{what}: ranks ended with different results",
                             hint="every rank must end with the same tensor: all-gather the full result everywhere")
        c.passed(f"equal to torch.distributed.all_reduce on {', '.join(f'{n}×{g}' for n, g in CLUSTERS)} clusters, "
                 f"for sum and max, float64 and int64, lengths the world size does not divide")


def check_axis_bytes(hierarchical_all_reduce, axis_bytes) -> None:
    """Bytes each rank sent on each mesh axis (ledger, per group) == the closed forms == your axis_bytes()."""
    with check("axis_bytes") as c:
        figure = ""
        for nodes, gpn in CLUSTERS:
            p = nodes * gpn
            for r, res in enumerate(_all_reduce_runs(c, hierarchical_all_reduce, nodes, gpn)):
                for case in res:
                    n, elem = case["n"], case["elem"]
                    what = f"{nodes}×{gpn} rank {r}, n={n} ({case['dtype']})"
                    c.expect(case["nominal"] == 0, f"{what}: the ledger shows backend collectives",
                             hint="use collectives.reduce_scatter_ring / all_reduce_ring / all_gather_ring (built "
                                  "on send/recv, so every byte is measured), not mesh[...].all_reduce (gloo's own)")
                    c.expect(case["world"] == 0, f"{what}: {case['world']:,} B went over the world communicator, "
                                                 f"not a mesh axis", hint=AXIS_HINT)
                    want = axis_bytes_reference(n, nodes, gpn, r, elem)
                    c.expect((case["tp"], case["dp"]) == (want["tp"], want["dp"]),
                             f"{what}: sent {case['tp']:,} B on tp and {case['dp']:,} B on dp (ledger); the "
                             f"hierarchical all-reduce sends {want['tp']:,} B inside the node and {want['dp']:,} B "
                             f"across nodes", hint=AXIS_HINT)
                    mine = axis_bytes(n, nodes, gpn, r, elem)
                    c.expect(isinstance(mine, dict) and set(mine) == {"tp", "dp"},
                             f"{what}: your axis_bytes() returned {mine!r}", hint="return {'tp': …, 'dp': …}")
                    c.expect(mine["tp"] == want["tp"],
                             f"{what}: your axis_bytes()['tp'] says {mine['tp']!r}, the ledger {want['tp']:,} B",
                             hint="inside the node: ring_reduce_scatter_bytes + ring_all_gather_bytes of all n "
                                  "elements over gpus_per_node ranks, as rank rank % gpus_per_node")
                    c.expect(mine["dp"] == want["dp"],
                             f"{what}: your axis_bytes()['dp'] says {mine['dp']!r}, the ledger {want['dp']:,} B",
                             hint="across nodes: ring_all_reduce_bytes of the shard, chunk_sizes(n, gpus_per_node)"
                                  "[rank % gpus_per_node] elements (not n / gpus_per_node: chunks differ by one), "
                                  "over the nodes, as rank rank // gpus_per_node")
                    if (nodes, gpn) == CLUSTERS[0] and r == 0 and n == 24 * p:
                        S = n * elem
                        flat = max(ring_all_reduce_bytes(n, p, q, elem) for q in range(gpn - 1, p, gpn))
                        c.expect(case["dp"] * nodes * gpn == 2 * (nodes - 1) * S
                                 and case["tp"] * gpn == 2 * (gpn - 1) * S and flat > case["dp"],
                                 f"{what}: {case['dp']:,} B is not 2(N−1)/N · S/L")
                        figure = (f"2×2, S = {S:,} B: each rank sends {case['dp']:,} B = 2(N−1)/N·S/L across nodes "
                                  f"(dp) and {case['tp']:,} B = 2(L−1)/L·S inside its node (tp); a flat ring's "
                                  f"node-crossing ranks send {flat:,} B each")
        c.passed(figure + " — exact on every rank, axis and length")


def check_hierarchical_time(hierarchical_time) -> None:
    """hierarchical_time(intra_link, inter_link, nbytes, nodes, gpus_per_node) == the sum of the three ring phases."""
    with check("hierarchical_time") as c:
        nv, ib = costmodel.get_link("NVLink 4"), costmodel.get_link("InfiniBand NDR")
        for nodes, gpn, S in ((2, 2, 1e6), (16, 8, 2**30), (4, 8, 1024), (8, 1, 1e8), (1, 8, 1e8)):
            got, want = hierarchical_time(nv, ib, S, nodes, gpn), hierarchical_time_reference(nv, ib, S, nodes, gpn)
            c.expect(isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9),
                     f"{nodes} nodes × {gpn}, S = {S:g} B: you modeled {got!r} s, the three ring phases take "
                     f"{want:.6g} s",
                     hint="reduce-scatter of S inside the node + ring all-reduce of S/L across N nodes + all-gather "
                          "of S inside the node; costmodel has each phase")
        flat = costmodel.ring_all_reduce_time(ib, 2**30, 128)
        c.passed(f"modeled 16 nodes × 8 GPUs, 1 GiB: {hierarchical_time(nv, ib, 2**30, 16, 8) * 1e3:.2f} ms "
                 f"vs {flat * 1e3:.2f} ms for one flat ring over InfiniBand (modeled)")
