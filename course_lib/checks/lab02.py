"""Checks for Lab 02 (hierarchical all-reduce): node/rail groups, correctness on real ranks, exact bytes on the
links between nodes, and the α–β time of the three phases.

Each check runs the learner's functions on real gloo ranks (a 2 × 2 "cluster" of 4 ranks and a 3 × 2 one of 6),
compares the result with `torch.distributed.all_reduce`, and counts from the traffic ledger every byte a rank sent to
a rank on another node (rank r is on node r // gpus_per_node). The target is the closed form of the per-rail ring

    bytes rank r sends across nodes = ring_all_reduce_bytes(|shard r mod L|, N, r // L)
                                    = 2(N−1)/N · S/L      when N·L divides n      (N nodes, L ranks per node)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import costmodel
from ..dist.collectives import chunk_sizes, ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from . import NOT_IMPLEMENTED, check, run_ranks

CLUSTERS = ((2, 2), (3, 2))                 # (nodes, gpus_per_node) run on real ranks
TIMEOUT = 30                # seconds per launch: a correct run takes a few; a hang is a bug


def reference_groups(comm, gpus_per_node: int):
    """(intra, inter): this rank's node group and its rail (same local index on every node)."""
    nodes = comm.world_size // gpus_per_node
    intra = inter = None
    for node in range(nodes):
        intra = comm.new_group(range(node * gpus_per_node, (node + 1) * gpus_per_node), f"node{node}") or intra
    for local in range(gpus_per_node):
        inter = comm.new_group(range(local, comm.world_size, gpus_per_node), f"rail{local}") or inter
    return intra, inter


def inter_node_bytes_reference(n: int, nodes: int, gpus_per_node: int, rank: int, elem: int) -> int:
    local, node = rank % gpus_per_node, rank // gpus_per_node
    return ring_all_reduce_bytes(chunk_sizes(n, gpus_per_node)[local], nodes, node, elem)


def intra_node_bytes_reference(n: int, nodes: int, gpus_per_node: int, rank: int, elem: int) -> int:
    local = rank % gpus_per_node
    return ring_reduce_scatter_bytes(n, gpus_per_node, local, elem) + ring_all_gather_bytes(n, gpus_per_node, local, elem)


def hierarchical_time_reference(intra_link, inter_link, nbytes: float, nodes: int, gpus_per_node: int) -> float:
    return (costmodel.ring_reduce_scatter_time(intra_link, nbytes, gpus_per_node)
            + costmodel.ring_all_reduce_time(inter_link, nbytes / gpus_per_node, nodes)
            + costmodel.ring_all_gather_time(intra_link, nbytes, gpus_per_node))


# ----------------------------------------------------------------------------------------- running learner code
def _run(c, worker, world_size: int, *args):
    return run_ranks(c, worker, world_size, *args, timeout=TIMEOUT,
                     hang_hint="every rank must create every group, in the same order (new_group "
                               "is collective), and every send needs its matching recv")


def _groups_worker(ctx, make_groups, gpus_per_node):
    try:
        intra, inter = make_groups(ctx.comm, gpus_per_node)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    return [None if g is None else (list(g.global_ranks), g.name) for g in (intra, inter)]


def _all_reduce_worker(ctx, hier, gpus_per_node, cases):
    comm, r = ctx.comm, ctx.rank
    intra, inter = reference_groups(comm, gpus_per_node)
    where = {c.name: c.global_ranks for c in (comm, intra, inter)}
    out = []
    for seed, (n, dtype, op) in enumerate(cases):
        g = torch.Generator().manual_seed(100 * seed + r)
        x = (torch.randn(n, generator=g, dtype=torch.float64) if dtype == "float64"
             else torch.randint(-1000, 1000, (n,), generator=g))
        ref = x.clone()
        dist.all_reduce(ref, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        y = x.clone()
        comm.ledger.reset()
        try:
            hier(intra, inter, y, op)
        except NotImplementedError:
            return NOT_IMPLEMENTED
        cross = same = nominal = 0
        for e in comm.ledger.events:
            if e.nominal:
                nominal += e.sent
            elif e.sent:
                peer = where[e.group][e.peer]
                if peer // gpus_per_node != r // gpus_per_node:
                    cross += e.sent
                else:
                    same += e.sent
        out.append(dict(n=n, dtype=dtype, op=op, got=y, ref=ref, cross=cross, same=same, nominal=nominal,
                        elem=x.element_size()))
    return out


# ----------------------------------------------------------------------------------------- the checks
def check_cluster_groups(make_cluster_groups) -> None:
    """make_cluster_groups(comm, gpus_per_node) -> (intra, inter) sub-communicators, on 2×2 and 3×2 clusters."""
    with check("cluster_groups") as c:
        for nodes, gpn in CLUSTERS:
            p = nodes * gpn
            for r, res in enumerate(_run(c, _groups_worker, p, make_cluster_groups, gpn)):
                node, local = divmod(r, gpn)
                want_intra = list(range(node * gpn, (node + 1) * gpn))
                want_inter = list(range(local, p, gpn))
                c.expect(res[0] is not None and res[1] is not None,
                         f"{nodes}×{gpn}: rank {r} got None for a group it belongs to",
                         hint="comm.new_group returns None on ranks outside the group: keep the one that isn't None")
                (intra, intra_name), (inter, inter_name) = res
                c.expect(intra == want_intra, f"{nodes}×{gpn}: rank {r}'s node group holds ranks {intra}, "
                                              f"expected {want_intra}", hint="node = rank // gpus_per_node")
                c.expect(inter == want_inter, f"{nodes}×{gpn}: rank {r}'s inter-node group holds ranks {inter}, "
                                              f"expected {want_inter}",
                         hint="the inter-node group joins the ranks with the same rank % gpus_per_node (a 'rail')")
                c.expect(len({intra_name, inter_name, "world"}) == 3,
                         f"give the two groups distinct names (got {intra_name!r}, {inter_name!r})",
                         hint="the ledger records the group name with every message")
        c.passed(f"node groups and rails right on {', '.join(f'{n}×{g}' for n, g in CLUSTERS)} clusters")


def _cases(p: int):
    return [(1001, "float64", "sum"), (1001, "int64", "sum"), (257, "float64", "max"), (p - 1, "int64", "sum"),
            (24 * p, "float64", "sum")]


def check_hierarchical_all_reduce(hierarchical_all_reduce) -> None:
    """hierarchical_all_reduce(intra, inter, tensor, op) in place == torch.distributed.all_reduce, on real ranks."""
    with check("hierarchical_all_reduce") as c:
        for nodes, gpn in CLUSTERS:
            p = nodes * gpn
            results = _run(c, _all_reduce_worker, p, hierarchical_all_reduce, gpn, _cases(p))
            for r, res in enumerate(results):
                for i, case in enumerate(res):
                    what = f"{nodes}×{gpn} rank {r}, {case['dtype']} {case['op']} of n={case['n']}"
                    if case["dtype"] == "int64" or case["op"] == "max":
                        ok = torch.equal(case["got"], case["ref"])
                    else:
                        ok = torch.allclose(case["got"], case["ref"], rtol=1e-12, atol=1e-12)
                    err = (case["got"].double() - case["ref"].double()).abs().max().item() if case["n"] else 0.0
                    c.expect(ok, f"{what}: your tensor differs from torch.distributed.all_reduce by up to {err:.3g}",
                             hint="reduce-scatter inside the node (inplace=True gives chunk intra.rank of the node's "
                                  "sum), all-reduce that chunk across nodes on the inter group, then all-gather it "
                                  "inside the node into the whole tensor (out=)")
                    c.expect(torch.equal(case["got"], results[0][i]["got"]),
                             f"{what}: ranks ended with different results")
        c.passed(f"equal to torch.distributed.all_reduce on {', '.join(f'{n}×{g}' for n, g in CLUSTERS)} clusters, "
                 f"for sum and max, float64 and int64, lengths the world size does not divide")


def check_inter_node_bytes(hierarchical_all_reduce, inter_node_bytes) -> None:
    """Bytes each rank sends to other nodes, from the ledger, == the closed form == your inter_node_bytes()."""
    with check("inter_node_bytes") as c:
        figure = ""
        for nodes, gpn in CLUSTERS:
            p = nodes * gpn
            results = _run(c, _all_reduce_worker, p, hierarchical_all_reduce, gpn, _cases(p))
            for r, res in enumerate(results):
                for case in res:
                    n, elem = case["n"], case["elem"]
                    what = f"{nodes}×{gpn} rank {r}, n={n} ({case['dtype']})"
                    c.expect(case["nominal"] == 0, f"{what}: the ledger shows backend collectives",
                             hint="use collectives.reduce_scatter_ring / all_reduce_ring / all_gather_ring (built "
                                  "on send/recv, so every byte is measured), not comm.all_reduce (gloo's own)")
                    want = inter_node_bytes_reference(n, nodes, gpn, r, elem)
                    c.expect(case["cross"] == want,
                             f"{what}: sent {case['cross']:,} B to other nodes; the per-rail ring sends {want:,} B",
                             hint="only the shard this rank owns after the intra-node reduce-scatter may cross "
                                  "nodes, in a ring all-reduce over the inter group")
                    want_in = intra_node_bytes_reference(n, nodes, gpn, r, elem)
                    c.expect(case["same"] == want_in,
                             f"{what}: sent {case['same']:,} B inside the node; a ring reduce-scatter plus "
                             f"all-gather of the whole tensor sends {want_in:,} B")
                    mine = inter_node_bytes(n, nodes, gpn, r, elem)
                    c.expect(mine == want, f"{what}: your inter_node_bytes() says {mine!r}, the ledger {want:,} B",
                             hint="the shard of rank r has chunk_sizes(n, gpus_per_node)[r % gpus_per_node] "
                                  "elements; ring_all_reduce_bytes gives a ring's bytes for any length")
                    if (nodes, gpn) == CLUSTERS[0] and r == 0 and n == 24 * p:
                        S = n * elem
                        flat = max(ring_all_reduce_bytes(n, p, q, elem) for q in range(gpn - 1, p, gpn))
                        figure = (f"2×2, S = {S:,} B: each rank sends {case['cross']:,} B = 2(N−1)/N·S/L across "
                                  f"nodes; a flat ring's node-crossing ranks send {flat:,} B each")
                        c.expect(case["cross"] * nodes * gpn == 2 * (nodes - 1) * S and flat > case["cross"],
                                 f"{what}: {case['cross']:,} B is not 2(N−1)/N · S/L")
        c.passed(figure + " — exact on every rank and length")


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
