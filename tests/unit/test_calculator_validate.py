"""One validation for every entry point of the calculator (formulas §15.6): `step_time`, `memory_per_device`, the
planner and notebook 13's widget all go through `config.validate`, and each bad input is refused with one line (a
ValueError) that names what to change. And the analytic calculator imports without torch."""
import math
import subprocess
import sys

import pytest

from course_lib.calculator import CalculatorError, Cluster, Decoder, Job, Prices, memory_per_device, search, validate
from course_lib.calculator.step_time import Efficiency, step_time
from course_lib.core.costmodel import Link

GPT = Decoder("GPT 1.7B", 24, 2304, 24, 51200, 2048)
MOE = Decoder("MoE", 24, 2304, 24, 51200, 2048, n_expert=8, top_k=2)
NODE = Cluster("A100", 80e9, 312e12, 8, "NVLink 4", "InfiniBand NDR", num_devices=64)

BAD_JOBS = [   # (model, job, words of the one-line answer) — each was priced or crashed before (issue 34)
    (GPT, Job(batch=64, dp=4, tp=16), ("tp=16 does not divide the 24 heads", "use a tp that divides")),
    (GPT, Job(batch=64, dp=4, pp=16), ("does not divide the 24 layers", "stage_layers='ends'")),
    (GPT, Job(batch=256, dp=128), ("needs 128 devices but A100 has 64", "use fewer")),
    (MOE, Job(batch=64, dp=16, ep=16), ("ep=16 needs a MoE model whose n_expert (8)", "divides")),
    (GPT, Job(batch=4, dp=8), ("batch of 4 sequences does not split", "multiple of 8")),
    (GPT, Job(batch=64, dp=8, pp=5, stage_layers=(5, 5, 5, 5, 5)), ("add up to 25", "sum to 24")),
]


@pytest.mark.parametrize("model, job, words", BAD_JOBS)
def test_every_entry_point_refuses_bad_input_with_one_line(model, job, words):
    for call in (lambda: step_time(model, job, NODE), lambda: memory_per_device(model, job, NODE),
                 lambda: validate(model, NODE, job)):
        with pytest.raises(CalculatorError) as e:
            call()
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
        assert all(w in str(e.value) for w in words), str(e.value)
    # the planner's placement of the same job carries the same line
    if job.world <= NODE.num_devices:
        p = search(model, NODE, batch=64 if job.batch % 64 == 0 else 8 * 64, world=job.world)
        assert p.place(job)["reason"] == str(pytest.raises(CalculatorError, validate, model, NODE, job).value)


@pytest.mark.parametrize("make, words", [
    (lambda: Decoder("x", 2, 64, 4, 10, 8, d_ff=0), "d_ff must be a positive integer"),
    (lambda: Decoder("x", 2, 64, 4, 10, 8, d_ff=-64), "d_ff must be a positive integer"),
    (lambda: Decoder("x", 2, 64, 4, 10, 8, n_kv_head=0), "n_kv_head must be a positive integer"),
    (lambda: Decoder("x", 2, 64, 4, 10, 8, n_kv_head=-2), "n_kv_head must be a positive integer"),
    (lambda: Decoder("x", 2, 64, 4, 10, 8, n_expert=4, top_k=8), "top_k=8 > n_expert=4"),
    (lambda: Decoder("x", 2, 64, 4, 10, 8, n_expert=4, capacity=math.nan), "capacity must be a positive finite"),
    (lambda: Cluster("x", math.nan, 1e15, 8, "NVLink 4", "InfiniBand NDR"), "device_memory must be a positive finite"),
    (lambda: Cluster("x", 80e9, math.inf, 8, "NVLink 4", "InfiniBand NDR"), "peak_flops must be a positive finite"),
    (lambda: Cluster("x", 80e9, 1e15, 8, "NVLink 4", "InfiniBand NDR", memory_bandwidth=math.inf),
     "memory_bandwidth must be a positive finite"),
    (lambda: Cluster("x", 80e9, 1e15, 8, Link("l", 1e-6, math.nan), "InfiniBand NDR"), "needs a finite bandwidth"),
    (lambda: Cluster("x", 80e9, 1e15, 8, "NVLink 4", Link("l", math.inf, 1e9)), "needs a finite alpha"),
    (lambda: Prices(math.inf, 25000, 5, 700, 1.5, 0.1), "rent_per_gpu_hour must be a finite number > 0"),
    (lambda: Prices(2.0, 25000, 5, 700, 1.5, math.inf), "electricity_per_kwh must be a finite number > 0"),
    (lambda: Job(batch=8, stage_layers=(3, 3)), "stage_layers=(3, 3)"),
    (lambda: Job(batch=8, precision="fp4"), "use one of"),
    (lambda: Efficiency(compute=math.nan), "Efficiency.compute must be a finite number > 0"),
    (lambda: Efficiency(network=0), "Efficiency.network must be a finite number > 0"),
    (lambda: Efficiency(half_width=-1.0), "Efficiency.half_width must be a finite number ≥ 0"),
])
def test_bad_shapes_clusters_and_prices_are_refused_when_made(make, words):
    with pytest.raises(CalculatorError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        make()
    assert "\n" not in str(e.value)


def test_the_planner_refuses_a_world_beyond_the_cluster_and_non_objects():
    with pytest.raises(CalculatorError, match="world=128 devices but A100 has 64"):
        search(GPT, NODE, batch=128, world=128)
    with pytest.raises(CalculatorError, match="expected a Decoder"):
        validate("GPT", NODE, Job(batch=8))


def test_the_calculator_imports_without_torch_in_under_a_second():
    """CPU seconds of the import (what it costs, whatever else the machine runs); measured 0.4 s here, against
    6–20 s when it pulled in torch."""
    code = ("import sys, time; t = time.process_time(); import course_lib.calculator; "
            "print(time.process_time() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    seconds, torch = out.stdout.split()
    assert torch == "False", "course_lib.calculator pulled in torch"
    assert float(seconds) < 1.0, seconds
