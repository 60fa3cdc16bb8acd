"""Checks for Lab 10: an atomic checkpoint save and a verify-and-fall-back load, written from scratch.

The lab's format (a small version of `course_lib.resilience.checkpoint`'s):

    root/step_00000003/tensors.safetensors     the tensors (safetensors.torch.save)
    root/step_00000003/MANIFEST.json           {"step": 3, "files": {"tensors.safetensors": {"bytes": n,
                                                                                         "sha256": "…"}}}

    check_atomic_write(atomic_write)          the bytes land; a temporary in the target's directory; fsync(file)
                                              → rename → fsync(directory), in that order; a failure before the
                                              rename leaves the old file and no temp
    check_save(save_checkpoint)               a published step directory with the manifest of its files, nothing
                                              staged left over; a full disk during the next save leaves the
                                              previous checkpoint byte for byte and publishes nothing
    check_fallback(load_latest)               on checkpoints written here: a truncated file, a flipped byte, a
                                              deleted manifest, a deleted tensor file, a manifest that is not JSON,
                                              each on the newest checkpoint → the previous one is loaded and the
                                              skipped one named with a reason that says what was wrong; all
                                              corrupt → an error naming every checkpoint; a staging directory is
                                              never taken for a checkpoint, even a complete one; a loader that
                                              crashes on damage is told which damage and how to handle it
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from . import check

MANIFEST, TENSORS = "MANIFEST.json", "tensors.safetensors"


@contextlib.contextmanager
def _recorded(fail_fsync_at: int | None = None):
    """Record every fsync (of a file or of a directory) and rename; optionally fail the n-th fsync with ENOSPC."""
    calls = []
    real = {"fsync": os.fsync, "replace": os.replace, "rename": os.rename}

    def fsync(fd):
        # what was synced, from the descriptor itself (fstat works everywhere; /proc/self/fd is Linux's alone):
        # file or directory, and which one as (device, inode), compared with os.stat of the expected path
        st = os.fstat(fd)
        calls.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", (st.st_dev, st.st_ino)))
        if fail_fsync_at is not None and sum(c[0] == "fsync" for c in calls) == fail_fsync_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real["fsync"](fd)

    def rename(kind):
        def f(a, b, *args, **kwargs):
            calls.append(("rename", str(a), str(b)))
            return real[kind](a, b, *args, **kwargs)
        return f
    os.fsync, os.replace, os.rename = fsync, rename("replace"), rename("rename")
    try:
        yield calls
    finally:
        os.fsync, os.replace, os.rename = real["fsync"], real["replace"], real["rename"]


def check_atomic_write(atomic_write) -> None:
    with check("atomic_write") as c, tempfile.TemporaryDirectory() as d:
        target = Path(d) / "state.bin"
        with _recorded() as calls:
            atomic_write(target, b"new bytes")
        c.expect(target.exists() and target.read_bytes() == b"new bytes",
                 f"after atomic_write, {target.name} holds {target.read_bytes()[:20] if target.exists() else 'nothing'}"
                 f", not the bytes written", hint="write the bytes to a temporary file, then rename it to `path`")
        c.expect(sorted(os.listdir(d)) == ["state.bin"], f"the directory holds {sorted(os.listdir(d))}: a temporary "
                 f"file was left behind", hint="rename the temporary file over `path` (os.replace)")
        # (fsync, file|dir) / (rename, to)
        order = [(k, a) if k == "fsync" else (k, Path(b).name) for k, a, b in calls]
        renames = [i for i, (k, x) in enumerate(order) if k == "rename" and x == "state.bin"]
        c.expect(len(renames) == 1, f"{len(renames)} rename(s) onto {target.name}: expected exactly one",
                 hint="write to a temporary name in the same directory, then os.replace(tmp, path) once")
        i = renames[0]
        source = Path(calls[i][1])                     # the rename's source: the temporary file
        c.expect(source.parent.resolve() == target.parent.resolve(), f"the temporary file was {source}, outside "
                 f"{target.parent}", hint="a rename is atomic only within one file system (and durable with its "
                                          "directory): create the temporary file in path's own directory")
        c.expect(("fsync", "file") in order[:i], "no fsync of the file before the rename: after a power cut the new "
                 "name could point at bytes that never reached the disk", hint="os.fsync(f.fileno()) after writing, "
                                                                                "before the rename")
        c.expect(("fsync", "dir") in order[i + 1:], "no fsync of the directory after the rename: the rename itself "
                 "may not be durable", hint="fd = os.open(directory, os.O_RDONLY); os.fsync(fd); os.close(fd)")
        target.write_bytes(b"old bytes")
        failed = False
        with _recorded(fail_fsync_at=1):
            try:
                atomic_write(target, b"newer, longer bytes")
            except OSError:
                failed = True
        c.expect(failed, "atomic_write returned although its fsync failed (No space left on device)",
                 hint="let the OSError propagate: the caller must know the write did not happen")
        c.expect(target.read_bytes() == b"old bytes", f"after a failed write {target.name} holds "
                 f"{target.read_bytes()[:20]!r}, not the old bytes", hint="rename only after the fsync succeeded")
        c.expect(sorted(os.listdir(d)) == ["state.bin"], f"after a failed write the directory holds "
                 f"{sorted(os.listdir(d))}", hint="remove the temporary file when anything fails (try/except)")
        c.passed(f"write → fsync(file) → rename → fsync(dir), {len(calls)} calls; a failed fsync left the old "
                 f"file and no temporary")


def _tensors(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"weight": torch.randn(64, 32, generator=g), "exp_avg": torch.randn(64, 32, generator=g),
            "step": torch.tensor(float(step))}


def _published(root: Path) -> list:
    return sorted(p.name for p in root.iterdir())


def check_save(save_checkpoint) -> None:
    with check("save_checkpoint") as c, tempfile.TemporaryDirectory() as d:
        root = Path(d)
        path = save_checkpoint(root, 1, _tensors(1))
        c.expect(Path(path) == root / "step_00000001", f"save_checkpoint returned {path}, expected "
                 f"{root / 'step_00000001'}", hint="publish as root / f'step_{step:08d}' and return that path")
        c.expect(_published(root) == ["step_00000001"], f"the root holds {_published(root)}: only the published "
                 f"checkpoint should remain", hint="stage into a temporary directory, then rename it; nothing else")
        files = sorted(p.name for p in Path(path).iterdir())
        c.expect(files == [MANIFEST, TENSORS], f"the checkpoint holds {files}, expected {[MANIFEST, TENSORS]}")
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        blob = (Path(path) / TENSORS).read_bytes()
        want = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        c.expect(manifest.get("step") == 1 and manifest.get("files", {}).get(TENSORS) == want,
                 f"MANIFEST.json is {manifest}, expected step 1 and files = {{'{TENSORS}': {want}}}",
                 hint="hash the exact bytes you wrote: hashlib.sha256(data).hexdigest()")
        loaded = safetensors.torch.load(blob)
        c.expect(loaded.keys() == _tensors(1).keys() and all(torch.equal(loaded[k], v) for k, v in _tensors(1).items()),
                 "tensors.safetensors does not hold the tensors passed in")
        before = {p.name: p.read_bytes() for p in Path(path).iterdir()}
        with _recorded() as calls:
            save_checkpoint(root, 2, _tensors(2))
        dir_renames = [i for i, call in enumerate(calls) if call[0] == "rename" and Path(call[2]).name ==
                       "step_00000002"]
        manifest_writes = [i for i, call in enumerate(calls) if call[0] == "rename" and Path(call[2]).name == MANIFEST]
        c.expect(len(dir_renames) == 1 and manifest_writes and manifest_writes[-1] < dir_renames[0],
                 "the checkpoint directory was not published by one rename after its manifest was written",
                 hint="write both files with atomic_write into a staging directory, the manifest last, then "
                      "os.replace(staging, root / 'step_…')")
        root_id = (os.stat(root).st_dev, os.stat(root).st_ino)
        c.expect(any(call[0] == "fsync" and call[1] == "dir" and call[2] == root_id for call in
                     calls[dir_renames[0]:]), "no fsync of the root directory after publishing",
                 hint="the rename of the staging directory is durable once the root directory is fsynced")
        failed = None
        with _recorded(fail_fsync_at=1):
            try:
                save_checkpoint(root, 3, _tensors(3))
            except OSError as e:
                failed = e
        c.expect(failed is not None and failed.errno == errno.ENOSPC, "save_checkpoint returned although a write "
                 "failed with 'No space left on device'", hint="let the OSError propagate")
        c.expect(_published(root) == ["step_00000001", "step_00000002"], f"after a failed save the root holds "
                 f"{_published(root)}", hint="publish only after every file is written; remove the staging "
                                             "directory when anything fails")
        c.expect({p.name: p.read_bytes() for p in Path(path).iterdir()} == before, "a failed save changed the "
                 "previous checkpoint")
        c.passed(f"published step_00000001 and step_00000002 ({len(blob):,} B of tensors each) with their "
                 f"manifests; a full disk during step 3 left them byte for byte and published nothing")


# ----------------------------------------------------------------------------------------------- fallback
def _reference_save(root: Path, step: int, tensors: dict) -> Path:
    """The lab's format, written by the check itself (so check_fallback tests only load_latest)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    blob = safetensors.torch.save(tensors)
    (path / TENSORS).write_bytes(blob)
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": {TENSORS: {
        "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}}))
    return path


def _truncate(p):
    (p / TENSORS).write_bytes((p / TENSORS).read_bytes()[:-100])


def _flip(p):
    blob = bytearray((p / TENSORS).read_bytes())
    blob[len(blob) - 100] ^= 0x04
    (p / TENSORS).write_bytes(bytes(blob))


CORRUPTIONS = {   # name: (how, what the reason must say, what to do about it)
    "truncated tensor file": (_truncate, ("truncated",), "compare each file's size with the manifest's 'bytes' "
                              "first: a shorter file is truncated (say so; its sha256 differs too, but the size "
                              "says what happened)"),
    "a flipped byte": (_flip, ("sha256",), "same size, other bytes: compare hashlib.sha256(data).hexdigest() with "
                       "the manifest's 'sha256' (say so)"),
    "deleted manifest": (lambda p: (p / MANIFEST).unlink(), ("manifest",), "no MANIFEST.json means the save never "
                         "finished: catch FileNotFoundError, skip the checkpoint, and say the manifest is missing"),
    "deleted tensor file": (lambda p: (p / TENSORS).unlink(), ("missing",), "check that every file the manifest "
                            "lists exists before reading it; skip the checkpoint and say which file is missing"),
    "manifest not JSON": (lambda p: (p / MANIFEST).write_text("{not json"), ("manifest",), "json.loads raises "
                          "json.JSONDecodeError (a ValueError) on a damaged manifest: catch it, skip the checkpoint "
                          "and say the manifest is not valid JSON"),
}


def _load(c, load_latest, root: Path, what: str, hint: str):
    """load_latest(root); an exception becomes one line naming the damage it met and what to do about it."""
    try:
        return load_latest(root)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 — the learner's loader crashed on damage it should have handled
        c.expect(False, f"{what}, load_latest raised {type(e).__name__}: {e}", hint=hint)


def check_fallback(load_latest) -> None:
    with check("load_latest") as c, tempfile.TemporaryDirectory() as d:
        base = Path(d) / "base"
        for step in (1, 2, 3):
            _reference_save(base, step, _tensors(step))
        step, tensors, skipped = _load(c, load_latest, base, "on three good checkpoints", "list the step_* "
                                       "directories newest first, verify the newest, load it")
        c.expect(step == 3 and skipped == [], f"on three good checkpoints load_latest returned step {step}, "
                 f"skipped {skipped}", hint="list the step_* directories, newest first")
        c.expect(all(torch.equal(tensors[k], v) for k, v in _tensors(3).items()), "the tensors of step 3 differ "
                 "from what was saved")
        for name, (corrupt, words, fix) in CORRUPTIONS.items():
            root = Path(d) / name.replace(" ", "_")
            shutil.copytree(base, root)
            corrupt(root / "step_00000003")
            step, tensors, skipped = _load(c, load_latest, root, f"with a {name} in step_00000003", fix)
            c.expect(step == 2, f"with a {name} in step_00000003, load_latest returned step {step}; the previous "
                     f"good checkpoint is step 2", hint="verify every file against the manifest (exists, size, "
                                                        "sha256) before trusting a checkpoint; skip it if any fails")
            c.expect(all(torch.equal(tensors[k], v) for k, v in _tensors(2).items()), f"with a {name}: the tensors "
                     f"returned are not step 2's")
            c.expect(len(skipped) == 1 and skipped[0][0] == "step_00000003", f"with a {name}: skipped = {skipped}, "
                     f"expected one entry for step_00000003", hint="skipped is a list of (directory name, reason)")
            reason = str(skipped[0][1]).lower()
            c.expect(any(w in reason for w in words), f"with a {name}, the reason given was {skipped[0][1]!r}: it "
                     f"should say {' or '.join(repr(w) for w in words)}", hint=fix)
        # a save that died after its manifest, before the rename: complete, verifiable, and still not published
        os.rename(_reference_save(base, 9, _tensors(9)), base / ".tmp-step_00000009")
        step, _, _ = _load(c, load_latest, base, "with a staging directory .tmp-step_00000009 beside them",
                           "only directories named exactly step_<8 digits> are checkpoints")
        c.expect(step == 3, f"with a complete staging directory .tmp-step_00000009 beside them (a save that died "
                 f"before its rename), load_latest returned step {step}",
                 hint="only directories named exactly step_<8 digits> are checkpoints (re.fullmatch, not search): a "
                      "staging directory was never published")
        for sub, corrupt in zip(("step_00000003", "step_00000002", "step_00000001"), (_flip, _truncate,
                                                                                    lambda p: (p / MANIFEST).unlink())):
            corrupt(base / sub)
        try:
            returned = load_latest(base)
            raised = None
        except Exception as e:   # noqa: BLE001 — any error type, but it must name every checkpoint
            raised, returned = str(e), None
        c.expect(not (isinstance(returned, tuple) and returned[:1] == (9,)), "with every checkpoint corrupt, "
                 "load_latest loaded the "
                 "staging directory .tmp-step_00000009 (a save that never published)",
                 hint="only directories named exactly step_<8 digits> are checkpoints (re.fullmatch, not search)")
        c.expect(raised is not None, "with every checkpoint corrupt, load_latest returned instead of raising",
                 hint="raise an error listing each checkpoint and why it was skipped")
        missing = [s for s in ("step_00000003", "step_00000002", "step_00000001") if s not in raised]
        c.expect(not missing, f"with every checkpoint corrupt, the error does not name {missing}: {raised!r}")
        c.passed(f"{len(CORRUPTIONS)} kinds of corruption of the newest checkpoint → step 2 loaded, each named "
                 f"with its reason; all corrupt → one error naming all three")


__all__ = ["check_atomic_write", "check_save", "check_fallback"]
