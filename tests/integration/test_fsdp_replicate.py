"""FSDP with chosen parameters left replicated (course_lib.parallel.fsdp.replicate), on real gloo ranks in float64.

Proved for "replicate norms and biases" (every 1-D parameter), "replicate below N elements" (which also catches a
2-D parameter, the position embedding) and a set of names, on 2 and 3 ranks of a model whose every dimension pads:
- loss and every parameter after 2 steps equal the single-process reference within 1e-12;
- the replicated parameters are bitwise identical on every rank (the ring all-reduce hands every rank the same bits,
  so the same optimizer step keeps them so);
- memory per rank after the step and ledger bytes per tag equal the formulas exactly, with P (sharded, padded) and
  R_u (replicated, per unit) counted here from the model's parameter shapes, not from the wrapper:
      parameters = gradients = e·(P/N + R)       optimizer = 2e·(Ψ_r + R) + 4·(tensors this rank steps)
      (AdamW's two moments in the parameters' dtype, a 4-byte step count per tensor; Ψ_r: this rank's shard rows)
      fsdp_fwd_ag = fsdp_bwd_ag = fsdp_rs = steps·(N−1)·e·P/N
      fsdp_ar = steps · Σ_u ring all-reduce bytes of R_u   (= steps · Σ_u 2(N−1)/N·e·R_u where N divides R_u)
"""
from __future__ import annotations

import pytest
import torch

from course_lib import optim
from course_lib.core.model import GPT, GPTConfig
from course_lib.distributed.collectives import ring_all_reduce_bytes
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import data_parallel_batches
from course_lib.parallel.fsdp import FSDP, apply_fsdp, norms_and_biases, shard_rows
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration

ODD = GPTConfig(seq_len=31, n_layer=2, n_head=5, d_model=35)   # 35, 31, 140, 256 rows: every world size pads
STEPS = 2
EPS = 1e-6           # a weight whose true gradient is ~0 (the key bias) would turn rounding noise into updates
TOL = 1e-12
E = 8                # float64
BELOW = 1100         # replicates every 1-D parameter and the (31, 35) position embedding, not the (35, 35) ones
RULES = {"norms+biases": dict(replicate=norms_and_biases),
         f"below {BELOW}": dict(min_shard_numel=BELOW),
         "names": dict(replicate={"wpe.weight", "ln_f.weight", "blocks.1.mlp.fc_in.bias"})}
FULL = dict(GPT(ODD).named_parameters())                        # full shapes (FSDP's module holds shards)


def _chosen(rule: str, name: str, p: torch.Tensor) -> bool:
    """The test's own statement of each rule (not the library's predicate)."""
    if rule == "norms+biases":
        return name.endswith(".bias") or ".ln" in name or name.startswith("ln_f")
    if rule.startswith("below"):
        return p.numel() < BELOW
    return name in RULES["names"]["replicate"]


def _expected(rule: str, n: int, rank: int) -> dict:
    """P, R_u per unit (blocks then the root), R, Ψ_r and the tensor count, from the model's shapes alone."""
    model = GPT(ODD)
    units = [f"blocks.{i}." for i in range(ODD.n_layer)] + [""]          # the root: everything else
    R_u, P, local, tensors = [0] * len(units), 0, 0, 0
    for name, p in model.named_parameters():
        u = next(i for i, prefix in enumerate(units) if name.startswith(prefix))
        d0 = p.shape[0]
        if _chosen(rule, name, p):
            R_u[u] += p.numel()
            tensors += 1
        else:
            P += n * -(-d0 // n) * (p.numel() // d0)
            lo, hi = shard_rows(d0, n, rank)
            local += (hi - lo) * (p.numel() // d0)
            tensors += 1                       # a shard with no rows is still a parameter tensor of this rank
    return {"P": P, "R_u": [r for r in R_u if r], "R": sum(R_u), "local": local, "tensors": tensors}


def _worker(ctx, tc):
    data = data_parallel_batches(ctx.comm, ODD.seq_len, tc.batch_size)
    out = {}
    for rule, options in RULES.items():
        model = GPT(ODD, seed=tc.seed).double()
        f = (FSDP(model, ctx.comm, units=model.blocks, **options) if rule != "names"
             else apply_fsdp(model, ctx.comm, **options))                # the composer's entry point
        ctx.comm.ledger.reset()
        r = run(f, optim.build(f, **optimizer_kwargs(tc)), data, steps=tc.steps, probes=[MemoryProbe(timeline=False)])
        sent = {k: v["sent"] for k, v in ctx.comm.ledger.by("tag").items()}     # the training steps' traffic only
        losses = ctx.comm.all_reduce(torch.tensor(r.losses, dtype=torch.float64), "avg", tag="loss").tolist()
        replicated = {n: p.detach().clone() for n, p in model.named_parameters() if _chosen(rule, n, FULL[n])}
        out[rule] = {"losses": losses, "state": f.full_state_dict(), "replicated": replicated,
                     "mem": r["memory"]["after_step"][-1], "tensors": len(list(f.parameters())),
                     "sent": sent,
                     "R_u": f.replicated_numel, "P": f.padded_numel}
        f.close()                                                        # FSDP's hooks come off the blocks
        out[rule]["hooks_left"] = sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_with_replicated_params_equals_reference_with_exact_bytes_and_memory(world_size):
    n = world_size
    tc = TrainConfig(steps=STEPS, batch_size=2 * n, eps=EPS)
    ref = train_reference(ODD, tc, model=GPT(ODD, seed=tc.seed).double(), progress=False)
    ref_state = ref.model.state_dict()
    res = launch(_worker, n, tc, timeout=180)
    for rule in RULES:
        r0 = res[0][rule]
        assert max(abs(a - b) for a, b in zip(r0["losses"], ref.losses)) < TOL, rule
        assert list(r0["state"]) == list(ref_state), rule
        for k, v in ref_state.items():
            assert (r0["state"][k] - v).abs().max().item() < TOL, (rule, k)
        assert r0["replicated"], rule                                    # the rule chose something
        for r in res[1:]:                                               # whole and bitwise equal on every rank
            assert r[rule]["replicated"].keys() == r0["replicated"].keys()
            assert all(torch.equal(r[rule]["replicated"][k], v) for k, v in r0["replicated"].items()), rule
        for rank, rr in enumerate(res):
            x, got = _expected(rule, n, rank), rr[rule]
            assert got["hooks_left"] == 0, rule
            assert (got["P"], got["R_u"]) == (x["P"], x["R_u"]), rule
            mem, sent = got["mem"], got["sent"]
            assert mem["parameters"] == mem["gradients"] == E * (x["P"] // n + x["R"]), (rule, rank, mem)
            assert got["tensors"] == x["tensors"]
            assert mem["optimizer"] == 2 * E * (x["local"] + x["R"]) + 4 * x["tensors"], (rule, rank, mem)
            for tag in ("fsdp_fwd_ag", "fsdp_bwd_ag", "fsdp_rs"):
                assert sent[tag] == STEPS * (n - 1) * E * x["P"] // n, (rule, rank, tag)
            assert sent["fsdp_ar"] == STEPS * sum(ring_all_reduce_bytes(R, n, rank, E) for R in x["R_u"]), (rule, rank)
            assert set(sent) == {"fsdp_fwd_ag", "fsdp_bwd_ag", "fsdp_rs", "fsdp_ar"}, (rule, sent)


def test_replicate_rejects_unknown_names_and_bad_thresholds_before_any_message():
    model = GPT(ODD)
    with pytest.raises(ValueError, match="not parameters of the model"):
        FSDP(model, None, replicate={"ln_f.wieght"})                     # a typo: no rank ever gets a message
    with pytest.raises(ValueError, match="min_shard_numel"):
        FSDP(model, None, min_shard_numel=-1)
    with pytest.raises(ValueError, match="collection of parameter names"):
        FSDP(model, None, replicate="ln_f.weight")


# ------------------------------------------------------------------------------------------ against FSDP2
def _fsdp2_worker(ctx, tc):
    """FSDP2 with the norms and biases as `ignored_params`, their gradients averaged by hand (the replication FSDP2
    leaves to DDP), beside ours with replicate=norms_and_biases: every parameter and gradient after one backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    data = data_parallel_batches(ctx.comm, ODD.seq_len, tc.batch_size)
    theirs = GPT(ODD, seed=tc.seed).double()
    ignored = {p for p in theirs.parameters() if p.dim() <= 1}
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(theirs, mesh=mesh, ignored_params=ignored)
    m = GPT(ODD, seed=tc.seed).double()
    ours = FSDP(m, ctx.comm, units=m.blocks, replicate=norms_and_biases)
    x, y = data.get(0)
    theirs(x, y)[1].backward()
    for p in (p for p in theirs.parameters() if p in ignored):         # one order on every rank (a set has none)
        dist.all_reduce(p.grad)
        p.grad.div_(ctx.world_size)
    ours(x, y)[1].backward()
    out = []
    for (name, p), (_, q) in zip(theirs.named_parameters(), m.named_parameters()):
        value, grad = (p, p.grad) if p in ignored else (p.to_local(), p.grad.to_local())
        out.append((name, p in ignored, tuple(value.shape) == tuple(q.shape),
                    (q.detach() - value.detach()).abs().max().item() if q.numel() else 0.0,
                    (q.grad - grad).abs().max().item() if q.numel() else 0.0))
    return out


def test_replicated_params_match_fsdp2_ignored_params_plus_an_all_reduce_gradient_by_gradient():
    tc = TrainConfig(steps=1, batch_size=4, eps=EPS)
    res = launch(_fsdp2_worker, 2, tc, timeout=180)
    for rows in res:
        assert len(rows) == len(FULL)
        assert ({name for name, ignored, *_ in rows if ignored}
                == {n for n in FULL if _chosen("norms+biases", n, FULL[n])})
        for name, _, same_shape, d_value, d_grad in rows:
            assert same_shape and d_value == 0.0, name         # the same rows (or whole tensor) of the same values
            assert d_grad < TOL, (name, d_grad)                # the same gradient after the reduction
