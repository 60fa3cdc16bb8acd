#!/usr/bin/env python3
"""Benchmark (not a test): step time of every ZeRO stage built by `course_lib.parallel.zero.apply_zero` — DDP
(stage 0), ZeRO-1, ZeRO-2, ZeRO-3/FSDP — against PyTorch's FSDP2 `fully_shard` on gloo, same model, same global
batch, the course's training loop (`train.run`).

    .venv/bin/python tools/bench_fsdp.py --preset micro --world-size 4 --steps 8

Prints the median step time of each variant (after warm-up steps) and its ratio to FSDP2. Timings on a shared CPU
box are noisy: compare ratios, and run it twice.
"""
from __future__ import annotations

import argparse
import statistics

from course_lib.composer.parallelize import train_parallel
from course_lib.core.model import get_config, param_count
from course_lib.distributed.launch import launch
from course_lib.parallel.zero import STAGE_NAMES, apply_zero
from course_lib.train import TrainConfig

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def fsdp2(model, comm):
    """PyTorch's FSDP2 over the whole world, one unit per block plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (comm.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def worker(ctx, variant: str, cfg, tc: TrainConfig, warmup: int) -> dict:
    if variant == "fsdp2":
        wrap = fsdp2
    else:
        stage = VARIANTS.index(variant)
        wrap = lambda m, comm: apply_zero(m, comm, stage)   # noqa: E731  (train_parallel builds the optimizer)
    run, _ = train_parallel(ctx.comm, cfg, TrainConfig(steps=warmup + tc.steps, batch_size=tc.batch_size), wrap)
    return {"median_s": statistics.median(run.step_seconds[warmup:]), "losses": run.losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    a = ap.parse_args(argv)
    cfg = get_config(a.preset)
    tc = TrainConfig(steps=a.steps, batch_size=a.micro_batch_size * a.world_size)
    print(f"preset {a.preset} (psi = {param_count(cfg):,}), world_size {a.world_size}, "
          f"global batch {tc.batch_size}, {a.steps} timed steps after {a.warmup} warm-up")
    res = {v: launch(worker, a.world_size, v, cfg, tc, a.warmup, timeout=600)[0] for v in a.variants}
    base = res.get("fsdp2")
    for v, r in res.items():
        name = STAGE_NAMES.get(VARIANTS.index(v), v) if v != "fsdp2" else "FSDP2"
        ratio = f"{r['median_s'] / base['median_s']:.2f}× FSDP2" if base else ""
        print(f"  {name:<7} median step {1e3 * r['median_s']:8.1f} ms   {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
