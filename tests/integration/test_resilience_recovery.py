"""Recovery from a real rank death: a rank SIGKILLed mid-step is reported (which rank, how), the job is relaunched,
the lost rank's state comes from its peer's in-memory replica (Gemini) and the run ends bit for bit where an
uninterrupted one does, having lost at most one snapshot interval; a bug is not retried; two lost neighbours are
beyond the in-memory copies; and `torchrun --max-restarts` resumes the same job from its disk checkpoint."""
from __future__ import annotations

import re

import pytest
import torch

from course_lib.core.model import get_config
from course_lib.distributed.launch import LaunchError, launch
from course_lib.resilience import checkpoint as C
from course_lib.resilience.peer import HostMemory, dead_ranks, describe_exit, resilient_worker, run_with_recovery
from course_lib.resilience.references import resumable_worker, run_torchft, run_torchrun, torchft_summary
from course_lib.train import TrainConfig

pytestmark = pytest.mark.integration
CFG = get_config("nano")
TC = TrainConfig(batch_size=12, eps=1e-6)


def _same(a: list, b: list) -> bool:
    return all(x["state"].keys() == y["state"].keys() and all(torch.equal(x["state"][k], y["state"][k])
                                                               for k in x["state"]) for x, y in zip(a, b))


STEPS = 6
_STRAIGHT: dict = {}


def _straight(world_size, stage, every):
    """The uninterrupted run (once per layout)."""
    key = (world_size, stage, every)
    if key not in _STRAIGHT:
        with HostMemory() as memory:
            _STRAIGHT[key] = run_with_recovery(resilient_worker, world_size, memory, CFG, TC, stage=stage,
                                               steps=STEPS, every=every, timeout=120)
    return _STRAIGHT[key]


@pytest.mark.parametrize("world_size, stage, kill, every", [(4, 3, [(2, 5)], 3), (3, 2, [(0, 5)], 2),
                                                          (4, 3, [(0, 4), (2, 4)], 3)])
def test_a_killed_rank_comes_back_from_its_peers_replica_bit_for_bit(world_size, stage, kill, every, no_leaks):
    steps = STEPS
    straight = _straight(world_size, stage, every)
    with HostMemory() as memory:
        lost = []

        def machine_lost(dead):
            lost.extend(dead)
            for rank in dead:
                memory.lose(rank)
        rec = run_with_recovery(resilient_worker, world_size, memory, CFG, TC, stage=stage, steps=steps,
                                every=every, kill=kill, on_failure=machine_lost, timeout=120)
        assert not memory._dir(99).exists() and all(memory.steps(r, "own") for r in range(world_size))
    killed = sorted(r for r, _ in kill)
    assert sorted(lost) == killed and rec.attempts == 2
    assert sorted(f.rank for f in rec.failures) == killed and all(f.how == "killed by SIGKILL" for f in rec.failures)
    step = kill[0][1]                                  # killed in this step's backward: `step` steps were done
    start = rec.results[0]["start"]
    assert start == step // every * every and 0 <= step - start < every     # lost work ≤ one snapshot interval
    for r, result in enumerate(rec.results):
        assert result["start"] == start
        assert result["source"] == (f"rank {(r + 1) % world_size}'s replica" if r in killed else "own memory")
    assert _same(straight.results, rec.results)        # every parameter and optimizer value, bit for bit


def test_two_neighbours_lost_leave_no_copy_and_the_job_says_so(no_leaks):
    with HostMemory() as memory:
        with pytest.raises(LaunchError, match=r"rank \d raised CheckpointError: no snapshot step survived in host "
                                              r"memory .* restart from the last checkpoint on disk"):
            run_with_recovery(resilient_worker, 4, memory, CFG, TC, steps=6, every=2, kill=[(1, 3), (2, 3)],
                              on_failure=lambda dead: [memory.lose(r) for r in dead], timeout=120)


def _raises(ctx, attempt):
    if ctx.rank == 1:
        raise ValueError("a bug, not a failure")
    return attempt


def _dies(ctx, attempt):
    import os
    import signal
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.barrier()


def test_a_worker_that_raises_is_not_restarted():
    calls = []
    with pytest.raises(LaunchError, match="rank 1 raised ValueError: a bug, not a failure"):
        run_with_recovery(_raises, 2, on_failure=calls.append, max_restarts=3, timeout=60)
    assert calls == []


def test_the_driver_reports_the_dead_rank_and_gives_up_after_max_restarts(no_leaks):
    with pytest.raises(LaunchError) as e:
        run_with_recovery(_dies, 3, max_restarts=1, timeout=60)
    assert str(e.value).startswith("gave up after 1 restart(s): rank 1 killed by SIGKILL in attempt 0; rank 1 "
                                   "killed by SIGKILL in attempt 1")


def test_the_launcher_names_the_rank_and_its_exit_code_without_hanging():
    with pytest.raises(LaunchError) as e:
        launch(_dies, 3, 0, timeout=60)
    assert dead_ranks(e.value) == {1: -9} and describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path):
    """Rank 0 is SIGKILLed in step 3 of torchrun's first attempt; torchrun names it, restarts both workers (each
    attempt with its own rendezvous store), they load step 2 and finish: the final checkpoint equals an
    uninterrupted run's. (torchrun's own main with forked workers: see `run_torchrun`. It reports the first failed
    worker in rank order, so the killed one is rank 0 — a rank 1 killed would be reported as rank 0's error, raised
    because its peer was gone.)"""
    out = run_torchrun(2, tmp_path / "elastic", 6, 2, kill_rank=0, kill_step=3, max_restarts=1)
    assert out["returncode"] == 0 and out["attempt"] == 1 and out["resumed_from"] == 2, out["output"][-3000:]
    assert re.search(r"failed \(exitcode: -9\) local_rank: 0 ", out["output"]), out["output"][-3000:]
    launch(resumable_worker, 2, str(tmp_path / "straight"), "6", "2", timeout=120)
    a = C.consolidate(tmp_path / "straight" / "step_00000006")
    b = C.consolidate(tmp_path / "elastic" / "step_00000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_torchft_keeps_the_survivor_training_and_heals_the_replacement_from_live_state():
    """Replica group 1 is SIGKILLed at step 5: replica 0's attempt at that step is discarded, it commits steps alone
    (half the global batch each) until a replacement joins by copying its live state; both end with the same
    parameters — which differ from an uninterrupted run's, since some steps saw half the samples."""
    out = run_torchft(steps=8, kill_step=5, down_steps=3)      # goes on until both trained 3 steps together again
    s = torchft_summary(out)
    assert out["codes"] == [0, -9, 0], out["stderr"]
    assert s["killed_at_step"] == 5 and s["discarded"] == 1 and s["alone"] >= 3
    assert s["joined_at_step"] >= 5 + 3 and s["same_parameters"]
    straight = torchft_summary(run_torchft(steps=s["steps"], kill_step=-1))      # as many steps, no failure
    assert straight["steps"] == s["steps"] and straight["same_parameters"] and straight["alone"] == 0
    assert straight["sha256"] != s["sha256"]
