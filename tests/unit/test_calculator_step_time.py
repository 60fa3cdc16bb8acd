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


def test_layer_gemms_carry_the_layers_flops_and_sit_on_a_roofline():
    moe = Decoder("MoE", 4, 1024, 16, 32000, 2048, gated_mlp=True, n_expert=8, top_k=2, shared_experts=1,
                  d_ff=2048, learned_positions=False, dropout=False)
    for m, job in ((GPT, Job(batch=64, dp=8, tp=8)), (moe, Job(batch=64, dp=8, ep=4, tp=2))):
        tokens = job.micro_batch * m.seq_len
        for is_moe in ((False, True) if m.n_expert else (False,)):
            flops = sum(2 * r * k * n * c for r, k, n, c in S.layer_gemms(m, job, is_moe))
            assert flops == pytest.approx(S.layer_weight_flops(m, is_moe) * tokens / job.tp, rel=1e-12)
    rows, k, n = 128, 7168, 6144
    rate, bw = 989e12, 3.35e12
    assert S.gemm_seconds([(rows, k, n, 2)], rate, 2, bw) == max(2 * rows * k * n * 2 / rate,
                                                                  2 * (rows * k + k * n + rows * n) * 2 / bw)
    assert S.gemm_seconds([(rows, k, n, 1)], rate, 2, None) == 2 * rows * k * n / rate


def test_a_larger_micro_batch_helps_only_where_the_gemms_are_memory_bound():
    """An expert's share of a micro-batch is few rows: 2048 tokens × top-2 ÷ 64 experts = 64 rows per expert on
    one device, far left of H100's ridge (989 TFLOP/s ÷ 3.35 TB/s ≈ 295 FLOP per byte), so eight sequences per
    micro-batch run each token faster; a dense layer's 2048-row GEMMs are compute-bound at any micro-batch."""
    h100 = Cluster("H100", 80e9, 989e12, 8, "NVLink 4", "InfiniBand NDR", memory_bandwidth=3.35e12)
    moe = Decoder("MoE 64", 4, 2048, 16, 32000, 2048, gated_mlp=True, n_expert=64, top_k=2, d_ff=1024,
                  learned_positions=False, dropout=False)
    dense = moe.replace(n_expert=0, top_k=1, d_ff=4096)
    for m, helps in ((moe, True), (dense, False)):
        one, eight = (S.stage_times(m, Job(batch=8, micro_batch=b), h100)[1][bool(m.n_expert)] / b for b in (1, 8))
        assert (eight < 0.9 * one) if helps else eight == pytest.approx(one, rel=1e-12)


def test_the_optimizer_step_and_the_overlap_slowdown():
    from dataclasses import replace
    h100 = Cluster("H100", 80e9, 989e12, 8, "NVLink 4", "InfiniBand NDR", memory_bandwidth=3.35e12, num_devices=64)
    job = Job(batch=64, dp=8, tp=8, zero=1, sequence_parallel=True)
    st = step_time(GPT, job, h100)
    from course_lib.calculator import memory as M
    dense, _ = M.rank_params(GPT, job, 0)
    assert st["parts"]["optimizer"] == pytest.approx((2 + 2 * 4 + 2 * 8 + 2) * dense / 8 / 3.35e12, rel=1e-12)
    assert st["parts"]["overlap"] == 0                                       # no share stated
    shared = replace(h100, comm_sm_share=20 / 132)
    st2 = step_time(GPT, job, shared)
    link = S.axis_link("dp", job, shared)
    comm = S.ring_all_reduce_time(link, dense * 2, 8)
    hidden = comm - st2["parts"]["dp"]
    assert hidden > 0 and st2["parts"]["overlap"] == pytest.approx(20 / 132 * hidden, rel=1e-12)
