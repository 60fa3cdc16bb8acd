"""Surviving failures: checkpoints (synchronous, asynchronous, sharded, in peers' memory), recovery from a killed
rank, and how often to checkpoint. Notebook 10.

    state        what a rank must keep to resume bit for bit, as pieces of named global tensors (any layout:
                 one process, DDP, ZeRO-1/2, FSDP), the generators and the data position
    checkpoint   the on-disk format (safetensors + JSON + a sha256 manifest), atomic save, verify-and-fall-back
                 load, sharded save and load on another number of ranks
    async_ckpt   CheckFreq: snapshot to host memory, persist on a background thread while training goes on
    peer         Gemini: every rank keeps its state and a replica of its neighbour's in host memory; a driver that
                 relaunches the ranks after one is killed and restores the lost one from its peer, without disk
    redundant    Bamboo: each pipeline stage also runs its successor's forward and keeps its replica; a killed
                 stage is taken over by its predecessor in the running processes, without disk or restart
    membership   Bamboo's membership: a peer's loss noticed (`PeerLost`), the survivors' new group, `takeover`
    failures     Young/Daly's checkpoint interval and a seeded simulation of goodput, and fault injectors
    references/  the production references: torchrun --max-restarts, torch.distributed.checkpoint, torchft;
                 the workers that run under them
    plots        Bamboo's recovery drawn from the survivors' records
"""
