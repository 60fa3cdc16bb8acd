"""The capstone's worker (`course_lib.capstone`) runs unchanged under torchrun: `torch.distributed.run --standalone`
starts the ranks (env:// rendezvous, gloo on CPU), `course_lib.run` hands each its rank, and the composed run —
pp × dp × tp with ZeRO-1, 1F1B and selective recomputation, float64 — equals one process on every rank (1e-12),
sends exactly the formulas' bytes on every mesh axis and holds exactly the formula's model states. The notebook
(13) runs the same worker through `launch`; the README gives the multi-node command lines (NCCL on GPUs)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.capstone import composed_shape

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4                   # pp × dp × tp = 2 × 1 × 2: a pipeline of tensor-parallel stages (8 in the notebook)


def test_the_capstone_worker_runs_unchanged_under_torchrun(tmp_path):
    # TMPDIR: torchrun leaves its log directory (torchelastic_*) and error file in the temporary directory
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           "-m", "course_lib.run", "course_lib.capstone:torchrun_worker", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == NPROC, out.stdout
    assert composed_shape(NPROC) == {"pp": 2, "dp": 1, "tp": 2}
    for i, line in enumerate(lines):
        r = ast.literal_eval(line.split(": ", 1)[1])
        assert r["err"] < 1e-12, (i, r)                     # float64: one process's parameters to rounding
        assert r["bytes_equal"] and r["state_equal"], (i, r)
        assert set(r["want"]) == {"pp", "tp"}, (i, r)       # dp = 1: nothing to reduce
        if r["loss_err"] is not None:                       # the last stage computes the loss
            assert r["loss_err"] < 1e-12, (i, r)


def test_the_time_worker_returns_every_steps_seconds_and_each_axis_messages_per_step():
    """What notebook 13 §3 models the toy's step from: the ping-pong's one-way times, the seconds per message of
    ring all-reduces (back to back, and each after a block's forward + backward), each step's seconds, and the
    messages per step on each axis — for DDP on 2 ranks, the dp all-reduces only."""
    from course_lib.capstone import CONFIG, Job, time_worker
    from course_lib.composer.plan import ParallelPlan
    from course_lib.core.model import get_config
    from course_lib.distributed.launch import launch
    from course_lib.train import TrainConfig
    cfg = get_config("nano", **{**CONFIG, "n_layer": 2})
    jobs = [Job("DDP", ParallelPlan(dp=2), cfg, TrainConfig(steps=1, batch_size=8), "float32"),
            Job("pipeline", ParallelPlan(pp=2, microbatches=2), cfg, TrainConfig(steps=1, batch_size=8), "float32")]
    res = launch(time_worker, 2, jobs, 3, [8, 4096], 6, timeout=120)
    for r in res:
        assert len(r["one_way"]) == 2 and all(t > 0 for t in r["one_way"])
        for key in ("ring_messages", "ring_messages_after_compute"):                    # back to back; after compute
            assert len(r[key]) == 6 and all(t > 0 for t in r[key]), key                   # 3 before, 3 after
        ddp, pipe = r["jobs"]
        assert len(ddp["seconds"]) == len(pipe["seconds"]) == 3 and all(s > 0 for s in ddp["seconds"])
        assert set(ddp["messages"]) == {"dp"} and set(pipe["messages"]) == {"pp"}
    # 1F1B with 2 micro-batches: each stage sends 2 boundary tensors per step (activations forward or gradients back)
    assert [r["jobs"][1]["messages"]["pp"] for r in res] == [2, 2]


def test_each_survey_rows_activation_peak_equals_its_closed_form_on_another_model():
    """The survey's act. peak column (notebook 13 §3) on a model the notebook does not run — 3 layers, d = 48,
    6 heads, 3 sequences per rank — so the formulas must hold for the shape, not for the toy's numbers: one
    process, a 3-stage-in-flight pipeline, TP and SP, CP, offload, every recomputation policy, bf16."""
    from course_lib.capstone import Job
    from course_lib.capstone.survey import activation_formula, survey_worker
    from course_lib.composer.plan import ParallelPlan as P
    from course_lib.core.model import get_config
    from course_lib.distributed.launch import launch
    from course_lib.train import TrainConfig
    cfg = get_config("nano", n_layer=3, d_model=48, n_head=6, seq_len=16, vocab_size=200)
    tc = TrainConfig(steps=1, batch_size=6, seed=3, data_seed=3)
    plans = {"dp": P(dp=2), "gpipe": P(pp=2, microbatches=3, schedule="gpipe"), "1f1b": P(pp=2, microbatches=3),
             "tp": P(tp=2), "sp": P(tp=2, sequence_parallel=True), "cp": P(cp=2),
             "offload": P(dp=2, offload_activations=True), "full": P(dp=2, recompute="full"),
             "selective": P(dp=2, recompute="selective"), "sqrt": P(dp=2, recompute="sqrt"),
             "bf16": P(dp=2, precision="bf16")}
    jobs = [Job(name, plan, cfg, tc, "float32") for name, plan in plans.items()]
    res = launch(survey_worker, 2, jobs, timeout=300)
    for i, job in enumerate(jobs):
        for r in (ranks[i] for ranks in res):
            want, source = activation_formula(job, r["coords"])
            assert want is not None and r["saved"] == want, (job.name, r["coords"], r["saved"], want, source)
