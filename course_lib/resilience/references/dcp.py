"""torch.distributed.checkpoint (DCP), PyTorch's sharded checkpoint, as the reference for `checkpoint`'s sharded
save and load: each rank writes its shards (`__r_0.distcp`) and a `.metadata` file maps every chunk to its global
offsets, so a checkpoint of 4 ranks loads on 2. It checks shapes, but not the bytes: a flipped bit in a shard loads as
a wrong value.
"""
from __future__ import annotations

from ...core.model import GPT
from ...distributed.mesh import data_parallel_batches
from ...train import optimizer_kwargs, run
from .workers import CONFIG, TRAIN


def dcp_worker(ctx, path, steps: int = 0, seed: int = 0):
    """The PyTorch reference: the nano GPT under FSDP2 (`fully_shard` per block, then the root). steps > 0: train
    that many steps and save with torch.distributed.checkpoint into `path`; steps = 0: load `path` into a fresh
    model on this many ranks. Returns the full state dict (gathered), keyed like `checkpoint.consolidate`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = GPT(CONFIG, seed=seed)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fused AdamW: one DTensor op per step instead of ~60 distinct ones, each paying DTensor's first-call sharding
    # propagation in every rank (about a CPU-second per rank); saving and loading build the same optimizer
    opt = torch.optim.AdamW(model.parameters(), fused=True, **optimizer_kwargs(TRAIN))
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
