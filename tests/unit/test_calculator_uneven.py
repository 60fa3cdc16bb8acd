"""Uneven pipeline stages (issue 34): Llama 3's 126 layers on 16 × 2 virtual stages with the first and last one
layer lighter, DeepSeek-V3's 61 on 16. Every layer is counted (memory of the busiest rank, TP communication of
every layer of the slowest rank), the bubble comes from the actual stage times (checked against notebook 05's
simulator with per-stage costs), and the planner enumerates and places such splits."""
from fractions import Fraction

import pytest

from course_lib.calculator import ends_split, memory_per_device
from course_lib.calculator import memory as M
from course_lib.calculator import published as P
from course_lib.calculator import step_time as S
from course_lib.calculator.planner import candidates
from course_lib.parallel.pipeline.schedules import make_schedule, simulate


def test_ends_split_takes_the_shortfall_from_the_ends_inward():
    assert ends_split(126, 32) == (3,) + (4,) * 30 + (3,)                   # Llama 3 §3.3.2
    assert ends_split(61, 16) == (3, 3) + (4,) * 13 + (3,)                  # 64 − 61 = 3: first, last, second
    assert ends_split(24, 6) == (4,) * 6
    with pytest.raises(ValueError, match="cannot fill 16 stages"):
        ends_split(15, 16)


@pytest.fixture(scope="module")
def llama():
    return P.llama3_table4()[0]          # 8192 GPUs: tp 8, pp 16, v 2, 126 layers, 'ends'


def test_every_layer_is_counted_not_126_floor_16(llama):
    m, job, cl = llama["model"], llama["job"], llama["cluster"]
    st = S.step_time(m, job, cl)
    layers = [sum(M.ranks(m, job)[r][:2]) for r in range(job.pp)]
    assert sum(layers) == 126 and layers[0] == layers[-1] == 7 and set(layers[1:-1]) == {8}
    # the TP part is the per-layer charge × the slowest rank's 8 layers × M (integer division gave 7)
    link = S.axis_link("tp", job, cl)
    per = 4 * S.ring_all_reduce_time(link, job.micro_batch * m.seq_len * m.d_model * 2, job.tp)
    assert st["parts"]["tp"] == pytest.approx(per * 8 * job.num_microbatches, rel=1e-12)
    assert layers[st["busiest_rank"]] == 8
    # compute is the mean rank's: all hardware FLOPs ÷ world at the matmul rate; the rest of the makespan is bubble
    rate = cl.peak_flops
    mean = S.flops_per_token(m)["hardware"] * job.batch * m.seq_len / job.world / rate
    assert st["parts"]["compute"] == pytest.approx(mean, rel=1e-12)
    t = st["stage_times"]
    makespan = job.num_microbatches * max(sum(t[r::16]) for r in range(16)) + (sum(t) - max(sum(t[r::16])
                                                                                      for r in range(16))) / 2
    assert st["parts"]["compute"] + st["parts"]["bubble"] == pytest.approx(makespan, rel=1e-12)


def test_an_even_tuple_is_the_even_split():
    r = P.narayanan_table1()[5]
    job = r["job"]
    even = S.step_time(r["model"], job, r["cluster"])["total"]
    given = job.replace(stage_layers=(r["model"].n_layer // job.pp,) * job.pp)
    assert S.step_time(r["model"], given, r["cluster"])["total"] == even


@pytest.mark.parametrize("schedule, pp, M_, v, L, head", [
    ("1f1b", 8, 16, 1, 30, Fraction(1, 2)), ("1f1b", 16, 32, 1, 61, Fraction(2, 3)), ("1f1b", 16, 16, 1, 61, 0),
    ("interleaved", 16, 16, 2, 126, Fraction(2, 3)), ("interleaved", 8, 16, 2, 62, Fraction(1, 3)),
    ("interleaved", 4, 8, 3, 46, Fraction(1, 2)), ("zb_h1", 16, 32, 1, 61, Fraction(1, 2)),
    ("gpipe", 8, 16, 1, 30, 1), ("1f1b", 4, 8, 1, 14, 0)])
def test_the_bubble_from_actual_stage_times_against_the_simulator(schedule, pp, M_, v, L, head):
    """The closed form M·W_max + φ·(Σt − W_max)/v against notebook 05's simulator with per-stage costs, for the
    planner's ends-lighter splits (+ the LM head on the last stage): exact for GPipe and for equal stages, and
    otherwise never below the simulation and at most 4 % above it (measured 0 … 3.5 % on this grid: the closed form
    charges the fill as if every stage waited for the slowest one's pace)."""
    w = [Fraction(n) for n in ends_split(L, pp * v)]
    w[-1] += head
    tl = simulate(make_schedule(schedule, pp, M_, v), stage_weights=w)
    simulated = max(t1 for ops in tl for _, _, t1 in ops)
    closed = S.pipeline_time(schedule, [3 * x / v for x in w], pp, M_)
    assert simulated <= closed <= simulated * Fraction(104, 100), (float(simulated), float(closed))
    if schedule == "gpipe":
        assert closed == simulated
    equal = S.pipeline_time(schedule, [Fraction(3, v)] * (pp * v), pp, M_)
    even = simulate(make_schedule(schedule, pp, M_, v))
    assert equal == max(t1 for ops in even for _, _, t1 in ops)


def test_memory_is_the_busiest_ranks(llama):
    m, job, cl = llama["model"], llama["job"], llama["cluster"]
    mem = memory_per_device(m, job, cl)
    assert mem["total"] == max(mem["per_stage"]) and len(mem["per_stage"]) == 16
    r = mem["stage"]
    dense, _ = M.rank_params(m, job, r)
    n = sum(M.ranks(m, job)[r][:2])
    # activations of rank r: its in-flight chunks ÷ v × its layers × one layer's, + the embedding output on rank 0
    held = M.in_flight_chunks("interleaved", 16, job.num_microbatches, 2, r) / 2 * (
        n * M.layer_activation_bytes(m, job) + (2 * m.seq_len * m.d_model / job.tp if r == 0 else 0))
    assert mem["device"]["activations"] == pytest.approx(held, rel=1e-12)
    assert mem["device"]["gradients"] == int(4 * dense)                       # FP32 gradients (§3.3.2)


def test_the_planner_enumerates_uneven_splits_and_places_the_published_plans(llama):
    m, job, cl = llama["model"], llama["job"], llama["cluster"]
    jobs = list(candidates(m, cl, job.batch, job.world))
    assert any(j.pp == 16 and j.chunks == 2 and j.stage_layers == "ends" for j in jobs)
    assert {j.pp for j in jobs if j.stage_layers == "ends"} >= {16, 32}
