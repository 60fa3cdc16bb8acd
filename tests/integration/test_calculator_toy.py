"""The capstone's calculator against the course's own runs: for plans of `parallelize` on real gloo ranks, the bytes
each rank sends per step on each mesh axis (the ledger) and its parameters, gradients and optimizer state after a
step (the memory accountant) equal `calculator.toy.expected` — exactly: both are integer counts of the same layout
(TP shards with the padded vocabulary, the stage split, the DDP / ZeRO / FSDP buckets), and the calculator reads
that layout from the techniques themselves, built on layout communicators, before any rank starts.

Step time is not asserted here (a measured time ratio is not a test: `calculator.toy.measured_vs_modeled` is the
notebook's comparison, formulas §15.7).
"""
import pytest

from course_lib.calculator import toy
from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.train import LedgerProbe, MemoryProbe, TrainConfig

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=4, n_head=4, d_model=32, seq_len=16, vocab_size=258)  # tp=4 pads it to 260
STEPS = 1
GROUPS = ("pp", "dp", "cp", "tp", "dp×cp")
STATES = ("parameters", "gradients", "optimizer")
P = ParallelPlan

# one launch of 8 ranks: every axis, each ZeRO stage, SP, both recomputation kinds, interleaving, a padded vocabulary
PLANS = [P(pp=2, dp=2, tp=2, microbatches=2),
         P(pp=2, dp=2, tp=2, microbatches=4, zero=1, schedule="interleaved", chunks=2, sequence_parallel=True,
           recompute="selective"),
         P(dp=2, tp=4, zero=3, sequence_parallel=True),
         P(pp=4, tp=2, microbatches=4, schedule="zb_h1", recompute="full"),
         P(dp=4, cp=2, zero=2)]


def _worker(ctx, plans, tc):
    out = []
    for plan in plans:
        mesh = Mesh(ctx.comm, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp)
        ctx.comm.ledger.reset()
        with parallelize(GPT(CFG, seed=tc.seed), mesh, plan, train_config=tc) as job:
            run = job.train(STEPS, probes=[LedgerProbe(ctx.comm, groups=GROUPS), MemoryProbe(timeline=False)])
        out.append({"bytes": [{g: n for g, n in s.items() if n} for s in run["ledger"]["group_bytes"]],
                    "memory": {k: run["memory"]["after_step"][-1].get(k, 0) for k in STATES},
                    "coords": {a: mesh.coords[a] for a in ("pp", "dp", "cp", "tp")}})
    return out


def test_calculator_bytes_per_axis_and_model_states_equal_the_ledger_and_the_accountant():
    tc = TrainConfig(steps=STEPS, batch_size=8, lr=1e-3)
    plans = PLANS
    want = [toy.expected(CFG, plan, tc) for plan in plans]          # before any rank starts
    res = launch(_worker, 8, plans, tc, timeout=300)
    for i, plan in enumerate(plans):
        for rank, r in enumerate(res):
            got, calc = r[i], want[i][rank]
            assert got["coords"] == calc["coords"], (plan.describe(), rank)
            assert got["bytes"] == [calc["bytes"]] * STEPS, (plan.describe(), rank, got["bytes"], calc["bytes"])
            assert got["memory"] == calc["memory"], (plan.describe(), rank, got["memory"], calc["memory"])
        assert any(len(c["bytes"]) == sum(getattr(plan, a) > 1 for a in ("pp", "tp", "cp")) + (plan.dp * plan.cp > 1)
                   for c in want[i]), plan.describe()                    # every axis of the plan carries bytes
