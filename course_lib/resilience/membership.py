"""Noticing that a peer is gone and carrying on without it (Bamboo's membership): a communicator whose every
message raises `PeerLost` (naming the peer) instead of hanging or failing obscurely, a membership on the rendezvous
store through which the survivors agree who is dead and re-form their process group, and `takeover`, which gives a
dead stage's layers to the stage that held their replica. Used by `resilience.redundant`.
"""
from __future__ import annotations

import datetime
import re
import time

import torch.distributed as dist

from ..distributed.comm import Communicator


class PeerLost(RuntimeError):
    """A point-to-point transfer with group rank `peer` failed: its connection closed."""

    def __init__(self, peer: int, message: str):
        super().__init__(f"the connection to group rank {peer} closed: {message}")
        self.peer = peer


# ============================================================================================ detection
def _lost(peer: int, e: RuntimeError) -> PeerLost:
    # gloo: "[…/pair.cc:553] Connection closed by peer [127.0.0.1]:port. This is typically …": the middle part
    return PeerLost(peer, re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0]).split(". ")[0])


class _Handle:
    def __init__(self, handle, peer):
        self.handle, self.peer = handle, peer

    def wait(self) -> None:
        try:
            self.handle.wait()
        except RuntimeError as e:
            raise _lost(self.peer, e) from e


class Watched:
    """A communicator whose point-to-point transfers say which peer they lost when they fail — when posted (the
    connection is already closed) or when waited for: a SIGKILLed process's sockets are closed by the kernel, so the
    rank waiting on it gets an error at once, not at a timeout."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def isend(self, tensor, dst: int, *, tag: str = ""):
        try:
            return _Handle(self.comm.isend(tensor, dst, tag=tag), dst)
        except RuntimeError as e:
            raise _lost(dst, e) from e

    def irecv(self, tensor, src: int, *, tag: str = ""):
        try:
            return _Handle(self.comm.irecv(tensor, src, tag=tag), src)
        except RuntimeError as e:
            raise _lost(src, e) from e

    def __getattr__(self, name):
        return getattr(self.comm, name)


class Membership:
    """Who is in the job (original ranks, in pipeline order) and the store through which the survivors of a failure
    agree on who died. Generation g's keys live under `bamboo/<job>/g<g>/`; each generation is a process group."""

    def __init__(self, store, world_size: int, rank: int, timeout: float, job: int = 0):
        self.store = dist.PrefixStore(f"bamboo/{job}/", store)
        self.members, self.me, self.gen, self.timeout = list(range(world_size)), rank, 0, timeout

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)

    def _key(self, *parts) -> str:
        return "/".join([f"g{self.gen}", *map(str, parts)])

    def fail(self, peer: int) -> None:
        """The connection to group rank `peer` closed. A peer that left the group on its own said so first
        (`left/`); one that did not is dead. Then this rank leaves too (`regroup`)."""
        self.store.set(self._key("left", self.me), "1")
        who = self.members[peer]
        if not self.store.check([self._key("left", who)]) and self.store.add(self._key("dead", who), 1) == 1:
            self.store.add(self._key("ndead"), 1)

    def regroup(self) -> list:
        """Leave the process group (closing this rank's connections wakes whoever waits on it), wait until every
        member has joined the next generation or been found dead, and form its process group. Returns the dead."""
        dist.destroy_process_group()
        self.store.add(self._key("joined"), 1)
        deadline = time.monotonic() + self.timeout
        while self.store.add(self._key("joined"), 0) + self.store.add(self._key("ndead"), 0) < self.size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {self.gen}: members {self.members} did not all rejoin or get marked "
                                   f"dead within {self.timeout:g} s")
            time.sleep(0.001)
        dead = [m for m in self.members if self.store.check([self._key("dead", m)])]
        self.members = [m for m in self.members if m not in dead]
        self.gen += 1
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{self.gen}/pg/", self.store), rank=self.rank,
                                world_size=self.size, timeout=datetime.timedelta(seconds=self.timeout))
        return dead


def takeover(layers, dead) -> list:
    """Blocks per stage after the stages at indices `dead` died: each dead stage's blocks go to its predecessor,
    which holds their replica. Stage 0 has no predecessor; two neighbours lost leave the second without one."""
    dead = sorted(set(dead))
    if 0 in dead:
        raise ValueError("stage 0 was lost: it has no predecessor holding its replica (and its rank serves the "
                         "job's store); restart from a checkpoint")
    if any(b - a == 1 for a, b in zip(dead, dead[1:])):
        raise ValueError(f"neighbouring stages {dead} were lost: a stage's only replica lived on the stage before it")
    out = []
    for i, n in enumerate(layers):
        if i in dead:
            out[-1] += n
        else:
            out.append(n)
    return out
