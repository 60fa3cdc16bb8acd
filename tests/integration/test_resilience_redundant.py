"""Redundant computation (Bamboo) on real ranks: the redundant forward computes exactly the successor's forward and
leaves training unchanged; a stage SIGKILLed mid-step is taken over by its predecessor in the running processes
— no file opened — and the run ends bit for bit where an uninterrupted plain pipeline ends."""
from __future__ import annotations

import tempfile

import pytest
import torch

from course_lib.composer.parallelize import ParallelPlan, parallelize
from course_lib.core.model import GPT, get_config, param_count
from course_lib.distributed.launch import LaunchError, RankDied, launch
from course_lib.distributed.mesh import Mesh
from course_lib.parallel.pipeline import split_layers
from course_lib.resilience.redundant import GRAD_TAG, REPLICA_TAG, train_redundant
from course_lib.train import TrainConfig

pytestmark = pytest.mark.integration
CFG = get_config("nano", n_layer=3)
M, STEPS = 3, 4
TC = TrainConfig(steps=STEPS, batch_size=2 * M, seed=0, data_seed=0)
BLOCK = param_count(CFG.replace(n_layer=2)) - param_count(CFG.replace(n_layer=1))     # ψ of one block


def _plain(ctx):
    plan = ParallelPlan(pp=ctx.world_size, microbatches=M)
    with parallelize(GPT(CFG, seed=TC.seed), Mesh(ctx.comm, pp=ctx.world_size), plan, train_config=TC) as job:
        return job.train(TC.steps, keep_params=True).params


def _redundant(ctx, schedule="1f1b", kill=None, note=None):
    return train_redundant(ctx, CFG, TC, num_microbatches=M, steps=STEPS, schedule=schedule, kill=kill, note=note,
                           check=kill is None, timeout=60)


_REFERENCE: dict = {}


def _reference() -> dict:
    """The uninterrupted plain pipeline's parameters (2 stages: the split does not change a bit of them)."""
    if not _REFERENCE:
        _REFERENCE.update({k: v for r in launch(_plain, 2, timeout=60) for k, v in r.items()})
    return _REFERENCE


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_redundant_forward_is_the_successors_forward_and_training_is_unchanged(no_leaks):
    out = launch(_redundant, 3, timeout=60, allow_deaths=True)
    assert _same({k: v for r in out for k, v in r["params"].items()}, _reference())
    for k in range(2):                         # each replica is its successor, bit for bit, after the last step
        assert out[k]["replica"] and _same(out[k]["replica"], out[k + 1]["params"])
    assert out[2]["replica"] == {}             # the last stage has no successor (no wrap-around)
    own = {key: h for r in out for key, h in r["hashes"].items() if key[0] == "F"}
    redundant = {key: h for r in out for key, h in r["hashes"].items() if key[0] == "R"}
    assert len(redundant) == 2 * STEPS * M and all(own[("F",) + key[1:]] == h for key, h in redundant.items())
    for k, r in enumerate(out):                # formulas §8.4: 4·ψ_k gradient bytes to the predecessor per step
        psi = sum(p.numel() for p in r["params"].values())
        assert r["sent"].get(GRAD_TAG, {"sent": 0})["sent"] == (4 * psi * STEPS if k > 0 else 0)
        assert r["sent"].get(REPLICA_TAG, {"sent": 0})["sent"] == r["replicated"][0]   # the whole state, once
        assert (r["replicated"][0] > 4 * psi) == (k > 0) and r["events"] == [] and len(r["layouts"]) == 1
    assert sum(p.numel() for p in out[1]["params"].values()) == BLOCK


@pytest.mark.parametrize("world_size, kill, schedule, redo", [
    (3, (1, 2), "1f1b", 2),                # in its backward: step 2 did not commit and runs again
    (3, (2, 1, "sync"), "gpipe", 1),       # while reporting in: neither
    (3, (2, 1, "step"), "1f1b", 2),        # in its optimizer step, after step 1 committed: the replica took step 1
    (2, (1, 3, "forward"), "1f1b", 3)],    # one stage left
    ids=["backward", "reporting-in-gpipe", "after-the-commit", "one-stage-left"])
def test_a_killed_stage_is_taken_over_by_its_predecessor_bit_for_bit_without_disk(world_size, kill, schedule, redo,
                                                                                  no_leaks):
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as note:
        out = launch(_redundant, world_size, schedule, kill, note.name, timeout=60, allow_deaths=True)
    rank = kill[0]
    assert out[rank] == RankDied(rank, -9)
    alive = [r for r in out if not isinstance(r, RankDied)]
    assert _same({k: v for r in alive for k, v in r["params"].items()}, _reference())
    before = [e - s for s, e in split_layers(CFG.n_layer, world_size)]
    after = before[:rank - 1] + [before[rank - 1] + before[rank]] + before[rank + 1:]
    for r in alive:
        assert [lay["layers"] for lay in r["layouts"]] == [before, after]
        assert r["layouts"][1]["start"] == redo          # at most the interrupted step is run again
        (event,) = r["events"]
        assert event["dead"] == [rank] and event["step"] == redo
        assert event["caught"] < event["regrouped"] < event["replicated"] <= event["resumed"]
        assert r["opened"] == []                         # no file opened from the failure to the end
    for a, b in zip(alive, alive[1:]):
        assert _same(a["replica"], b["params"])
    assert alive[-1]["replica"] == {}


def test_rank_0_cannot_be_taken_over_and_says_so(no_leaks):
    with pytest.raises(LaunchError, match="kill rank 0"):
        launch(_redundant, 2, "1f1b", (0, 1), None, timeout=60, allow_deaths=True)
