"""Bamboo's takeover plan and overhead formula, without ranks."""
import pytest

from course_lib.resilience.redundant import predicted_overhead, takeover


@pytest.mark.parametrize("layers, dead, after", [([2, 2, 2], [1], [4, 2]), ([2, 2, 2], [2], [2, 4]),
                                                 ([1, 1], [1], [2]), ([1, 2, 3, 4], [1, 3], [3, 7])])
def test_a_dead_stages_blocks_go_to_its_predecessor(layers, dead, after):
    assert takeover(layers, dead) == after and sum(after) == sum(layers)


def test_stage_0_and_two_neighbours_cannot_be_taken_over():
    with pytest.raises(ValueError, match="stage 0 was lost: it has no predecessor"):
        takeover([2, 2, 2], [0])
    with pytest.raises(ValueError, match=r"neighbouring stages \[1, 2\] were lost"):
        takeover([1, 1, 1, 1], [1, 2])


def test_the_redundant_forward_costs_a_third_of_a_stage_with_b_equal_2f():
    assert predicted_overhead(1.0, 2.0) == pytest.approx(1 / 3)
    assert predicted_overhead(1.0, 2.0, 2.0) == pytest.approx(2 / 3)      # a successor twice as deep
    with pytest.raises(ValueError):
        predicted_overhead(0.0, 2.0)
