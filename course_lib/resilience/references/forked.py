"""Children forked from this process, which has torch and the course imported: a new process without a new
interpreter (about 4 CPU-seconds of imports saved per process). `run_torchrun` forks torchrun's agent and
`run_torchft` the lighthouse and the replica groups this way; `stop_forked` kills what is left of them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys


def start_forked(target, *args, stdout=None, stderr=None):
    """Start `target(*args)` in a child forked from this process, which has torch and this package imported: a new
    process without a new interpreter. A new interpreter imports torch again, and torch._dynamo at the first
    optimizer step — about 4 CPU-seconds, more than a whole torchrun or torchft run of the nano GPT takes here. The
    child sits in its own process group, dies with this process, runs one thread (the rule for forked ranks) and
    writes stdout and stderr into the files `stdout` and `stderr` (default: stdout nowhere, stderr with it)."""
    import multiprocessing as mp
    proc = mp.get_context("fork").Process(target=_child, args=(target, args, stdout, stderr), name=target.__name__)
    proc.start()
    return proc


def _child(target, args, stdout, stderr):
    from ...distributed.launch import _die_with_parent
    os.setpgid(0, 0)
    _die_with_parent()
    import torch
    torch.set_num_threads(1)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out = os.open(stdout, flags, 0o644) if stdout else os.open(os.devnull, os.O_WRONLY)
    err = os.open(stderr, flags, 0o644) if stderr else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", buffering=1, closefd=False)
    import logging
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):     # torch's log handlers hold the caller's stderr (a
            if type(handler) is logging.StreamHandler:      # notebook's, pytest's): they write to this one now
                handler.stream = sys.stderr
    target(*args)


def stop_forked(procs) -> None:
    """Kill every child still running (its whole process group: what it started too) and reap it. One that has
    exited was reaped already: its process group id may belong to another process by now."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.join(5)
