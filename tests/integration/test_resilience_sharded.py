"""Sharded checkpoints on real gloo ranks: every rank saves its shard (ZeRO-1/2: optimizer state; FSDP: parameters
too; DDP: rank 0 alone), resume in new processes is bit for bit the uninterrupted run, a checkpoint of 4 ranks
loads on 2 and 3 (resharding) with every value in place — as torch.distributed.checkpoint does for the same case,
which is also shown to load a flipped byte silently — and a full disk on one rank fails the save everywhere."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from course_lib import optim
from course_lib.core.model import GPT
from course_lib.distributed.launch import launch
from course_lib.parallel.zero import apply_zero
from course_lib.resilience import checkpoint as C
from course_lib.resilience.references import CONFIG, TRAIN, dcp_worker, reload_worker, resumable_worker
from course_lib.train import optimizer_kwargs, run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _files(path: Path) -> dict:
    return {p.name: p.stat().st_size for p in path.iterdir()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 uninterrupted steps on 4 ranks for each ZeRO stage, checkpoints after steps 3 and 6."""
    out = {}
    for stage in (1, 2, 3):
        root = tmp_path_factory.mktemp(f"zero{stage}")
        launch(resumable_worker, 4, str(root), "6", "3", "-1", "0", str(stage), timeout=120)
        out[stage] = root
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_on_4_ranks_in_new_processes_is_bit_for_bit(straight, tmp_path, stage):
    shutil.copytree(straight[stage] / "step_00000003", tmp_path / "step_00000003")   # what a run of 3 steps saved
    assert launch(resumable_worker, 4, str(tmp_path), "6", "3", "-1", "0", str(stage), timeout=120)[0] == (0, 3, 6)
    a, b = C.consolidate(straight[stage] / "step_00000006"), C.consolidate(tmp_path / "step_00000006")
    assert len(a) == 4 * len(list(GPT(CONFIG).parameters()))   # parameter, exp_avg, exp_avg_sq, step of each
    assert _equal(a, b)


def test_resume_from_the_command_line_is_a_new_interpreter_and_still_bit_for_bit(straight, tmp_path):
    shutil.copytree(straight[2] / "step_00000003", tmp_path / "step_00000003")
    out = subprocess.run([sys.executable, "-m", "course_lib.run", "course_lib.resilience.references:resumable_worker",
                          str(tmp_path), "6", "3", "-1", "0", "2", "--world-size", "4"], cwd=ROOT, timeout=180,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "rank 0: (0, 3, 6)" in out.stdout, out.stderr
    assert _equal(C.consolidate(straight[2] / "step_00000006"), C.consolidate(tmp_path / "step_00000006"))


def test_every_rank_writes_its_own_shard(straight):
    path = straight[3] / "step_00000006"
    assert sorted(_files(path)) == sorted(["MANIFEST.json", "meta.json"] + [f"rank_{r:05d}.{e}" for r in range(4)
                                                                           for e in ("json", "safetensors")])
    index = [json.loads((path / f"rank_{r:05d}.json").read_text())["tensors"] for r in range(4)]
    keys = [{e["key"] for e in i.values()} for i in index]
    assert all("model/wte.weight" in k for k in keys)                     # FSDP: every rank has its rows of it
    starts = sorted(e["start"] for i in index for e in i.values() if e["key"] == "model/wte.weight")
    assert starts == [r * 64 * 32 for r in range(4)]                      # 256 rows / 4 ranks, 32 columns


@pytest.mark.parametrize("stage, world_size", [(1, 2), (3, 2), (3, 3), (2, 1)])
def test_a_4_rank_checkpoint_loads_on_another_number_of_ranks(straight, tmp_path, stage, world_size):
    got = launch(reload_worker, world_size, str(straight[stage]), str(tmp_path), str(stage), timeout=120)
    saved = C.consolidate(straight[stage] / "step_00000006")
    assert _equal(saved, C.consolidate(tmp_path / "step_00000006"))
    assert json.loads((tmp_path / "step_00000006" / "meta.json").read_text())["world_size"] == world_size
    for params in (g for g in got if g is not None):     # ZeRO-1/2: every rank holds the whole model again
        assert all(torch.equal(v, saved[f"model/{n}"]) for n, v in params.items())


def test_a_ddp_checkpoint_holds_one_copy_written_by_rank_0(tmp_path):
    launch(resumable_worker, 3, str(tmp_path), "2", "2", "-1", "0", "0", timeout=120)
    path = tmp_path / "step_00000002"
    index = [json.loads((path / f"rank_{r:05d}.json").read_text())["tensors"] for r in range(3)]
    assert len(index[0]) == 4 * len(list(GPT(CONFIG).parameters())) and index[1] == index[2] == {}
    model = GPT(CONFIG, seed=TRAIN.seed)
    opt = optim.build(model, **optimizer_kwargs(TRAIN))
    run(model, opt, data_parallel_batches_single(), steps=2)
    full = C.consolidate(path)
    assert all((full[f"model/{n}"] - p).abs().max() < 1e-5 for n, p in model.named_parameters())   # fp32 reordering


def data_parallel_batches_single():
    from course_lib.core.data import ShardedBatches
    return ShardedBatches(CONFIG.seq_len, TRAIN.batch_size, seed=TRAIN.data_seed)


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous(straight, tmp_path):
    shutil.copytree(straight[3] / "step_00000003", tmp_path / "step_00000003")
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_00000003").iterdir()}

    def save_with_rank_2_full(ctx, root):
        model = apply_zero(GPT(CONFIG, seed=TRAIN.seed), ctx.comm, 3)
        opt = optim.build(model, **optimizer_kwargs(TRAIN))
        r = C.load(root, model, opt)
        try:
            with (C.disk_full(1000) if ctx.rank == 2 else warnings.catch_warnings()):
                C.save(root, model, opt, step=r.step + 1)
        except C.CheckpointError as e:
            return str(e)
    messages = launch(save_with_rank_2_full, 4, str(tmp_path), timeout=120)
    assert all(m.startswith("checkpoint step_00000004 was not written: rank(s) [2] failed") for m in messages)
    assert "(No space left on device)" in messages[2] and messages[2].endswith("step_00000003 is untouched")
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_00000003").iterdir()} == before


# ------------------------------------------------------------------------------------------- the PyTorch built-in
def test_dcp_reshards_4_to_2_like_ours_but_loads_a_flipped_byte_silently(tmp_path):
    saved = launch(dcp_worker, 4, tmp_path / "dcp", 1, timeout=240)[0]      # one step: AdamW's state exists
    from torch.distributed.checkpoint import FileSystemReader
    shutil.copytree(tmp_path / "dcp", tmp_path / "flipped")
    item = next(v for k, v in FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data.items()
                if k.fqn == "model.wte.weight")          # one rank's rows of the embedding, inside its file
    f = tmp_path / "flipped" / item.relative_path
    blob = bytearray(f.read_bytes())
    blob[item.offset + item.length // 2] ^= 0x01          # the middle of the item is tensor data
    f.write_bytes(bytes(blob))

    def load_both(ctx):                                  # each load builds its model afresh: one launch serves both
        return dcp_worker(ctx, tmp_path / "dcp"), dcp_worker(ctx, tmp_path / "flipped")
    loaded, flipped = launch(load_both, 2, timeout=240)[0]
    assert _equal(saved, loaded)                                  # resharding: the same values on 2 ranks
    assert flipped.keys() == saved.keys() and not _equal(saved, flipped)      # no error: a wrong value
