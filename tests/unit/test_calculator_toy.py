"""The toy calculator's modeled step from stated op costs (no measured time is asserted anywhere): the compute of
each rank is its blocks' and ends' share, the bubble notebook 05's simulator's, each axis α per message + bytes/B.
Bytes and model states against real ranks: tests/integration/test_calculator_toy.py."""
import pytest

from course_lib.calculator import toy
from course_lib.calculator.step_time import pipeline_factor
from course_lib.composer.parallelize import ParallelPlan
from course_lib.core.costmodel import Link
from course_lib.core.model import get_config
from course_lib.train import TrainConfig

CFG = get_config("nano", n_layer=4, n_head=4, d_model=32, seq_len=16)
TC = TrainConfig(steps=1, batch_size=8)
COSTS = {"block": 1e-3, "ends": 4e-4}                 # stated op costs, seconds per micro-batch
LINK = Link("stated", alpha=1e-4, bandwidth=1e9)


def test_modeled_step_composes_stated_op_costs_the_simulator_and_the_formulas_bytes():
    plan = ParallelPlan(pp=2, dp=2, microbatches=4)
    ranks = toy.modeled_step(CFG, plan, TC, COSTS, LINK, messages={"pp": 8, "dp": 6})
    want = toy.expected(CFG, plan, TC)
    factor = pipeline_factor("1f1b", 2, 4)
    for r, w in zip(ranks, want):
        ends = COSTS["ends"] / 2                      # stage 0 holds the embedding, stage 1 the head
        assert r["parts"]["compute"] == pytest.approx(4 * (2 * COSTS["block"] + ends), rel=1e-12)
        assert r["parts"]["bubble"] == pytest.approx(r["parts"]["compute"] * (factor - 1), rel=1e-12)
        assert r["parts"]["pp"] == pytest.approx(w["bytes"]["pp"] / 1e9 + 8e-4, rel=1e-12)
        assert r["parts"]["dp"] == pytest.approx(w["bytes"]["dp"] / 1e9 + 6e-4, rel=1e-12)
    slowest = max(r["total"] for r in ranks)
    assert toy.measured_vs_modeled(1.9 * slowest, ranks)["within"]             # TOLERANCE: a factor of 2
    assert not toy.measured_vs_modeled(2.1 * slowest, ranks)["within"]
    assert not toy.measured_vs_modeled(slowest / 2.1, ranks)["within"]


def test_a_measured_cost_per_message_replaces_the_links_alpha_and_leaves_the_bytes_term():
    plan = ParallelPlan(pp=2, dp=2, microbatches=4)
    messages = {"pp": 8, "dp": 6}
    with_link = toy.modeled_step(CFG, plan, TC, COSTS, LINK, messages=messages)
    with_ring = toy.modeled_step(CFG, plan, TC, COSTS, LINK, messages=messages, alpha=7e-4)
    for a, b in zip(with_link, with_ring):
        for axis, n in messages.items():
            assert b["parts"][axis] - a["parts"][axis] == pytest.approx(n * (7e-4 - LINK.alpha), rel=1e-9)
        assert b["parts"]["compute"] == a["parts"]["compute"] and b["parts"]["bubble"] == a["parts"]["bubble"]


def test_full_recomputation_adds_a_third_of_the_blocks_compute():
    plain = toy.modeled_step(CFG, ParallelPlan(tp=2), TC, COSTS, LINK)[0]["parts"]["compute"]
    full = toy.modeled_step(CFG, ParallelPlan(tp=2, recompute="full"), TC, COSTS, LINK)[0]["parts"]["compute"]
    assert full - plain == pytest.approx(4 * COSTS["block"] / 3 / 2, rel=1e-12)


def test_plans_the_toy_layout_does_not_count_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="precision='bf16'"):
        toy.expected(CFG, ParallelPlan(dp=2, precision="bf16"), TC)
    with pytest.raises(RuntimeError, match="cannot communicate"):
        toy.LayoutComm(0, 2, "dp").all_reduce(None)


def test_the_step_overhead_is_fitted_on_one_process_and_added_once_to_every_ranks_step():
    one = toy.modeled_step(CFG, ParallelPlan(), TC, COSTS, LINK)[0]["total"]          # no overhead given: fwd + bwd
    assert one == pytest.approx(CFG.n_layer * COSTS["block"] + COSTS["ends"], rel=1e-12)
    step = toy.step_overhead(CFG, TC, COSTS, one + 3e-3)
    assert step == pytest.approx(3e-3, rel=1e-9) and toy.step_overhead(CFG, TC, COSTS, one / 2) == 0.0
    plan = ParallelPlan(pp=2, dp=2, microbatches=4)
    with_step = toy.modeled_step(CFG, plan, TC, {**COSTS, "step": step}, LINK)
    without = toy.modeled_step(CFG, plan, TC, COSTS, LINK)
    for a, b in zip(with_step, without):
        assert a["parts"]["step overhead"] == step and a["total"] == pytest.approx(b["total"] + step, rel=1e-12)
