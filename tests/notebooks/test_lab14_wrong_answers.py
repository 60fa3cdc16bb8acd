"""Lab 14's check catches the plausible wrong Mobius prefetch plans, each with the line that names its cause.

Each wrong answer is a mutation of the solution notebook's own plan (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes the check, and each mutation fails `check_plan` with `CheckFailed` whose ✘ line is
exactly the one naming the mistake (one test per wrong answer) — memory (a stage kept), bytes (the last stage
reloaded), order (backwards reversed, a stage dropped before its compute or not reloaded, a prefetch two ahead),
the lab's rule (a stage left on the device after the last backward) or time (a load issued after the compute it
should hide under).
"""
from __future__ import annotations

import pytest

from course_lib.checks import lab14

from .test_lab_wrong_answers import _fails, _fails_with, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB14 = _lab("lab14_mobius_prefetch.ipynb", ("mobius_prefetch_plan",))
PREFETCH = ('        if nxt is not None and nxt != ("bwd", S - 1):\n            plan.append(("load", nxt[1]))\n'
            '        plan.append((kind, s))\n')
DROP = '        if kind == "bwd" or s < S - 1:\n            plan.append(("drop", s))\n'
LAB14_WRONG = {     # id: (mutations, the ✘ line, a fragment of the hint)
    "load_after_compute": ([(PREFETCH, '        plan.append((kind, s))\n        if nxt is not None and nxt != '
                                       '("bwd", S - 1):\n            plan.append(("load", nxt[1]))\n')],
                           "✘ plan: the modeled step takes 3.341 ms, 28% longer than with one-ahead prefetch "
                           "(2.617 ms): loads wait for the compute before them", "before stage s computes"),
    "never_drops": ([(DROP, "")],
                    "✘ plan: the device ran out of its 503.75 KiB: stage 0 is still there at fwd 1, after its "
                    "forward", "drop each stage once it has computed"),
    "reloads_the_last_stage": ([('if nxt is not None and nxt != ("bwd", S - 1):', "if nxt is not None:")],
                               "✘ plan: 839,936 B came in, the formula says 708,608 (2ΣP − P_last + M(S−1)A_b): "
                               "131,328 B too many", "the last stage stays"),
    "drops_the_last_stage_after_its_forward": ([('if kind == "bwd" or s < S - 1:', "if True:")],
                                               "✘ plan: the plan drops the last stage after fwd 4 and does not load "
                                               "it again for bwd 4", "keep it on the device in between"),
    "backwards_in_forward_order": ([('[("bwd", s) for s in reversed(range(S))]', '[("bwd", s) for s in range(S)]')],
                                   "✘ plan: the plan runs bwd 0 where bwd 4 is due (forwards 0…S−1, then backwards "
                                   "S−1…0)", "backwards S−1 … 0"),
    "stage_0_never_loaded": ([('plan = [("load", 0)]', "plan = []")],
                             "✘ plan: the plan never loads stage 0: fwd 0 finds nothing on the device",
                             "start the plan with ('load', 0)"),
    "prefetch_two_ahead": ([("nxt = order[k + 1] if k + 1 < len(order) else None",
                             "nxt = order[k + 2] if k + 2 < len(order) else None")],
                           "✘ plan: the plan never loads stage 1 before fwd 1; it loads stage 2 before fwd 0, 2 "
                           "computes ahead", "prefetch one ahead"),
    "stage_0_kept_after_the_last_backward": ([('if kind == "bwd" or s < S - 1:',
                                               'if kind == "bwd" and s > 0 or kind == "fwd" and s < S - 1:')],
                                             "✘ plan: stage 0 still on the device when the step ends (the executor "
                                             "frees it for you)", "drop each stage after its backward too"),
    "drop_before_compute": ([("        plan.append((kind, s))\n" + DROP, DROP + "        plan.append((kind, s))\n")],
                            "✘ plan: the plan drops stage 0 (operation 2) after loading it (operation 0) and before "
                            "fwd 0 runs: the compute finds it gone", "never between its load and its compute"),
}


def test_lab14_solution_passes():
    lab14.check_plan(_load(LAB14)["mobius_prefetch_plan"])


@pytest.mark.parametrize("mutations, line, hint", LAB14_WRONG.values(), ids=list(LAB14_WRONG))
def test_lab14_wrong_plan_fails_with_its_cause(mutations, line, hint):
    plan = _load(LAB14, mutations)["mobius_prefetch_plan"]
    _fails_with(lambda: lab14.check_plan(plan), line, hint)


def test_lab14_a_stub_says_not_implemented_yet():
    def stub(n_stages):
        raise NotImplementedError()
    _fails(lambda: lab14.check_plan(stub), "✘ plan", "not implemented yet")
