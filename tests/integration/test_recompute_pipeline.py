"""Recomputation inside pipeline stages (course_lib.memopt.recompute × course_lib.parallel.pipeline) on real gloo
ranks: a stage with dropout runs and holds exactly what its schedule predicts; with each stage's blocks recomputed
(`parallelize` with `ParallelPlan(pp=S, recompute=policy)`: `apply_recompute` on the `PipelineStage`), the activation
peak of every stage is (m − 1)·held + work — m micro-batches in flight (1F1B: S − stage), `held` what one keeps from
F to B, `work` its working set in B —
exactly, and the gradients are bitwise those of the same pipeline without recomputation (float32, dropout on) and
equal the single-process reference (float64, dropout off).

S = 2 and 3 stages of an uneven 5-block split ([3, 2] and [2, 2, 1]); one launch per S runs everything.
"""
from __future__ import annotations

import functools

import pytest
import torch

from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, activation_bytes, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.memopt.recompute import make_plan
from course_lib.memopt.recompute.costs import formula_costs
from course_lib.memopt.recompute.measured import ActivationPeakProbe
from course_lib.memopt.recompute.pipeline import pipeline_peaks
from course_lib.parallel import pipeline as P
from course_lib.train import GradProbe, TrainConfig

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=5, seq_len=16, dropout=0.1)
B = 2                                               # sequences per micro-batch


def test_peak_bytes_adds_the_backward_working_set_of_one_micro_batch():
    """By hand: 1F1B on 3 stages holds 3, 2, 1 micro-batches; during a B one of them needs `work` instead of
    `held`. GPipe holds all M before its first B."""
    s = P.make_schedule("1f1b", 3, 5)
    held, work = {0: 10, 1: 100, 2: 1000}, {0: 25, 1: 150, 2: 1200}
    assert P.peak_bytes(s, held, work) == [2 * 10 + 25, 1 * 100 + 150, 0 * 1000 + 1200]
    assert P.peak_bytes(s, held) == P.peak_bytes(s, held, held) == [30, 200, 1000]
    assert P.peak_bytes(P.make_schedule("gpipe", 3, 5), held, work) == [4 * 10 + 25, 4 * 100 + 150, 4 * 1000 + 1200]
    # a working set smaller than what is held never lowers the peak below the forward's
    assert P.peak_bytes(s, held, {k: 0 for k in held}) == [30, 200, 1000]


def test_stage_activation_bytes_count_the_embedding_dropout_mask():
    for S in (2, 3):
        bounds = P.split_layers(CFG.n_layer, S)
        assert sum(P.stage_activation_bytes(CFG, bounds, k, B) for k in range(S)) == activation_bytes(CFG, B)


# ---------------------------------------------------------------------------------------------- on ranks
POLICIES = ("none", "full", "selective", "every 2")
GRAD_TOL = 1e-12                                    # float64: the pipeline only regroups the same additions


def _plan(policy: str, n_blocks: int):
    return make_plan("every", n_blocks, k=min(2, n_blocks)) if policy == "every 2" else make_plan(policy, n_blocks)


def _step(ctx, cfg, M, policy, schedule="1f1b", dtype=None, probes=()):
    """One training step of a fresh S-stage pipeline whose stage recomputes its blocks by `policy`; the dropout
    generator is seeded per rank, so every variant draws the same masks."""
    blocks = P.split_layers(cfg.n_layer, ctx.world_size)[ctx.rank]
    torch.manual_seed(ctx.rank)
    tc = TrainConfig(steps=1, batch_size=M * B)
    model = GPT(cfg, seed=tc.seed)
    plan = ParallelPlan(pp=ctx.world_size, num_microbatches=M, schedule=schedule,
                        recompute=_plan(policy, blocks[1] - blocks[0]))
    with parallelize(model.to(dtype) if dtype is not None else model, Mesh(ctx.comm, pp=ctx.world_size), plan,
                     train_config=tc) as job:
        return job.train(tc.steps, probes=probes)


def _ranks(ctx):
    S = ctx.world_size
    M = 2 * S + 1
    out = {}
    for policy in POLICIES:
        r = _step(ctx, CFG, M, policy, probes=[ActivationPeakProbe(), GradProbe()])
        out[policy] = {"peak": r["activation peak"], "grads": r["grads"]}
    r = _step(ctx, CFG, M, "full", schedule="gpipe", probes=[ActivationPeakProbe()])
    out["gpipe full"] = {"peak": r["activation peak"]}
    r = _step(ctx, CFG.replace(dropout=0.0), M, "full", dtype=torch.float64, probes=[GradProbe()])
    out["float64 full"] = {"grads": r["grads"]}
    return out


@functools.cache
def _runs(S):
    return launch(_ranks, S, timeout=120)


def _formula(S, policy, schedule="1f1b"):
    plan = P.plan_pipeline(CFG, S, 2 * S + 1, schedule)
    plans = {k: _plan(policy, end - start) for k, (start, end) in enumerate(plan.bounds)}
    return pipeline_peaks(plan.schedule, plan.bounds, formula_costs(CFG, B), plans)


@pytest.mark.parametrize("S", [3])            # first, middle and last stage, 5 blocks split unevenly
def test_a_stage_with_dropout_holds_what_its_schedule_predicts(S):
    plan = P.plan_pipeline(CFG, S, 2 * S + 1)
    units = {k: P.stage_activation_bytes(CFG, plan.bounds, k, B) for k in range(S)}
    assert [r["none"]["peak"] for r in _runs(S)] == P.peak_bytes(plan.schedule, units) == \
        [(S - k) * units[k] for k in range(S)] == _formula(S, "none")


@pytest.mark.parametrize("S", [3])            # first, middle and last stage, 5 blocks split unevenly
def test_with_recomputation_each_stage_peaks_at_m_minus_1_held_plus_one_working_set(S):
    ranks = _runs(S)
    for policy in POLICIES[1:]:
        assert [r[policy]["peak"] for r in ranks] == _formula(S, policy), policy
    assert [r["gpipe full"]["peak"] for r in ranks] == _formula(S, "full", "gpipe")
    # full recomputation, written out: stage k holds S − k micro-batches of E + n_k·4bTd (+ H on the last stage),
    # one of them rebuilding a block (s instead of its 4bTd input) in backward
    costs, bounds = formula_costs(CFG, B), P.split_layers(CFG.n_layer, S)
    a, s = 4 * B * CFG.seq_len * CFG.d_model, costs.blocks[0].saved
    for k, r in enumerate(ranks):
        n, E, H = bounds[k][1] - bounds[k][0], costs.embed * (k == 0), costs.head * (k == S - 1)
        held = E + n * a + H
        assert r["full"]["peak"] == (S - k - 1) * held + max(held, E + (n - 1) * a + s)
        assert r["full"]["peak"] < r["selective"]["peak"] < r["none"]["peak"]


@pytest.mark.parametrize("S", [3])            # first, middle and last stage, 5 blocks split unevenly
def test_gradients_are_bitwise_those_without_recomputation_and_equal_the_reference(S):
    ranks = _runs(S)
    for policy in POLICIES[1:]:
        for r in ranks:
            assert r[policy]["grads"].keys() == r["none"]["grads"].keys()
            assert all(torch.equal(g, r["none"]["grads"][k]) for k, g in r[policy]["grads"].items()), policy
    M = 2 * S + 1
    cfg = CFG.replace(dropout=0.0)
    ref = GPT(cfg, seed=0).double()
    ref(*ShardedBatches(cfg.seq_len, M * B, seed=0).global_batch(0))[1].backward()
    grads = {k: g for r in ranks for k, g in r["float64 full"]["grads"].items()}
    assert grads.keys() == {k for k, _ in ref.named_parameters()}
    assert max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()) < GRAD_TOL
