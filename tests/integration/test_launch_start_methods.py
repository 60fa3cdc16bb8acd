"""launch() under every start method: a worker defined in a notebook cell (in `__main__`) runs forked, from the fork
server and spawned, with the same results and the same bytes on the wire; the method is chosen per platform and
forced by $COURSE_START_METHOD; what cannot travel by value is named in one line; a rank that cannot even load its
worker reports why; a killed caller leaves no rank behind under the fork server either."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from course_lib.distributed import start
from course_lib.distributed.launch import LaunchError, launch

pytestmark = pytest.mark.integration
NON_FORK = [m for m in ("forkserver", "spawn") if m in mp.get_all_start_methods()]

# What a learner types into notebook cells: a class, a helper, a global and a worker, all in `__main__`.
_CELLS = textwrap.dedent("""
    import torch
    SCALE = 3

    class Tally:                                    # returned by every rank: must come back as *this* class
        def __init__(self, value, sent):
            self.value, self.sent = value, sent

    def _nb_helper(x):
        return x * SCALE

    def _nb_worker(ctx, n):
        t = torch.arange(n, dtype=torch.float64) * (ctx.rank + 1)
        ctx.comm.all_reduce(t)                      # the course's ring: bytes counted by the ledger
        return Tally(_nb_helper(float(t.sum())), ctx.comm.ledger.bytes_sent())
""")


@pytest.fixture
def notebook():
    """Define the cells in the real `__main__`, as a Jupyter kernel does, and take them away afterwards."""
    main = sys.modules["__main__"].__dict__
    before = set(main)
    exec(compile(_CELLS, "<notebook cell>", "exec"), main)
    yield main
    for name in set(main) - before:
        del main[name]


def test_a_notebook_worker_gives_the_same_results_and_bytes_under_every_method(notebook, no_leaks):
    n, world = 10, 3
    runs = {m: launch(notebook["_nb_worker"], world, n, start_method=m, timeout=120) for m in ["fork", *NON_FORK]}
    # closed form: every rank holds sum_r (r+1) · sum_i i = (1+2+3) · n(n−1)/2, times SCALE
    expect = 3 * (world * (world + 1) / 2) * (n * (n - 1) / 2)
    for method, results in runs.items():
        assert all(type(r) is notebook["Tally"] for r in results), method       # the caller's own class back
        assert [r.value for r in results] == [expect] * world, method
        # ring all-reduce: 2(N−1)/N · S bytes per rank, S = n float64 elements (the same bytes as forked ranks)
        assert [r.sent for r in results] == [r.sent for r in runs["fork"]], method


def _started_by(ctx):
    """How this rank came to be, from its command line: a spawned interpreter runs spawn_main, a fork server's child
    carries the server's command line, a forked child its parent's."""
    cmd = " ".join(psutil.Process().cmdline())
    return "spawn" if "spawn_main" in cmd else "forkserver" if "forkserver import main" in cmd else "fork"


def test_the_environment_variable_forces_the_start_method(monkeypatch, no_leaks):
    for method in NON_FORK:
        monkeypatch.setenv(start.ENV, method)
        assert launch(_started_by, 2, timeout=120) == [method] * 2
    monkeypatch.setenv(start.ENV, "fork")
    assert launch(_started_by, 2, timeout=60) == ["fork"] * 2
    assert launch(_started_by, 2, start_method="spawn", timeout=120) == ["spawn"] * 2    # the argument wins


@pytest.mark.parametrize("platform,backend,expect", [
    ("linux", "gloo", "fork"), ("darwin", "gloo", "forkserver"), ("win32", "gloo", "spawn"),
    ("linux", "nccl", "forkserver"), ("win32", "nccl", "spawn")])
def test_the_default_start_method_per_platform(platform, backend, expect):
    assert start.default_start_method(backend, platform) == expect


def test_a_start_method_the_platform_lacks_is_one_line(monkeypatch):
    with pytest.raises(ValueError, match="CUDA cannot be used in a forked process"):
        start.choose_start_method("fork", "nccl", env={})
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])            # what Windows offers
    with pytest.raises(ValueError, match=r"^start_method='fork': this platform \(\w+\) has no 'fork' start "
                                         r"method; pick one of spawn$"):
        start.choose_start_method("fork", "gloo", env={})
    with pytest.raises(ValueError, match=r"^\$COURSE_START_METHOD='forkserver': .* pick one of spawn$"):
        start.choose_start_method(None, "gloo", env={start.ENV: "forkserver"})
    assert start.choose_start_method(None, "nccl", env={start.ENV: "fork"}) == "spawn"   # machine-wide: falls back


def test_an_open_file_in_the_closure_is_named_in_one_line(tmp_path):
    log = open(tmp_path / "log.txt", "w")
    try:
        def worker(ctx):
            log.write(f"{ctx.rank}\n")
        with pytest.raises(ValueError) as err:
            launch(worker, 2, start_method="spawn")
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("`log` (closed over by `test_an_open_file_in_the_closure_is_named_in_one_line.<locals>."
                              "worker`) is TextIOWrapper <_io.TextIOWrapper name=")
        assert "create it inside the worker" in msg
    finally:
        log.close()


_LOCK = threading.Lock()


def _uses_a_global_lock(ctx):
    with _LOCK:
        return ctx.rank


def test_a_lock_is_named_wherever_it_hides():
    _uses_a_global_lock.__module__ = "__main__"                  # a notebook function: pickled by value, globals too
    try:
        with pytest.raises(ValueError, match=r"^`_LOCK` \(a global `_uses_a_global_lock` uses\) is lock "):
            launch(_uses_a_global_lock, 2, start_method="forkserver")
        with pytest.raises(ValueError, match=r"^argument 0 of the launch\[0\] is lock "):
            launch(_takes, 2, [_LOCK], start_method="spawn")
    finally:
        _uses_a_global_lock.__module__ = __name__


class _FailsToLoad:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this object refuses to be rebuilt in a rank")


def _takes(ctx, obj):
    return ctx.rank


def test_a_rank_that_cannot_load_its_worker_reports_the_traceback(no_leaks):
    with pytest.raises(LaunchError) as err:
        launch(_takes, 2, _FailsToLoad(), start_method="forkserver", timeout=60)
    assert str(err.value).startswith("rank ")
    assert all("this object refuses to be rebuilt in a rank" in t and "_refuse" in t
               for t in err.value.failures.values())


_CALLER = """
import os, sys, time
sys.path.insert(0, {root!r})
if {no_pdeathsig!r}:                 # as on macOS: no PR_SET_PDEATHSIG, so each rank's watching thread must do it
    import course_lib.distributed.rank
    course_lib.distributed.rank._LIBC = None
from course_lib.distributed.launch import launch
def sleeper(ctx):
    print("PID", os.getpid(), flush=True)
    time.sleep(3600)
if __name__ == "__main__":     # a spawned rank imports this script again: the launch must not run there
    launch(sleeper, 2, timeout=600, start_method={method!r})
"""


@pytest.mark.parametrize("method,no_pdeathsig", [*((m, False) for m in NON_FORK), ("fork", True)])
def test_killing_the_caller_leaves_no_rank_behind(tmp_path, method, no_pdeathsig):
    """Under the fork server a rank's parent is the server, not the caller: the server exits when the caller dies,
    and PR_SET_PDEATHSIG takes the ranks with it (the check that a rank's parent is the caller once took the
    server for a dead parent and ended every rank at start). Without PR_SET_PDEATHSIG (macOS) a thread in each rank
    waits on multiprocessing's parent sentinel: forked ranks are run that way here (their module is the caller's)."""
    script = tmp_path / "caller.py"
    script.write_text(_CALLER.format(root=os.getcwd(), method=method, no_pdeathsig=no_pdeathsig))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    ranks = []
    try:
        while len(ranks) < 2:
            line = caller.stdout.readline()
            assert line, "the caller ended before its ranks started"
            if line.startswith("PID"):
                ranks.append(psutil.Process(int(line.split()[1])))
        caller.kill()
        caller.wait(30)
        end = time.monotonic() + 15
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks) \
                and time.monotonic() < end:
            time.sleep(0.1)
        alive = [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"ranks {alive} outlived the caller killed under {method}"
    finally:
        for p in ranks:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(caller.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_gloo_gets_the_loopback_interface_only_where_the_host_name_does_not_resolve(monkeypatch):
    """gloo warns at every launch when the host name does not resolve to a bindable address (macOS often): launch
    then names the loopback interface for its ranks; otherwise it leaves gloo's own choice alone."""
    import socket

    from course_lib.distributed import launch as L
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    lo = L._loopback_interface()
    assert lo in [name for _, name in socket.if_nameindex()] and lo in ("lo", "lo0")
    assert L._rank_env() == {} or socket.gethostname()       # this machine's name resolves (or not): no crash

    def unresolvable(name):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    L._hostname_binds.cache_clear()
    try:
        assert L._rank_env() == {"GLOO_SOCKET_IFNAME": lo}
    finally:
        L._hostname_binds.cache_clear()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert L._rank_env() == {}                               # the user's own choice wins


def _rank_sees(ctx):
    return os.environ.get("GLOO_SOCKET_IFNAME")


@pytest.mark.parametrize("method", ["fork", *NON_FORK])
def test_the_ranks_get_that_interface_under_every_method(method, monkeypatch, no_leaks):
    from course_lib.distributed import launch as L
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(L, "_rank_env", lambda: {"GLOO_SOCKET_IFNAME": L._loopback_interface()})
    assert launch(_rank_sees, 2, start_method=method, timeout=120) == [L._loopback_interface()] * 2


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (NCCL): this machine has none")
def test_nccl_runs_a_notebook_worker_on_one_gpu_per_rank(notebook, no_leaks):
    """The README's NCCL path from a notebook: a worker defined in a cell, by value to fork-server ranks, one GPU
    each; the same sums as gloo on CPU."""
    import torch

    def gpu_worker(ctx, n):
        t = torch.arange(n, dtype=torch.float64, device=ctx.device) * (ctx.rank + 1)
        torch.distributed.all_reduce(t)
        return str(t.device), float(t.sum())
    gpu_worker.__module__ = "__main__"
    world = min(torch.cuda.device_count(), 4)
    out = launch(gpu_worker, world, 10, backend="nccl", timeout=300)
    assert [d for d, _ in out] == [f"cuda:{r}" for r in range(world)]
    assert all(s == (world * (world + 1) / 2) * 45 for _, s in out)


def test_a_raising_rank_and_a_hanging_one_end_the_launch_with_every_stack(no_leaks):
    """launch's guarantees hold for ranks that are not forked: the failing rank's traceback heads the error, the
    others are stopped with their stacks (faulthandler on SIGUSR1), a hang ends at the timeout. From the fork server:
    spawn differs only in how a rank starts (and a hang test there must wait out torch's import, ~90 s here)."""
    from tests.integration.test_launch import _one_rank_raises, _rank0_hangs
    with pytest.raises(LaunchError) as err:
        launch(_one_rank_raises, 3, start_method="forkserver", timeout=120)
    assert str(err.value).startswith("rank 1 raised ZeroDivisionError: rank one divided by zero")
    assert set(err.value.failures) == {0, 1, 2} and "_one_rank_raises" in err.value.failures[1]
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 4 s") as err:
        launch(_rank0_hangs, 2, start_method="forkserver", timeout=4)
    assert list(err.value.failures) == [0] and "_rank0_hangs" in err.value.failures[0]
    assert time.monotonic() - t0 < 60


def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    """A spawned rank runs the caller's script again before its worker; unguarded, the launch in it fails there, before
    any traceback can be sent back: the error says what to change."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"import sys\nsys.path.insert(0, {os.getcwd()!r})\n"
                      f"from course_lib.distributed.launch import launch\n"
                      f"def w(ctx):\n    return ctx.rank\nlaunch(w, 2, timeout=120, start_method='spawn')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "LaunchError: rank " in out.stderr and "inside `if __name__ == '__main__':`" in out.stderr
