"""Our pipeline against PyTorch's own, `torch.distributed.pipelining`, on the same split of the same GPT, on real gloo
ranks (S = 2, 3, 4): the schedule tables agree op by op with `pipeline_order` (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble with one stage per rank = ZB-H1) for several M, and one
float64 step gives the same gradients as ours and as one process's.

One documented difference: torch 2.13's Schedule1F1B *table* numbers the last rank's forwards from 1 (F1 … FM);
its execution does not (its gradients equal ours), so on that rank we assert exactly that shift.
"""
from __future__ import annotations

import functools

import pytest

from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.parallel import pipeline as P
from course_lib.parallel.pipeline.reference import torch_order, torch_pipeline_run, torch_schedule
from course_lib.train import GradProbe, TrainConfig

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=12, seq_len=16)
B = 2
CHUNKS = {2: 2, 3: 2, 4: 3}
NAMES = ("gpipe", "1f1b", "interleaved", "zb_h1")


def _chunks(name, S):
    return CHUNKS[S] if name == "interleaved" else 1


def _ms(name, S):
    """Micro-batch counts torch accepts for the schedule: 1F1B needs M ≥ S; interleaved and its zero-bubble sibling
    need M to split into equal rounds of about S (the same rule as ours)."""
    return [M for M in (S, 2 * S, 2 * S + 1, 3 * S) if name in ("gpipe", "1f1b") or M % max(1, M // S) == 0]


def _torch_side(ctx):
    S = ctx.world_size
    orders = {(name, M): torch_order(torch_schedule(ctx, CFG, name, M, chunks=_chunks(name, S))[0], ctx.rank)
              for name in NAMES for M in _ms(name, S)}
    mesh, tc, runs = Mesh(ctx.comm, pp=S), TrainConfig(steps=1, batch_size=S * B), {}
    for name in NAMES:
        theirs = torch_pipeline_run(ctx, CFG, tc, name, S, chunks=_chunks(name, S))
        plan = ParallelPlan(pp=S, schedule=name, microbatches=S, chunks=_chunks(name, S))
        with parallelize(GPT(CFG, seed=tc.seed).double(), mesh, plan, train_config=tc) as job:
            ours = job.train(tc.steps, probes=[GradProbe()])
        runs[name] = {"torch": theirs["grads0"], "ours": ours["grads"], "torch_loss": theirs["losses"],
                      "our_loss": ours.losses}
    return {"orders": orders, "runs": runs}


@functools.cache
def _runs(S):
    return launch(_torch_side, S, timeout=300)


@pytest.mark.parametrize("S", [2, 3, 4])
def test_our_schedule_tables_equal_torch_pipeline_order_op_by_op(S):
    res = _runs(S)
    for name in NAMES:
        for M in _ms(name, S):
            ours = P.make_schedule(name, S, M, _chunks(name, S))
            for r in range(S):
                theirs = res[r]["orders"][(name, M)]
                want = [str(op) for op in ours.ops[r]]
                if name == "1f1b" and r == S - 1:      # torch's table (not its execution) counts these from 1
                    want = [f"{op.stage}F{op.mb + 1}" if op.kind == "F" else str(op) for op in ours.ops[r]]
                assert theirs == want, (name, S, M, r)


@pytest.mark.parametrize("S", [2, 3, 4])
def test_one_step_gives_torch_pipelinings_gradients_and_one_process(S):
    res = _runs(S)
    model = GPT(CFG).double()
    model(*ShardedBatches(CFG.seq_len, S * B).global_batch(0))[1].backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    for name in NAMES:
        theirs = {k: g for r in res for k, g in r["runs"][name]["torch"].items()}
        ours = {k: g for r in res for k, g in r["runs"][name]["ours"].items()}
        assert theirs.keys() == ours.keys() == ref.keys()
        assert max((theirs[k] - ours[k]).abs().max().item() for k in ref) < 1e-12, name
        assert max((theirs[k] - ref[k]).abs().max().item() for k in ref) < 1e-12, name
        assert abs(res[-1]["runs"][name]["torch_loss"][0] - res[-1]["runs"][name]["our_loss"][0]) < 1e-12
