"""ParallelPlan.check refuses, before any rank starts, every plan that cannot work — one line naming the parameter
and the fix — and accepts the combinations the composition matrix trains (tests/integration/test_parallelize.py)."""
import pytest

from course_lib.composer.plan import ParallelPlan, PlanError
from course_lib.core.model import get_config

CFG = get_config("nano", n_layer=4, n_head=4, seq_len=16)


@pytest.mark.parametrize("plan, world, batch, match", [
    (ParallelPlan(dp=2, tp=2), 8, 8, r"pp × dp × tp = 1 × 2 × 2 = 4, but there are 8 ranks"),
    (ParallelPlan(tp=3), 3, 8, r"tp_size=3 does not divide n_head=4; use tp_size in \[1, 2, 4\]"),
    (ParallelPlan(pp=5, num_microbatches=5), 5, 10, r"cannot split n_layer=4 blocks into 5 stage"),
    (ParallelPlan(pp=2, chunks=4, schedule="interleaved", num_microbatches=2), 2, 4, r"chunks=4 does not divide"),
    (ParallelPlan(pp=2, chunks=2, num_microbatches=2), 2, 4,
     r"chunks=2 \(model chunks per rank\) needs the 'interleaved' schedule"),
    (ParallelPlan(chunks=2, schedule="interleaved"), 1, 4, r"chunks=2 interleaves virtual pipeline stages, but pp=1"),
    (ParallelPlan(sequence_parallel=True), 1, 4, r"sequence_parallel .* but tp=1"),
    (ParallelPlan(dp=2, num_microbatches=3), 2, 8, r"does not split into dp × num_microbatches = 2 × 3"),
    (ParallelPlan(pp=2, dp=2, zero=3, num_microbatches=2), 4, 8, r"zero=3 \(FSDP\) inside a pipeline"),
    (ParallelPlan(dp=2, fsdp_replicate="norms+biases"), 2, 4, r"fsdp_replicate .* but zero=0"),
    (ParallelPlan(dp=2, offload_optimizer="host"), 2, 4, r"needs ZeRO-1 or 2 over dp=2"),
    (ParallelPlan(dp=2, zero=1, offload_optimizer="disk"), 2, 4, r"use precision='bf16' with it, not None"),
    (ParallelPlan(dp=2, zero=2, offload_optimizer="host", precision="fp16"), 2, 4, r"use precision='bf16'"),
    (ParallelPlan(dp=2, recompute="full", offload_activations=True), 2, 4, r"nothing left to offload"),
    (ParallelPlan(dp=2, zero=3, recompute="selective"), 2, 4, r"FSDP's gather hooks would fire again"),
    (ParallelPlan(dp=2, zero=3, offload_activations=True), 2, 4, r"FSDP's gathered weights"),
    (ParallelPlan(tp=2, sequence_parallel=True, offload_activations=True), 2, 4, r"own saved-tensor hooks"),
    (ParallelPlan(cp=3), 3, 4, r"zigzag split cuts the sequence into 6 equal chunks .* T=16 is not a multiple of 6"),
    (ParallelPlan(pp=2, cp=2, num_microbatches=2, recompute="full"), 4, 4, r"around ring attention inside a stage"),
    (ParallelPlan(pp=2, layers=(4,), num_microbatches=2), 2, 4, r"layers"),
    (ParallelPlan(layers=(2, 2)), 1, 4, r"layers=\(2, 2\) splits the blocks over pipeline stages, but pp=1"),
    (ParallelPlan(dp=2, ep=2), 2, 4, r"the model is dense"),
])
def test_a_plan_that_cannot_work_is_refused_with_the_fix(plan, world, batch, match):
    with pytest.raises(PlanError, match=match):
        plan.check(CFG, world, batch_size=batch)


MOE = CFG.replace(n_expert=4, top_k=2)


@pytest.mark.parametrize("plan, world, match", [
    (ParallelPlan(dp=2, tp=2, sequence_parallel=True, recompute="full"), 4,
     r"with sequence parallelism and experts: the replay's collectives in MoE blocks"),
    (ParallelPlan(dp=4, ep=2, recompute="full"), 4, r"repeat each MoE layer's all-to-all"),
    (ParallelPlan(dp=4, ep=2, zero=3), 4, r"FSDP and optimizer offload over those two groups are not built"),
    (ParallelPlan(dp=2, zero=2, offload_optimizer="host", precision="bf16"), 2,
     r"zero=2, offload_optimizer='host' with a mixture of experts"),
    (ParallelPlan(dp=3, ep=3), 3, r"n_expert=4 does not split over ep=3; use an ep that divides it"),
])
def test_an_moe_plan_that_cannot_work_is_refused_with_the_fix(plan, world, match):
    with pytest.raises(PlanError, match=match):
        plan.check(MOE, world, batch_size=4 * plan.dp)


@pytest.mark.parametrize("plan, world", [
    (ParallelPlan(dp=4, ep=2, tp=2), 8), (ParallelPlan(pp=2, dp=4, ep=4, num_microbatches=2), 8),
    (ParallelPlan(dp=4, ep=2, cp=2), 8), (ParallelPlan(pp=2, dp=2, ep=2, tp=2, num_microbatches=2), 8),
    (ParallelPlan(pp=2, dp=2, ep=2, cp=2, num_microbatches=2), 8),
    (ParallelPlan(pp=2, dp=4, ep=2, zero=1, num_microbatches=2), 8),
    (ParallelPlan(pp=2, dp=2, ep=2, tp=2, zero=1, sequence_parallel=True, num_microbatches=2), 8),
])
def test_experts_compose_with_tp_pp_and_cp(plan, world):
    assert plan.check(MOE, world, batch_size=4 * plan.dp) is plan


def test_a_capacity_factor_that_keeps_no_token_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match=r"capacity_factor must be > 0"):
        CFG.replace(n_expert=4, capacity_factor=0.0)


def test_sequence_parallel_under_context_parallelism_needs_tp_to_divide_each_cp_ranks_tokens():
    with pytest.raises(PlanError, match=r"splits each cp rank's T/cp = 6 tokens over tp=4; use a seq_len that is a "
                                        r"multiple of cp·tp"):
        ParallelPlan(cp=4, tp=4, sequence_parallel=True).check(CFG.replace(seq_len=24), 16)


def test_sequence_parallel_needs_tp_to_divide_the_sequence():
    with pytest.raises(PlanError, match="does not divide seq_len=17"):
        ParallelPlan(tp=2, sequence_parallel=True).check(CFG.replace(seq_len=17), 2)


def test_a_pipeline_needs_untied_embeddings():
    with pytest.raises(PlanError, match="untied embeddings"):
        ParallelPlan(pp=2, num_microbatches=2).check(CFG.replace(tie_weights=True), 2)


@pytest.mark.parametrize("field, value, match", [
    ("dp", 0, "dp must be a positive integer"), ("zero", 4, "ZeRO stage"), ("schedule", "1F1B", "use one of"),
    ("recompute", "all", "recompute='all'"), ("precision", "fp64", "precision='fp64'"),
    ("offload_optimizer", "gpu", "'host'"), ("sequence_parallel", 1, "True or False"),
    ("fsdp_replicate", -1, "positive number of elements"), ("num_microbatches", 1.5, "positive integer"),
    ("ep", 2, "ep=2 must divide dp=1"), ("cp_layout", "ring", "'zigzag'"), ("dp_kind", "ring", "dp_kind='ring'"),
    ("layers", (2, 0), "tuple of positive block counts"),
])
def test_a_field_out_of_range_is_refused_when_the_plan_is_made(field, value, match):
    with pytest.raises(PlanError, match=match):
        ParallelPlan(**{field: value})


@pytest.mark.parametrize("plan, world", [
    (ParallelPlan(pp=2, dp=2, tp=2, zero=1, num_microbatches=2, recompute="selective"), 8),
    (ParallelPlan(pp=2, dp=2, tp=2, zero=2, num_microbatches=4, schedule="interleaved", chunks=2,
                  sequence_parallel=True), 8),
    (ParallelPlan(dp=2, tp=4, zero=3, fsdp_replicate="norms+biases"), 8),
    (ParallelPlan(pp=4, tp=2, num_microbatches=4, schedule="zb_h1"), 8),
    (ParallelPlan(dp=8, zero=2, offload_optimizer="host", precision="bf16"), 8),
    (ParallelPlan(dp=3, zero=3, fsdp_replicate=64), 3),
    (ParallelPlan(pp=2, dp=2, cp=2, zero=1, num_microbatches=2, schedule="zb_h1"), 8),
    (ParallelPlan(pp=2, dp=2, num_microbatches=2, dp_kind="overlap", layers=[3, 1]), 4),
    (ParallelPlan(pp=2, dp=2, cp=2, tp=2, num_microbatches=2, zero=1, sequence_parallel=True), 16),
])
def test_plans_the_course_builds_pass_the_check(plan, world):
    assert plan.check(CFG, world, batch_size=16 if plan.dp != 3 else 12) is plan


def test_a_schedule_can_be_a_generator_and_recompute_a_plan_of_the_blocks():
    from course_lib.memopt.recompute import make_plan
    from course_lib.parallel.pipeline import one_f_one_b
    plan = ParallelPlan(pp=2, num_microbatches=3, schedule=one_f_one_b, recompute=make_plan("every", 2, k=1))
    assert plan.check(CFG, 2, batch_size=6) is plan
    assert ParallelPlan(layers=[3, 1], pp=2).layers == (3, 1)         # a list is kept as a tuple: hashable


def test_describe_names_only_what_differs_from_the_defaults():
    assert ParallelPlan(pp=2, dp=2, tp=2, zero=1, num_microbatches=4).describe() == "2×2×2 zero=1 num_microbatches=4"
