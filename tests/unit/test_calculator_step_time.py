"""The calculator's step time: FLOP counts against Narayanan's eq. (3), the pipeline factor against notebook 05's
simulator, MFU vs HFU, and which link each axis uses."""
import pytest

from course_lib.calculator import Cluster, Decoder, Job
from course_lib.calculator import step_time as S
from course_lib.calculator.step_time import step_time
from course_lib.parallel.pipeline.schedules import bubble_formula, make_schedule, simulate

GPT = Decoder("GPT 175B", 96, 12288, 96, 51200, 2048)
SELENE = Cluster("A100", 80e9, 312e12, 8, "NVLink 4", "InfiniBand NDR")


def test_hardware_flops_with_full_recompute_equal_narayanan_eq3():
    per_token = S.flops_per_token(GPT, "full")["hardware"]
    assert per_token * 1536 * GPT.seq_len == pytest.approx(S.narayanan_flops(GPT, 1536), rel=1e-12)
    # without recomputation: 3 × forward = 72·B·s·l·h²·(1 + s/(6h) + V/(12lh)) (Korthikanti's model FLOPs)
    B, s, l, h, V = 1, 2048, 96, 12288, 51200
    korthikanti = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert S.flops_per_token(GPT)["model"] * s == pytest.approx(korthikanti, rel=1e-12)


@pytest.mark.parametrize("schedule, P, M, v", [(sc, p, m, v) for sc, vs in (("gpipe", (1,)), ("1f1b", (1,)),
                                                                            ("interleaved", (2, 3)), ("zb_h1", (1,)))
                                               for p in (2, 3, 4, 6) for m in range(1, 13) for v in vs
                                               if sc != "interleaved" or m < p or m % p == 0])
def test_pipeline_factor_closed_form_equals_the_simulator(schedule, P, M, v):
    tl = simulate(make_schedule(schedule, P, M, v))
    end = max(t1 for ops in tl for _, _, t1 in ops)
    assert S.pipeline_factor(schedule, P, M, v) == pytest.approx(float(end) / (3 * M), rel=1e-15)
    if M >= P:                               # docs/formulas.md §3's bubble fractions
        closed = 1 / (1 - bubble_formula(schedule, P, M, v))
        assert float(closed) == pytest.approx(float(end) / (3 * M), rel=1e-15)


def test_parts_add_up_and_hfu_over_mfu_is_the_recompute_flops_ratio():
    job = Job(batch=1536, dp=16, tp=8, pp=12, zero=1, recompute="selective", sequence_parallel=True)
    st = step_time(GPT, job, SELENE)
    assert st["total"] == pytest.approx(sum(st["parts"].values()), rel=1e-15)
    f = st["flops_per_token"]
    assert st["hfu"] / st["mfu"] == pytest.approx(f["hardware"] / f["model"], rel=1e-12)
    assert st["tokens_per_s"] == pytest.approx(1536 * 2048 / st["total"], rel=1e-15)


def test_tp_inside_a_node_uses_the_intra_link_and_across_nodes_the_inter_link():
    inside, across = Job(batch=64, dp=8, tp=8), Job(batch=64, dp=4, tp=16)
    assert S.axis_link("tp", inside, SELENE).name == "NVLink 4"
    assert S.axis_link("tp", across, SELENE).name == "InfiniBand NDR"
    assert S.axis_link("dp", inside, SELENE).name == "InfiniBand NDR"       # dp strides over nodes
    assert S.axis_link("dp", Job(batch=64, dp=8), SELENE).name == "NVLink 4"
    t_in = step_time(GPT, inside.replace(pp=1), SELENE)["parts"]["tp"]
    t_x = step_time(GPT, across, SELENE)["parts"]["tp"]
    assert t_x > 5 * t_in                       # 50 vs 450 GB/s, and 15/16 vs 7/8 of the bytes
