"""launch(): real ranks, every rank's traceback, timeouts, nothing left behind."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.distributed.launch import LaunchError, LaunchTimeout, RankDied, launch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _identity(ctx, extra=0, *, scale=1):
    assert dist.get_world_size() == ctx.world_size and dist.get_rank() == ctx.rank
    return (ctx.rank + extra) * scale


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_returns_every_ranks_result_in_rank_order(world_size, no_leaks):
    assert launch(_identity, world_size, 10, scale=2) == [2 * (10 + r) for r in range(world_size)]


def test_workers_can_use_torch_after_the_parent_ran_threaded_ops(no_leaks):
    a = torch.randn(300, 300)
    for _ in range(5):
        a = a @ a.T / 300            # the parent's OpenMP pool is warm now (PLATFORM.md pitfall)

    def matmul(ctx):
        x = torch.randn(200, 200)
        return float((x @ x).shape[0])
    assert launch(matmul, 3, timeout=30) == [200.0] * 3


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_bad_world_size_says_what_to_change(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(_identity, bad)


@pytest.mark.parametrize("bad", [0, -5, "10"])
def test_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        launch(_identity, 2, timeout=bad)


def test_nccl_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error under test is for machines without it")
    with pytest.raises(ValueError, match="needs CUDA"):
        launch(_identity, 2, backend="nccl")


def _one_rank_raises(ctx):
    if ctx.rank == 1:
        raise ZeroDivisionError("rank one divided by zero")
    dist.barrier()                   # the others wait for rank 1, which never comes
    return ctx.rank


def test_a_raising_rank_stops_the_others_and_shows_every_traceback(no_leaks):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(_one_rank_raises, 3, timeout=60)
    msg = str(err.value)
    assert msg.startswith("rank 1 raised ZeroDivisionError: rank one divided by zero")
    assert set(err.value.failures) == {0, 1, 2}
    for r in range(3):
        assert f"---- rank {r} ----" in msg
    assert "_one_rank_raises" in err.value.failures[1]
    assert time.monotonic() - t0 < 30, "the others must be stopped, not left to the timeout"


def _rank0_hangs(ctx):
    if ctx.rank == 0:
        time.sleep(3600)
    return ctx.rank


def test_a_hanging_rank_is_killed_at_the_timeout_with_its_stack(no_leaks):
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as err:
        launch(_rank0_hangs, 2, timeout=3)
    assert 3 <= time.monotonic() - t0 < 20
    assert list(err.value.failures) == [0]
    assert "_rank0_hangs" in err.value.failures[0] and "timed out after 3 s" in str(err.value)


def _deadlock(ctx):
    buf = torch.zeros(4)
    ctx.comm.recv(buf, (ctx.rank + 1) % ctx.world_size)    # everyone receives, nobody sends


def test_a_deadlock_ends_at_the_timeout_showing_where_each_rank_waits(no_leaks):
    with pytest.raises(LaunchTimeout) as err:
        launch(_deadlock, 2, timeout=3)
    assert set(err.value.failures) == {0, 1}
    assert all("_deadlock" in text for text in err.value.failures.values())


def _exits_hard(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_dies_without_a_result_is_reported(no_leaks):
    with pytest.raises(LaunchError, match="exited with code 3"):
        launch(_exits_hard, 2, timeout=30)


def _killed_or_waits(ctx, raise_too=False):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if raise_too and ctx.rank == 2:
        raise ValueError("a bug is still a failure")
    time.sleep(0.5)                     # longer than the grace the others get after a failure (0.2 s here)
    return ctx.rank


def test_allow_deaths_lets_the_others_finish_and_names_the_dead(no_leaks, monkeypatch):
    monkeypatch.setattr("course_lib.distributed.launch._GRACE_AFTER_ERROR", 0.2)
    assert launch(_killed_or_waits, 3, timeout=30, allow_deaths=True) == [0, RankDied(1, -signal.SIGKILL), 2]
    with pytest.raises(LaunchError, match="rank 1 exited with code -9"):
        launch(_killed_or_waits, 2, timeout=30)
    with pytest.raises(LaunchError, match="a bug is still a failure"):
        launch(_killed_or_waits, 3, True, timeout=30, allow_deaths=True)


def _unpicklable(ctx):
    return lambda: None


def test_an_unpicklable_result_is_reported(no_leaks):
    with pytest.raises(LaunchError, match="cannot be pickled"):
        launch(_unpicklable, 2, timeout=30)


_CALLER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
if {restore_sigint!r}:
    # A background job of a non-interactive shell (CI's `make test &`) starts with SIGINT ignored, and children
    # inherit that: Ctrl-C / Jupyter's interrupt would do nothing. Python installs its handler only when SIGINT
    # is not ignored at start-up, so put it back explicitly, as an interactive caller has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
from course_lib.distributed.launch import launch
def sleeper(ctx):
    print("PID", os.getpid(), flush=True)
    time.sleep(3600)
try:
    launch(sleeper, 3, timeout=600)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
"""


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_caller(tmp_path, restore_sigint):
    """A caller process with 3 sleeping ranks, started the way CI starts it (SIGINT ignored, inherited).
    Returns (caller, ranks as psutil.Process)."""
    script = tmp_path / "caller.py"
    script.write_text(_CALLER.format(root=str(ROOT), restore_sigint=restore_sigint))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=_ignore_sigint, start_new_session=True)
    ranks = []
    try:
        while len(ranks) < 3:
            line = caller.stdout.readline()
            assert line, "the caller ended before its ranks started"
            if line.startswith("PID"):
                ranks.append(psutil.Process(int(line.split()[1])))
    except BaseException:
        _kill_everything(caller, ranks)
        raise
    return caller, ranks


def _running(procs):
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_until_gone(procs, seconds=10.0):
    end = time.monotonic() + seconds
    while _running(procs) and time.monotonic() < end:
        time.sleep(0.1)
    return _running(procs)


def _kill_everything(caller, ranks):
    """Whatever the test's outcome, nothing it started may outlive it (ranks have their own process groups)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(caller.pid, signal.SIGKILL)
    for p in ranks:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(Exception):
        caller.communicate(timeout=10)


def _wait_for_exit(caller, what):
    try:
        caller.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the caller was still alive 30 s after {what}")


def test_interrupting_the_caller_leaves_no_rank_behind(tmp_path):
    caller, ranks = _start_caller(tmp_path, restore_sigint=True)
    try:
        caller.send_signal(signal.SIGINT)                        # what Jupyter's "interrupt kernel" sends
        _wait_for_exit(caller, "SIGINT")
        alive = _wait_until_gone(ranks)
        assert not alive, f"ranks {alive} outlived the interrupted caller"
        assert "INTERRUPTED" in caller.stdout.read(), "the caller did not see KeyboardInterrupt"
    finally:
        _kill_everything(caller, ranks)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_a_caller_that_ignores_sigint_leaves_no_rank_behind(tmp_path, sig):
    """The caller gets no chance to clean up (SIGTERM's default action, or SIGKILL): PR_SET_PDEATHSIG must."""
    caller, ranks = _start_caller(tmp_path, restore_sigint=False)
    try:
        caller.send_signal(sig)
        _wait_for_exit(caller, signal.Signals(sig).name)
        assert caller.returncode == -sig
        alive = _wait_until_gone(ranks)
        assert not alive, f"ranks {alive} outlived the caller killed by {signal.Signals(sig).name}"
    finally:
        _kill_everything(caller, ranks)


def test_the_same_worker_runs_under_torchrun(tmp_path):
    # TMPDIR: torchrun leaves its log directory (torchelastic_*) and error file in the temporary directory
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "course_lib.run", str(ROOT / "tests/integration/_workers.py") + ":ring_sum", "16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2, out.stdout
    assert "'sum': 3.0" in lines[0] and "'world_size': 2" in lines[1]
    n, elements = 2, 16
    assert f"'sent': {2 * (n - 1) * elements * 4 // n}" in lines[0]      # ring all-reduce: 2(N−1)/N · S bytes


def test_run_module_launches_locally_too(no_leaks):
    out = subprocess.run([sys.executable, "-m", "course_lib.run", "tests/integration/_workers.py:ring_sum",
                          "--world-size", "3", "6"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"'sum': {3 * 4 / 2}") == 3                    # 3 ranks, each holding 1 + 2 + 3


def test_spawned_ranks_run_an_importable_worker(no_leaks):
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import _workers
    n, elements = 2, 4
    res = launch(_workers.ring_sum, n, str(elements), start_method="spawn", timeout=120)
    assert [r["sum"] for r in res] == [n * (n + 1) / 2] * n                  # every rank holds 1 + … + N
    assert res[0]["sent"] == 2 * (n - 1) * elements * 4 // n               # ring all-reduce: 2(N−1)/N · S bytes


def test_a_start_method_that_does_not_exist_is_one_line():
    with pytest.raises(ValueError, match=r"start_method='forkserv': pick one of fork, forkserver, spawn$"):
        launch(_identity, 2, start_method="forkserv")


def _imported(ctx, name):
    return name in sys.modules


def test_preloaded_modules_are_imported_before_the_fork_and_dist_names_none_above_it(monkeypatch, no_leaks):
    """`preload_in_ranks` names a module for the caller to import before forking, so every rank finds it already
    imported; distributed itself preloads only torch's own lazily imported module (no course layer above it)."""
    import course_lib.distributed.launch as L
    monkeypatch.setattr(L, "_PRELOAD", list(L._PRELOAD))
    # distributed itself names torch's module only; the course's are named by the layers that own them
    # (course_lib.parallel and course_lib.memopt name their techniques when they are imported, as they are by now)
    import course_lib.memopt
    import course_lib.parallel
    assert L._PRELOAD[0] == "torch._dynamo"
    assert {n for n in L._PRELOAD if n.startswith("course_lib")} == {
        f"{pkg.__name__}.{name}" for pkg in (course_lib.parallel, course_lib.memopt) for name in pkg.TECHNIQUES}
    name = "xml.dom.minidom"                      # a stdlib module nothing here imports on its own
    monkeypatch.delitem(sys.modules, name, raising=False)
    L.preload_in_ranks(name)
    assert launch(_imported, 2, name, timeout=60) == [True, True]
    with pytest.raises(ValueError, match="module names"):
        L.preload_in_ranks("")
