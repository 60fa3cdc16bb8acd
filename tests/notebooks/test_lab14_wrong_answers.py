"""Lab 14's check catches the plausible wrong Mobius prefetch plans, each with the hint that names its cause.

Each wrong answer is a mutation of the solution notebook's own plan (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes the check, and each mutation fails `check_plan` with `CheckFailed` whose message
names the mistake — memory (a stage kept), bytes (the last stage reloaded), order (backwards reversed, a compute
before its load) or time (a load issued after the compute it should hide under).
"""
from __future__ import annotations

import pytest

from course_lib.checks import lab14

from .test_lab_wrong_answers import _fails, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB14 = _lab("lab14_mobius_prefetch.ipynb", ("mobius_prefetch_plan",))
PREFETCH = ('        if nxt is not None and nxt != ("bwd", S - 1):\n            plan.append(("load", nxt[1]))\n'
            '        plan.append((kind, s))\n')
LAB14_WRONG = {
    "load_after_compute": ([(PREFETCH, '        plan.append((kind, s))\n        if nxt is not None and nxt != '
                                       '("bwd", S - 1):\n            plan.append(("load", nxt[1]))\n')],
                           ("✘ plan", "longer than with one-ahead prefetch", "before stage s computes")),
    "never_drops": ([('        if kind == "bwd" or s < S - 1:\n            plan.append(("drop", s))\n', "")],
                    ("✘ plan", "ran out of", "still there", "drop each stage once it has computed")),
    "reloads_the_last_stage": ([('if nxt is not None and nxt != ("bwd", S - 1):', "if nxt is not None:")],
                               ("✘ plan", "too many", "the last stage stays")),
    "drops_the_last_stage_after_its_forward": ([('if kind == "bwd" or s < S - 1:', "if True:")],
                                               ("✘ plan", "bwd 4", "not on the device", "loaded first")),
    "backwards_in_forward_order": ([('[("bwd", s) for s in reversed(range(S))]', '[("bwd", s) for s in range(S)]')],
                                   ("✘ plan", "where bwd 4 is due", "backwards S−1 … 0")),
    "stage_0_never_loaded": ([('plan = [("load", 0)]', "plan = []")],
                             ("✘ plan", "fwd 0", "not on the device", "including stage 0")),
    "prefetch_two_ahead": ([("nxt = order[k + 1] if k + 1 < len(order) else None",
                             "nxt = order[k + 2] if k + 2 < len(order) else None")],
                           ("✘ plan", "not on the device")),
}


def test_lab14_solution_passes():
    lab14.check_plan(_load(LAB14)["mobius_prefetch_plan"])


@pytest.mark.parametrize("mutations, hints", LAB14_WRONG.values(), ids=list(LAB14_WRONG))
def test_lab14_wrong_plan_fails_with_its_cause(mutations, hints):
    plan = _load(LAB14, mutations)["mobius_prefetch_plan"]
    _fails(lambda: lab14.check_plan(plan), *hints)


def test_lab14_a_stub_says_not_implemented_yet():
    def stub(n_stages):
        raise NotImplementedError()
    _fails(lambda: lab14.check_plan(stub), "✘ plan", "not implemented yet")
