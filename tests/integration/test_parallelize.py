"""The composition matrix: every technique with every other through `parallelize(model, mesh, plan)`, on real ranks.

Each accepted plan trains 2 optimizer steps of a float64 toy GPT and must equal the single-process reference —
loss and every parameter (this rank's shard of it) within 1e-12 — and each mesh axis's ledger bytes per step must
equal the sum of the techniques' formulas (`Parallelized.expected_bytes`). Mixed-precision plans are compared with
the single-process run of the same recipe (`ParallelPlan(precision=…)` on one rank). Several plans share a launch,
so the whole matrix costs a handful of process starts. Plans the course refuses are refused before any launch
(tests/unit/test_parallel_plan.py).
"""
import pytest
import torch

from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.core.model import GPT, get_config
from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.train import LedgerProbe, TrainConfig, train_reference

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=4, n_head=4, d_model=32, seq_len=16)
STEPS = 2
GROUPS = ("pp", "dp", "cp", "tp", "dp×cp")
P = ParallelPlan

# world size -> (global batch, plans); every schedule, ZeRO stage, SP, recomputation policy and a size-3 axis
MATRIX = {
    8: (8, [
        P(pp=2, dp=2, tp=2, microbatches=2),
        P(pp=2, dp=2, tp=2, microbatches=2, zero=1, sequence_parallel=True, recompute="selective"),
        P(pp=2, dp=2, tp=2, microbatches=2, zero=2, schedule="zb_h1"),
        P(pp=2, dp=2, tp=2, microbatches=4, zero=1, schedule="interleaved", chunks=2, sequence_parallel=True),
        P(pp=2, dp=2, tp=2, microbatches=2, schedule="gpipe", recompute="full"),
        P(dp=2, tp=4, microbatches=2, zero=2),
        P(dp=2, tp=4, zero=3, sequence_parallel=True),
        P(dp=2, tp=4, recompute="selective"),
        P(pp=2, dp=4, microbatches=2, zero=1, recompute="full"),
        P(pp=2, dp=4, microbatches=2, zero=2, schedule="gpipe"),
        P(pp=4, tp=2, microbatches=4, sequence_parallel=True),
        P(pp=4, tp=2, microbatches=4, schedule="zb_h1", recompute="selective"),
        P(dp=8, zero=3),
        P(dp=8, zero=3, fsdp_replicate="norms+biases"),
        P(dp=8, zero=1),
        P(pp=2, dp=2, tp=2, microbatches=2, offload_activations=True),
        P(pp=2, dp=4, microbatches=2, zero=2, schedule="zb_h1", offload_activations=True),
        # context × pipeline: each stage's ring attention over the cp peers holding it; (b, T/cp, d) crosses
        P(pp=2, dp=2, cp=2, microbatches=2),
        P(pp=2, dp=2, cp=2, microbatches=2, zero=2, schedule="zb_h1"),
        P(pp=2, cp=4, microbatches=4, schedule="interleaved", chunks=2),
    ]),
    6: (6, [
        P(dp=3, tp=2, zero=1, sequence_parallel=True),
        P(pp=3, dp=2, microbatches=3, zero=2),
        P(pp=3, tp=2, microbatches=3, schedule="zb_h1", recompute="full"),
    ]),
    4: (8, [
        P(dp=2, cp=2, zero=1),
        P(cp=4, zero=2),
        P(dp=4, zero=3, fsdp_replicate=512, microbatches=2),
    ]),
}


def _worker(ctx, batch, plans, reference):
    torch.set_default_dtype(torch.float64)
    tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3)
    out = []
    for plan in plans:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        ctx.comm.ledger.reset()
        with parallelize(GPT(CFG, seed=tc.seed).double(), mesh, plan, train_config=tc) as job:
            run = job.train(STEPS, keep_params=True, probes=[LedgerProbe(ctx.comm, groups=GROUPS)])
            err = max((v - job.local_shard(k, reference[k])).abs().max().item() for k, v in run.params.items())
            names = sorted(run.params)
            out.append({"err": err, "losses": run.losses, "names": names, "coords": mesh.coords,
                        "bytes": [{g: n for g, n in s.items() if n} for s in run["ledger"]["group_bytes"]],
                        "want": {g: n for g, n in job.expected_bytes.items() if n}})
    return out


def _reference(batch):
    torch.set_default_dtype(torch.float64)
    try:
        ref = train_reference(CFG, TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3), progress=False,
                              model=GPT(CFG, seed=0).double())
    finally:
        torch.set_default_dtype(torch.float32)
    return ref, {k: v.detach() for k, v in ref.model.named_parameters()}


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_every_accepted_plan_trains_like_one_process_with_the_formulas_bytes(world):
    batch, plans = MATRIX[world]
    for plan in plans:
        plan.check(CFG, world, batch_size=batch)
    ref, params = _reference(batch)
    res = launch(_worker, world, batch, plans, params, timeout=600)
    report = []
    for i, plan in enumerate(plans):
        ranks = [r[i] for r in res]
        err = max(c["err"] for c in ranks)
        report.append(f"{plan.describe():<70} max |Δ| = {err:.1e}")
        assert err < 1e-12, (plan.describe(), err)
        # every parameter is held somewhere (pipeline stages split them; TP and FSDP hold shards under their names)
        assert set().union(*(c["names"] for c in ranks)) == set(params), plan.describe()
        for c in ranks:
            assert c["bytes"] == [c["want"]] * STEPS, (plan.describe(), c["coords"], c["bytes"], c["want"])
        # the loss: the mean over the ranks that compute one (the last stage's; each cp rank's over its tokens)
        for s in range(STEPS):
            losses = [c["losses"][s] for c in ranks if c["losses"][s] == c["losses"][s]]
            assert abs(sum(losses) / len(losses) - ref.losses[s]) < 1e-12, (plan.describe(), s)
    print("\n".join(report))


# ------------------------------------------------------------------------------------------ mixed precision
BF16 = [P(pp=2, dp=2, tp=2, microbatches=2, zero=1, precision="bf16"),
        P(dp=2, tp=4, zero=2, sequence_parallel=True, precision="bf16"),
        P(dp=8, zero=3, precision="bf16"),
        P(dp=8, zero=2, offload_optimizer="host", precision="bf16")]


def _bf16(ctx, plans, batch):
    tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3)
    out = []
    for plan in plans:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        with parallelize(GPT(CFG, seed=tc.seed), mesh, plan, train_config=tc) as job:
            run = job.train(STEPS)
            dtypes = {p.dtype for _, p in job.named_parameters()}
            out.append({"losses": run.losses, "dtypes": dtypes})
    return out


def test_bf16_mixed_precision_composes_and_trains_like_one_process_with_the_same_recipe():
    """bf16 has 8 significant bits: the composed run and one process with the same recipe (fp32 masters, bf16
    compute) round their reductions in different orders, so their losses agree to bf16's precision, not to float64's
    — within 2⁻⁷ relative at each step. That is far tighter than what a step moves the loss (≈ 1.6 % here), so a
    composition that loses the master update, casts wrongly or skips a step fails it."""
    single = launch(_bf16, 1, [P(precision="bf16")], 8, timeout=120)[0][0]["losses"]
    offloaded = launch(_bf16, 1, [P(precision="bf16", offload_optimizer="host")], 8, timeout=120)[0][0]["losses"]
    assert offloaded[0] == single[0]                 # the same bf16 weights: only the optimizer's place differs
    assert abs(single[1] - single[0]) > 2 ** -7 * single[0] * 2          # a step moves the loss well past the bound
    res = launch(_bf16, 8, BF16, 8, timeout=300)
    for i, plan in enumerate(BF16):
        ranks = [r[i] for r in res]
        for s in range(STEPS):
            losses = [c["losses"][s] for c in ranks if c["losses"][s] == c["losses"][s]]
            mean = sum(losses) / len(losses)
            assert abs(mean - single[s]) <= 2 ** -7 * single[s], (plan.describe(), s, mean, single[s])
        # FSDP keeps fp32 shards (the masters) and casts its gathers; the others hold bf16 compute copies
        # (ZeRO-Offload included: its fp32 masters and Adam state live on the host)
        assert all(c["dtypes"] == ({torch.float32} if plan.zero == 3 else {torch.bfloat16}) for c in ranks)
