"""Checks for Lab 06: Megatron's f and g, and a RowParallelLinear built on them.

    check_f_and_g(f, g, world_sizes)                    values and gradients of both operators on real ranks, and
                                                        their bytes: one ring all-reduce each, in the right pass
    check_row_parallel(RowParallelLinear, world_sizes)  output and every gradient equal nn.Linear's (float64), the
                                                        ledger shows one ring all-reduce of the output, in forward
    check_megatron_mlp(f, RowParallelLinear, world_sizes)
                                                        f → ColumnParallelLinear → GeLU → your RowParallelLinear
                                                        equals the single-process MLP; 2 all-reduces of b·s·h per
                                                        rank (docs/formulas.md §4.1), exact

Every check runs at t = 2 and 4 (and any other world size passed), in float64, where tensor parallelism only
reorders additions: the tolerance is 1e-12.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import ring_all_reduce_bytes
from ..parallel.tensor.megatron import ColumnParallelLinear
from . import NOT_IMPLEMENTED, check, run_ranks

B, T, D = 2, 6, 48              # a (B, T, D) activation: B·T·D = 576 splits evenly over 2, 3, 4 and 6 ranks
TOL = 1e-12
ELEM = 8


def _sizes(world_sizes) -> list[int]:
    sizes = sorted({2, 4, *world_sizes})
    bad = [t for t in sizes if not (isinstance(t, int) and 2 <= t <= 6 and (4 * D) % t == 0)]
    if bad:
        raise ValueError(f"world sizes for this lab are 2 to 6 (dividing {4 * D}); got {bad}")
    return sizes


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _guard(fn):
    """Run a check's worker; a stub still raising NotImplementedError returns NOT_IMPLEMENTED."""
    def worker(ctx, *args):
        try:
            return fn(ctx, *args)
        except NotImplementedError:
            return NOT_IMPLEMENTED
    return worker


# ============================================================================================ f and g
def _f_and_g_worker(ctx, f, g):
    comm, r, t = ctx.comm, ctx.rank, ctx.world_size
    x = _rand(B, T, D, seed=r).requires_grad_(True)           # a different tensor on every rank
    out = {}
    for name, op in (("f", f), ("g", g)):
        x.grad = None
        comm.ledger.reset()
        y = op.apply(x, comm)
        fwd = comm.ledger.bytes_sent()
        y.backward(_rand(B, T, D, seed=100 + r))
        bwd = comm.ledger.bytes_sent() - fwd
        xs = [_rand(B, T, D, seed=k) for k in range(t)]
        grads = [_rand(B, T, D, seed=100 + k) for k in range(t)]
        want_y = x.detach() if name == "f" else sum(xs)         # f: identity; g: the sum over ranks
        want_grad = sum(grads) if name == "f" else grads[r]     # f: the sum of the gradients; g: identity
        dgrad = (x.grad - want_grad).abs().max().item() if x.grad is not None else float("inf")
        ratio = (x.grad / want_grad).median().item() if x.grad is not None else None
        out[name] = {"dy": (y.detach() - want_y).abs().max().item(), "dgrad": dgrad, "fwd": fwd, "bwd": bwd,
                     "ratio": ratio if ratio is not None and abs(ratio - 1) > 1e-9 and
                     torch.allclose(x.grad, ratio * want_grad, rtol=1e-9, atol=1e-12) else None}
    return out


def check_f_and_g(f, g, world_sizes=()) -> None:
    with check("f_and_g") as c:
        for t in _sizes(world_sizes):
            res = run_ranks(c, _guard(_f_and_g_worker), t, f, g, timeout=60,
                            hang_hint="every rank must call the same collectives in the same order")
            for rank, r in enumerate(res):
                n = ring_all_reduce_bytes(B * T * D, t, rank, ELEM)
                for name, want in (("f", {"fwd": 0, "bwd": n}), ("g", {"fwd": n, "bwd": 0})):
                    got = r[name]
                    c.expect(got["dy"] < TOL, f"t={t}, rank {rank}: {name}'s forward output is off by {got['dy']:.1e}",
                             hint={"f": "f's forward returns its input unchanged (x.view_as(x)): no communication",
                                   "g": "g's forward returns the sum over the ranks: all_reduce_ring on a copy of x, "
                                        "return the copy"}[name])
                    c.expect(got["dgrad"] < TOL, f"t={t}, rank {rank}: {name}'s gradient is off by {got['dgrad']:.1e}"
                             + (f" (it is {got['ratio']:g}× the right one)" if got.get("ratio") else ""),
                             hint={"f": "f's backward all-reduces (sums over the ranks) the incoming gradient: "
                                        "all_reduce_ring on a copy of grad, return (copy, None)",
                                   "g": "g's backward passes the incoming gradient through unchanged: return grad, "
                                        "None"}[name])
                    c.expect({k: got[k] for k in ("fwd", "bwd")} == want,
                             f"t={t}, rank {rank}: {name} sent {got['fwd']:,} B in forward and {got['bwd']:,} B in "
                             f"backward; one ring all-reduce of {B * T * D} float64 sends {n:,} B, in "
                             f"{'backward' if name == 'f' else 'forward'} only",
                             hint="all_reduce_ring(comm, buffer) once: f in backward, g in forward; nothing else")
        sizes = _sizes(world_sizes)
        c.passed(f"t = {', '.join(map(str, sizes))}: values and gradients exact; f sends "
                 f"{ring_all_reduce_bytes(B * T * D, 4, 0, ELEM):,} B only in backward, g only in forward (t = 4)")


# ============================================================================================ RowParallelLinear
def _row_worker(ctx, RowParallelLinear):
    comm, r, t = ctx.comm, ctx.rank, ctx.world_size
    ref = nn.Linear(4 * D, D).double()
    with torch.no_grad():
        ref.weight.copy_(_rand(D, 4 * D, seed=1))
        ref.bias.copy_(_rand(D, seed=2))
    x = _rand(B, T, 4 * D, seed=3).requires_grad_(True)
    dy = _rand(B, T, D, seed=4)
    y_ref = ref(x)
    y_ref.backward(dy)
    layer = RowParallelLinear(ref, comm)
    params = dict(layer.named_parameters())
    shape = tuple(params["weight"].shape) if "weight" in params else None
    bad = torch.tensor([float(shape != (D, 4 * D // t))])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)        # outside the ledger: every rank stops if any weight is wrong,
    if bad.item():                                    # before a matmul of the wrong shapes (or a g on some ranks)
        return {"shape": shape}
    x_r = x.detach().chunk(t, -1)[r].clone().requires_grad_(True)       # this rank's slice of the input
    comm.ledger.reset()
    y = layer(x_r)
    fwd = comm.ledger.bytes_sent()
    y.backward(dy)
    bwd = comm.ledger.bytes_sent() - fwd
    bias_twice = "bias" in params and (y.detach() - y_ref.detach() - (t - 1) * ref.bias.detach()).abs().max() < TOL
    return {"y": (y - y_ref).abs().max().item(), "bias_before_g": bool(bias_twice), "names": sorted(params),
            "x": (x_r.grad - x.grad.chunk(t, -1)[r]).abs().max().item(),
            "weight": (params["weight"].grad - ref.weight.grad.chunk(t, 1)[r]).abs().max().item()
            if "weight" in params and params["weight"].grad is not None else float("inf"),
            "bias": (params["bias"].grad - ref.bias.grad).abs().max().item()
            if "bias" in params and params["bias"].grad is not None else float("inf"),
            "shape": tuple(params["weight"].shape) if "weight" in params else None, "fwd": fwd, "bwd": bwd}


def check_row_parallel(RowParallelLinear, world_sizes=()) -> None:
    with check("row_parallel") as c:
        for t in _sizes(world_sizes):
            res = run_ranks(c, _guard(_row_worker), t, RowParallelLinear, timeout=60)
            for rank, r in enumerate(res):
                c.expect(r["shape"] == (D, 4 * D // t), f"t={t}, rank {rank}: weight has shape {r['shape']}, "
                         f"expected {(D, 4 * D // t)} (nn.Linear's layout: out × in/t)",
                         hint="keep linear.weight.chunk(t, dim=1)[rank]: the rows of B = weightᵀ are its columns")
                if "y" not in r:
                    continue                  # another rank's weight has the wrong shape: its line comes first
                c.expect(not r["bias_before_g"], f"t={t}, rank {rank}: the output is nn.Linear's plus (t − 1) × the "
                         f"bias", hint="the bias was added on every rank before g, so g summed t copies of it: add "
                                       "it once, after g")
                c.expect(r["y"] < TOL or r["fwd"] > 0, f"t={t}, rank {rank}: the output differs from nn.Linear's by "
                         f"{r['y']:.1e} and nothing was sent in forward",
                         hint="x_r @ W_rᵀ is only this rank's partial sum: g (the all-reduce) adds the ranks' partial "
                              "sums, then add the bias")
                for what in ("y", "x", "weight", "bias"):
                    c.expect(r[what] < TOL, f"t={t}, rank {rank}: {'output' if what == 'y' else what + ' gradient'} "
                             f"differs from nn.Linear's by {r[what]:.1e}",
                             hint={"y": "partial = x_r @ W_rᵀ, then g (the sum over ranks), then add the bias once",
                                   "x": "the input gradient is local: autograd gives it if forward is x_r @ W_rᵀ",
                                   "weight": "name the parameters 'weight' and 'bias' (nn.Parameter)",
                                   "bias": "add the whole bias after g, on every rank (a bias split or scaled "
                                           "before g gets a gradient scaled the same way)"}[what])
                n = ring_all_reduce_bytes(B * T * D, t, rank, ELEM)
                c.expect((r["fwd"], r["bwd"]) == (n, 0), f"t={t}, rank {rank}: sent {r['fwd']:,} B in forward and "
                         f"{r['bwd']:,} B in backward; one all-reduce of the (B, T, d) output sends {n:,} B",
                         hint="exactly one g per forward, and nothing in backward")
        c.passed(f"t = {', '.join(map(str, _sizes(world_sizes)))}: output and gradients equal nn.Linear's "
                 f"(float64), one all-reduce of {B * T * D} elements in forward")


# ============================================================================================ the Megatron MLP
def _mlp_worker(ctx, f, RowParallelLinear):
    comm, r, t = ctx.comm, ctx.rank, ctx.world_size
    fc_in, fc_out = nn.Linear(D, 4 * D).double(), nn.Linear(4 * D, D).double()
    with torch.no_grad():
        for i, p in enumerate([*fc_in.parameters(), *fc_out.parameters()]):
            p.copy_(_rand(*p.shape, seed=10 + i) * 0.1)
    x = _rand(B, T, D, seed=5).requires_grad_(True)
    dz = _rand(B, T, D, seed=6)
    fc_out(F.gelu(fc_in(x))).backward(dz)
    col, row = ColumnParallelLinear(fc_in, comm, input_f=False), RowParallelLinear(fc_out, comm)
    x_tp = x.detach().clone().requires_grad_(True)
    comm.ledger.reset()
    z = row(F.gelu(col(f.apply(x_tp, comm))))                   # f → column → GeLU → row (with g)
    z.backward(dz)
    want = {"fc_in.weight": fc_in.weight.grad.chunk(t, 0)[r], "fc_in.bias": fc_in.bias.grad.chunk(t, 0)[r],
            "fc_out.weight": fc_out.weight.grad.chunk(t, 1)[r], "fc_out.bias": fc_out.bias.grad}
    got = {"fc_in.weight": col.weight.grad, "fc_in.bias": col.bias.grad, "fc_out.weight": row.weight.grad,
           "fc_out.bias": row.bias.grad}
    errs = {k: (got[k] - want[k]).abs().max().item() for k in want}
    errs["input"] = (x_tp.grad - x.grad).abs().max().item()
    z_ref = fc_out(F.gelu(fc_in(x.detach())))
    errs["output"] = (z.detach() - z_ref.detach()).abs().max().item()
    return {"errs": errs, "sent": comm.ledger.bytes_sent()}


def check_megatron_mlp(f, RowParallelLinear, world_sizes=()) -> None:
    with check("megatron_mlp") as c:
        for t in _sizes(world_sizes):
            res = run_ranks(c, _guard(_mlp_worker), t, f, RowParallelLinear, timeout=60)
            for rank, r in enumerate(res):
                worst = max(r["errs"], key=r["errs"].get)
                c.expect(r["errs"][worst] < TOL, f"t={t}, rank {rank}: {worst} differs from the single-process MLP's "
                         f"by {r['errs'][worst]:.1e}",
                         hint="f on the input (gradient summed in backward), GeLU on the column slice, your row layer")
                n = 2 * ring_all_reduce_bytes(B * T * D, t, rank, ELEM)
                c.expect(r["sent"] == n, f"t={t}, rank {rank}: the MLP sent {r['sent']:,} B; Megatron's two "
                         f"all-reduces of b·s·h = {B * T * D} float64 (g forward, f backward) send {n:,} B",
                         hint="one f before the column layer and one g inside your row layer: no other collective")
        c.passed(f"t = {', '.join(map(str, _sizes(world_sizes)))}: the MLP equals the single-process one; rank 0 "
                 f"sends {2 * ring_all_reduce_bytes(B * T * D, 4, 0, ELEM):,} B at t = 4 = 2 × 2(t−1)/t·bsh·8")


__all__ = ["check_f_and_g", "check_row_parallel", "check_megatron_mlp"]
