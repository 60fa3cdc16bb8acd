"""The calculator's memory per device: ZeRO's model states, Korthikanti's activation terms, pipeline in-flight counts
from notebook 05's schedules, checkpoint size; and the one-line errors of bad input."""
import pytest

from course_lib.calculator import CalculatorError, Cluster, Decoder, Job, check_job, memory_per_device, param_count
from course_lib.calculator import memory as M
from course_lib.parallel.pipeline.schedules import in_flight, make_schedule

GPT = Decoder("GPT 1.7B", 24, 2304, 24, 51200, 2048)
NODE = Cluster("A100", 80e9, 312e12, 8, "NVLink 4", "InfiniBand NDR", num_devices=64)


def test_parameter_count_matches_narayanan_closed_form():
    # Narayanan SC'21 eq. (2): P = 12lh²(1 + 13/(12h) + (V + s)/(12lh)) for a GPT with biases, learned positions and
    # a tied LM head, which leaves out the final LayerNorm (2h); untied adds one more V·h
    l, h, V, s = 24, 2304, 51200, 2048
    tied = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)) + 2 * h
    assert param_count(GPT.replace(tied_embeddings=True)) == pytest.approx(tied, rel=1e-12)
    assert param_count(GPT) - param_count(GPT.replace(tied_embeddings=True)) == V * h


def test_model_states_follow_zero_stages_and_equal_the_techniques_formula():
    from course_lib.calculator.config import RECIPES
    from course_lib.parallel.zero import model_state_bytes
    psi, n = 1_000_003, 8
    for stage, want in ((0, 16 * psi), (1, 4 * psi + 12 * psi // n), (2, 2 * psi + (2 * psi) // n + 12 * psi // n),
                        (3, 2 * psi // n + 2 * psi // n + 12 * psi // n)):
        assert sum(M.model_states(psi, n, stage).values()) == want
    for name, rc in RECIPES.items():             # the calculator's copy is ZeRO's formula, recipe by recipe
        for stage in range(4):
            assert M.model_states(psi, n, stage, name) == model_state_bytes(
                psi, n, stage, param=rc.params, grad=rc.grads, optim=rc.master + rc.optimizer)
    # experts' states are shared by the expert-data-parallel group only: ZeRO-1 over 8 replicas with ep 4
    e = M.model_states(psi, n, 1, "bf16", expert_psi=psi, expert_shards=2)
    assert e["optimizer"] == 12 * psi // 8 + 12 * psi // 2 and e["parameters"] == 4 * psi


def test_fp32_gradients_recipe_is_llama3s_and_checkpoint_keeps_master_and_moments():
    from course_lib.calculator.config import RECIPES
    rc = RECIPES["bf16+fp32grads"]
    assert (rc.params, rc.grads, rc.master, rc.optimizer, rc.reduce) == (2, 4, 4, 8, 4)
    job = Job(batch=512, dp=8, tp=8, zero=1, recompute="full", sequence_parallel=True)
    a = memory_per_device(GPT, job, NODE)["device"]
    b = memory_per_device(GPT, job.replace(precision="bf16+fp32grads"), NODE)["device"]
    assert b["gradients"] == 2 * a["gradients"] and b["optimizer"] == a["optimizer"]
    assert M.checkpoint_bytes(GPT, job.replace(precision="bf16+fp32grads")) == 14 * param_count(GPT)


@pytest.mark.parametrize("schedule, S, M_, v", [("1f1b", 4, 8, 1), ("gpipe", 4, 6, 1), ("interleaved", 4, 8, 2),
                                                ("interleaved", 2, 4, 3), ("1f1b", 8, 3, 1), ("zb_h1", 4, 8, 1),
                                                ("interleaved", 8, 16, 2), ("1f1b", 16, 32, 1)])
def test_in_flight_closed_forms_equal_the_schedules_on_every_rank(schedule, S, M_, v):
    want = in_flight(make_schedule(schedule, S, M_, v))
    assert [M.in_flight_chunks(schedule, S, M_, v, r) for r in range(S)] == want


def test_activations_scale_with_tp_sp_recompute_as_korthikanti_says():
    s, b, h, a, t = 2048, 1, 6144, 64, 8
    base = sum(M.layer_activation_terms(s, b, h, a, t).values())
    assert base == s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
    sp = sum(M.layer_activation_terms(s, b, h, a, t, sp=True).values())
    assert sp == s * b * h * 34 / t + 5 * a * s * s * b / t
    assert sum(M.layer_activation_terms(s, b, h, a, t, recompute="full").values()) == 2 * s * b * h


def test_memory_per_device_by_category_and_fit():
    job = Job(batch=512, dp=8, tp=8, zero=1, recompute="full", sequence_parallel=True)
    mem = memory_per_device(GPT, job, NODE)
    psi, experts = M.rank_params(GPT, job, 0)
    assert experts == 0 and mem["params_per_device"] == int(psi) == M.device_params(GPT, job)
    assert mem["device"]["parameters"] == int(2 * psi) and mem["device"]["optimizer"] == int(12 * psi) // 8
    assert mem["fits"] and mem["total"] == sum(mem["device"].values())
    off = memory_per_device(GPT, job.replace(offload="optimizer"), NODE)
    assert off["device"]["optimizer"] == 0 and off["host"]["optimizer"] == int(12 * psi) // 8


def test_checkpoint_is_14_bytes_per_parameter_for_mixed_precision_adam():
    assert M.checkpoint_bytes(GPT, Job(batch=8)) == 14 * param_count(GPT)
    assert M.checkpoint_bytes(GPT, Job(batch=8, precision="fp32")) == 12 * param_count(GPT)


@pytest.mark.parametrize("job, words", [
    (Job(batch=64, dp=3, tp=8), ("dp × tp × pp × cp", "= 24", "world has 64", "product is 64")),
    (Job(batch=64, dp=4, tp=16), ("tp=16 does not divide the 24 heads",)),
    (Job(batch=64, dp=4, pp=16, tp=1), ("pp × chunks = 16 × 1 does not divide the 24 layers",)),
    (Job(batch=60, dp=64), ("batch of 60 sequences does not split", "multiple of 64")),
    (Job(batch=64, dp=32, pp=2, zero=3), ("zero=3 inside a pipeline",)),
])
def test_bad_input_says_what_to_change_in_one_line(job, words):
    with pytest.raises(CalculatorError) as e:
        check_job(GPT, NODE, job, world=64)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_bad_shapes_and_clusters_are_refused():
    with pytest.raises(CalculatorError, match="not a multiple of n_head"):
        Decoder("x", 2, 100, 3, 10, 8)
    with pytest.raises(CalculatorError, match="watts must be a positive finite number"):
        Cluster("x", 80e9, 1e15, 8, "NVLink 4", "InfiniBand NDR", watts=0)
    with pytest.raises(CalculatorError, match="device_memory must be a positive finite number"):
        Cluster("x", -1, 1e15, 8, "NVLink 4", "InfiniBand NDR")
