"""The checkpoint format on one process: atomic writes in the right order, bit-for-bit resume (also in a new
process), verification that catches truncation, flipped bytes, a missing manifest and wrong shapes and falls back
to the previous good checkpoint with a message, a full disk that leaves the previous checkpoint intact, and a
checkpoint of another model or other data refused with the name of what differs."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.resilience import checkpoint as C
from course_lib.resilience.state import ResumedBatches, training_state
from course_lib.train import TrainConfig, optimizer_kwargs, run

ROOT = Path(__file__).resolve().parents[2]
CFG = get_config("nano")
TC = TrainConfig(batch_size=4)


def _fresh(cfg=CFG):
    model = GPT(cfg, seed=0)
    return model, optim.build(model, **optimizer_kwargs(TC))


def _batches(batch_size=4):
    return ShardedBatches(CFG.seq_len, batch_size)


def _state(model, opt) -> dict:
    return {(p.key, p.start): p.tensor.clone() for p in training_state(model, opt).pieces}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Checkpoints after steps 2, 4 and 6 of one run, and the state at each."""
    root = tmp_path_factory.mktemp("ckpt")
    model, opt = _fresh()
    states = {}
    for step in (2, 4, 6):
        run(model, opt, ResumedBatches(_batches(), step - 2), steps=2)
        C.save(root, model, opt, step=step, batches=_batches())
        states[step] = _state(model, opt)
    return root, states


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------- atomic writes
def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        real_fsync(fd)

    def replace(a, b):
        calls.append(("rename", Path(b).name))
        real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    C.atomic_write(tmp_path / "x.bin", b"payload")
    assert calls == [("fsync", "file"), ("rename", "x.bin"), ("fsync", "dir")]
    assert (tmp_path / "x.bin").read_bytes() == b"payload" and os.listdir(tmp_path) == ["x.bin"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"old")
    with C.disk_full(after_bytes=3), pytest.raises(OSError, match="No space left"):
        C.atomic_write(tmp_path / "x.bin", b"new and longer")
    assert (tmp_path / "x.bin").read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]


# ----------------------------------------------------------------------------------------------- the format
def test_a_checkpoint_has_the_files_the_manifest_lists_with_their_sha256(three):
    root, _ = three
    path = root / "step_00000006"
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in path.iterdir() if p.name != "MANIFEST.json")
    for name, want in manifest["files"].items():
        blob = (path / name).read_bytes()
        assert len(blob) == want["bytes"] and hashlib.sha256(blob).hexdigest() == want["sha256"]


def test_the_tensor_file_holds_exactly_model_optimizer_and_generators(three):
    root, _ = three
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    n_tensors = len(list(GPT(CFG).parameters()))
    tensors = C.consolidate(root / "step_00000006")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes == 4 * psi + 8 * psi + 4 * n_tensors           # fp32 weights, AdamW's m and v, a step counter each
    meta = json.loads((root / "step_00000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["config"] == CFG.as_dict() and meta["data"]["global_batch_size"] == 4


def test_loading_never_unpickles(three, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("a checkpoint load must not unpickle anything")
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model, opt = _fresh()
    assert C.load(three[0], model, opt).step == 6


def test_resume_is_bit_for_bit_the_uninterrupted_run(three, tmp_path):
    root, states = three
    model, opt = _fresh()
    run(model, opt, _batches(), steps=8)
    again, opt2 = _fresh()
    resumed = C.load(root, again, opt2, batches=_batches())
    assert resumed.step == 6 and resumed.skipped == [] and _equal(_state(again, opt2), states[6])
    run(again, opt2, resumed.batches, steps=2)
    assert _equal(_state(model, opt), _state(again, opt2))


def test_generators_and_hyper_parameters_are_restored(tmp_path):
    model, opt = _fresh()
    torch.manual_seed(5)
    np.random.seed(6)
    import random
    random.seed(7)
    opt.param_groups[0]["lr"] = 1.25e-3
    C.save(tmp_path, model, opt, step=1)
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model2, opt2 = _fresh()
    C.load(tmp_path, model2, opt2)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert opt2.param_groups[0]["lr"] == 1.25e-3 and opt2.param_groups[0]["betas"] == TC.betas


def test_resume_in_a_new_process_is_bit_for_bit(three, tmp_path):
    root, _ = three
    root2 = _copy(root, tmp_path / "copy")
    script = textwrap.dedent(f"""
        import torch
        from course_lib.core.data import ShardedBatches
        from course_lib.core.model import GPT, get_config
        from course_lib import optim
        from course_lib.resilience import checkpoint as C
        from course_lib.train import TrainConfig, optimizer_kwargs, run
        torch.set_num_threads(1)
        model = GPT(get_config("nano"), seed=0)
        opt = optim.build(model, **optimizer_kwargs(TrainConfig(batch_size=4)))
        r = C.load({str(root2)!r}, model, opt, batches=ShardedBatches(64, 4))
        run(model, opt, r.batches, steps=8 - r.step)
        C.save({str(root2)!r}, model, opt, step=8)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    model, opt = _fresh()
    run(model, opt, _batches(), steps=8)
    C.save(tmp_path / "straight", model, opt, step=8)
    a, b = C.consolidate(tmp_path / "straight" / "step_00000008"), C.consolidate(root2 / "step_00000008")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------- corruption
def _truncate(path):
    f = path / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _flip(path):
    f = path / "rank_00000.safetensors"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    f.write_bytes(bytes(blob))


def _no_manifest(path):
    (path / "MANIFEST.json").unlink()


def _wrong_shapes(path):
    """meta.json rewritten with another shape and the manifest re-hashed: only the shape check can catch it."""
    meta = json.loads((path / "meta.json").read_text())
    meta["tensors"]["model/wte.weight"]["shape"] = [128, 32]
    blob = json.dumps(meta).encode()
    (path / "meta.json").write_bytes(blob)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["meta.json"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def _listed(path) -> int:
    return json.loads((path / "MANIFEST.json").read_text())["files"]["rank_00000.safetensors"]["bytes"]


@pytest.mark.parametrize("corrupt, reason", [
    (_truncate, lambda n: f"rank_00000.safetensors is {n - 1000:,} bytes, the manifest says {n:,} (truncated)"),
    (_flip, lambda n: "rank_00000.safetensors's sha256 differs from the manifest's"),
    (_no_manifest, lambda n: "no MANIFEST.json"),
    (_wrong_shapes, lambda n: "wrong shapes: rank_00000.safetensors holds model/wte.weight@0 as [8192], but its "
                              "index and meta.json describe model/wte.weight as [256, 32] and [128, 32]"),
])
def test_a_corrupt_newest_checkpoint_is_named_and_the_previous_one_loaded(three, tmp_path, corrupt, reason):
    root = _copy(three[0], tmp_path / "c")
    reason = reason(_listed(root / "step_00000006"))
    corrupt(root / "step_00000006")
    model, opt = _fresh()
    with pytest.warns(C.CheckpointWarning, match="step_00000006 is unusable.*falling back to step_00000004"):
        resumed = C.load(root, model, opt)
    assert resumed.step == 4 and resumed.skipped[0][0] == "step_00000006" and reason in resumed.skipped[0][1]
    assert _equal(_state(model, opt), three[1][4])


def test_when_every_checkpoint_is_corrupt_the_error_lists_each_reason(three, tmp_path):
    root = _copy(three[0], tmp_path / "c")
    _flip(root / "step_00000006")
    _truncate(root / "step_00000004")
    _no_manifest(root / "step_00000002")
    with pytest.raises(C.NoCheckpoint, match=r"(?s)step_00000006: .*sha256.*step_00000004: .*truncated.*"
                                             r"step_00000002: no MANIFEST"):
        C.load(root, *_fresh())


def test_an_empty_directory_and_a_stray_staging_directory_are_not_checkpoints(tmp_path):
    (tmp_path / ".tmp-step_00000009-abc").mkdir()
    (tmp_path / ".tmp-step_00000009-abc" / "rank_00000.safetensors").write_bytes(b"partial")
    with pytest.raises(C.NoCheckpoint, match="none was ever published"):
        C.load(tmp_path, *_fresh())


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    model, opt = _fresh()
    for step in range(1, 6):
        C.save(tmp_path, model, opt, step=step, keep=2)
    assert [p.name for _, p in C.list_checkpoints(tmp_path)] == ["step_00000005", "step_00000004"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000005"]


# ----------------------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("after_bytes", [0, 4096, 300_000, 560_000])
def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_intact(three, tmp_path, after_bytes):
    root = _copy(three[0], tmp_path / "c")
    before = {p.name: p.read_bytes() for p in (root / "step_00000006").iterdir()}
    model, opt = _fresh()
    run(model, opt, _batches(), steps=1)
    with C.disk_full(after_bytes), pytest.raises(C.CheckpointError, match=r"step_00000007 was not written: rank\(s\) "
                                                 r"\[0\] failed \(No space left on device\); the previous checkpoint "
                                                 r"step_00000006 is untouched"):
        C.save(root, model, opt, step=7)
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004", "step_00000006"]   # no staging left
    assert {p.name: p.read_bytes() for p in (root / "step_00000006").iterdir()} == before
    assert C.load(root, *_fresh()).step == 6


def _save_under_a_file_size_limit(root, conn):
    """In a forked child: the limit holds for this process only."""
    import resource
    import signal
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    model = GPT(get_config("nano"), seed=1)
    try:
        C.save(root, model, optim.build(model, **optimizer_kwargs(TrainConfig())), step=7)
        conn.send("saved")
    except C.CheckpointError as e:
        conn.send(f"refused: {e}")


def test_a_real_file_size_limit_fails_the_save_cleanly(three, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG), as a nearly full disk would."""
    import multiprocessing as mp
    root = _copy(three[0], tmp_path / "c")
    here, there = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_save_under_a_file_size_limit, args=(str(root), there))
    child.start()
    try:
        said = here.recv() if here.poll(120) else f"no answer; exit code {child.exitcode}"
    finally:
        child.kill()
        child.join()
    assert said.startswith("refused: checkpoint step_00000007 was not written"), said
    assert "File too large" in said
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004", "step_00000006"]
    assert C.load(root, *_fresh()).step == 6


@pytest.mark.parametrize("change, message", [
    (dict(d_model=64), r"parameter 'wte.weight' has shape \[256, 32\] in the checkpoint and \[256, 64\] in this "
                       r"model .*d_model = 32 there, 64 here"),
    (dict(n_layer=3), r"this one has parameter 'blocks.2.ln1.weight', the checkpoint does not.*n_layer = 2 there"),
    (dict(n_layer=1), r"it has parameter 'blocks\.1\.[\w.]+', which this model lacks \(and 15 more"),
    (dict(tie_weights=True), r"it has parameter 'lm_head.weight', which this model lacks.*tie_weights = False"),
])
def test_a_checkpoint_of_another_model_config_names_the_parameter(three, change, message):
    with pytest.raises(C.CheckpointMismatch, match=message):
        C.load(three[0], *_fresh(CFG.replace(**change)))


def test_a_checkpoint_of_other_data_is_refused(three):
    with pytest.raises(C.CheckpointMismatch, match="global_batch_size = 4 there, 8 here"):
        C.load(three[0], *_fresh(), batches=_batches(8))
    with pytest.raises(C.CheckpointMismatch, match="seed = 0 there, 3 here"):
        C.load(three[0], *_fresh(), batches=ShardedBatches(CFG.seq_len, 4, seed=3))


def test_resumed_batches_continue_the_stream():
    b = _batches()
    r = ResumedBatches(b, 5)
    assert all(torch.equal(x, y) for x, y in zip(r.get(2), b.get(7))) and r.seq_len == b.seq_len
    with pytest.raises(ValueError, match="non-negative step"):
        ResumedBatches(b, -1)


def test_load_warnings_can_be_silenced_but_skipped_is_still_reported(three, tmp_path):
    root = _copy(three[0], tmp_path / "c")
    _flip(root / "step_00000006")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = C.load(root, *_fresh(), warn=False)
    assert resumed.step == 4 and resumed.skipped[0][0] == "step_00000006"
