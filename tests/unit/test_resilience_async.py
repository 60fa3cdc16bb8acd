"""Checkpointing inside train.run: synchronous and asynchronous (CheckFreq) saves write the same checkpoints, the
asynchronous one persists exactly the snapshot even while training goes on (without the copy it would not), and a
failure on the background thread reaches the training loop."""
from __future__ import annotations

import threading

import pytest
import torch

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.resilience import checkpoint as C
from course_lib.resilience.async_ckpt import CheckpointProbe
from course_lib.train import Probe, TrainConfig, optimizer_kwargs, run

CFG = get_config("nano")
TC = TrainConfig(batch_size=4)


def _fresh():
    model = GPT(CFG, seed=0)
    return model, optim.build(model, **optimizer_kwargs(TC))


def _batches():
    return ShardedBatches(CFG.seq_len, 4)


class _Record(Probe):
    """Keeps the parameters after step `at`, and sets `release` after step `release_at`."""
    name = "record"

    def __init__(self, at, release=None, release_at=None):
        self.at, self.release, self.release_at, self.value = at, release, release_at, None

    def start(self, model, optimizer):
        self.model = model

    def after_step(self, step):
        if step == self.at:
            self.value = {f"model/{k}": v.detach().clone() for k, v in self.model.named_parameters()}
        if step == self.release_at:
            self.release.set()

    def finish(self):
        return self.value


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_probe_saves_every_k_steps_and_the_last_one_resumes(tmp_path, asynchronous):
    model, opt = _fresh()
    r = run(model, opt, _batches(), steps=6, probes=[CheckpointProbe(tmp_path, 2, asynchronous=asynchronous,
                                                                     batches=_batches())])
    assert [e["step"] for e in r["checkpoint"]] == [2, 4, 6]
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [6, 4, 2]
    full = C.consolidate(tmp_path / "step_00000006")
    assert all(torch.equal(full[f"model/{k}"], v) for k, v in model.named_parameters())


def test_the_probe_also_saves_at_the_steps_it_is_given(tmp_path):
    model, opt = _fresh()
    r = run(model, opt, _batches(), steps=6, probes=[CheckpointProbe(tmp_path, 4, at=[3], batches=_batches())])
    assert [e["step"] for e in r["checkpoint"]] == [3, 4]


def test_sync_and_async_write_identical_tensors(tmp_path):
    for mode in (False, True):
        model, opt = _fresh()
        run(model, opt, _batches(), steps=4, probes=[CheckpointProbe(tmp_path / str(mode), 2, asynchronous=mode)])
    a, b = (C.consolidate(tmp_path / str(m) / "step_00000004") for m in (False, True))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("copy, equal", [(True, True), (False, False)])
def test_the_persisted_checkpoint_is_the_snapshot_not_what_training_did_meanwhile(tmp_path, copy, equal):
    """The background write of step 2 is held back until step 4 finished: with the snapshot copy it still holds
    step 2's values; writing the live tensors instead (copy=False) would have written step 4's under step 2's name."""
    release = threading.Event()
    model, opt = _fresh()
    r = run(model, opt, _batches(), steps=4, probes=[
        _Record(at=1, release=release, release_at=3),
        CheckpointProbe(tmp_path, 2, asynchronous=True, copy=copy, hold=release)])
    saved = C.consolidate(tmp_path / "step_00000002")
    assert all(torch.equal(saved[k], v) for k, v in r["record"].items()) is equal
    if not copy:    # what it wrote instead: the parameters after step 4
        assert all(torch.equal(saved[f"model/{k}"], v) for k, v in model.named_parameters())


def test_a_failed_background_write_reaches_the_training_loop(tmp_path):
    model, opt = _fresh()
    with C.disk_full(after_bytes=0), pytest.raises(C.CheckpointError, match="step_00000002 was not written"):
        run(model, opt, _batches(), steps=4, probes=[CheckpointProbe(tmp_path, 2, asynchronous=True)])
    assert C.list_checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every must be a positive number of steps"):
        CheckpointProbe("x", 0)
    with pytest.raises(ValueError, match="copy=False only makes sense with asynchronous=True"):
        CheckpointProbe("x", 2, copy=False)
