"""The rank side of `launch`: what every forked, fork-served or spawned rank runs, and the context its worker
receives.

`_rank_main` loads the worker (sent by value unless forked), joins the process group through the rendezvous store
that rank 0 serves on the socket the caller opened, runs the worker, sends its result (or traceback — also of a
worker that failed to load) back through a pipe, and leaves with the others. Each rank lives in its own process
group and dies with the caller (PR_SET_PDEATHSIG on Linux, a watching thread elsewhere), so nothing outlives the
launch; faulthandler dumps its stack on SIGUSR1, so a rank stuck at a timeout can say where, and on a crash.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class RankContext:
    """What a worker gets as its first argument."""
    rank: int
    world_size: int
    backend: str
    device: torch.device
    local_rank: int = 0
    comm: object = field(default=None, repr=False)   # course_lib.distributed.comm.Communicator over the default group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args, **kwargs) -> None:
        """print with a '[rank r]' prefix."""
        print(f"[rank {self.rank}]", *args, **kwargs, flush=True)


def _make_context(rank: int, world_size: int, backend: str, local_rank: int) -> RankContext:
    from .comm import Communicator
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    return RankContext(rank, world_size, backend, device, local_rank, comm=Communicator())


try:   # loaded here, in the parent: dlopen in a forked child of a threaded process can deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _alive(pid: int) -> bool:
    if sys.platform == "win32":     # os.kill(pid, 0) would end the process there; a spawned rank's parent is the caller
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # PermissionError: it exists
        return True
    return True


def _die_with_parent(caller: int | None = None) -> None:
    """End this rank when the caller (the process that called `launch`) ends.

    Linux: PR_SET_PDEATHSIG fires when this process's parent dies. A forked or spawned rank's parent is the caller;
    a fork server's rank's parent is the fork server, which exits when the caller does (its 'alive' pipe closes), so
    the chain holds there too. Elsewhere a daemon thread waits on multiprocessing's parent sentinel (readable when
    the parent is gone) and exits."""
    caller = caller or (mp.parent_process().pid if mp.parent_process() else os.getppid())
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: if the parent dies, so does this rank
    else:
        parent = mp.parent_process()
        if parent is not None and parent.sentinel is not None:
            threading.Thread(target=_exit_when_ready, args=(parent.sentinel,), daemon=True).start()
    # ... unless the caller died before the line above ran (the signal is only sent on a death after it): then
    # nobody is left to collect this rank's result. Forked or spawned, the parent changed; under a fork server the
    # caller is simply gone.
    if os.getppid() != caller and not _alive(caller):
        os._exit(1)
    if os.getppid() != caller:
        _release_fork_server()


def _release_fork_server() -> None:
    """A fork server's child inherits the write end of the server's 'alive' pipe, and the server exits only when
    every holder has closed it: kept open here, a dead caller would leave the server, and so this rank, running."""
    from multiprocessing import forkserver
    fd = forkserver._forkserver._forkserver_alive_fd
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def _exit_when_ready(sentinel) -> None:
    from multiprocessing.connection import wait
    wait([sentinel])
    os._exit(1)


class _PrefixedStream(io.TextIOBase):
    """Line-buffered writer to a file descriptor that prefixes each line with the rank (works under Jupyter,
    which captures fd 1/2 of the kernel process and its children)."""

    def __init__(self, fd: int, prefix: str):
        self.fd, self.prefix, self.buf = fd, prefix, ""

    def writable(self):
        return True

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            os.write(self.fd, f"{self.prefix}{line}\n".encode())
        return len(s)

    def flush(self):
        if self.buf:
            os.write(self.fd, f"{self.prefix}{self.buf}".encode())
            self.buf = ""


def _rank_main(work, rank, world_size, backend, port, listen, conn, dump_path, timeout, caller=None, env=None):
    """Body of a rank. `work` is (fn, args, kwargs), or those as cloudpickle bytes when the rank was not forked;
    `listen` is rank 0's listening socket (a descriptor when forked, the socket object otherwise). Never returns:
    exits with os._exit so the parent's atexit hooks don't run."""
    code = 1
    by_value = isinstance(work, bytes)
    try:
        dump = open(dump_path, "w")
        faulthandler.enable(file=dump, all_threads=True)          # a crash (segfault, abort) leaves its stack
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
        if hasattr(os, "setpgid"):
            os.setpgid(0, 0)       # own process group: killpg reaches anything the rank starts
        _die_with_parent(caller)
        torch.set_num_threads(1)   # a forked child hangs in its first matmul if the parent ran threaded ops
        sys.stdout = _PrefixedStream(1, "")
        sys.stderr = _PrefixedStream(2, f"[rank {rank}] ")
        os.environ.update(env or {})
        if by_value:               # loaded here, so a worker that cannot load reports its traceback like any error
            from .start import loads
            work = loads(work)
        fn, args, kwargs = work
        listen_fd = listen if isinstance(listen, int) or listen is None else listen.fileno()
        # Rank 0 serves the rendezvous store on the socket the caller opened (no free-port race, and no store
        # thread in the caller, whose locks a forked child could inherit held).
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),
                              master_listen_fd=listen_fd if rank == 0 else None,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        ctx = _make_context(rank, world_size, backend, rank)
        result = fn(ctx, *args, **kwargs)
        payload = ("ok", result)
        try:
            # by value, a class defined in the notebook goes back by value too (cloudpickle maps it back to the
            # caller's own class); forked, the caller has every class the rank has
            if by_value:
                from .start import cloudpickle
                data = cloudpickle.dumps(payload)
            else:
                data = pickle.dumps(payload)
        except Exception as e:  # an unpicklable result is the worker's bug; say so
            data = pickle.dumps(("error", f"rank {rank} returned a value that cannot be pickled: {e!r}",
                                 type(e).__name__, str(e), time.time()))
        conn.send_bytes(data)
        code = 0
        with contextlib.suppress(Exception):
            # Leave together. gloo's full-mesh connect is no barrier: a rank can finish its side of the handshake,
            # run a short worker and exit while a slower rank is still reading the handshake on their connection;
            # the exit closes the socket (with a reset) and the slow rank's init_process_group fails with
            # "Connection closed by peer". Measured here: 12 of 450 concurrent 4-rank launches failed that way.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), type(e).__name__, str(e), time.time())))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
