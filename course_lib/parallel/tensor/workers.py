"""What notebook 06's launches run on every rank: one training step of each tensor-parallel variant measured against
the single process and PyTorch's DTensor (`tp_worker`), and tensor parallelism inside ZeRO-1 on a dp × tp mesh
against PyTorch's 2D (`dp_tp_worker`).

Each step goes through `course_lib.train.run`, the course's one loop, with probes for the gradients, the ledger and
the activations; every rank compares its gradients with its slice of the reference's (`local_shard`). In float64,
tensor parallelism only reorders additions, so the differences are rounding (~1e-16; formulas §4).
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh  # PyTorch's own, the references
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from ... import optim
from ...core.data import ShardedBatches
from ...core.model import GPT
from ...distributed.mesh import Mesh, data_parallel_batches
from ...train import GradProbe, LedgerProbe, MemoryProbe, TrainConfig, optimizer_kwargs, run
from ..zero import apply_zero
from .gpt import apply_tp, layer_traffic, torch_parallelize_blocks
from .megatron import CollectiveLog, padded_vocab
from .sequence import LayerActivationProbe

DTYPE = torch.float64
VARIANTS = {"1D": {}, "1D naive": {"plan": "naive"}, "SP": {"sequence_parallel": True},
            "SP, keep gathered": {"sequence_parallel": True, "regather": False}}


def tp_step(comm, tp, ref_grads, batches, *, dtensor=False) -> dict:
    """One step of `tp` (an apply_tp model, or a GPT parallelized by DTensor) through train.run: its loss, the
    largest |Δ| of its gradients against `ref_grads` (cut to this rank's slice), per-layer traffic and activations,
    and the collectives it called per block."""
    ledger = comm.ledger
    ledger.reset()
    mem = MemoryProbe(timeline=False)
    probes = [GradProbe()] + ([] if dtensor else [mem, LayerActivationProbe(mem)])
    with CollectiveLog() as log, (CommDebugMode() if dtensor else contextlib.nullcontext()) as dt_comms:
        r = run(tp, optim.build(tp, **optimizer_kwargs(TrainConfig())), batches, steps=1, probes=probes)
    grads = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in r["grads"].items()}
    cut = (lambda name, full: full) if dtensor else tp.local_shard
    n_layer = len(tp.blocks)
    return {"loss": r.losses[0], "dgrad": max((grads[k] - cut(k, ref_grads[k])).abs().max().item() for k in ref_grads),
            "grads": grads, "layers": [layer_traffic(ledger, i) for i in range(n_layer)],
            "sent": ledger.bytes_sent(), "by_tag": {k: v["sent"] for k, v in ledger.by("tag").items()},
            "act": None if dtensor else r["layer_activations"], "calls": dict(log.counts("blocks.0.")),
            "dt_calls": sum(dt_comms.get_comm_counts().values()) if dtensor else None}


def tp_worker(ctx, cfg, seed: int, micro_batch_size: int, ref_grads, ref_logits) -> dict:
    """Every variant of VARIANTS on t = world_size ranks, 1D at t = 2 on a (t/2) × 2 mesh when t is even, and
    PyTorch's parallelize_module (plain and PrepareModuleInput); then a per-rank timeline of one layer."""
    comm, t = ctx.comm, ctx.world_size
    B, S, vocab = micro_batch_size, cfg.seq_len, padded_vocab(cfg.vocab_size, t)

    def batches():
        return ShardedBatches(cfg.seq_len, B, seed=seed)

    def model():
        return GPT(cfg, seed=seed).to(DTYPE)

    out = {}
    for name, kw in VARIANTS.items():
        tp = apply_tp(model(), comm, **kw)
        if name == "1D":
            with torch.no_grad():                      # (B, T, V/t) against this rank's columns of the logits
                padded = torch.cat([ref_logits, ref_logits.new_zeros(B, S, vocab - cfg.vocab_size)], dim=-1)
                out["logits"] = (tp(batches().get(0, 0)[0])[0] - padded.chunk(t, -1)[comm.rank]).abs().max().item()
            ours = tp
        out[name] = tp_step(comm, tp, ref_grads, batches())
    if t % 2 == 0 and t > 2:                           # t = 2 inside the same launch: a (t/2) × 2 mesh
        out["1D, t=2"] = tp_step(comm, apply_tp(model(), Mesh(comm, dp=t // 2, tp=2)), ref_grads, batches())
    device_mesh = init_device_mesh("cpu", (t,))
    for name, prepare in (("DTensor, plain", False), ("DTensor, PrepareModuleInput", True)):
        out[name] = tp_step(comm, torch_parallelize_blocks(model(), device_mesh, prepare_input=prepare), ref_grads,
                            batches(), dtensor=True)
    out["vs DTensor"] = max((out["1D"]["grads"][k] - ours.local_shard(k, v)).abs().max().item()
                            for k, v in out["DTensor, PrepareModuleInput"]["grads"].items())
    for result in out.values():
        if isinstance(result, dict):
            result.pop("grads")
    # a per-rank timeline of one tensor-parallel layer, forward and backward
    block = apply_tp(model(), comm).blocks[0]
    x = torch.randn(B, S, cfg.d_model, dtype=DTYPE, generator=torch.Generator().manual_seed(seed),
                    requires_grad=True)                # (B, T, d)
    comm.ledger.reset()
    with CollectiveLog() as log:
        with comm.compute("forward"):
            y = block(x)
        with comm.compute("backward"):
            y.backward(torch.ones_like(y))
    out["timeline"] = {"ledger": comm.ledger, "calls": log.calls}
    return out


def dp_tp_worker(ctx, cfg, tc, ref_params) -> dict:
    """Tensor parallelism (tp = 2) inside ZeRO-1 (dp = 2) on four ranks for tc.steps steps; then PyTorch's 2D
    (parallelize_module over tp, fully_shard over dp) on the same model and data. Losses, the largest parameter
    difference from the reference, and the bytes each mesh axis carried."""
    mesh = Mesh(ctx.comm, dp=2, tp=2)
    batches = data_parallel_batches(mesh, cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    tp = apply_tp(GPT(cfg, seed=tc.seed).to(DTYPE), mesh)
    model = apply_zero(tp, mesh, 1)
    opt = optim.build(model, **optimizer_kwargs(tc))
    ctx.comm.ledger.reset()                         # forget the broadcast at wrap time
    r = run(model, opt, batches, steps=tc.steps, probes=[LedgerProbe(ctx.comm, groups=("dp", "tp"))],
            keep_params=True)
    out = {"losses": r.losses, "axis_bytes": r["ledger"]["group_bytes"], "coords": dict(mesh.coords),
           "buckets": [b.padded for b in opt.buckets],
           "d_param": max((v - tp.local_shard(k, ref_params[k])).abs().max().item() for k, v in r.params.items())}
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref_model = torch_parallelize_blocks(GPT(cfg, seed=tc.seed).to(DTYPE), dm["tp"])
    for block in ref_model.blocks:
        fully_shard(block, mesh=dm["dp"])
    fully_shard(ref_model, mesh=dm["dp"])
    # fused AdamW (every parameter is a DTensor here): one DTensor op per step instead of ~60 distinct ones, each
    # paying DTensor's first-call sharding propagation on every rank; the same update (float64: ~1e-16 apart)
    r2 = run(ref_model, torch.optim.AdamW(ref_model.parameters(), fused=True, **optimizer_kwargs(tc)),
             batches, steps=tc.steps)
    out["torch losses"] = r2.losses
    out["torch d_param"] = max((v.full_tensor() - ref_params[k]).abs().max().item()
                               for k, v in ref_model.named_parameters())
    return out
