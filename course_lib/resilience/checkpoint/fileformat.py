"""The checkpoint format's names: the format tag, step directories (`step_00000012`), the errors a load can raise,
and the one digest (sha256) the manifest records. Saving is in `checkpoint_save`, loading in `checkpoint_load`."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

FORMAT = "course-checkpoint/1"
MANIFEST, META = "MANIFEST.json", "meta.json"
_STEP = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or loaded; the message says why and what survived."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint on disk failed verification; `.reason` says how."""

    def __init__(self, path, reason: str):
        super().__init__(f"checkpoint {Path(path).name} is unusable: {reason}")
        self.path, self.reason = Path(path), reason


class NoCheckpoint(CheckpointError):
    """No usable checkpoint in the directory."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit this model, optimizer or data (another config)."""


class CheckpointWarning(UserWarning):
    """Loading skipped a corrupt checkpoint and fell back to an older one."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """Published checkpoints in `root`, newest first (staging directories and strays are not checkpoints)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()] \
        if root.is_dir() else []
    return sorted(found, reverse=True)


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()
