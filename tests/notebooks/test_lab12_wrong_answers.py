"""Lab 12's checks catch the plausible wrong online-softmax merges and blockwise loops, each with the line that names
its cause.

Each wrong answer is a mutation of the solution notebook's own code (tests/notebooks/test_lab_wrong_answers.py's
pattern): the solution passes every check, and each mutation fails `check_merge` or `check_blockwise` with
`CheckFailed` whose ✘ line is exactly the one naming the mistake (one test per wrong answer). The ring check runs on
real ranks once, for the solution and for one mutation.
"""
from __future__ import annotations

import pytest

from course_lib.checks import lab12

from .test_lab_wrong_answers import _fails, _fails_with, _lab, _load

pytestmark = [pytest.mark.notebooks]

LAB12 = _lab("lab12_online_softmax.ipynb", ("merge", "blockwise_attention"))
RESCALE = "return o1 * a1 + o2 * a2, m, l1 * a1 + l2 * a2"
FACTORS = "a1, a2 = torch.exp(m1 - safe), torch.exp(m2 - safe)"
MERGE_WRONG = {     # id: (mutations, the ✘ line, a fragment of the hint)
    "o_not_rescaled": ([(RESCALE, "return o1 + o2, m, l1 * a1 + l2 * a2")],
                       "✘ merge: o' = o₁ + o₂: the two partial outputs are relative to different maxima",
                       "rescale o by e^(m−m')"),
    "max_not_subtracted": ([(FACTORS, "a1, a2 = torch.exp(m1), torch.exp(m2)")],
                           "✘ merge: ℓ' is e^(m') times too large: the exponentials were taken without subtracting "
                           "the new max", "e^(m₁ − m')"),
    "minus_inf_blocks_not_handled": ([(FACTORS, "a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)")],
                                     "✘ merge: NaN in the merged o, ℓ for rows that see no key in either part "
                                     "(m₁ = m₂ = −∞)", "subtract 0 instead"),
    "rescale_sign_flipped": ([(FACTORS, "a1, a2 = torch.exp(safe - m1), torch.exp(safe - m2)")],
                             "✘ merge: ℓ' = ℓ₁·e^(m'−m₁) + ℓ₂·e^(m'−m₂): the rescale factors' sign is flipped (each "
                             "part grows instead of shrinking to the new max)", "both are ≤ 1"),
    "rescale_sign_flipped_without_guard": ([(FACTORS, "a1, a2 = torch.exp(m - m1), torch.exp(m - m2)")],
                                           "✘ merge: ℓ' = ℓ₁·e^(m'−m₁) + ℓ₂·e^(m'−m₂): the rescale factors' sign is "
                                           "flipped (each part grows instead of shrinking to the new max)",
                                           "both are ≤ 1"),
    "l_summed_without_rescale": ([(RESCALE, "return o1 * a1 + o2 * a2, m, l1 + l2")],
                                 "✘ merge: ℓ' = ℓ₁ + ℓ₂: the two sums are relative to different maxima",
                                 "rescale each ℓ"),
    "normalised_twice": ([(RESCALE, "return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2), m, l1 * a1 + l2 * a2")],
                         "✘ merge: o' is already divided by ℓ': the final o/ℓ would normalise twice",
                         "divide by ℓ once"),
    "min_instead_of_max": ([("m = torch.maximum(m1, m2)", "m = torch.minimum(m1, m2)")],
                           "✘ merge: the merged m is not max(m₁, m₂)", "torch.maximum"),
}
MASK = "visible = pos[:, None] >= keys[None, :]"
ALL_BLOCKS = "✘ blockwise: blocks of 1, 3, 4, 16 keys: the output is wrong — "
BLOCKWISE_WRONG = {
    "running_max_started_at_0": ([('torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype)',
                                   "torch.zeros(q.shape[:-1] + (1,), dtype=q.dtype)")],
                                 "✘ blockwise: block=1: NaN in the output when every score is below −745 (−1240 at "
                                 "most; e^S underflows to 0 in float64), though N(0, 1) scores pass: the running max "
                                 "started at 0 (or another finite value) instead of −∞, so o = ℓ = 0 and o/ℓ = 0/0",
                                 "start from m = −∞"),
    "causal_mask_off_by_one": ([(MASK, "visible = pos[:, None] > keys[None, :]")],
                               ALL_BLOCKS + "it is attention with each query's own key hidden (t > s): the causal "
                                            "mask is off by one, and row 0 sees no key (0/0)", "t ≥ s"),
    "causal_mask_reversed": ([(MASK, "visible = pos[:, None] <= keys[None, :]")],
                             ALL_BLOCKS + "it is attention with the mask reversed: each query sees the keys at or "
                                          "after it", "t ≥ s"),
    "no_causal_mask": ([(MASK, "visible = torch.ones(T, len(keys), dtype=torch.bool)")],
                       ALL_BLOCKS + "it is attention without the causal mask: each query sees the keys after it",
                       "by global position"),
    "mask_by_position_in_the_block": ([(MASK, "visible = pos[:, None] >= torch.arange(len(keys))[None, :]")],
                                      "✘ blockwise: blocks of 1, 3, 4 keys: the output is wrong — it is attention "
                                      "with each block's mask built from the keys' positions inside the block "
                                      "(0 … block−1), not in the sequence", "pos[start:start + block]"),
    "shorter_last_block_skipped": ([("range(0, T, block)", "range(0, T - T % block, block)")],
                                   "✘ blockwise: blocks of 3 keys: the output is wrong — it is attention over the "
                                   "first keys only: with blocks of 3, key 15 never merged", "range(0, T, block)"),
    "last_block_skipped": ([("range(0, T, block)", "range(0, T - block, block)")],
                           ALL_BLOCKS + "it is attention over the first keys only: with blocks of 1, key 15 never "
                                        "merged; with blocks of 3, key 15 never merged; with blocks of 4, keys 12 … 15 "
                                        "never merged; with blocks of 16, keys 0 … 15 never merged",
                           "range(0, T, block)"),
    "divided_by_m": ([("o, _, l = acc", "o, l, _ = acc")],
                     ALL_BLOCKS + "it is o/m: the output was divided by the running max, not by ℓ", "o/ℓ"),
    "not_divided_by_l": ([("    return o / l  ", "    return o  ")],
                         ALL_BLOCKS + "it is o before the division: the output was not divided by ℓ",
                         "divide o by ℓ once"),
}


def test_lab12_solution_passes_merge_and_blockwise():
    ns = _load(LAB12)
    lab12.check_merge(ns["merge"])
    lab12.check_blockwise(ns["blockwise_attention"])


@pytest.mark.parametrize("mutations, line, hint", MERGE_WRONG.values(), ids=list(MERGE_WRONG))
def test_lab12_wrong_merge_fails_with_its_cause(mutations, line, hint):
    merge = _load(LAB12, mutations)["merge"]
    _fails_with(lambda: lab12.check_merge(merge), line, hint)


@pytest.mark.parametrize("mutations, line, hint", BLOCKWISE_WRONG.values(), ids=list(BLOCKWISE_WRONG))
def test_lab12_wrong_blockwise_fails_with_its_cause(mutations, line, hint):
    blockwise = _load(LAB12, mutations)["blockwise_attention"]     # with the solution's merge
    _fails_with(lambda: lab12.check_blockwise(blockwise), line, hint)


def test_lab12_a_stub_says_not_implemented_yet():
    def stub(a, b):
        raise NotImplementedError()
    _fails(lambda: lab12.check_merge(stub), "✘ merge", "not implemented yet")
    _fails(lambda: lab12.check_ring(stub, world_size=2), "✘ ring", "not implemented yet")


@pytest.mark.integration
def test_lab12_ring_passes_the_solution_and_catches_an_unrescaled_o_on_real_ranks():
    lab12.check_ring(_load(LAB12)["merge"], world_size=2)
    wrong = _load(LAB12, MERGE_WRONG["o_not_rescaled"][0])["merge"]
    _fails(lambda: lab12.check_ring(wrong, world_size=2), "✘ ring", "from reference_attention", "check_merge")
