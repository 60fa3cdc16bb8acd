"""The production references — torchrun's elastic restarts, torch.distributed.checkpoint, torchft — and the
workers that run under them.

`torchrun --max-restarts K` (torch.distributed.elastic) watches its worker processes; when one dies it stops the
others and starts the whole group again, up to K times. It restarts processes, nothing more: the workers must
find their place again themselves — here by loading the newest good checkpoint (`checkpoint.load`), so a job
that loses a rank loses the steps since that checkpoint plus the restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
             -m course_lib.run course_lib.resilience.references:resumable_worker ROOT STEPS EVERY KILL_RANK KILL_STEP

One pitfall on a single machine: by default the restarted workers reuse the rendezvous store of the previous
attempt and can read the previous attempt's addresses (gloo's "connectFullMesh failed … Connection refused", or a
hang); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a store of its own. `torchrun_command` sets it.

torch.distributed.checkpoint (DCP) is PyTorch's sharded checkpoint: each rank writes its shards (`__r_0.distcp`)
and a `.metadata` file maps every chunk to its global offsets, so a checkpoint of 4 ranks loads on 2 (`dcp_worker`,
with FSDP2's `fully_shard`). It checks shapes, but not the bytes: a flipped bit in a shard loads as a wrong value.

torchft (pytorch/torchft) goes further: replica groups (DDP replicas) coordinate through a lighthouse every step;
when one group dies, the others go on with a smaller quorum and the restarted group rejoins by copying the live
state from a healthy one — no step of the survivors is lost, but the steps it misses are taken with fewer
samples, so the run is no longer bit for bit the uninterrupted one.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..model import GPT, get_config
from ..parallel.compose import apply_zero, data_parallel_batches
from ..train import TrainConfig, make_optimizer, optimizer_kwargs, run
from .async_ckpt import CheckpointProbe
from .checkpoint import list_checkpoints, load, save
from .failures import KillAt

CONFIG = get_config("nano")
TRAIN = TrainConfig(batch_size=12, eps=1e-6)   # splits over 1, 2, 3, 4 and 6 ranks


def _build(ctx, stage, seed):
    """The nano GPT with ZeRO-`stage` (0 = DDP, 3 = FSDP) and this dp rank's batches; `seed` for both."""
    tc = replace(TRAIN, seed=int(seed), data_seed=int(seed))
    model, opt = apply_zero(GPT(CONFIG, seed=tc.seed), ctx.comm, int(stage), **optimizer_kwargs(tc))
    return model, opt, data_parallel_batches(ctx.comm, CONFIG.seq_len, tc.batch_size, seed=tc.data_seed)


def resumable_worker(ctx, root, steps, every, kill_rank="-1", kill_step="0", stage="1", seed="0"):
    """Train the nano GPT with ZeRO-`stage` (string arguments: it runs from the command line), checkpointing
    every `every` steps into `root` and resuming from the newest good checkpoint there; in torchrun's first attempt
    rank `kill_rank` SIGKILLs itself in step `kill_step`. Returns (attempt, first step, last step)."""
    steps, every, kill_rank, kill_step = int(steps), int(every), int(kill_rank), int(kill_step)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model, opt, batches = _build(ctx, stage, seed)
    start = 0
    if list_checkpoints(root):
        resumed = load(root, model, opt, batches=batches)
        start, batches = resumed.step, resumed.batches
    probes = [CheckpointProbe(root, every, batches=batches, start_step=start)]
    if attempt == 0 and kill_rank >= 0:
        probes.append(KillAt(kill_rank, kill_step, start_step=start))
    run(model, opt, batches, steps=steps - start, probes=probes)
    return attempt, start, steps


def reload_worker(ctx, src, dst, stage="1", seed="0"):
    """Load the newest good checkpoint in `src` on this job's ranks — any number of them: the pieces are re-cut
    to this layout — and save it again in `dst` (then `dst` holds the same values, cut for this many ranks).
    Returns this rank's parameters when it holds the whole model (ZeRO-1/2, DDP), else None."""
    model, opt, batches = _build(ctx, stage, seed)
    resumed = load(src, model, opt, batches=batches)
    save(dst, model, opt, step=resumed.step, batches=batches)
    if int(stage) < 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def dcp_worker(ctx, path, steps: int = 0, seed: int = 0):
    """The PyTorch reference: the nano GPT under FSDP2 (`fully_shard` per block, then the root). steps > 0: train
    that many steps and save with torch.distributed.checkpoint into `path`; steps = 0: load `path` into a fresh
    model on this many ranks. Returns the full state dict (gathered), keyed like `checkpoint.consolidate`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = GPT(CONFIG, seed=seed)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model.parameters(), TRAIN)
    if steps:
        run(model, opt, data_parallel_batches(ctx.comm, CONFIG.seq_len, TRAIN.batch_size, seed=seed), steps=steps)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full_model, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().clone() for k, v in full_model.items()}
    out.update({f"optim/{s}/{k}": v.clone() for k, state in full_optim["state"].items() for s, v in state.items()})
    return out


def torchrun_command(nproc: int, *args, max_restarts: int = 1, share_store: bool = False):
    """(argv, env) to run `resumable_worker` under torchrun on this machine. share_store=False sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a rendezvous store of its own."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "-m", "course_lib.run",
            "course_lib.resilience.references:resumable_worker", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return argv, env


def run_torchrun(nproc: int, root, steps: int, every: int, kill_rank: int = -1, kill_step: int = 0, *,
                 max_restarts: int = 1, share_store: bool = False, timeout: float = 240) -> dict:
    """Run `resumable_worker` under torchrun and report: exit code, seconds, the attempt that finished and the step
    it resumed from (rank 0's result line), and the whole output (torchrun's own log lines included)."""
    argv, env = torchrun_command(nproc, root, steps, every, kill_rank, kill_step, max_restarts=max_restarts,
                                 share_store=share_store)
    t0 = time.perf_counter()
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        code, text = None, f"torchrun did not finish within {timeout:g} s\n{e.stdout or ''}{e.stderr or ''}"
    m = re.search(r"rank 0: \((\d+), (\d+), (\d+)\)", text)
    return {"returncode": code, "seconds": time.perf_counter() - t0, "output": text,
            "attempt": int(m.group(1)) if m else None, "resumed_from": int(m.group(2)) if m else None}


__all__ = ["resumable_worker", "reload_worker", "dcp_worker", "torchrun_command", "run_torchrun", "CONFIG", "TRAIN"]
