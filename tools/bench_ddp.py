#!/usr/bin/env python3
"""Benchmark (not a test): step time of course_lib.parallel.dp's wrappers vs PyTorch's DistributedDataParallel, same
model, same batches, same bucket cap, on real gloo ranks, with the course's training loop (`train.run`). Prints
medians and ratios; asserts nothing (timings on a shared machine are noisy — compare ratios, and rerun).

    python tools/bench_ddp.py                                  # micro preset, 2 and 4 ranks
    python tools/bench_ddp.py --preset mini --world-sizes 2 3 --steps 30 --bucket-kib 256

The 'ring' rows use the from-scratch ring all-reduce (2(N−1) Python-driven messages per bucket); the 'backend' rows
run torch.distributed's all-reduce on the same communication thread, which isolates the cost of the Python ring
from the cost of the hooks, copies and thread.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_step(ctx, wrap, cfg, tc, warmup):
    from course_lib.composer.parallelize import train_parallel
    run, _ = train_parallel(ctx.comm, cfg, tc, wrap)
    return statistics.median(run.step_seconds[warmup:])


def main(argv=None) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from course_lib import optim
    from course_lib.core.model import get_config, param_count
    from course_lib.distributed.launch import launch
    from course_lib.parallel import dp as D
    from course_lib.train import TrainConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=15, help="steps per run; the first 3 are warm-up")
    ap.add_argument("--bucket-kib", type=int, default=256,
                    help="bucket cap; 256 KiB gives micro 4 buckets (a message costs ~ms on a shared CPU box)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per wrapper (the best median is kept)")
    ap.add_argument("--skip-naive", action="store_true", help="skip the per-tensor wrapper (slow: many messages)")
    a = ap.parse_args(argv)

    cap = a.bucket_kib * 1024
    optim.AdamW([torch.zeros(1, requires_grad=True)])   # AdamW's lazy imports happen once here, not in every rank
    wrappers = {
        "own naive (ring)": D.DataParallelNaive,
        "own bucketed (ring)": functools.partial(D.DataParallelBucket, bucket_cap_bytes=cap),
        "own overlapped (ring)": functools.partial(D.DataParallelOverlap, bucket_cap_bytes=cap),
        "own bucketed (backend)": functools.partial(D.DataParallelBucket, bucket_cap_bytes=cap, algorithm="backend"),
        "own overlapped (backend)": functools.partial(D.DataParallelOverlap, bucket_cap_bytes=cap, algorithm="backend"),
        "torch DDP": lambda m, comm: DistributedDataParallel(m, bucket_cap_mb=cap / 2**20),
    }
    if a.skip_naive:
        wrappers.pop("own naive (ring)")
    cfg = get_config(a.preset)
    print(f"preset {a.preset} (Ψ = {param_count(cfg):,}), {a.micro_batch_size} sequences per rank, bucket cap "
          f"{a.bucket_kib} KiB, median step time over steps 3..{a.steps - 1}, best of {a.repeats}")
    for n in a.world_sizes:
        tc = TrainConfig(steps=a.steps, batch_size=n * a.micro_batch_size)
        times = {}
        for name, wrap in wrappers.items():
            times[name] = min(statistics.median(launch(_median_step, n, wrap, cfg, tc, 3, timeout=600))
                              for _ in range(a.repeats))
        base = times["torch DDP"]
        print(f"\nworld_size {n}:")
        for name, t in times.items():
            print(f"  {name:<26} {t * 1e3:8.1f} ms/step   {t / base:6.2f}× torch DDP")
        for kind in ("ring", "backend"):
            print(f"  overlapped / bucketed ({kind}): "
                  f"{times[f'own overlapped ({kind})'] / times[f'own bucketed ({kind})']:.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
