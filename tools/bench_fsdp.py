#!/usr/bin/env python3
"""Benchmark (not a test): step time of the course's DDP (ZeRO stage 0), ZeRO-1/2 (`course_lib.parallel.zero`) and ZeRO-3
(`course_lib.parallel.fsdp`) against PyTorch's FSDP2 `fully_shard` on gloo, same model, same global batch.

    .venv/bin/python tools/bench_fsdp.py --preset micro --world-size 4 --steps 8

Prints the median step time of each variant (after warm-up steps) and its ratio to FSDP2. Timings on a shared CPU
box are noisy: compare ratios, and run it twice.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from course_lib.data import ShardedBatches
from course_lib.parallel.fsdp import FSDP
from course_lib.dist.launch import launch
from course_lib.model import GPT, get_config, param_count
from course_lib.train import TrainConfig, make_optimizer
from course_lib.parallel.zero import ShardedOptimizer

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def build(ctx, variant: str, preset: str, tc: TrainConfig):
    """(model, optimizer) for one variant."""
    model = GPT(preset, seed=tc.seed)
    if variant in ("ddp", "zero1", "zero2"):
        stage = {"ddp": 0, "zero1": 1, "zero2": 2}[variant]
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.comm, stage=stage,
                               lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)
        return model, opt
    if variant == "zero3":
        model = FSDP(model, ctx.comm, units=model.blocks)
        return model, make_optimizer(model.parameters(), tc)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, make_optimizer(model.parameters(), tc)
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def worker(ctx, variant: str, preset: str, tc: TrainConfig, warmup: int) -> dict:
    model, opt = build(ctx, variant, preset, tc)
    cfg = get_config(preset)
    data = ShardedBatches(cfg.seq_len, tc.batch_size // ctx.world_size, ctx.world_size, ctx.rank, seed=tc.data_seed)
    times, losses = [], []
    for step in range(warmup + tc.steps):
        x, y = data.get(step)
        ctx.comm.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"median_s": statistics.median(times[warmup:]), "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    a = ap.parse_args(argv)
    tc = TrainConfig(steps=a.steps, batch_size=a.micro_batch_size * a.world_size)
    print(f"preset {a.preset} (psi = {param_count(a.preset):,}), world_size {a.world_size}, "
          f"global batch {tc.batch_size}, {a.steps} timed steps after {a.warmup} warm-up")
    res = {v: launch(worker, a.world_size, v, a.preset, tc, a.warmup, timeout=600)[0] for v in a.variants}
    base = res.get("fsdp2")
    for v, r in res.items():
        ratio = f"{r['median_s'] / base['median_s']:.2f}× FSDP2" if base else ""
        print(f"  {v:<6} median step {1e3 * r['median_s']:8.1f} ms   {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
