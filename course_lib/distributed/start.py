"""How `launch` starts its ranks, and how a worker travels to them: the start method per platform, and a worker
defined in a notebook cell sent by value.

Three ways to start a process (Python's `multiprocessing` start methods):

    fork        the child is a copy of the caller: everything defined or imported there is already in the rank, so
                nothing is pickled. Linux's default here. Not safe after Apple's frameworks are loaded (macOS), absent
                on Windows, and CUDA cannot be used in a forked child (NCCL).
    forkserver  a clean server process, started once per kernel, imports torch and the course (`_PRELOAD_SERVER`)
                and forks each rank from itself: as fast as fork after its first start, and safe for CUDA.
    spawn       a fresh interpreter per rank: works everywhere (Windows has only this), imports torch each time.

Under forkserver and spawn the worker, its arguments and what it closes over are pickled with cloudpickle (as loky
and joblib do), which sends a function defined in `__main__` — a notebook cell — by value and everything importable
by reference, so ranks compute the same results and send the same bytes as forked ranks. What cannot be pickled
(an open file, a lock, a socket) is named in one line, with the fix: make it inside the worker.

The method is, first to last: `launch(start_method=...)`, the environment variable COURSE_START_METHOD, then the
platform's default (`default_start_method`).
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import types

import cloudpickle

METHODS = ("fork", "forkserver", "spawn")
ENV = "COURSE_START_METHOD"
# What the fork server imports once, so each rank it forks starts with torch and the course already loaded (a
# spawned rank spends ~3 s importing them). `preload_in_ranks` adds the lazily imported layers.
_PRELOAD_SERVER = ["torch", "torch.distributed", "cloudpickle", "course_lib.distributed.rank",
                   "course_lib.distributed.comm"]


def default_start_method(backend: str = "gloo", platform: str = sys.platform) -> str:
    """fork on Linux with gloo; forkserver where fork is unsafe or CUDA is used (macOS, NCCL); spawn on Windows."""
    if platform.startswith("win"):
        return "spawn"
    if backend == "nccl" or platform == "darwin":
        return "forkserver"
    return "fork"


def choose_start_method(start_method: str | None, backend: str, env: dict | None = None) -> str:
    """The start method `launch` uses: the argument, else $COURSE_START_METHOD, else the platform's default. A name
    this platform lacks, or fork for NCCL, is one line saying what to pick. ($COURSE_START_METHOD=fork with NCCL
    falls back to NCCL's default: the variable is a machine-wide choice, the argument a deliberate one.)"""
    import os
    env = os.environ if env is None else env
    source, method = "start_method", start_method
    if method is None and env.get(ENV):
        source, method = f"${ENV}", env[ENV].strip().lower()
        if method == "fork" and backend == "nccl":
            method = None
    available = [m for m in METHODS if m in mp.get_all_start_methods()]
    if method is None:
        method = default_start_method(backend)
        return method if method in available else "spawn"
    if method not in METHODS:
        raise ValueError(f"{source}={method!r}: pick one of {', '.join(available)}")
    if method not in available:
        raise ValueError(f"{source}={method!r}: this platform ({sys.platform}) has no {method!r} start method; "
                         f"pick one of {', '.join(available)}")
    if method == "fork" and backend == "nccl":
        raise ValueError("start_method='fork' with backend='nccl': CUDA cannot be used in a forked process; "
                         f"pick {' or '.join(m for m in available if m != 'fork')}")
    return method


def context(method: str, preload: list[str]):
    """multiprocessing's context for `method`; the fork server is told what to import before it first starts."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver
        if forkserver._forkserver._forkserver_pid is None:     # not started yet: later calls cannot change it
            ctx.set_forkserver_preload([*_PRELOAD_SERVER, *preload])
    return ctx


# ------------------------------------------------------------------------------------------------ by value
def dumps(fn, args: tuple, kwargs: dict) -> bytes:
    """(fn, args, kwargs) as bytes a spawned rank can load; ValueError naming the object that cannot travel."""
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - whatever pickling raised, find the object and say what to do
        where, obj, err = _culprit(fn, args, kwargs) or ("the worker or its arguments", None, e)
        what = f"{type(obj).__name__} {_short(obj)}" if obj is not None else f"({type(err).__name__}: {err})"
        raise ValueError(f"{where} is {what}, which cannot be sent to a rank started with spawn/forkserver: create "
                         f"it inside the worker (e.g. open the file or make the lock there) and pass what it is made "
                         f"from, or use start_method='fork' where the platform has it") from None


def loads(data: bytes):
    return cloudpickle.loads(data)


def _short(obj, n: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= n else text[:n - 1] + "…"


def _picklable(obj) -> Exception | None:
    try:
        cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _global_names(code: types.CodeType) -> set[str]:
    """The globals a function's code reads (cloudpickle's own walk, so exactly the ones it pickles)."""
    try:
        return set(cloudpickle.cloudpickle._extract_code_globals(code))
    except Exception:  # noqa: BLE001 - a private helper: fall back to every name the code mentions
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= _global_names(const)
        return names


def _parts(obj, label: str):
    """(label, value) of what pickling `obj` pickles too: a function's closure, the globals it names, its defaults;
    a container's items; an object's attributes."""
    if isinstance(obj, types.FunctionType):
        name = obj.__qualname__
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"`{var}` (closed over by `{name}`)", cell.cell_contents
            except ValueError:     # an empty cell (a name assigned later)
                continue
        for var in sorted(_global_names(obj.__code__)):
            if var in obj.__globals__:
                yield f"`{var}` (a global `{name}` uses)", obj.__globals__[var]
        for _i, d in enumerate(obj.__defaults__ or ()):
            yield f"a default argument of `{name}`", d
        for k, d in (obj.__kwdefaults__ or {}).items():
            yield f"the default of `{name}`'s argument `{k}`", d
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{label}[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"{label}[{i}]", v
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
        for k, v in vars(obj).items():
            yield f"{label}.{k}", v


def _culprit(fn, args, kwargs):
    """(where, object, error) of the innermost object that will not pickle, or None."""
    seen: set[int] = set()

    def search(label, obj, depth):
        if id(obj) in seen or depth > 6:
            return None
        seen.add(id(obj))
        err = _picklable(obj)
        if err is None:
            return None
        for sub_label, sub in _parts(obj, label):
            found = search(sub_label, sub, depth + 1)
            if found:
                return found
        return label, obj, err

    top = [(f"the worker `{getattr(fn, '__qualname__', fn)}`", fn)]
    top += [(f"argument {i} of the launch", a) for i, a in enumerate(args)]
    top += [(f"keyword argument `{k}` of the launch", v) for k, v in kwargs.items()]
    for label, obj in top:
        found = search(label, obj, 0)
        if found:
            return found
    return None
