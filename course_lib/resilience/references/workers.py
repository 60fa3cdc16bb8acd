"""The workers the production references run: the nano GPT under ZeRO-`stage`, checkpointed with `checkpoint.save`
and resumed with `checkpoint.load` — what a rank does after torchrun restarts it (`resumable_worker`) and what
re-cuts a checkpoint for another number of ranks (`reload_worker`). Arguments arrive as strings: they run from the
command line too (`python -m course_lib.run course_lib.resilience.references:resumable_worker …`).
"""
from __future__ import annotations

import os
from dataclasses import replace

from ... import optim
from ...core.model import GPT, get_config
from ...distributed.mesh import data_parallel_batches
from ...parallel.zero import apply_zero
from ...train import TrainConfig, optimizer_kwargs, run
from ..async_ckpt import CheckpointProbe
from ..checkpoint import list_checkpoints, load, save
from ..failures import KillAt

CONFIG = get_config("nano")
TRAIN = TrainConfig(batch_size=12, eps=1e-6)   # splits over 1, 2, 3, 4 and 6 ranks


def _build(ctx, stage, seed):
    """The nano GPT with ZeRO-`stage` (0 = DDP, 3 = FSDP) and this dp rank's batches; `seed` for both."""
    tc = replace(TRAIN, seed=int(seed), data_seed=int(seed))
    model = apply_zero(GPT(CONFIG, seed=tc.seed), ctx.comm, int(stage))
    opt = optim.build(model, **optimizer_kwargs(tc))
    return model, opt, data_parallel_batches(ctx.comm, CONFIG.seq_len, tc.batch_size, seed=tc.data_seed)


def resumable_worker(ctx, root, steps, every, kill_rank="-1", kill_step="0", stage="1", seed="0", save_at="0"):
    """Train the nano GPT with ZeRO-`stage` (string arguments: it runs from the command line), checkpointing
    every `every` steps into `root` and resuming from the newest good checkpoint there; in torchrun's first attempt
    rank `kill_rank` SIGKILLs itself in step `kill_step`. save_at > 0: also save after that step — the checkpoint
    a run that stopped there leaves, since saving changes nothing in the run. Returns (attempt, first step, last
    step)."""
    steps, every, kill_rank, kill_step, save_at = int(steps), int(every), int(kill_rank), int(kill_step), int(save_at)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model, opt, batches = _build(ctx, stage, seed)
    start = 0
    if list_checkpoints(root):
        resumed = load(root, model, opt, batches=batches)
        start, batches = resumed.step, resumed.batches
    probes = [CheckpointProbe(root, every, batches=batches, start_step=start, at=[save_at] if save_at else [])]
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
