"""Recomputation of tensor-parallel blocks (apply_tp, then apply_recompute) on real gloo ranks, float64: with full,
selective and every-2 recomputation the loss and every gradient are bitwise those of the same tensor-parallel model
without recomputation (the rerun executes the same ops, its collectives included) and equal the single-process
reference within 1e-12; the tp ledger shows exactly `tp_bytes_per_microbatch` plus the forward collectives the
rerun re-issues (`recompute.tensor_parallel.rerun_tp_bytes`). At tp = 2 (1D and sequence parallelism), tp = 4,
and dp × tp = 2 × 2 on a Mesh (DDP over dp: its bytes do not change). One launch per world size runs every variant.
"""
from __future__ import annotations

import functools

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, GPTConfig
from course_lib.distributed.collectives import ring_all_reduce_bytes
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh, data_parallel_batches
from course_lib.memopt.recompute import apply_recompute, make_plan
from course_lib.memopt.recompute.tensor_parallel import rerun_tp_bytes
from course_lib.parallel.dp import apply_dp
from course_lib.parallel.tensor import apply_tp, tp_bytes_per_microbatch
from course_lib.train import GradProbe, TrainConfig, optimizer_kwargs, run

pytestmark = pytest.mark.integration

CFG = GPTConfig(seq_len=12, n_layer=3, n_head=12, d_model=24)     # 3 blocks: 'every 2' makes segments [0 1] [2]
GLOBAL_B, E, TOL = 4, 8, 1e-12
POLICIES = (None, "full", "selective", "every 2")
SP = {"sequence_parallel": True}


def _plan(policy):
    return make_plan("every", CFG.n_layer, k=2) if policy == "every 2" else make_plan(policy, CFG.n_layer)


def _step(ctx, mesh, policy, kw, ref_grads):
    """One forward and backward (and step) of the tp model on `mesh`, recomputed by `policy`; DDP over dp if dp > 1.
    d_ref: the largest difference of a gradient from the reference's (cut as this rank holds it)."""
    tp = apply_tp(GPT(CFG).double(), mesh, **kw)
    if policy is not None:
        assert apply_recompute(tp, mesh, policy=_plan(policy)) is tp        # in place, the same kind of model
    model = apply_dp(tp, mesh) if mesh.sizes["dp"] > 1 else tp
    batches = data_parallel_batches(mesh, CFG.seq_len, GLOBAL_B)
    ctx.comm.ledger.reset()
    r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), batches, steps=1, probes=[GradProbe()])
    grads = {k.removeprefix("module."): v.detach() for k, v in r["grads"].items()}      # DDP's names: module.…
    return {"loss": r.losses[0], "grads": grads, "tp": ctx.comm.ledger.bytes_sent(group="tp"),
            "dp": ctx.comm.ledger.bytes_sent(group="dp"), "coords": dict(mesh.coords),
            "d_ref": max((grads[k] - tp.local_shard(k, g)).abs().max().item() for k, g in ref_grads.items())}


def _all(ctx, meshes, ref_grads):
    torch.set_num_threads(1)
    out = {}
    for label, sizes, kw in meshes:
        mesh = Mesh(ctx.comm, **sizes)
        for policy in POLICIES:
            out[label, policy] = _step(ctx, mesh, policy, kw, ref_grads)
    return out


@functools.cache
def _reference():
    model = GPT(CFG).double()
    r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), ShardedBatches(CFG.seq_len, GLOBAL_B),
            steps=1, probes=[GradProbe()])
    return r.losses[0], {k: v.detach() for k, v in r["grads"].items()}


MESHES = {2: (("tp=2", {"tp": 2}, {}), ("tp=2 SP", {"tp": 2}, SP)),
          4: (("tp=4", {"tp": 4}, {}), ("dp×tp=2×2", {"dp": 2, "tp": 2}, {}))}


@functools.cache
def _results(world_size):
    return launch(_all, world_size, MESHES[world_size], _reference()[1], timeout=300)


CASES = [(w, label) for w, meshes in MESHES.items() for label, _, _ in meshes]


@pytest.mark.parametrize("world_size, label", CASES)
def test_recomputed_tp_gradients_are_bitwise_those_without_recomputation_and_the_reference(world_size, label):
    ref_loss, _ = _reference()
    for r in _results(world_size):
        base = r[label, None]
        for policy in POLICIES:
            v = r[label, policy]
            assert v["loss"] == base["loss"], (label, policy)
            assert v["grads"].keys() == base["grads"].keys()
            assert all(torch.equal(v["grads"][k], base["grads"][k]) for k in base["grads"]), (label, policy)
            assert v["d_ref"] < TOL, (label, policy, v["d_ref"])
        if label != "dp×tp=2×2":                  # each dp rank's loss is the mean over its half of the batch
            assert abs(base["loss"] - ref_loss) < TOL


@pytest.mark.parametrize("world_size", [4])
def test_the_dp_ranks_mean_loss_is_the_reference_and_ddp_sends_the_same_bytes(world_size):
    MESH = "dp×tp=2×2"
    ref_loss, _ = _reference()
    ranks = _results(world_size)
    for policy in POLICIES:
        for tp_rank in (0, 1):
            pair = [r[MESH, policy]["loss"] for r in ranks if r[MESH, None]["coords"]["tp"] == tp_rank]
            assert abs(sum(pair) / 2 - ref_loss) < TOL, policy
        for r in ranks:
            assert r[MESH, policy]["dp"] == r[MESH, None]["dp"] > 0, policy


@pytest.mark.parametrize("world_size, label", CASES)
def test_tp_bytes_are_the_tp_formula_plus_exactly_the_collectives_the_rerun_reissues(world_size, label):
    sizes, kw = {lab: (s, k) for lab, s, k in MESHES[world_size]}[label]
    b = GLOBAL_B // sizes.get("dp", 1)
    t = sizes["tp"]
    for r in _results(world_size):
        rank = r[label, None]["coords"]["tp"]
        base = sum(tp_bytes_per_microbatch(CFG, b, t, rank, E, **kw).values())
        for policy in POLICIES:
            extra = 0 if policy is None else rerun_tp_bytes(_plan(policy), CFG, b, t, rank, E, **kw)
            assert r[label, policy]["tp"] == base + extra, (label, policy)
        # full recomputation of one-block segments: each block re-issues its attention's collectives and, but for
        # its last ḡ/g, the MLP's (1D: one all-reduce of b·s·h per block)
        if not kw:
            assert r[label, "full"]["tp"] - base == CFG.n_layer * ring_all_reduce_bytes(b * CFG.seq_len * CFG.d_model,
                                                                                        t, rank, E)
