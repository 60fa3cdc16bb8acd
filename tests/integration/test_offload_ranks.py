"""ZeRO-Offload composed with ZeRO-2 on real gloo ranks (`apply_offload(model, mesh)`): each rank offloads only the
optimizer state of its shard. Per-rank bytes on the device, the host and the disk (exact), link bytes 2P/N each way
and wire bytes (exact), equality with the non-offloaded mixed-precision ZeRO-2 (bitwise) and, in float64, with one
process (docs/formulas.md §2.2, §6.1)."""
from __future__ import annotations

import os

import pytest
import torch

from course_lib.data import ShardedBatches
from course_lib.dist.launch import launch
from course_lib.dist.mesh import Mesh
from course_lib.memopt.offload import OffloadAdam, apply_offload, offload_log
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.compose import data_parallel_batches
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run

pytestmark = pytest.mark.integration

ODD = GPTConfig(seq_len=31, n_layer=2, n_head=5, d_model=35)      # Ψ = 49,385: every world size pads
STEPS = 3
CAP = 64_000


def _worker(ctx, tier, dtype, offload_dir=None):
    torch.set_num_threads(1)
    tc = TrainConfig(steps=STEPS, batch_size=6 * ctx.world_size, eps=1e-6)
    mesh = Mesh(ctx.comm, dp=ctx.world_size)
    model, opt = apply_offload(GPT(ODD, seed=tc.seed), mesh, activations=False, optimizer=tier, dtype=dtype,
                               master_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                               bucket_cap_bytes=CAP, offload_dir=offload_dir, chunk_bytes=16 << 10,
                               **optimizer_kwargs(tc))
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
