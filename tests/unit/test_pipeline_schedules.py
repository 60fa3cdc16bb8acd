"""Pipeline schedules as plain data (course_lib.parallel.pipeline.schedules), without ranks: every generator gives a
schedule the validator accepts, the simulator reproduces the closed forms of docs/formulas.md §3 exactly, the
in-flight counts are 1F1B's S − r and GPipe's M, and the validator rejects what cannot run with a message that says
why."""
from fractions import Fraction

import pytest

from course_lib.parallel.pipeline import (
    GENERATORS,
    Op,
    ScheduleError,
    bubble_formula,
    bubble_fraction,
    gpipe,
    in_flight,
    make_schedule,
    one_f_one_b,
    peak_bytes,
    simulate,
    validate,
)
from course_lib.parallel.pipeline.schedules import Schedule

SHAPES = [(S, M) for S in range(1, 7) for M in range(1, 3 * S + 2)]


def _interleaved_ok(S, M):
    rounds = max(1, M // S)
    return M % rounds == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_every_generator_is_valid_for_every_shape(name):
    for S, M in SHAPES:
        s = make_schedule(name, S, M)                       # validates
        assert sum(len(ops) for ops in s.ops) == S * M * (3 if name == "zb_h1" else 2)


def test_interleaved_is_valid_wherever_its_rounds_divide_m_and_says_why_otherwise():
    for S, M in SHAPES:
        for v in (2, 3, 4):
            if _interleaved_ok(S, M):
                s = make_schedule("interleaved", S, M, v)
                assert s.num_virtual_stages == S * v and all(len(ops) == 2 * M * v for ops in s.ops)
                assert all(s.rank_of(op.stage) == r for r, ops in enumerate(s.ops) for op in ops)
            else:
                with pytest.raises(ScheduleError, match="equal rounds"):
                    make_schedule("interleaved", S, M, v)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1_on_every_rank(name):
    for S, M in SHAPES:
        got = bubble_fraction(simulate(make_schedule(name, S, M)))
        assert got == [Fraction(S - 1, M + S - 1)] * S, (S, M, got)


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1_for_m_at_least_p():
    for S, M in SHAPES:
        if M >= S and _interleaved_ok(S, M):
            for v in (2, 3, 4):
                got = bubble_fraction(simulate(make_schedule("interleaved", S, M, v)))
                assert got == [Fraction(S - 1, v * M + S - 1)] * S == [bubble_formula("interleaved", S, M, v)] * S


def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1_for_m_at_least_p():
    for S, M in SHAPES:
        if M >= S:
            got = bubble_fraction(simulate(make_schedule("zb_h1", S, M)))
            assert got == [Fraction(S - 1, 3 * M + S - 1)] * S, (S, M, got)


def test_zb_h1_idles_a_third_of_1f1b_in_time_units():
    """Qi et al. Table 2 with T_F = T_B = T_W = 1: 1F1B idles (p−1)·3 per rank, ZB-H1 (p−1)·1."""
    for S in range(2, 6):
        M = 2 * S
        for name, idle in (("1f1b", 3 * (S - 1)), ("zb_h1", S - 1)):
            tl = simulate(make_schedule(name, S, M))
            end = max(t1 for ops in tl for _, _, t1 in ops)
            assert all(end - sum(t1 - t0 for _, t0, t1 in ops) == idle for ops in tl)


def test_in_flight_gpipe_holds_m_and_1f1b_holds_s_minus_r():
    for S, M in SHAPES:
        assert in_flight(make_schedule("gpipe", S, M)) == [M] * S
        assert in_flight(make_schedule("1f1b", S, M)) == [min(S - r, M) for r in range(S)]


def test_zb_h1_keeps_1f1b_forwards_in_flight_and_at_most_s_until_w():
    for S, M in SHAPES:
        z = make_schedule("zb_h1", S, M)
        assert in_flight(z, "B") == in_flight(make_schedule("1f1b", S, M))
        assert all(n <= min(S, M) for n in in_flight(z, "W"))


def test_interleaved_in_flight_is_its_warmup_plus_one_derived():
    """Rank r runs min((v−1)·R + 2(S−1−r), v·M) warm-up forwards (R = micro-batches per round, S when S divides M),
    then one more before its first backward."""
    for S, M in SHAPES:
        if S > 1 and _interleaved_ok(S, M):
            R = M // max(1, M // S)
            for v in (2, 3):
                got = in_flight(make_schedule("interleaved", S, M, v))
                assert got == [min((v - 1) * R + 2 * (S - 1 - r) + 1, v * M) for r in range(S)], (S, M, v, got)


def test_peak_bytes_weights_each_stage_and_refuses_a_bw_split():
    s = make_schedule("1f1b", 3, 5)
    assert peak_bytes(s, {0: 10, 1: 100, 2: 1000}) == [30, 200, 1000]
    with pytest.raises(ValueError, match="W"):
        peak_bytes(make_schedule("zb_h1", 3, 5), {0: 1, 1: 1, 2: 1})


def test_op_notation_is_torch_pipelinings():
    assert str(Op("F", 2, 0)) == "2F0" and str(Op("W", 0, 13)) == "0W13"
    assert make_schedule("1f1b", 2, 2).table() == "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"


def test_simulated_costs_scale_and_comm_delays_cross_rank_inputs():
    s = make_schedule("gpipe", 2, 1)
    assert simulate(s, {"F": 3, "B": 5})[1] == [(Op("F", 1, 0), 3, 6), (Op("B", 1, 0), 6, 11)]
    timed = simulate(s, {"F": 1.0, "B": 2.0}, comm=0.5)
    assert timed[1][0][1] == 1.5 and timed[0][1][1] == 1.5 + 1.0 + 2.0 + 0.5


# ---------------------------------------------------------------------------------------------- the validator
def _custom(ops):
    return lambda S, M: ops


@pytest.mark.parametrize("ops, match", [
    ([[Op("F", 0, 0), Op("B", 0, 0), Op("F", 0, 1), Op("B", 0, 1)],
      [Op("F", 1, 0), Op("F", 1, 1), Op("B", 1, 0), Op("B", 1, 1)]], "deadlock: .*rank 0 waits at 0B0 for \\['1B0'\\]"),
    ([[Op("B", 0, 0), Op("F", 0, 0)], [Op("F", 1, 0), Op("B", 1, 0)]], "deadlock"),
    ([[Op("F", 0, 0), Op("B", 0, 0)], [Op("F", 1, 0)]], "1B0 is missing"),
    ([[Op("F", 0, 0), Op("F", 0, 0), Op("B", 0, 0)], [Op("F", 1, 0), Op("B", 1, 0)]], "twice"),
    ([[Op("F", 1, 0), Op("B", 0, 0)], [Op("F", 0, 0), Op("B", 1, 0)]], "lives on rank"),
    ([[Op("F", 0, 0), Op("B", 0, 0)], [Op("F", 1, 0), Op("B", 1, 0)], []], "2 ranks|3 ranks"),
    ([[Op("F", 0, 0), Op("X", 0, 0)], [Op("F", 1, 0), Op("B", 1, 0)]], "kind"),
    ([[Op("F", 0, 0), Op("B", 0, 5)], [Op("F", 1, 0), Op("B", 1, 0)]], "outside"),
])
def test_validator_rejects_what_cannot_run_and_says_why(ops, match):
    M = 1 + max(op.mb for rank in ops for op in rank if op.mb < 5)
    with pytest.raises(ScheduleError, match=match):
        make_schedule(_custom(ops), 2, M)


def test_validator_rejects_a_w_without_split_or_a_missing_w():
    ops = [list(o) for o in make_schedule("zb_h1", 2, 2).ops]
    ops[0] = [o for o in ops[0] if str(o) != "0W1"]
    with pytest.raises(ScheduleError, match="0W1 is missing"):
        make_schedule(_custom(ops), 2, 2)


def test_make_schedule_rejects_bad_shapes_and_unknown_names():
    for bad in (dict(num_stages=0, num_microbatches=1), dict(num_stages=2, num_microbatches=0),
                dict(num_stages=2, num_microbatches=2.0)):
        with pytest.raises(ScheduleError, match="positive integer"):
            make_schedule("1f1b", **bad)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make_schedule("2f2b", 2, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        make_schedule("1f1b", 2, 2, chunks=2)


def test_validate_checks_a_hand_built_schedule_object():
    s = Schedule("hand", 2, 1, 1, ((Op("F", 0, 0), Op("B", 0, 0)), (Op("F", 1, 0), Op("B", 1, 0))))
    assert validate(s) is s and set(GENERATORS) == {"gpipe", "1f1b", "interleaved", "zb_h1"}
    assert gpipe(2, 1)[1] == list(s.ops[1]) and one_f_one_b(2, 1) == [list(o) for o in s.ops]
