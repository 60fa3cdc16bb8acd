"""course_lib.distributed.collectives on real gloo ranks: every algorithm against torch.distributed's own collectives,
and every rank's ledger bytes against the exact closed forms (docs/formulas.md §1); and Lab 02's checks, which must
name the real cause of plausible wrong answers.

One launch per world size runs every case (algorithms × dtypes × ops × lengths, lengths not divisible by the world
size included) and returns plain results; the tests below only read them, so the file stays fast.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import collectives as C
from course_lib.distributed.launch import launch

pytestmark = pytest.mark.integration

WORLD_SIZES = (2, 3, 4, 5)
LENGTHS = (3, 13, 60)              # 3 < p for p = 4, 5 (empty chunks); 13 divisible by none; 60 by every p here
DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)
OPS = ("sum", "max", "avg")
TORCH_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}


def _input(n: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """Small integers for int64 and bfloat16 (sums of ≤ 5 of them are exact in bf16, whatever the order), normals
    for float32/64 (where a different summation order changes the last bits)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype in (torch.int64, torch.bfloat16):
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _torch_all_reduce(x: torch.Tensor, op: str, p: int) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref, TORCH_OP[op])
    return ref.div_(p) if op == "avg" else ref


def _cases():
    for n in LENGTHS:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                yield n, dtype, op


def _worker(ctx):
    comm, p, r = ctx.comm, ctx.world_size, ctx.rank
    L = comm.ledger
    out = {"all_reduce": [], "reduce_scatter": [], "all_gather": [], "broadcast": [], "reduce": [], "errors": {}}
    for seed, (n, dtype, op) in enumerate(_cases()):
        x = _input(n, dtype, r, seed)
        ref = _torch_all_reduce(x, op, p)
        elem = x.element_size()
        for algorithm in C.ALL_REDUCE:
            y = x.clone()
            L.reset()
            C.all_reduce(comm, y, op, algorithm=algorithm, tag="t")
            out["all_reduce"].append(dict(n=n, dtype=str(dtype), op=op, algorithm=algorithm, got=y, ref=ref,
                                          sent=L.bytes_sent(tag="t"), recv=L.bytes_recv(tag="t"),
                                          want=C.ALL_REDUCE_BYTES[algorithm](n, p, r, elem)))
        # reduce-scatter: torch's list form accepts uneven chunks
        ref_rs = torch.empty(C.chunk_sizes(n, p)[r], dtype=dtype)
        dist.reduce_scatter(ref_rs, [c.clone() for c in x.tensor_split(p)], TORCH_OP[op])
        if op == "avg":
            ref_rs.div_(p)
        for inplace in (False, True):
            y = x.clone()
            L.reset()
            mine = C.reduce_scatter_ring(comm, y, op, tag="t", inplace=inplace)
            out["reduce_scatter"].append(dict(n=n, dtype=str(dtype), op=op, inplace=inplace, got=mine.clone(),
                                              ref=ref_rs, input_untouched=bool(torch.equal(y, x)),
                                              is_view_of_input=mine.numel() > 0 and
                                              mine.data_ptr() == y.tensor_split(p)[r].data_ptr(),
                                              sent=L.bytes_sent(tag="t"),
                                              want=C.ring_reduce_scatter_bytes(n, p, r, elem)))
        # all-gather: gloo's all_gather needs equal sizes, so pad every chunk to the largest and cut afterwards
        if op == "sum":
            sizes = C.chunk_sizes(n, p)
            chunk = x.tensor_split(p)[r].clone()
            padded = torch.zeros(sizes[0], dtype=dtype)
            padded[:sizes[r]] = chunk
            parts = [torch.empty(sizes[0], dtype=dtype) for _ in range(p)]
            dist.all_gather(parts, padded)
            ref_ag = torch.cat([parts[i][:sizes[i]] for i in range(p)])
            L.reset()
            got = C.all_gather_ring(comm, chunk, n, tag="t")
            out["all_gather"].append(dict(n=n, dtype=str(dtype), got=got, ref=ref_ag, sent=L.bytes_sent(tag="t"),
                                          want=C.ring_all_gather_bytes(n, p, r, elem)))
            for root in range(p):
                ref_b = x.clone()
                dist.broadcast(ref_b, root)
                y = x.clone()
                L.reset()
                C.broadcast_tree(comm, y, root, tag="t")
                out["broadcast"].append(dict(n=n, dtype=str(dtype), root=root, got=y, ref=ref_b,
                                             sent=L.bytes_sent(tag="t"),
                                             want=C.tree_broadcast_bytes(n, p, r, elem, root)))
        root = seed % p
        ref_red = x.clone()
        dist.reduce(ref_red, root, TORCH_OP[op])
        if op == "avg":
            ref_red.div_(p)
        y = x.clone()
        L.reset()
        C.reduce_tree(comm, y, root, op, tag="t")
        out["reduce"].append(dict(n=n, dtype=str(dtype), op=op, root=root, got=y if r == root else None,
                                  ref=ref_red if r == root else None, sent=L.bytes_sent(tag="t"),
                                  want=C.tree_reduce_bytes(n, p, r, elem, root)))

    # bad input: every rank makes the same mistake, so each raises before any message moves
    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    base = torch.zeros(4 * p, 3)
    L.reset()
    out["errors"]["non_contiguous"] = error(lambda: C.all_reduce_ring(comm, base.t()))
    out["errors"]["wrong_chunk"] = error(lambda: C.all_gather_ring(comm, torch.zeros(7), 4 * p + 1))
    out["errors"]["wrong_out"] = error(lambda: C.all_gather_ring(comm, torch.zeros(2), 2 * p, out=torch.zeros(3)))
    out["errors"]["avg_int"] = error(lambda: C.all_reduce(comm, torch.zeros(4, dtype=torch.int64), "avg"))
    out["errors"]["unknown_op"] = error(lambda: C.all_reduce(comm, torch.zeros(4), "mean"))
    out["errors"]["unknown_algorithm"] = error(lambda: C.all_reduce(comm, torch.zeros(4), algorithm="butterfly"))
    out["messages_during_errors"] = len(L.events)

    out["trace"] = C.trace_ring_all_reduce(comm, chunk_len=2)
    comm.barrier()          # nothing may still be in flight when the next case (or the test) starts
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"p{p}")
def ranks(request):
    p = request.param
    return p, launch(_worker, p, timeout=180)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: str) -> bool:
    if dtype in ("torch.int64", "torch.bfloat16"):      # integer-valued inputs: exact in any order
        return torch.equal(got, ref)
    rtol = {"torch.float32": 1e-5, "torch.float64": 1e-12}[dtype]
    return torch.allclose(got, ref, rtol=rtol, atol=rtol)


def test_every_all_reduce_algorithm_matches_torch_distributed(ranks):
    p, res = ranks
    for r, out in enumerate(res):
        for c in out["all_reduce"]:
            assert _close(c["got"], c["ref"], c["dtype"]), \
                f"p={p} rank {r} {c['algorithm']} {c['op']} {c['dtype']} n={c['n']}: {c['got']} vs torch {c['ref']}"


def test_every_rank_ends_with_bitwise_the_same_all_reduce_result(ranks):
    p, res = ranks
    for i, c0 in enumerate(res[0]["all_reduce"]):
        for r in range(1, p):
            assert torch.equal(res[r]["all_reduce"][i]["got"], c0["got"]), \
                f"p={p}: rank {r} differs from rank 0 in {c0['algorithm']} {c0['op']} {c0['dtype']} n={c0['n']}"


def test_all_reduce_bytes_per_rank_equal_the_closed_forms_exactly(ranks):
    p, res = ranks
    for r, out in enumerate(res):
        for c in out["all_reduce"]:
            assert c["sent"] == c["want"], f"p={p} rank {r} {c['algorithm']} n={c['n']} {c['dtype']}: " \
                                           f"ledger {c['sent']} B, closed form {c['want']} B"


def test_every_all_reduce_algorithm_moves_2_p_minus_1_S_in_total(ranks):
    p, res = ranks
    for i, c0 in enumerate(res[0]["all_reduce"]):
        S = c0["n"] * c0["ref"].element_size()
        sent = sum(res[r]["all_reduce"][i]["sent"] for r in range(p))
        recv = sum(res[r]["all_reduce"][i]["recv"] for r in range(p))
        assert sent == recv == 2 * (p - 1) * S, f"p={p} {c0['algorithm']} n={c0['n']}: {sent} sent, {recv} received"


def test_ring_all_reduce_sends_2_p_minus_1_over_p_S_when_p_divides_n(ranks):
    p, res = ranks
    checked = 0
    for out in res:
        for c in out["all_reduce"]:
            if c["algorithm"] == "ring" and c["n"] % p == 0:
                S = c["n"] * c["ref"].element_size()
                assert c["sent"] * p == 2 * (p - 1) * S, f"p={p} n={c['n']}: {c['sent']} B"
                checked += 1
    assert checked > 0, f"no length in LENGTHS is divisible by p={p}: the formula was not checked"


def test_reduce_scatter_ring_matches_torch_and_respects_inplace(ranks):
    p, res = ranks
    for r, out in enumerate(res):
        for c in out["reduce_scatter"]:
            where = f"p={p} rank {r} {c['op']} {c['dtype']} n={c['n']} inplace={c['inplace']}"
            assert _close(c["got"], c["ref"], c["dtype"]), f"{where}: {c['got']} vs torch {c['ref']}"
            assert c["sent"] == c["want"], f"{where}: ledger {c['sent']} B, closed form {c['want']} B"
            if c["inplace"]:
                assert c["is_view_of_input"] or c["got"].numel() == 0, where
            else:
                assert c["input_untouched"], f"{where}: inplace=False changed the input"


def test_all_gather_ring_matches_torch_for_uneven_chunks(ranks):
    p, res = ranks
    for r, out in enumerate(res):
        for c in out["all_gather"]:
            assert torch.equal(c["got"], c["ref"]), f"p={p} rank {r} n={c['n']} {c['dtype']}"
            assert c["sent"] == c["want"], f"p={p} rank {r} n={c['n']}: ledger {c['sent']} B vs {c['want']} B"


def test_tree_broadcast_and_reduce_match_torch_from_every_root(ranks):
    p, res = ranks
    for r, out in enumerate(res):
        for c in out["broadcast"]:
            assert torch.equal(c["got"], c["ref"]), f"p={p} rank {r} root {c['root']} n={c['n']}"
            assert c["sent"] == c["want"], f"p={p} rank {r} root {c['root']}: {c['sent']} B vs {c['want']} B"
        for c in out["reduce"]:
            if c["got"] is not None:
                assert _close(c["got"], c["ref"], c["dtype"]), f"p={p} root {r} {c['op']} {c['dtype']} n={c['n']}"
            assert c["sent"] == c["want"], f"p={p} rank {r} root {c['root']}: {c['sent']} B vs {c['want']} B"
    S_roots = {}
    for out in res:                          # the binomial root sends ⌈log₂p⌉·S, and the tree sends (p−1)·S in all
        for c in out["broadcast"]:
            S_roots.setdefault((c["n"], c["dtype"], c["root"]), []).append(c["sent"])
    for (n, dtype, root), sent in S_roots.items():
        S = n * torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
        assert sum(sent) == (p - 1) * S and sent[root] == (p - 1).bit_length() * S


def test_ring_trace_follows_the_documented_schedule(ranks):
    """RS step s: rank r sends chunk (r−s−1) mod p; AG step s: chunk (r−s) mod p; always to rank r+1. After the
    reduce-scatter rank r holds every contribution to chunk r; at the end every chunk holds all of them."""
    p, res = ranks
    everyone = (1 << p) - 1
    for r, out in enumerate(res):
        t = out["trace"]
        rs = [(r - s - 1) % p for s in range(p - 1)]
        ag = [(r - s) % p for s in range(p - 1)]
        assert t["sent"] == rs + ag and t["dst"] == [(r + 1) % p] * (2 * (p - 1))
        assert t["holds"][0] == [1 << r] * p
        assert t["holds"][p - 1][r] == everyone          # state after the reduce-scatter
        assert t["holds"][-1] == [everyone] * p


def test_bad_input_raises_a_clear_error_before_any_message(ranks):
    p, res = ranks
    for out in res:
        e = out["errors"]
        assert "contiguous" in e["non_contiguous"]
        assert "holds 7 elements" in e["wrong_chunk"] and "tensor_split" in e["wrong_chunk"]
        assert "out must hold" in e["wrong_out"]
        assert "floating-point" in e["avg_int"]
        assert "unknown reduction 'mean'" in e["unknown_op"]
        assert "unknown all-reduce algorithm 'butterfly'" in e["unknown_algorithm"]
        assert out["messages_during_errors"] == 0, "a rejected call sent or received something first"


def test_closed_forms_reduce_to_the_formula_sheet_when_p_divides_n():
    """docs/formulas.md §1.1, §1.3: ring all-reduce 2(p−1)/p·S, all-gather and reduce-scatter (p−1)/p·S;
    Rabenseifner's the same as the ring's when p is a power of two."""
    for p in (2, 4, 8):
        n, elem = 8 * 3 * p, 4
        S = n * elem
        for r in range(p):
            assert C.ring_all_reduce_bytes(n, p, r, elem) * p == 2 * (p - 1) * S
            assert C.ring_reduce_scatter_bytes(n, p, r, elem) * p == (p - 1) * S
            assert C.ring_all_gather_bytes(n, p, r, elem) * p == (p - 1) * S
            assert C.rhd_all_reduce_bytes(n, p, r, elem) * p == 2 * (p - 1) * S
        assert C.naive_all_reduce_bytes(n, p, 0, elem) == (p - 1) * S
        assert C.tree_broadcast_bytes(n, p, 0, elem) == (p - 1).bit_length() * S


# ============================================================================ Lab 02's checks
def _hierarchical(inside: str = "tp", across: str = "dp"):
    """Lab 02's hierarchical all-reduce as a learner writes it: reduce-scatter and all-gather on the `inside` axis,
    the shard all-reduced on the `across` axis (the solution is inside="tp", across="dp")."""
    def hierarchical(mesh, tensor, op="sum"):
        flat = tensor.view(-1)
        shard = C.reduce_scatter_ring(mesh[inside], flat, op, inplace=True)
        C.all_reduce_ring(mesh[across], shard, op)
        C.all_gather_ring(mesh[inside], shard, flat.numel(), out=flat)
        return tensor
    return hierarchical


def _lab02_solution():
    """The reference answers of Lab 02's first two exercises (the solution notebook's code)."""
    from course_lib.distributed.mesh import Mesh
    return (lambda comm, gpus_per_node: Mesh(comm, tp=gpus_per_node)), _hierarchical()


@pytest.fixture
def lab02_on_3x2(monkeypatch):
    """Lab 02's checks on one 3 × 2 cluster only (N ≠ L, so swapped axes differ; one launch per check)."""
    from course_lib.checks import lab02
    monkeypatch.setattr(lab02, "CLUSTERS", ((3, 2),))
    monkeypatch.setattr(lab02, "_RUNS", {})
    return lab02


def _fails_with(check, *args) -> str:
    from course_lib.checks import CheckFailed
    with pytest.raises(CheckFailed) as err:
        check(*args)
    message = str(err.value)
    assert message.startswith("✘ ") and "hint:" in message, message
    return message


def test_lab02_checks_pass_the_reference_answers(lab02_on_3x2, capsys):
    lab02 = lab02_on_3x2
    cluster_mesh, hierarchical = _lab02_solution()
    lab02.check_cluster_mesh(cluster_mesh)
    lab02.check_hierarchical_all_reduce(hierarchical)
    lab02.check_axis_bytes(hierarchical, lab02.axis_bytes_reference)
    lab02.check_hierarchical_time(lab02.hierarchical_time_reference)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["✔ cluster_mesh", "✔ hierarchical_all_reduce", "✔ axis_bytes",
                                                      "✔ hierarchical_time"], lines


def test_lab02_mesh_with_swapped_axes_gets_the_innermost_axis_hint(lab02_on_3x2):
    from course_lib.distributed.mesh import Mesh
    message = _fails_with(lab02_on_3x2.check_cluster_mesh, lambda comm, L: Mesh(comm, tp=comm.world_size // L))
    assert "swapped" in message and "innermost" in message, message


def test_lab02_all_reduce_without_the_cross_node_phase_is_told_to_add_it(lab02_on_3x2):
    def node_only(mesh, tensor, op="sum"):
        flat = tensor.view(-1)
        shard = C.reduce_scatter_ring(mesh["tp"], flat, op, inplace=True)
        C.all_gather_ring(mesh["tp"], shard, flat.numel(), out=flat)
        return tensor
    message = _fails_with(lab02_on_3x2.check_hierarchical_all_reduce, node_only)
    assert "this node only" in message and "mesh['dp']" in message, message


def test_lab02_all_reduce_without_the_all_gather_is_told_to_gather(lab02_on_3x2):
    def no_gather(mesh, tensor, op="sum"):
        shard = C.reduce_scatter_ring(mesh["tp"], tensor.view(-1), op, inplace=True)
        C.all_reduce_ring(mesh["dp"], shard, op)
        return tensor
    message = _fails_with(lab02_on_3x2.check_hierarchical_all_reduce, no_gather)
    assert "own shard is right" in message and "all-gather" in message, message


@pytest.mark.parametrize("wrong, cause", [
    ("swapped_axes", "mesh['tp']"),          # a correct sum, but the full buffer crosses nodes
    ("flat_ring", "world communicator"),     # a correct sum, on no mesh axis at all
    ("backend", "backend collectives"),      # gloo's own collectives: nominal bytes, nothing measured
])
def test_lab02_axis_bytes_names_where_the_bytes_went(lab02_on_3x2, wrong, cause):
    def flat_ring(mesh, tensor, op="sum"):
        return C.all_reduce_ring(mesh.world, tensor, op)

    def backend(mesh, tensor, op="sum"):
        mesh["tp"].all_reduce(tensor, op)
        return mesh["dp"].all_reduce(tensor, op)

    impl = {"swapped_axes": _hierarchical(inside="dp", across="tp"), "flat_ring": flat_ring, "backend": backend}[wrong]
    lab02_on_3x2.check_hierarchical_all_reduce(impl)        # the result itself is right: only the bytes can tell
    message = _fails_with(lab02_on_3x2.check_axis_bytes, impl, lab02_on_3x2.axis_bytes_reference)
    assert cause in message, message


def test_lab02_axis_bytes_from_the_even_split_formula_is_told_chunks_differ(lab02_on_3x2):
    _, hierarchical = _lab02_solution()

    def even_split(n, nodes, gpus_per_node, rank, elem):       # 2(L−1)/L·S and 2(N−1)/N·S/L, rounded
        S = n * elem
        return {"tp": round(2 * (gpus_per_node - 1) / gpus_per_node * S),
                "dp": round(2 * (nodes - 1) / nodes * S / gpus_per_node)}
    message = _fails_with(lab02_on_3x2.check_axis_bytes, hierarchical, even_split)
    assert "chunks differ" in message or "ring_reduce_scatter_bytes" in message, message


def _ping(ctx, sizes, repeats):
    from course_lib.distributed.comm import ping_pong
    t = ping_pong(ctx, sizes, repeats)
    return t, ctx.comm.ledger.bytes_sent(), ctx.comm.ledger.messages()


def test_ping_pong_sends_every_size_once_per_round_plus_the_dropped_first_and_times_each():
    sizes, repeats = [8, 4096, 1 << 20], 3
    out = launch(_ping, 3, sizes, repeats, timeout=60)
    for rank in (0, 1):
        t, sent, msgs = out[rank]
        assert len(t) == len(sizes) and all(0 < x < 1 for x in t), t
        assert sent == (repeats + 1) * sum(sizes) and msgs == (repeats + 1) * len(sizes)
    assert out[2] == ([], 0, 0), "a third rank takes no part"


def _ring_messages(ctx, repeats, numel, between=False):
    from course_lib.distributed.collectives import ring_message_seconds
    calls = []
    t = ring_message_seconds(ctx, repeats, numel, between=(lambda: calls.append(ctx.comm.ledger.messages()))
                             if between else None)
    return t, ctx.comm.ledger.bytes_sent(), ctx.comm.ledger.messages(), calls


def test_ring_message_seconds_times_each_chained_all_reduce_per_message_plus_the_dropped_first():
    """3 ranks, 5 timed ring all-reduces of 30 float32 after one dropped: each call sends 2(p − 1) = 4 messages of
    a 10-element chunk, and is timed per message. `between` runs before every call, the dropped one too."""
    repeats, numel = 5, 30
    for between in (False, True):
        for t, sent, msgs, calls in launch(_ring_messages, 3, repeats, numel, between, timeout=60):
            assert len(t) == repeats and all(0 < x < 1 for x in t), t
            assert msgs == (repeats + 1) * 4 and sent == (repeats + 1) * 4 * 10 * 4
            assert calls == ([4 * i for i in range(repeats + 1)] if between else []), calls
    assert launch(_ring_messages, 1, repeats, numel, timeout=60)[0] == ([], 0, 0, []), "one rank has no ring"
