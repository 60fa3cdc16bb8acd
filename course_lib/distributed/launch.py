"""Real ranks: `launch(fn, world_size)` runs `fn(ctx, *args, **kwargs)` in `world_size` processes joined by
torch.distributed and returns every rank's result, in rank order.

    results = launch(worker, 4, timeout=60)      # from a notebook cell, a script or a test

Guarantees, each tested:
  * functions defined in notebook cells work under every start method: forked ranks inherit them, and ranks
    started by a fork server or spawned get them by value (cloudpickle), with the same results and bytes. The
    method is fork on Linux, forkserver on macOS and with NCCL, spawn on Windows, or what `start_method=` or
    $COURSE_START_METHOD says (`course_lib.distributed.start`);
  * gloo on CPU; NCCL when CUDA is present and `backend="nccl"` (never forked: CUDA cannot be used in a forked
    child);
  * if any rank raises, the others are stopped and one `LaunchError` shows every rank's traceback (a rank that was
    still running shows the stack where it was stuck, dumped by faulthandler before it is killed);
  * a timeout kills everything and raises `LaunchTimeout` with every rank's stack;
  * no child process or port outlives the call, also when the caller is interrupted (Ctrl-C / kernel interrupt):
    the rendezvous store lives in the caller and is closed, ranks are killed by process group, and each rank
    dies with its parent (PR_SET_PDEATHSIG on Linux; elsewhere a thread that watches the parent). The fork server
    and multiprocessing's resource tracker live as long as the caller and end with it;
  * a rank that dies without a word (killed) stops the job — unless `allow_deaths=True`, for jobs that survive
    losing a rank themselves (`resilience.redundant`): then the others go on, and the dead rank's entry in the
    result list is a `RankDied` (its exit code). Rank 0 serves the rendezvous store, so its death ends the job.

The same worker runs unchanged under `torchrun` (env:// rendezvous): when torchrun's environment is present,
`launch` runs this process's rank only and returns all ranks' results (gathered with all_gather_object). See
`python -m course_lib.run --help` and the README. What each rank runs is in `course_lib.distributed.rank`.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import importlib
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import start
from .rank import RankContext, _die_with_parent, _make_context, _rank_main  # noqa: F401  (re-exported)

DEFAULT_TIMEOUT = 120.0
_GRACE_AFTER_ERROR = 1.5   # seconds other ranks get to finish or fail on their own after one rank raised


class LaunchError(RuntimeError):
    """One or more ranks failed; `.failures` maps rank -> text (traceback or stack dump)."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class LaunchTimeout(LaunchError):
    """The job ran past its timeout; every rank was killed."""


@dataclass(frozen=True)
class RankDied:
    """The result of a rank that died without reporting one (`launch(..., allow_deaths=True)`)."""
    rank: int
    exitcode: int



def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))


def _validate(world_size, timeout, backend) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size <= 0:
        raise ValueError(f"world_size must be a positive integer (number of ranks), got {world_size!r}")
    if world_size > 64:
        raise ValueError(f"world_size={world_size} processes on one machine is more than this course needs; use <= 64")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which this machine does not have; use backend='gloo'")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if backend == "nccl" and local > torch.cuda.device_count():
        raise ValueError(f"backend='nccl' with {local} ranks on this machine needs that many GPUs; "
                         f"this machine has {torch.cuda.device_count()}")


def launch(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None,
           start_method: str | None = None, allow_deaths: bool = False, **kwargs) -> list:
    """Run fn(ctx, *args, **kwargs) on `world_size` real ranks; return the list of results in rank order.

    start_method: 'fork', 'forkserver' or 'spawn'; default $COURSE_START_METHOD, else the platform's
    (`course_lib.distributed.start.default_start_method`). A worker defined in a notebook cell works under each; under
    forkserver and spawn it and its arguments travel by value, so what they hold must pickle (no open files, locks
    or sockets: make those inside the worker). spawn imports torch in every rank at every launch (seconds).
    allow_deaths: a rank killed by a signal (or gone without a result) does not stop the others; its result is a
    `RankDied`. A rank that raises still fails the job; so does a timeout. Not under torchrun (its agent decides).
    """
    backend = backend or "gloo"          # NCCL only on request: CPU machines have no CUDA
    _validate(world_size, timeout, backend)
    method = start.choose_start_method(start_method, backend)
    if under_torchrun():
        if allow_deaths:
            raise ValueError("allow_deaths=True is for local launches: under torchrun its agent restarts the group "
                             "when a worker dies; use torchrun's --max-restarts instead")
        return _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend)
    return _launch_local(fn, world_size, args, kwargs, timeout, backend, method, allow_deaths)


# --------------------------------------------------------------------------------------------- the rank side
# --------------------------------------------------------------------------------------------- the caller side
_PRELOAD = ["torch._dynamo"]   # module names `launch` imports in the caller before forking: see preload_in_ranks


def preload_in_ranks(*module_names: str) -> None:
    """Name modules that `launch` should import in the caller, once, before it forks ranks: a performance preload.

    A forked rank inherits every module its parent has imported; what a worker imports inside the rank (a
    function-local import, a module the caller never touched) costs each rank again, every launch — torch.optim
    imports torch._dynamo the first time an optimizer is built (1–5 s here), and without bytecode caching a course
    module is compiled from source in every rank (~0.5 s per rank per launch). So the layer that knows which modules
    its workers import lazily names them here (`course_lib.parallel` and `course_lib.memopt` name their techniques).
    distributed depends on none of them: they are strings imported by `importlib` only to warm the cache, and a name
    that fails to import is skipped (the rank that needs it raises, with its own traceback)."""
    for name in module_names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"preload_in_ranks takes module names, e.g. 'course_lib.parallel.zero'; got {name!r}")
        if name not in _PRELOAD:
            _PRELOAD.append(name)


def _warm_imports() -> None:
    """Import the registered preloads in the caller (`preload_in_ranks`), so that forked ranks inherit them."""
    for name in list(_PRELOAD):
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _launch_local(fn, world_size, args, kwargs, timeout, backend, method, allow_deaths=False):
    if method == "fork":
        _warm_imports()
        work = (fn, args, kwargs)                   # inherited by the fork: nothing pickled
    else:
        work = start.dumps(fn, args, kwargs)        # by value; an object that cannot travel is named here
    ctx = start.context(method, _PRELOAD)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    tmpdir = tempfile.mkdtemp(prefix="course-launch-")
    env = _rank_env()
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            # rank 0 serves the store on this socket: a forked rank inherits its descriptor; a spawned one gets the
            # socket itself, duplicated into it by multiprocessing (SCM_RIGHTS to the fork server, or passed fds)
            listen = (listener.fileno() if method == "fork" else listener) if rank == 0 else None
            p = ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                            args=(work, rank, world_size, backend, port, listen, send_end,
                                  os.path.join(tmpdir, f"rank{rank}.stack"), timeout, os.getpid(), env))
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        listener.close()                            # rank 0 holds the port now; it closes when rank 0 ends
        return _collect(procs, conns, timeout, tmpdir, allow_deaths, method)
    finally:
        listener.close()
        _kill_all(procs)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _loopback_interface() -> str | None:
    """The loopback interface's name (lo on Linux, lo0 on macOS and the BSDs), None if there is no such list."""
    with contextlib.suppress(Exception):
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0") or name.startswith("Loopback"):
                return name
    return None


@functools.lru_cache(maxsize=1)
def _hostname_binds() -> bool:
    """Whether this machine's host name resolves to an address it can bind, as gloo needs (asked once: a resolver
    that times out would otherwise cost every launch)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _rank_env() -> dict[str, str]:
    """Environment the ranks set before joining: gloo's interface when the host name does not resolve to an
    address this machine can bind (macOS often), since gloo would print a fallback warning into the notebook at
    every launch. A GLOO_SOCKET_IFNAME the user set wins."""
    if "GLOO_SOCKET_IFNAME" in os.environ or _hostname_binds():
        return {}
    name = _loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


# A rank that is not forked runs Python's start-up before the worker; an error there (most often a script that
# launches without `if __name__ == "__main__":`, so each rank launches again) is printed to stderr, not sent back.
_START_HINT = ("\nIt may have failed before its worker started; its error is printed above this message. A script "
               "that calls launch under spawn or forkserver must do so inside `if __name__ == '__main__':`.")


# Errors a rank raises because *another* rank failed: never the cause when a better candidate exists.
_PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
                  "Socket Timeout", "Timed out waiting", "connection refused")


def _collect(procs, conns, timeout, tmpdir, allow_deaths=False, method="fork"):
    """Wait for every rank's report; on the first failure give the others a short grace, then stop them (a death
    is no failure with `allow_deaths`: the others go on)."""
    n = len(procs)
    results: dict[int, object] = {}
    failures: dict[int, str] = {}
    causes: list[tuple] = []             # (priority, time, rank, exception name, message); lowest sorts first
    deadline = time.monotonic() + timeout
    error_deadline = None
    pending = set(range(n))
    while pending:
        now = time.monotonic()
        limit = deadline if error_deadline is None else min(deadline, error_deadline)
        if now >= limit:
            break
        waitables = [conns[i] for i in pending] + [procs[i].sentinel for i in pending]
        ready = mpc.wait(waitables, timeout=min(0.5, limit - now))
        for i in list(pending):
            kind = None
            if conns[i] in ready:
                try:
                    kind, *payload = pickle.loads(conns[i].recv_bytes())
                except (EOFError, OSError):      # the pipe closed: the rank died without a word
                    kind = "died"
            elif procs[i].sentinel in ready and not conns[i].poll():
                kind = "died"
            if kind == "ok":
                results[i] = payload[0]
            elif kind == "error":
                failures[i] = payload[0]
                symptom = any(s.lower() in payload[2].lower() for s in _PEER_SYMPTOMS)
                causes.append((2 if symptom else 0, payload[3], i, payload[1], payload[2]))
            elif kind == "died" and allow_deaths:
                procs[i].join(1.0)
                results[i] = RankDied(i, procs[i].exitcode)
                kind = "ok"
            elif kind == "died":
                procs[i].join(1.0)
                code = procs[i].exitcode
                failures[i] = f"rank {i} exited with code {code} without reporting a result " \
                              f"(killed by a signal, or os._exit/sys.exit in the worker)" + _fatal_dump(tmpdir, i)
                if method != "fork" and code == 1:
                    failures[i] += _START_HINT
                causes.append((1, time.time(), i, "RankDied", f"exited with code {code} without a result"))
            if kind is not None:
                pending.discard(i)
                if kind != "ok" and error_deadline is None:
                    error_deadline = time.monotonic() + _GRACE_AFTER_ERROR
    failures.update(_dump_stacks({i: procs[i] for i in pending}, tmpdir))   # where each one is stuck
    if not failures:
        return [results[i] for i in range(n)]
    if not causes:
        head = f"launch timed out after {timeout:g} s: rank(s) {sorted(pending)} still running and were killed. " \
               f"A rank waiting forever usually means a send without its matching recv, or a collective that " \
               f"not every rank called. Pass a larger timeout= if the job is just slow."
        raise LaunchTimeout(_message(head, failures), failures)
    _, _, r, ename, emsg = min(causes)
    stopped = sorted(pending)
    head = f"rank {r} raised {ename}: {emsg}" if ename != "RankDied" else f"rank {r} {emsg}"
    head += f"; rank(s) {stopped} were stopped" if stopped else ""
    raise LaunchError(_message(head, failures), failures)


def _dump_stacks(procs: dict, tmpdir: str, wait: float = 3.0) -> dict[int, str]:
    """Ask every still-running rank for its Python stack (faulthandler on SIGUSR1), all at once."""
    paths = {i: os.path.join(tmpdir, f"rank{i}.stack") for i in procs}
    if not hasattr(signal, "SIGUSR1"):       # Windows: no signal to ask with
        return {i: "still running when stopped (no stack: this platform has no SIGUSR1)" for i in procs}
    for p in procs.values():
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    texts: dict[int, str] = {}
    end = time.monotonic() + wait
    while procs and time.monotonic() < end and len(texts) < len(procs):
        time.sleep(0.05)
        for i, path in paths.items():
            with contextlib.suppress(OSError):
                text = open(path).read()
                if "File" in text:
                    texts[i] = text
    time.sleep(0.1)                       # let a dump in progress finish
    out = {}
    for i, path in paths.items():
        with contextlib.suppress(OSError):
            texts[i] = open(path).read().strip()
        out[i] = ("still running when stopped; its Python stack:\n" + texts[i]) if texts.get(i) \
            else "still running when stopped (no stack could be dumped)"
    return out


def _fatal_dump(tmpdir: str, rank: int) -> str:
    """What faulthandler wrote when the rank crashed (segfault, abort), or nothing."""
    with contextlib.suppress(OSError):
        text = open(os.path.join(tmpdir, f"rank{rank}.stack")).read().strip()
        if text:
            return "\n" + text
    return ""


def _message(head: str, failures: dict[int, str]) -> str:
    parts = [head]
    for rank in sorted(failures):
        parts.append(f"\n---------------- rank {rank} ----------------\n{failures[rank].rstrip()}")
    return "\n".join(parts)


def _kill_all(procs) -> None:
    for p in procs:
        if p.pid is None:
            continue
        if hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, OSError, ValueError):
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(5)
            with contextlib.suppress(Exception):
                p.close()


# --------------------------------------------------------------------------------------------- under torchrun
def _run_under_torchrun(fn, world_size, args, kwargs, timeout, backend):
    env_ws = int(os.environ["WORLD_SIZE"])
    if env_ws != world_size:
        raise ValueError(f"launch(world_size={world_size}) but torchrun started WORLD_SIZE={env_ws} ranks; "
                         f"pass world_size=int(os.environ['WORLD_SIZE']) or match --nnodes × --nproc-per-node")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
        # Tear the group down before the interpreter does: a process group left to finalization can abort the
        # process ("terminate called without an active exception") after the work is done.
        atexit.register(_destroy_group)
    ctx = _make_context(rank, world_size, backend, local_rank)
    result = fn(ctx, *args, **kwargs)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    ctx.comm.release()
    return gathered


def _destroy_group() -> None:
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()
