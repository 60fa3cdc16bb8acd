"""One vocabulary: each option's names belong to the technique that implements them. The plan offers exactly the
technique's names (it imports them); the calculator, which must import without torch and so cannot import the
techniques, models a stated subset of them under the same names — tied here, so a name that drifts fails."""
from course_lib.calculator import config as C
from course_lib.composer import plan as P
from course_lib.memopt.offload.optimizer import TIERS
from course_lib.memopt.precision import RECIPES, bytes_per_parameter
from course_lib.memopt.recompute import POLICIES
from course_lib.parallel.dp import DP_KINDS
from course_lib.parallel.fsdp import REPLICATION_RULES
from course_lib.parallel.pipeline.schedules import GENERATORS


def test_the_plan_offers_exactly_each_techniques_names():
    assert P.SCHEDULES == tuple(GENERATORS)
    assert set(P.RECOMPUTE) | {"none"} == set(POLICIES)
    assert P.PRECISIONS == tuple(RECIPES)
    assert P.OPTIMIZER_TIERS == TIERS
    assert P.DP_KINDS == tuple(DP_KINDS)
    assert P.REPLICATE == tuple(REPLICATION_RULES)


def test_the_calculator_models_every_schedule_and_names_only_what_the_techniques_name():
    assert C.SCHEDULES == tuple(GENERATORS)                       # every pipeline schedule the course builds
    assert set(C.RECOMPUTE) - {None} <= set(POLICIES)            # the policies Megatron's published runs used


def test_a_recipe_the_course_builds_costs_the_calculator_what_it_costs_the_course():
    """Same name, same bytes per parameter: weights, gradients, fp32 master and optimizer state. The calculator's
    other recipes (Llama 3's fp32 gradients, DeepSeek-V3's FP8) are real runs' recipes the course does not build."""
    shared = set(C.RECIPES) & set(RECIPES)
    assert {"fp32", "bf16", "fp16"} <= shared
    for name in shared:
        course, calc = bytes_per_parameter(name), C.RECIPES[name]
        assert (calc.params, calc.grads, calc.master, calc.optimizer) == (
            course["weights"], course["gradients"], course["master"], course["optimizer state"]), name
