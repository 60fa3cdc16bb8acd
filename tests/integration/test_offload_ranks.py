"""Offload on real gloo ranks. ZeRO-Offload composed with ZeRO-2 (`apply_offload(model, mesh)`): each rank offloads
only the optimizer state of its shard. Per-rank bytes on the device, the host and the disk (exact), link bytes 2P/N
each way and wire bytes (exact), equality with the non-offloaded mixed-precision ZeRO-2 (bitwise) and, in float64,
with one process (docs/formulas.md §2.2, §6.1). Activation offload inside pipeline stages run by the executor
(several micro-batches in flight): bitwise the pipeline without offload, and each stage's device activations by
the formula for the micro-batches it holds (§6.4)."""
from __future__ import annotations

import os

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.handles import handle_of
from course_lib.core.model import (
    GPT,
    GPTConfig,
    block_activation_bytes,
    embed_activation_bytes,
    get_config,
    head_activation_bytes,
)
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh, data_parallel_batches
from course_lib.memopt.offload import OffloadAdam, apply_activation_offload, apply_offload, offload_log
from course_lib.parallel.pipeline.executor import apply_pipeline
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run

pytestmark = pytest.mark.integration

ODD = GPTConfig(seq_len=31, n_layer=2, n_head=5, d_model=35)      # Ψ = 49,385: every world size pads
STEPS = 3
CAP = 64_000


def _worker(ctx, tier, dtype, offload_dir=None):
    torch.set_num_threads(1)
    tc = TrainConfig(steps=STEPS, batch_size=6 * ctx.world_size, eps=1e-6)
    mesh = Mesh(ctx.comm, dp=ctx.world_size)
    model = apply_offload(GPT(ODD, seed=tc.seed), mesh, activations=False, optimizer=tier, dtype=dtype,
                          master_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          bucket_cap_bytes=CAP, offload_dir=offload_dir, chunk_bytes=16 << 10)
    opt = optim.build(model, **optimizer_kwargs(tc))
    batches = data_parallel_batches(mesh, ODD.seq_len, tc.batch_size)
    ctx.comm.ledger.reset()
    try:
        r = run(model, opt, batches, steps=tc.steps, probes=[MemoryProbe(timeline=False)])
    finally:
        opt.optimizer.close()
    log = offload_log(opt)
    rep = r["memory"]["report"]
    return {"losses": ctx.comm.all_reduce(torch.tensor(r.losses, dtype=torch.float64), "avg", tag="loss").tolist(),
            "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "device": r["memory"]["after_step"][-1], "host": rep.at("host")["current"],
            "disk": rep.at("disk")["current"], "P": opt.padded_numel, "K": opt.num_shards,
            "d2h": log.bytes_sent(op="d2h"), "h2d": log.bytes_recv(op="h2d"),
            "read": log.bytes_recv(op="read"), "write": log.bytes_sent(op="write"),
            "wire": ctx.comm.ledger.bytes_sent(tag="zero*")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_offloads_its_shard_and_trains_exactly_like_mixed_precision_zero2(world_size, tmp_path):
    base = launch(_worker, world_size, "device", torch.bfloat16, timeout=120)
    host = launch(_worker, world_size, "host", torch.bfloat16, timeout=120)
    disk = launch(_worker, world_size, "disk", torch.bfloat16, str(tmp_path), timeout=120)
    assert os.listdir(tmp_path) == []                         # every rank's chunk files are gone
    N = world_size
    for b, h, d in zip(base, host, disk):
        assert b["losses"] == h["losses"] == d["losses"]
        assert all(torch.equal(b["params"][k], h["params"][k]) and torch.equal(h["params"][k], d["params"][k])
                   for k in b["params"])
        P = h["P"]
        assert P % N == 0 and 0 <= P - sum(p.numel() for p in GPT(ODD).parameters()) < N * h["K"]
        # without offload: bf16 parameters 2P, this rank's bf16 gradient shard 2P/N, fp32 master + m + v 12P/N
        cats = ("parameters", "gradients", "optimizer")
        assert tuple(b["device"][c] for c in cats) == (2 * P, 2 * P // N, 12 * P // N)
        # offloaded: only the parameters stay; the shard's gradient and state live on the host (or disk)
        assert tuple(h["device"][c] for c in cats) == tuple(d["device"][c] for c in cats) == (2 * P, 0, 0)
        assert (h["host"]["gradients"], h["host"]["optimizer"]) == (2 * P // N, 12 * P // N)
        assert (d["host"]["gradients"], d["host"]["optimizer"], d["disk"]["optimizer"]) == (2 * P // N, 0,
                                                                                             12 * P // N)
        for r in (h, d):
            assert r["d2h"] == r["h2d"] == STEPS * 2 * P // N               # 2Ψ/N down, 2Ψ/N up per step
        assert d["read"] == STEPS * 12 * P // N and d["write"] == (STEPS + 1) * 12 * P // N
        # the wire is ZeRO-2's: reduce-scatter + all-gather of bf16, 2·(N−1)/N·2P per step
        assert b["wire"] == h["wire"] == d["wire"] == STEPS * 2 * (N - 1) * 2 * P // N
        assert b["d2h"] == b["h2d"] == 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero2_offload_in_float64_matches_one_process(world_size):
    ranks = launch(_worker, world_size, "host", torch.float64, timeout=120)
    tc = TrainConfig(steps=STEPS, batch_size=6 * world_size, eps=1e-6)
    model = GPT(ODD, seed=tc.seed).double()
    opt = OffloadAdam(model.parameters(), master_dtype=torch.float64, **optimizer_kwargs(tc))
    r = run(model, opt, ShardedBatches(ODD.seq_len, tc.batch_size, seed=tc.data_seed), steps=tc.steps)
    opt.close()
    assert max(abs(a - b) for a, b in zip(r.losses, ranks[0]["losses"])) < 1e-12
    for k, p in model.named_parameters():
        for rank in ranks:
            assert (rank["params"][k] - p.detach()).abs().max().item() < 1e-12, k


# ============================================================================================ inside a pipeline
PIPE = get_config("nano", n_layer=4)          # 2 blocks per stage on 2 ranks
M, B = 4, 2


def _pipeline_worker(ctx, schedule):
    """The same pipeline twice on this rank, without and with activation offload on its stage (the executor calls
    the stage; the hooks on its blocks do the rest)."""
    torch.set_num_threads(1)
    tc = TrainConfig(steps=2, batch_size=M * B)
    out = {}
    for name in ("plain", "offload"):
        mesh = Mesh(ctx.comm, pp=ctx.world_size)
        stage = apply_pipeline(GPT(PIPE, seed=tc.seed), mesh, num_microbatches=M, schedule=schedule)
        pipe = handle_of(stage, "pipeline")
        if name == "offload":
            assert apply_activation_offload(stage, mesh) is stage
        batches = mesh.batches(PIPE.seq_len, B, accum_steps=M, seed=tc.data_seed)
        r = run(stage, optim.build(stage, **optimizer_kwargs(tc)), batches, steps=tc.steps, step_fn=pipe,
                probes=[MemoryProbe(timeline=False)])
        off = handle_of(stage, "activation_offload")
        out[name] = {"losses": [x for x in r.losses if x == x],
                     "params": {k: v.detach().clone() for k, v in stage.named_parameters()},
                     "acts": r["memory"]["report"].max_by_category["activations"],
                     "d2h": off.log.bytes_sent(op="d2h") if off else 0, "h2d": off.log.bytes_recv(op="h2d") if off
                     else 0, "held": off.in_flight if off else 0, "stages": stage.stages}
        if off is not None:
            off.remove()
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_activation_offload_inside_pipeline_stages_matches_the_pipeline_without_it(schedule):
    ranks = launch(_pipeline_worker, 2, schedule, timeout=180)
    A, E, H = (f(PIPE, B) for f in (block_activation_bytes, embed_activation_bytes, head_activation_bytes))
    in_flight = {"gpipe": [M, M], "1f1b": [2, 1], "zb_h1": [2, 1]}[schedule]     # micro-batches held per stage
    for rank, r in enumerate(ranks):
        plain, off = r["plain"], r["offload"]
        assert plain["losses"] == off["losses"]
        assert all(torch.equal(plain["params"][k], off["params"][k]) for k in plain["params"])
        # 2 steps × M micro-batches × 2 blocks; stage 1 keeps the activation it received (the executor holds it)
        X = 4 * B * PIPE.seq_len * PIPE.d_model
        assert off["d2h"] == off["h2d"] == 2 * M * (2 * A - (X if rank else 0)) and off["held"] == 0
        k = in_flight[rank]
        if schedule != "zb_h1":             # (ZB-H1 keeps each linear's input until its deferred W runs)
            # stage 0 keeps each held micro-batch's embedding; the last stage its head and input; the one in
            # backward has its top block and the one arriving (or, in the head's backward, the top block arriving)
            want = k * E + 2 * A if rank == 0 else (k - 1) * (H + X) + max(H + X + A, 2 * A)
            assert off["acts"] == want, (rank, off["acts"], want)
            assert plain["acts"] == (k * (E + 2 * A) if rank == 0 else k * (2 * A + H))


def _parallelized_disk_worker(ctx, root):
    import tempfile

    from course_lib.composer.parallelize import parallelize
    from course_lib.composer.plan import ParallelPlan
    torch.set_num_threads(1)
    tempfile.tempdir = root            # the SSD tier's default directory, so the test can look inside it
    tc = TrainConfig(steps=1, batch_size=2 * ctx.world_size)
    plan = ParallelPlan(dp=ctx.world_size, zero=1, offload_optimizer="disk", precision="bf16")
    with parallelize(GPT(ODD, seed=tc.seed), Mesh(ctx.comm), plan, train_config=tc) as job:
        job.train(1)
        during = sorted(os.listdir(root))       # the tier writes its files at the first step
    return during


def test_closing_a_parallelized_job_removes_each_ranks_ssd_tier_files(tmp_path):
    """A forked rank ends with os._exit, so no finalizer removes what it leaves: `Parallelized.close()` must close
    the ZeRO optimizer, which closes the OffloadAdam it shards for, which removes its SSD tier's directory."""
    during = launch(_parallelized_disk_worker, 2, str(tmp_path), timeout=120)
    assert all(any(name.startswith("course-offload-") for name in d) for d in during), during
    assert os.listdir(tmp_path) == [], f"left behind: {os.listdir(tmp_path)}"
