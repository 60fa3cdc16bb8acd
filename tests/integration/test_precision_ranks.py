"""Mixed precision on real gloo ranks: the overflow vote agrees over EVERY axis of the mesh (pp, dp and tp).

ZeRO shards what each dp rank unscales, so an inf in one rank's gradient reaches, after the reduce-scatter, only the
rank that owns that element: without a vote over dp that rank alone would skip the step and halve its scale, and
the ranks' scalers would part ways. With `overflow_vote` over the mesh (one 4-byte all-reduce on the world), every
rank skips the same steps and its scale follows torch.amp.GradScaler's trajectory for the agreed overflows.

One launch of 4 ranks runs: (1) a dp × tp = 2 × 2 mesh, an inf on one rank's gradient, and the bf16 recipe on a
TensorParallelGPT; (2) ZeRO-1 and ZeRO-2 over dp = 4
with the fp16 recipe's MixedPrecisionOptimizer as the inner optimizer, an inf injected into one rank's gradient at
one step, with the vote over the mesh, and ZeRO-1 once more (the control) with no vote.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from course_lib import optim
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.memopt import precision as P
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.train import TrainConfig, optimizer_kwargs, run

pytestmark = pytest.mark.integration

WORLD = 4
CFG = get_config("nano")
STEPS, POISONED_STEP, POISONED_RANK = 5, 2, 1
SCALER = dict(init_scale=2.0 ** 10, growth_interval=2)


def _grid_skip(ctx):
    """dp × tp = 2 × 2: each rank holds its own parameters; only the rank at (dp 1, tp 1) overflows."""
    mesh = Mesh(ctx.comm, dp=2, tp=2)
    model = P.apply_precision(torch.nn.Linear(4, 4), mesh, recipe="fp16",
                              scaler=P.DynamicLossScaler(init_scale=2.0 ** 8))
    opt = optim.build(model, lr=0.1)
    before = [m.clone() for m in opt.masters]
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    if (mesh.dp_rank, mesh.tp_rank) == (1, 1):
        q.grad[0] = math.inf
    opt.step()
    return {"skipped": opt.skipped, "scale": model.scaler.scale,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, opt.masters)),
            "flag bytes": ctx.comm.ledger.bytes_sent(tag="found_inf")}


def _zero(ctx, vote: bool, stage: int = 1):
    mesh = Mesh(ctx.comm, dp=WORLD)
    model = P.apply_precision(GPT(CFG), mesh, recipe="fp16", scaler=P.DynamicLossScaler(**SCALER))
    backwards = [0]

    def poison(g):                       # one rank, one step: an inf in one element of its local gradient
        backwards[0] += 1
        if ctx.rank == POISONED_RANK and backwards[0] == POISONED_STEP + 1:
            g = g.clone()
            g.view(-1)[0] = math.inf
        return g
    model.blocks[0].attn.wq.weight.register_hook(poison)
    inner = functools.partial(optim.MixedPrecisionOptimizer, optimizer_cls=optim.AdamW, scaler=model.scaler,
                              vote=mesh if vote else None)
    opt = ShardedOptimizer(model.parameters(), inner, mesh["dp"], stage=stage, bucket_cap_bytes=None,
                           tag=f"zero{stage} vote={vote}", **optimizer_kwargs(TrainConfig()))
    r = run(model, opt, mesh.batches(CFG.seq_len, 2), steps=STEPS, step_fn=model.step_fn())
    opt.remove_hooks()
    return {"history": model.scaler.history, "skipped": opt.optimizer.skipped, "losses": r.losses,
            "params": torch.cat([p.detach().float().flatten() for p in model.parameters()]),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def _tensor_parallel(ctx):
    """dp × tp = 2 × 2: the bf16 recipe on a TensorParallelGPT keeps it one, its vocab-sharded logits leave the head
    in fp32 (so the vocab-parallel loss reduces in fp32) and its gradients are bf16."""
    from course_lib.parallel.tensor import TensorParallelGPT, apply_tp
    mesh = Mesh(ctx.comm, dp=2, tp=2)
    model = P.apply_precision(apply_tp(GPT(CFG), mesh), mesh, recipe="bf16")
    x, y = mesh.batches(CFG.seq_len, 2).get(0)
    logits, loss = model(x, y)
    loss.backward()
    single = P.apply_precision(GPT(CFG), recipe="bf16")(x, y)[1].item()
    return {"kind": isinstance(model, TensorParallelGPT), "logits": (logits.dtype, logits.shape[-1]),
            "grads": {p.grad.dtype for p in model.parameters() if p.grad is not None}, "loss": loss.item(),
            "single": single}


def _worker(ctx):
    torch.set_num_threads(1)
    return {"tp": _tensor_parallel(ctx), "grid": _grid_skip(ctx), "voted": _zero(ctx, True),
            "voted2": _zero(ctx, True, stage=2), "alone": _zero(ctx, False)}


@pytest.fixture(scope="module")
def ranks():
    return launch(_worker, WORLD, timeout=300)


def test_on_a_dp_x_tp_mesh_one_ranks_overflow_skips_the_step_on_every_rank(ranks):
    """The vote is one all-reduce of a 4-byte flag over the world: 2(p − 1)/p · 4 = 6 bytes per rank (p = 4)."""
    for out in ranks:
        assert out["grid"] == {"skipped": 1, "scale": 2.0 ** 7, "unchanged": True,
                               "flag bytes": round(2 * (WORLD - 1) * 4 / WORLD)}


def test_a_tensor_parallel_gpt_stays_one_with_fp32_vocab_sharded_logits_and_bf16_gradients(ranks):
    """Its loss is the single-process bf16 model's to bf16 rounding: within 10 unit round-offs (2^−8) relative."""
    for out in ranks:
        t = out["tp"]
        assert t["kind"] and t["logits"] == (torch.float32, CFG.vocab_size // 2) and t["grads"] == {torch.bfloat16}
        assert abs(t["loss"] - t["single"]) <= 10 * 2.0 ** -8 * t["single"]


@pytest.mark.parametrize("run", ["voted", "voted2"])
def test_under_zero_1_and_2_every_rank_skips_the_same_step_and_follows_grad_scalers_trajectory(ranks, run):
    flags = [inf for _, inf in ranks[0][run]["history"]]
    assert flags == [s == POISONED_STEP for s in range(STEPS)]
    want = [SCALER["init_scale"]] + P.grad_scaler_trajectory(flags, **SCALER)[:-1]   # the scale each step used
    for out in ranks:
        v = out[run]
        assert v["history"] == ranks[0][run]["history"] and [s for s, _ in v["history"]] == want
        assert v["skipped"] == 1 and v["finite"]
        assert torch.equal(v["params"], ranks[0][run]["params"])
    assert ranks[0]["voted2"]["losses"] == ranks[0]["voted"]["losses"]     # stage 2 reduces the same sums


def test_without_the_vote_over_dp_only_the_owner_of_the_poisoned_element_skips(ranks):
    """The control: the same run with no vote. After the reduce-scatter the inf sits in one rank's shard; that rank
    skips and halves its scale, the three others step on — their scalers disagree from then on."""
    skipped = [out["alone"]["skipped"] for out in ranks]
    assert sorted(skipped) == [0, 0, 0, 1]
    scales = {out["alone"]["history"][-1][0] for out in ranks}
    assert len(scales) == 2
