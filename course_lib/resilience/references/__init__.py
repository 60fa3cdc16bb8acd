"""The production references for recovering from a failure, and the workers that run under them. Notebook 10.

    workers         the nano GPT under ZeRO-`stage`, checkpointed and resumed from the newest good checkpoint
                    (`resumable_worker`), or re-cut for another number of ranks (`reload_worker`)
    torchrun        torchrun's elastic restarts (`--max-restarts`): its command line, and `run_torchrun`, which runs
                    it with torchrun's own `main` forked from this process
    torchrun_entry  the script torchrun runs in each worker (`--run-path`)
    dcp             torch.distributed.checkpoint under FSDP2, the reference for the sharded checkpoint
    torchft         torchft's replica groups under a lighthouse: recovery without restarting the survivors
    forked          children forked from this process (no new interpreter), and stopping them
"""
from .dcp import dcp_worker
from .torchft import run_torchft, torchft_replica, torchft_summary
from .torchrun import run_torchrun, torchrun_command
from .workers import CONFIG, TRAIN, reload_worker, resumable_worker

__all__ = ["resumable_worker", "reload_worker", "dcp_worker", "torchrun_command", "run_torchrun", "run_torchft",
           "torchft_replica", "torchft_summary", "CONFIG", "TRAIN"]
