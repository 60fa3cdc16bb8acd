"""Checkpoints that survive crashes, full disks and flipped bits, and that say so when one does not.

One directory per checkpoint, named for the optimizer steps it completed:

    step_00000012/
      rank_00000.safetensors   this rank's pieces of the training state (`state.py`) and its random generators;
                               safetensors: a JSON header and raw bytes, nothing is unpickled on load
      rank_00000.json          its index: each tensor's global name, global shape and start; RNG scalars; the
                               file's bytes and sha256
      rank_00001.…             one pair per rank (DDP: only rank 0's holds model and optimizer tensors)
      meta.json                step, world size, layout, model config, data position, optimizer hyper-parameters,
                               shape and dtype of every global tensor
      MANIFEST.json            bytes and sha256 of every file above, written LAST

Writing is atomic twice over. A file: write a temporary name, fsync it, rename it over the final name, fsync the
directory (a rename is durable only once its directory is). A checkpoint: every file goes into a staging
directory `.tmp-step_00000012-<run id>`, the manifest last, and one rename publishes it as `step_00000012`. A crash
or a full disk at any moment leaves the complete new checkpoint or none, and never touches the previous one;
loaders only look at `step_*`.

Loading verifies before it trusts: the manifest must exist, every file must have the size and sha256 it lists,
every tensor the shape its index and meta.json give. The newest checkpoint that passes is loaded and every one
skipped is reported with what was wrong. An intact checkpoint of another model fails, naming the parameter.
With several ranks, each writes its own pair of files; rank 0 writes meta.json and the manifest once every rank
has written (one all-reduce says whether all succeeded), so saving on N ranks and loading on M (resharding) both
work: see `state.py`. The cost of a save is δ in Young's interval √(2δM) (docs/formulas.md §8.3).

The package:

    fileformat  the format's names: the format tag, step directories, the errors a load raises, the sha256 digest
    save        snapshot, persist and publish a checkpoint
    load        verify, find the newest that passes, and fill this rank's pieces (N ranks saved, M load)
"""
from __future__ import annotations

from ...core.files import atomic_write, disk_full, fsync_dir  # noqa: F401  (re-exported: notebook 10 and lab 10 use them here)
from .fileformat import (  # noqa: F401
    FORMAT,
    MANIFEST,
    META,
    CheckpointError,
    CheckpointMismatch,
    CheckpointWarning,
    CorruptCheckpoint,
    NoCheckpoint,
    list_checkpoints,
    step_name,
)
from .load import Resumed, _fill, consolidate, find_latest, load, verify, verify_files, verify_shapes  # noqa: F401
from .save import Snapshot, agree_run_id, persist, save, snapshot  # noqa: F401

__all__ = ["save", "load", "snapshot", "persist", "verify", "verify_files", "verify_shapes", "find_latest",
           "list_checkpoints", "atomic_write", "fsync_dir", "disk_full", "consolidate", "agree_run_id", "step_name",
           "Snapshot", "Resumed", "CheckpointError", "CorruptCheckpoint", "CheckpointMismatch", "NoCheckpoint",
           "CheckpointWarning", "FORMAT"]
