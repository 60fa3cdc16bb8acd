"""Lab 13's checks catch the plausible wrong choices and wrong toy plans, each with the hint that names its cause.

Each wrong answer is a mutation of the solution notebook's own code (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes, each mutation fails with `CheckFailed` whose message names the mistake. The
calculator is analytic, so these run in a second; the toy run on real ranks runs once, for the solution.
"""
from __future__ import annotations

import pytest

from course_lib.checks import lab13

from .test_lab_wrong_answers import _fails, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB13 = _lab("lab13_choose_a_plan.ipynb", ("choose", "toy_plan"))
PICK = "return min(fitting, key=lambda o: o.seconds).job"

CHOOSE_WRONG = {
    "memory_not_checked": ([("fitting = [o for o in options if o.fits]", "fitting = [o for o in options if o.memory]")],
                           ("✘ choice", "does not fit", "GB per device >", "keep only the options whose memory fits")),
    "least_memory_instead_of_fastest": ([(PICK, 'return min(fitting, key=lambda o: o.memory["total"]).job')],
                                        ("✘ choice", "the least memory", "rank the options that fit by modeled step")),
    "slowest_instead_of_fastest": ([(PICK, "return max(fitting, key=lambda o: o.seconds).job")],
                                   ("✘ choice", "does not beat the baseline", "smallest modeled step time")),
    "option_instead_of_job": ([(PICK, "return min(fitting, key=lambda o: o.seconds)")],
                              ("✘ choice", "returned a Option, not a Job", "return that")),
    "technique_set_ignored": ([("candidates(model, cluster, batch, world,\n",
                                "candidates(model, cluster, batch, world)]\n#")],
                              ("✘ choice", "uses ZeRO-3, outside this lab's technique set", "**lab13.TECHNIQUES")),
    "first_that_fits": ([(PICK, "return fitting[0].job")],
                        ("✘ choice", "does not beat the baseline", "smallest modeled step time")),
}
PLAN_WRONG = {
    "sequences_not_microbatches": ([("microbatches=job.microbatches", "microbatches=job.batch // job.dp")],
                                   ("✘ toy plan", "microbatches is 4, the job's is 2",
                                    "each replica's micro-batches, not its sequences")),
    "dp_and_tp_swapped": ([("ParallelPlan(dp=job.dp, tp=job.tp,", "ParallelPlan(dp=job.tp, tp=job.dp,")],
                          ("✘ toy plan", "the plan's dp is", "dp=job.dp")),
    "recompute_dropped": ([("recompute=job.recompute)", "recompute=None)")],
                          ("✘ toy plan", "the plan's recompute is None, the job's is 'selective'")),
}


def _ns(mutations=()):
    return _load(LAB13, mutations)


def test_lab13_solution_passes_the_choice_and_the_plan():
    ns = _ns()
    job = lab13.check_choice(ns["choose"])
    assert job.world == lab13.WORLD
    lab13.check_toy_plan(ns["toy_plan"])


@pytest.mark.parametrize("mutations, hints", CHOOSE_WRONG.values(), ids=list(CHOOSE_WRONG))
def test_lab13_wrong_choice_fails_with_its_cause(mutations, hints):
    _fails(lambda: lab13.check_choice(_ns(mutations)["choose"]), *hints)


@pytest.mark.parametrize("mutations, hints", PLAN_WRONG.values(), ids=list(PLAN_WRONG))
def test_lab13_wrong_toy_plan_fails_with_its_cause(mutations, hints):
    _fails(lambda: lab13.check_toy_plan(_ns(mutations)["toy_plan"]), *hints)


def test_lab13_a_stub_says_not_implemented_yet():
    def stub(*a):
        raise NotImplementedError()
    _fails(lambda: lab13.check_choice(stub), "✘ choice", "not implemented yet")
    _fails(lambda: lab13.check_toy_plan(stub), "✘ toy plan", "not implemented yet")
    _fails(lambda: lab13.check_toy_run(stub, stub), "✘ toy run", "not implemented yet")


@pytest.mark.integration
def test_lab13_the_chosen_jobs_toy_trains_like_one_process_on_real_ranks():
    ns = _ns()
    lab13.check_toy_run(ns["toy_plan"], ns["choose"], world_size=lab13.WORLD)
