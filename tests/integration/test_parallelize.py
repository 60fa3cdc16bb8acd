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

from course_lib.capstone import one_process_losses
from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.train import LedgerProbe, TrainConfig, train_reference

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=4, n_head=4, d_model=32, seq_len=16)
STEPS = 2
GROUPS = ("pp", "dp", "cp", "tp", "dp×cp")
P = ParallelPlan

# world size -> (global batch, plans); every schedule, ZeRO stage, SP, recomputation policy and a size-3 axis
MATRIX = {
    8: (8, [
        P(pp=2, dp=2, tp=2, num_microbatches=2),
        P(pp=2, dp=2, tp=2, num_microbatches=2, zero=1, sequence_parallel=True, recompute="selective"),
        P(pp=2, dp=2, tp=2, num_microbatches=2, zero=2, schedule="zb_h1"),
        P(pp=2, dp=2, tp=2, num_microbatches=4, zero=1, schedule="interleaved", chunks=2, sequence_parallel=True),
        P(pp=2, dp=2, tp=2, num_microbatches=2, schedule="gpipe", recompute="full"),
        P(dp=2, tp=4, num_microbatches=2, zero=2),
        P(dp=2, tp=4, zero=3, sequence_parallel=True),
        P(dp=2, tp=4, recompute="selective"),
        P(pp=2, dp=4, num_microbatches=2, zero=1, recompute="full"),
        P(pp=2, dp=4, num_microbatches=2, zero=2, schedule="gpipe"),
        P(pp=4, tp=2, num_microbatches=4, sequence_parallel=True),
        P(pp=4, tp=2, num_microbatches=4, schedule="zb_h1", recompute="selective"),
        P(dp=8, zero=3),
        P(dp=8, zero=3, fsdp_replicate="norms+biases"),
        P(dp=8, zero=1),
        P(pp=2, dp=2, tp=2, num_microbatches=2, offload_activations=True),
        P(pp=2, dp=4, num_microbatches=2, zero=2, schedule="zb_h1", offload_activations=True),
        # context × pipeline: each stage's ring attention over the cp peers holding it; (b, T/cp, d) crosses
        P(pp=2, dp=2, cp=2, num_microbatches=2),
        P(pp=2, dp=2, cp=2, num_microbatches=2, zero=2, schedule="zb_h1"),
        P(pp=2, cp=4, num_microbatches=4, schedule="interleaved", chunks=2),
        # context × tensor (Llama 3's long-context layout): the ring on the heads this tp rank holds
        P(pp=2, cp=2, tp=2, num_microbatches=2),
        P(dp=2, cp=2, tp=2, zero=1, sequence_parallel=True),
    ]),
    6: (6, [
        P(dp=3, tp=2, zero=1, sequence_parallel=True),
        P(pp=3, dp=2, num_microbatches=3, zero=2),
        P(pp=3, tp=2, num_microbatches=3, schedule="zb_h1", recompute="full"),
    ]),
    4: (8, [
        P(dp=2, cp=2, zero=1),
        P(cp=4, zero=2),
        P(dp=4, zero=3, fsdp_replicate=512, num_microbatches=2),
        # recomputation replays ring attention's forward (its K/V rotation again) in every block it reruns
        P(dp=2, cp=2, recompute="full"),
        P(cp=2, tp=2, recompute="selective", sequence_parallel=True),
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


# Llama 3's long-context layout on the toy (Dubey et al. 2024, Table 4: TP 8 × CP 16 × PP 16 × DP): every axis of the
# mesh at size 2, one 16-rank launch — the one test that starts 16 processes; its wall time and memory are printed
LLAMA3 = P(pp=2, dp=2, cp=2, tp=2, num_microbatches=2, zero=1, sequence_parallel=True)


def _rss_worker(ctx, batch, plans, reference):
    import resource
    out = _worker(ctx, batch, plans, reference)
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # Linux: KiB


def test_the_llama3_layout_pp_dp_cp_tp_on_16_ranks_trains_like_one_process():
    import time
    LLAMA3.check(CFG, 16, batch_size=8)
    ref, params = _reference(8)
    t0 = time.perf_counter()
    res = launch(_rss_worker, 16, 8, [LLAMA3], params, timeout=600)
    wall = time.perf_counter() - t0
    ranks, rss = [r[0][0] for r in res], [r[1] for r in res]
    err = max(c["err"] for c in ranks)
    assert err < 1e-12, err
    assert set().union(*(c["names"] for c in ranks)) == set(params)
    for c in ranks:
        assert c["bytes"] == [c["want"]] * STEPS and set(c["want"]) == {"pp", "cp", "tp", "dp×cp"}, (c["coords"],
                                                                                                  c["bytes"])
    for s in range(STEPS):
        losses = [c["losses"][s] for c in ranks if c["losses"][s] == c["losses"][s]]
        assert len(losses) == 8 and abs(sum(losses) / len(losses) - ref.losses[s]) < 1e-12
    print(f"{LLAMA3.describe()}: max |Δ| = {err:.1e}; launch wall time {wall:.1f} s on {len(res)} ranks; peak RSS "
          f"per rank {max(rss) / 2**20:.0f} MiB (all ranks {sum(rss) / 2**30:.2f} GiB); bytes/step rank 0 "
          f"{ranks[0]['bytes'][0]}")


# ------------------------------------------------------------------------------------------ mixed precision
BF16 = [P(pp=2, dp=2, tp=2, num_microbatches=2, zero=1, precision="bf16"),
        P(dp=2, tp=4, zero=2, sequence_parallel=True, precision="bf16"),
        P(dp=8, zero=3, precision="bf16"),
        P(dp=8, zero=2, offload_optimizer="host", precision="bf16"),
        P(dp=2, cp=2, tp=2, zero=1, sequence_parallel=True, precision="bf16")]
# experts under bf16 (ZeRO-1 over dp and edp, tp): against one process with the same recipe and capacity groups
BF16_MOE = (P(dp=4, ep=2, tp=2, zero=1, precision="bf16"), {"n_expert": 4, "top_k": 2})


def _bf16(ctx, plans, batch, moe=None, groups=None):
    """Train each plan (the dense CFG; `moe`: config overrides of an MoE model for the plans with ep, or for all
    with `groups` — the capacity groups of a one-rank reference)."""
    from course_lib.parallel.expert import set_moe_groups
    tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3)
    out = []
    for plan in plans:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        model = GPT(CFG.replace(**moe) if moe and (plan.ep > 1 or groups) else CFG, seed=tc.seed)
        if groups:
            set_moe_groups(model, groups)
        with parallelize(model, mesh, plan, train_config=tc) as job:
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
    plan, moe = BF16_MOE
    single_moe = launch(_bf16, 1, [P(precision="bf16")], 8, moe, plan.dp * plan.num_microbatches,
                        timeout=120)[0][0]["losses"]
    res = launch(_bf16, 8, BF16 + [plan], 8, moe, timeout=300)
    for i, composed in enumerate(BF16 + [plan]):
        ranks, want = [r[i] for r in res], single_moe if composed.ep > 1 else single
        for s in range(STEPS):
            losses = [c["losses"][s] for c in ranks if c["losses"][s] == c["losses"][s]]
            mean = sum(losses) / len(losses)
            assert abs(mean - want[s]) <= 2 ** -7 * want[s], (composed.describe(), s, mean, want[s])
        # FSDP keeps fp32 shards (the masters) and casts its gathers; the others hold bf16 compute copies
        # (ZeRO-Offload included: its fp32 masters and Adam state live on the host)
        assert all(c["dtypes"] == ({torch.float32} if composed.zero == 3 else {torch.bfloat16}) for c in ranks)


# ------------------------------------------------------------------------------------------ experts on the mesh
# MoE plans: (plan, config overrides, collapsed router). A collapsed router sends every token to expert 0 (top-1): the
# ep ranks holding the other experts receive no row, yet must take part in the all-to-all's backward (a hang before),
# and most experts receive no token in the whole batch: their gradient is zeros on the ranks and in one process
# (`core.moe.UNUSED`), so AdamW moves them alike. Odd ep (3, 5) and capacity drops (factor 1.0 with top-2) included.
MOE = {
    6: [(P(dp=6, ep=3), {"n_expert": 6, "top_k": 1}, True),
        (P(dp=6, ep=3), {"n_expert": 3, "top_k": 2, "capacity_factor": 1.0}, False)],
    8: [(P(dp=4, ep=2, tp=2), {"n_expert": 4, "top_k": 2}, False),
        (P(dp=4, ep=2, cp=2), {"n_expert": 4, "top_k": 2, "capacity_factor": 1.0}, False),
        (P(pp=2, dp=4, ep=2, num_microbatches=2), {"n_expert": 4, "top_k": 2}, False),
        (P(pp=2, dp=4, ep=4, num_microbatches=2, schedule="gpipe"), {"n_expert": 4, "top_k": 1}, True),
        (P(pp=2, dp=2, ep=2, tp=2, num_microbatches=2), {"n_expert": 4, "top_k": 2}, False),
        (P(pp=2, dp=2, ep=2, cp=2, num_microbatches=2), {"n_expert": 2, "top_k": 1}, False),
        # ZeRO over two groups: the replicated parameters' state over dp (× cp), the experts' over edp (× cp)
        (P(dp=8, ep=4, zero=1), {"n_expert": 4, "top_k": 2}, False),
        (P(pp=2, dp=4, ep=2, zero=1, num_microbatches=2), {"n_expert": 4, "top_k": 2}, False),     # DeepSeek-V3's shape
        (P(dp=2, ep=2, cp=2, tp=2, zero=2), {"n_expert": 4, "top_k": 1}, True),
        # recomputation replays a MoE block's attention g (its MoE reads it): n all-reduces per segment of n
        (P(dp=4, tp=2, recompute="sqrt"), {"n_expert": 4, "top_k": 2}, False),
        # sequence parallelism: each tp rank routes its T/tp slice; router and expert gradients summed over tp
        (P(dp=4, ep=2, tp=2, sequence_parallel=True), {"n_expert": 4, "top_k": 2}, False),
        (P(dp=2, ep=2, cp=2, tp=2, sequence_parallel=True), {"n_expert": 4, "top_k": 1}, True),
        (P(pp=2, dp=2, ep=2, tp=2, zero=1, sequence_parallel=True, num_microbatches=2), {"n_expert": 4, "top_k": 2},
         False)],
    5: [(P(dp=5, ep=5), {"n_expert": 5, "top_k": 1}, True),
        (P(dp=5, ep=5), {"n_expert": 5, "top_k": 1}, False)],
}


def _collapse(model):
    """Every MoE router's logits become (d, 0, …, 0) for any token: ln2's bias is all ones and the router reads only
    the sum of ln2's output (the normalized part sums to zero), so expert 0 wins by e^d."""
    with torch.no_grad():
        for block in model.blocks:
            block.ln2.bias.fill_(1.0)
            block.mlp.router.weight.zero_()
            block.mlp.router.weight[0].fill_(1.0)
    return model


def _moe_model(cfg, collapsed):
    model = GPT(cfg, seed=0).double()
    return _collapse(model) if collapsed else model


def _moe_worker(ctx, cases):
    from course_lib.parallel.expert import aux_loss_per_step
    torch.set_default_dtype(torch.float64)
    out = []
    for plan, cfg, collapsed, batch, reference in cases:
        tc = TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3)
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        ctx.comm.ledger.reset()
        with parallelize(_moe_model(cfg, collapsed), mesh, plan, train_config=tc) as job:
            probe = LedgerProbe(ctx.comm, groups=GROUPS + ("ep", "edp", "edp×cp"))
            run = job.train(STEPS, keep_params=True, probes=[probe])
            err = max((v - job.local_shard(k, reference[k])).abs().max().item() for k, v in run.params.items())
            layers = [m for m in job.model.modules() if hasattr(m, "received_rows")]
            aux = aux_loss_per_step(job.model, cfg, plan.num_microbatches)
            out.append({"err": err, "losses": run.losses, "aux": aux, "names": sorted(run.params),
                        "coords": mesh.coords,
                        "bytes": [{g: n for g, n in s.items() if n} for s in run["ledger"]["group_bytes"]],
                        "want": [{g: n for g, n in s.items() if n} for s in job.expected_bytes_per_step(STEPS)],
                        "received": [sum(sum(r) for r in m.received_rows) for m in layers],
                        "dropped": sum(m.last[0].dropped for m in layers)})       # in the last forward
    return out


def _moe_reference(plan, cfg, collapsed, batch):
    from course_lib.parallel.expert import set_moe_groups
    torch.set_default_dtype(torch.float64)
    try:
        model = _moe_model(cfg, collapsed)
        # one capacity group per rank's micro-batch, and per cp rank's positions of it
        set_moe_groups(model, plan.dp * plan.num_microbatches, cp=plan.cp, layout=plan.cp_layout,
                       tp=plan.tp if plan.sequence_parallel else 1)
        ref = train_reference(cfg, TrainConfig(steps=STEPS, batch_size=batch, lr=1e-3), progress=False, model=model)
    finally:
        torch.set_default_dtype(torch.float32)
    return ref, {k: v.detach() for k, v in ref.model.named_parameters()}


def _check_moe(world, cases):
    """Run `cases` [(plan, config, collapsed)] in one launch of `world` ranks; assert each equals one process and
    books exactly the formulas' bytes on every axis; returns the report lines and the results."""
    runs, refs = [], []
    for plan, overrides, collapsed in cases:
        cfg = CFG.replace(**overrides)
        batch = 2 * plan.dp * plan.num_microbatches
        plan.check(cfg, world, batch_size=batch)
        ref, params = _moe_reference(plan, cfg, collapsed, batch)
        refs.append((ref, params))
        runs.append((plan, cfg, collapsed, batch, params))
    res = launch(_moe_worker, world, runs, timeout=600)
    report = []
    for i, ((plan, overrides, collapsed), (ref, params)) in enumerate(zip(cases, refs)):
        ranks = [r[i] for r in res]
        err = max(c["err"] for c in ranks)
        name = f"{plan.describe()} {overrides}{' collapsed' if collapsed else ''}"
        report.append(f"{name:<80} max |Δ| = {err:.1e}  bytes/step (rank 0) {ranks[0]['bytes'][0]}")
        assert err < 1e-12, (name, err)
        assert set().union(*(c["names"] for c in ranks)) == set(params), name
        for c in ranks:
            assert c["bytes"] == c["want"] and all(("ep" in s) == (plan.ep > 1) for s in c["want"]), (
                name, c["coords"], c["bytes"], c["want"])
        # the last stage's losses, + inside a pipeline every stage's share of the load-balancing loss (by backward)
        for s, loss in enumerate(one_process_losses(ranks, plan)):
            assert abs(loss - ref.losses[s]) < 1e-12, (name, s)
    return report, res


@pytest.mark.parametrize("world", sorted(MOE))
def test_experts_with_a_collapsed_router_odd_ep_and_unused_experts_train_like_one_process(world):
    report, res = _check_moe(world, MOE[world])
    for i, (plan, _overrides, collapsed) in enumerate(MOE[world]):
        if collapsed:              # the case is what it says: only the ep rank holding expert 0 receives rows
            assert all(r[i]["dropped"] > 0 for r in res)       # and its capacity overflows: tokens are dropped
            got = [r[i]["received"] for r in res]
            assert all(sum(g) > 0 for g, r in zip(got, res) if r[i]["coords"]["dp"] % plan.ep == 0)
            assert all(sum(g) == 0 for g, r in zip(got, res) if r[i]["coords"]["dp"] % plan.ep != 0)
    print("\n".join(report))
