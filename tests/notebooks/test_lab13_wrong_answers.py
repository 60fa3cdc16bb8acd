"""Lab 13's checks catch the plausible wrong choices and wrong toy plans, each with the line that names its cause.

Each wrong answer is a mutation of the solution notebook's own code (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes, each mutation fails with `CheckFailed` whose ✘ line is exactly the one naming the
mistake (one test per wrong answer). The calculator is analytic, so these run in a second; the toy run on real ranks
runs for the solution's job (dp = 1) and for jobs with dp = 2 and 4, where each replica reports the mean loss over
its own micro-batches and the check must compare the replicas' mean with one process's.
"""
from __future__ import annotations

import pytest

from course_lib.calculator import Job
from course_lib.calculator.planner import candidates, evaluate
from course_lib.calculator.published import fitted_efficiency
from course_lib.checks import lab13

from .test_lab_wrong_answers import _fails, _fails_with, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB13 = _lab("lab13_choose_a_plan.ipynb", ("choose", "toy_plan"))
PICK = "return min(fitting, key=lambda o: o.seconds).job"

# The figures in each ✘ line come from the calculator (lab13.options(): every option of the exercise's technique set,
# evaluated), so they follow the calculator's model; what the tests pin is which option each wrong answer picks.
OPTIONS = lab13.options()
FITS = [o for o in OPTIONS if o.fits]
FASTEST = min(FITS, key=lambda o: o.seconds)
BEST = f"the fastest that fits, {FASTEST.job.describe()}, takes {FASTEST.seconds:.2f} s"
NO_FIT = min(OPTIONS, key=lambda o: o.seconds)              # what a choice that never checks memory returns
LEAST = min(FITS, key=lambda o: o.memory["total"])
SLOWEST = max(FITS, key=lambda o: o.seconds)
_ALL = [evaluate(lab13.MODEL, lab13.cluster(), j, fitted_efficiency(), lab13.WORLD)
        for j in candidates(lab13.MODEL, lab13.cluster(), lab13.BATCH, lab13.WORLD)]
OUTSIDE = min((o for o in _ALL if o.fits), key=lambda o: o.seconds)    # the fastest of every technique: ZeRO-3
CHOOSE_WRONG = {    # id: (mutations, the ✘ line, a fragment of the hint)
    "memory_not_checked": ([("fitting = [o for o in options if o.fits]", "fitting = [o for o in options if o.memory]")],
                           f"✘ choice: {NO_FIT.job.describe()} does not fit: {NO_FIT.reason}",
                           "keep only the options whose memory fits"),
    "least_memory_instead_of_fastest": ([(PICK, 'return min(fitting, key=lambda o: o.memory["total"]).job')],
                                        f"✘ choice: {LEAST.job.describe()} is the option with the least memory "
                                        f"({LEAST.memory['total'] / lab13.GB:.1f} GB), {LEAST.seconds:.2f} s/step; "
                                        f"the fastest that fits takes {FASTEST.seconds:.2f} s",
                                        "rank the options that fit by modeled step"),
    "slowest_instead_of_fastest": ([(PICK, "return max(fitting, key=lambda o: o.seconds).job")],
                                   f"✘ choice: {SLOWEST.job.describe()} is the slowest option that fits: "
                                   f"{SLOWEST.seconds:.2f} s/step (modeled); {BEST}", "smallest modeled step time"),
    "option_instead_of_job": ([(PICK, "return min(fitting, key=lambda o: o.seconds)")],
                              "✘ choice: choose returned an Option, not a Job", "return that"),
    "technique_set_ignored": ([("candidates(model, cluster, batch, world,\n",
                                "candidates(model, cluster, batch, world)]\n#")],
                              f"✘ choice: {OUTSIDE.job.describe()} uses ZeRO-{OUTSIDE.job.zero}, outside this lab's "
                              f"technique set {lab13.TECHNIQUES}", "**lab13.TECHNIQUES"),
    "first_that_fits": ([(PICK, "return fitting[0].job")],
                        f"✘ choice: {FITS[0].job.describe()} is the first option that fits (in candidates' "
                        f"order): {FITS[0].seconds:.2f} s/step (modeled); {BEST}", "smallest modeled step time"),
}


def test_each_wrong_choice_picks_a_different_option_than_the_right_one():
    """The cases are what they claim: each wrong rule lands on an option other than the fastest that fits."""
    assert len({o.job for o in (FASTEST, NO_FIT, LEAST, SLOWEST, FITS[0], OUTSIDE)}) == 6
    assert not NO_FIT.fits and OUTSIDE.job.zero == 3


PLAN = "recompute=job.recompute)"
PLAN_WRONG = {
    "sequences_not_microbatches": ([("num_microbatches=job.num_microbatches", "num_microbatches=job.batch // job.dp")],
                                   "✘ toy plan: dp2·tp1·pp2 mb2 recompute=full: the plan's num_microbatches is 4, the "
                                   "job's is 2", "each replica's micro-batches, not its sequences"),
    "dp_and_tp_swapped": ([("ParallelPlan(dp=job.dp, tp=job.tp,", "ParallelPlan(dp=job.tp, tp=job.dp,")],
                          "✘ toy plan: dp1·tp2·pp2 mb1 schedule=interleaved chunks=2 sequence_parallel=True: the "
                          "plan's dp is 2, the job's is 1", "dp=job.dp"),
    "recompute_dropped": ([(PLAN, "recompute=None)")],
                          "✘ toy plan: dp2·tp2·pp1 mb1 sequence_parallel=True recompute=selective: the plan's "
                          "recompute is None, the job's is 'selective'", "recompute=job.recompute"),
    "the_jobs_bf16_precision": ([(PLAN, "recompute=job.recompute, precision=job.precision)")],
                                "✘ toy plan: dp2·tp2·pp1 mb1 sequence_parallel=True recompute=selective: the plan's "
                                "precision is 'bf16', the toy's is None", "the toy runs in float64"),
    "layers_set": ([(PLAN, "recompute=job.recompute, layers=(2, 2))")],
                   "✘ toy plan: dp2·tp2·pp1 mb1 sequence_parallel=True recompute=selective: the plan's layers is "
                   "(2, 2), the toy's is None", "leave layers at its default"),
}
# jobs with dp > 1 for the toy run (the lab's own choice has dp = 1): each replica's loss is its own micro-batches' mean
DP_JOBS = {"dp2_tp2_sp_selective": Job(batch=8, dp=2, tp=2, zero=1, sequence_parallel=True, recompute="selective"),
           "dp2_pp2_full": Job(batch=8, dp=2, pp=2, zero=1, recompute="full"),
           "dp4": Job(batch=8, dp=4, zero=1)}


def _ns(mutations=()):
    return _load(LAB13, mutations)


def test_lab13_solution_passes_the_choice_and_the_plan():
    ns = _ns()
    job = lab13.check_choice(ns["choose"])
    assert job.world == lab13.WORLD
    lab13.check_toy_plan(ns["toy_plan"])


@pytest.mark.parametrize("mutations, line, hint", CHOOSE_WRONG.values(), ids=list(CHOOSE_WRONG))
def test_lab13_wrong_choice_fails_with_its_cause(mutations, line, hint):
    _fails_with(lambda: lab13.check_choice(_ns(mutations)["choose"]), line, hint)


@pytest.mark.parametrize("mutations, line, hint", PLAN_WRONG.values(), ids=list(PLAN_WRONG))
def test_lab13_wrong_toy_plan_fails_with_its_cause(mutations, line, hint):
    _fails_with(lambda: lab13.check_toy_plan(_ns(mutations)["toy_plan"]), line, hint)


def test_lab13_the_toy_run_names_a_wrong_plan_before_any_rank_starts():
    wrong = _ns(PLAN_WRONG["the_jobs_bf16_precision"][0])["toy_plan"]
    _fails_with(lambda: lab13.check_toy_run(wrong, lambda *a: DP_JOBS["dp2_tp2_sp_selective"]),
                PLAN_WRONG["the_jobs_bf16_precision"][1].replace("✘ toy plan", "✘ toy run"), "float64")


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


@pytest.mark.integration
@pytest.mark.parametrize("job", DP_JOBS.values(), ids=list(DP_JOBS))
def test_lab13_a_correct_plan_passes_the_toy_run_at_dp_above_1(job):
    lab13.check_toy_run(_ns()["toy_plan"], lambda *a: job, world_size=lab13.WORLD)
