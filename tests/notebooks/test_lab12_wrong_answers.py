"""Lab 12's checks catch the plausible wrong online-softmax merges, each with the hint that names its cause.

Each wrong answer is a mutation of the solution notebook's own merge (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes every check, and each mutation fails `check_merge` with `CheckFailed` whose message
names the mistake. The ring check runs on real ranks once, for the solution and for one mutation.
"""
from __future__ import annotations

import pytest

from course_lib.checks import CheckFailed, lab12

from .test_lab_wrong_answers import _fails, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB12 = _lab("lab12_online_softmax.ipynb", ("merge", "blockwise_attention"))
RESCALE = "return o1 * a1 + o2 * a2, m, l1 * a1 + l2 * a2"
LAB12_WRONG = {
    "o_not_rescaled": ([(RESCALE, "return o1 + o2, m, l1 * a1 + l2 * a2")],
                       ("✘ merge", "o' = o₁ + o₂", "rescale o by e^(m−m')")),
    "max_not_subtracted": ([("a1, a2 = torch.exp(m1 - safe), torch.exp(m2 - safe)",
                             "a1, a2 = torch.exp(m1), torch.exp(m2)")],
                           ("✘ merge", "without subtracting the new max", "e^(m₁ − m')")),
    "minus_inf_blocks_not_handled": ([("torch.exp(m1 - safe), torch.exp(m2 - safe)", "torch.exp(m1 - m), torch.exp(m2 - m)")],
                                     ("✘ merge", "NaN", "m₁ = m₂ = −∞", "subtract 0 instead")),
    "l_summed_without_rescale": ([(RESCALE, "return o1 * a1 + o2 * a2, m, l1 + l2")],
                                 ("✘ merge", "ℓ' = ℓ₁ + ℓ₂", "rescale each ℓ")),
    "normalised_twice": ([(RESCALE, "return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2), m, l1 * a1 + l2 * a2")],
                         ("✘ merge", "already divided by ℓ'", "normalise twice", "divide by ℓ once")),
    "min_instead_of_max": ([("m = torch.maximum(m1, m2)", "m = torch.minimum(m1, m2)")],
                           ("✘ merge", "is not max(m₁, m₂)")),
}


def test_lab12_solution_passes_merge_and_blockwise():
    ns = _load(LAB12)
    lab12.check_merge(ns["merge"])
    lab12.check_blockwise(ns["blockwise_attention"])


@pytest.mark.parametrize("mutations, hints", LAB12_WRONG.values(), ids=list(LAB12_WRONG))
def test_lab12_wrong_merge_fails_with_its_cause(mutations, hints):
    merge = _load(LAB12, mutations)["merge"]
    _fails(lambda: lab12.check_merge(merge), *hints)


def test_lab12_blockwise_without_the_final_division_is_caught():
    blockwise = _load(LAB12, [("    return o / l  ", "    return o  ")])["blockwise_attention"]
    _fails(lambda: lab12.check_blockwise(blockwise), "✘ blockwise", "from reference_attention", "divide o by ℓ once")


def test_lab12_a_stub_says_not_implemented_yet():
    def stub(a, b):
        raise NotImplementedError()
    _fails(lambda: lab12.check_merge(stub), "✘ merge", "not implemented yet")
    _fails(lambda: lab12.check_ring(stub, world_size=2), "✘ ring", "not implemented yet")


@pytest.mark.integration
def test_lab12_ring_passes_the_solution_and_catches_an_unrescaled_o_on_real_ranks():
    lab12.check_ring(_load(LAB12)["merge"], world_size=2)
    wrong = _load(LAB12, LAB12_WRONG["o_not_rescaled"][0])["merge"]
    _fails(lambda: lab12.check_ring(wrong, world_size=2), "✘ ring", "from reference_attention", "check_merge")
