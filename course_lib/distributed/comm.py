"""The traffic ledger: a thin communicator over a torch.distributed process group that records, per rank, the bytes
each call sends and receives, per op and per caller-given tag, plus a trace of timed events for timelines.

Every algorithm in the course (collectives, DDP, ZeRO, pipelines, tensor parallelism) is written on these
primitives, and its traffic is checked by reading the ledger.

Two kinds of entries:
  * point-to-point (send / recv / isend / irecv): the bytes are exactly what was handed to the transport;
  * the backend's own collectives (broadcast / all_reduce / all_gather / reduce_scatter): the backend picks its
    algorithm invisibly, so the ledger records the *nominal* bytes of the bandwidth-optimal ring
    (docs/formulas.md §1.1: all-reduce 2(p−1)/p·S, all-gather and reduce-scatter (p−1)/p·S, broadcast S from the root)
    and marks the entry `nominal=True`. Notebooks that assert traffic use the from-scratch algorithms of
    `course_lib.distributed.collectives`, whose ledger entries are all point-to-point and therefore measured.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


@dataclass(frozen=True)
class Event:
    """One timed entry of the trace. kind: send | recv | collective | compute | barrier."""
    kind: str
    op: str
    tag: str
    t0: float               # time.perf_counter() (CLOCK_MONOTONIC: comparable across processes on one machine)
    t1: float
    sent: int = 0
    recv: int = 0
    peer: int | None = None  # group rank of the other side (point-to-point only)
    group: str = "world"
    nominal: bool = False


@dataclass
class Ledger:
    """Bytes and events of one rank. Picklable: workers return it so the caller can read and plot every rank's."""
    rank: int
    world_size: int
    events: list = field(default_factory=list)
    # bytes sent so far, in all and per group: probes read them after every phase, and summing the events each
    # time made a long run's reads quadratic (5 % of a rank's CPU in the composition tests)
    _sent: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for e in self.events:
            self._count(e)

    def _count(self, e: Event) -> None:
        if e.sent:
            self._sent[None] = self._sent.get(None, 0) + e.sent
            self._sent[e.group] = self._sent.get(e.group, 0) + e.sent

    def record(self, event: Event) -> None:
        self.events.append(event)
        self._count(event)

    def reset(self) -> None:
        self.events.clear()
        self._sent.clear()

    def _select(self, op=None, tag=None, kind=None, group=None):
        for e in self.events:
            if (op is None or e.op == op) \
                    and (tag is None or e.tag == tag or (tag.endswith("*") and e.tag.startswith(tag[:-1]))) \
                    and (kind is None or e.kind == kind) and (group is None or e.group == group):
                yield e

    def bytes_sent(self, op=None, tag=None, group=None) -> int:
        """Bytes this rank sent (tag may end in '*' to match a prefix)."""
        if op is None and tag is None:
            return self._sent.get(group, 0)
        return sum(e.sent for e in self._select(op, tag, group=group))

    def bytes_recv(self, op=None, tag=None, group=None) -> int:
        return sum(e.recv for e in self._select(op, tag, group=group))

    def messages(self, op=None, tag=None, group=None) -> int:
        """Number of messages this rank sent (point-to-point sends, plus one per nominal collective call)."""
        return sum(1 for e in self._select(op, tag, group=group) if e.sent)

    @property
    def has_nominal(self) -> bool:
        return any(e.nominal for e in self.events)

    def by(self, key: str = "op") -> dict:
        """{op or tag: {'sent': bytes, 'recv': bytes, 'messages': n}} over communication events."""
        out = defaultdict(lambda: {"sent": 0, "recv": 0, "messages": 0})
        for e in self.events:
            if e.kind in ("compute",):
                continue
            row = out[getattr(e, key)]
            row["sent"] += e.sent
            row["recv"] += e.recv
            row["messages"] += 1 if e.sent else 0
        return dict(out)

    def table(self, key: str = "op") -> str:
        rows = [f"rank {self.rank}: {'op' if key == 'op' else key:<24} {'sent B':>12} {'recv B':>12} {'msgs':>6}"]
        for name, r in sorted(self.by(key).items()):
            mark = "*" if any(e.nominal for e in self._select(**{key: name})) else ""
            rows.append(f"        {str(name) + mark:<24} {r['sent']:>12,} {r['recv']:>12,} {r['messages']:>6}")
        rows.append(f"        {'total':<24} {self.bytes_sent():>12,} {self.bytes_recv():>12,} {self.messages():>6}")
        if self.has_nominal:
            rows.append("        * nominal bytes of the ring algorithm (the backend's own collective)")
        return "\n".join(rows)


class Handle:
    """An in-flight isend/irecv. `wait()` completes it and records the event (t0 = posted, t1 = completed)."""

    def __init__(self, comm, work, kind, op, tag, nbytes, peer, t0):
        self._comm, self._work, self._args = comm, work, (kind, op, tag, nbytes, peer, t0)
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self._work.wait()
        self._comm._retire(self._work)
        kind, op, tag, nbytes, peer, t0 = self._args
        self._comm._log(kind, op, tag, t0, nbytes if kind == "send" else 0, nbytes if kind == "recv" else 0, peer)
        self.done = True


def wait_all(handles) -> None:
    for h in handles:
        h.wait()


class Communicator:
    """Ledgered send/recv/collectives over `group` (default: the whole world). Ranks and peers are group ranks.

    `new_group(ranks, name)` makes a sub-communicator (collective call: every rank calls it) sharing this ledger.
    """

    def __init__(self, group=None, *, name: str = "world", ledger: Ledger | None = None, solo: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("Communicator needs torch.distributed to be initialized; create ranks with "
                               "course_lib.distributed.launch.launch(fn, world_size), which passes ctx.comm to fn")
        self.group = group
        self.name = name
        if solo:        # a group of one: no process group, and every collective returns at once
            self.group, self.rank, self.world_size, self.global_ranks = None, 0, 1, [dist.get_rank()]
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.ledger = ledger or Ledger(dist.get_rank(), self.world_size)
        # Completed gloo point-to-point works, kept alive a little longer. Destroying one right after its wait()
        # can stall for a scheduler tick when ranks outnumber cores (measured here: a 4-rank ring all-reduce of
        # 64 B took 12 ms that way, 5 ms with this). A retired work pins its tensor, so collectives call
        # `release()` when they return, and memory-exact code calls it before reading a tracker.
        self._retired: deque = deque(maxlen=8)

    def _retire(self, work) -> None:
        self._retired.append(work)

    def release(self) -> None:
        """Drop the finished transfers this communicator still holds (and with them their tensors)."""
        self._retired.clear()

    # ------------------------------------------------------------------ trace
    def _log(self, kind, op, tag, t0, sent=0, recv=0, peer=None, nominal=False):
        self.ledger.record(Event(kind, op, tag, t0, time.perf_counter(), sent, recv, peer, self.name, nominal))

    @contextlib.contextmanager
    def compute(self, label: str = "compute"):
        """Mark a span of computation in the trace (for timelines): `with comm.compute('fwd 0'): ...`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._log("compute", label, label, t0)

    def _global(self, peer: int) -> int:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer {peer} is not another rank of group '{self.name}' (size {self.world_size}, "
                             f"this rank is {self.rank})")
        return self.global_ranks[peer]

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> None:
        self.isend(tensor, dst, tag=tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> torch.Tensor:
        self.irecv(tensor, src, tag=tag).wait()
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: str = "") -> Handle:
        t0 = time.perf_counter()
        work = dist.isend(tensor.contiguous(), self._global(dst), group=self.group)
        return Handle(self, work, "send", "send", tag, _nbytes(tensor), dst, t0)

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: str = "") -> Handle:
        _check_contiguous(tensor)
        t0 = time.perf_counter()
        work = dist.irecv(tensor, self._global(src), group=self.group)
        return Handle(self, work, "recv", "recv", tag, _nbytes(tensor), src, t0)

    def sendrecv(self, send_tensor, dst: int, recv_tensor, src: int, *, tag: str = "") -> torch.Tensor:
        """Send to dst and receive from src at once (a ring step); deadlock-free whatever the order of ranks."""
        hs = self.isend(send_tensor, dst, tag=tag)
        hr = self.irecv(recv_tensor, src, tag=tag)
        hr.wait()
        hs.wait()
        return recv_tensor

    # ------------------------------------------------------------------ the backend's collectives (nominal bytes)
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, tag: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        t0 = time.perf_counter()
        dist.broadcast(tensor, self.global_ranks[src], group=self.group)
        S = _nbytes(tensor) if self.world_size > 1 else 0
        self._log("collective", "broadcast", tag, t0, sent=S if self.rank == src else 0,
                  recv=0 if self.rank == src else S, nominal=True)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, tag: str = "") -> torch.Tensor:
        if self.world_size == 1:
            if op != "avg":
                _reduce_op(op)          # a bad op name is an error even when there is nothing to reduce
            return tensor
        t0 = time.perf_counter()
        if op == "avg":   # gloo has no AVG
            dist.all_reduce(tensor, dist.ReduceOp.SUM, group=self.group)
            tensor.div_(self.world_size)
        else:
            dist.all_reduce(tensor, _reduce_op(op), group=self.group)
        p = self.world_size
        b = round(2 * (p - 1) * _nbytes(tensor) / p)
        self._log("collective", "all_reduce", tag, t0, sent=b, recv=b, nominal=True)
        return tensor

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "") -> torch.Tensor:
        """output (world_size·n,) ← every rank's input (n,), concatenated in rank order."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"world_size × input = {self.world_size} × {input.numel()}")
        if self.world_size == 1:
            return output.copy_(input.reshape(output.shape))
        t0 = time.perf_counter()
        dist.all_gather_single(output, input.contiguous(), group=self.group)
        b = (self.world_size - 1) * _nbytes(input)
        self._log("collective", "all_gather", tag, t0, sent=b, recv=b, nominal=True)
        return output

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       tag: str = "") -> torch.Tensor:
        """output (n,) ← the reduction of chunk `rank` of every rank's input (world_size·n,)."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"world_size × output = {self.world_size} × {output.numel()}")
        if self.world_size == 1:
            return output.copy_(input.reshape(output.shape))
        t0 = time.perf_counter()
        if op == "avg":
            dist.reduce_scatter_single(output, input.contiguous(), dist.ReduceOp.SUM, group=self.group)
            output.div_(self.world_size)
        else:
            dist.reduce_scatter_single(output, input.contiguous(), _reduce_op(op), group=self.group)
        b = (self.world_size - 1) * _nbytes(output)
        self._log("collective", "reduce_scatter", tag, t0, sent=b, recv=b, nominal=True)
        return output

    def barrier(self, *, tag: str = "") -> None:
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        dist.barrier(group=self.group)
        self._log("barrier", "barrier", tag, t0)

    # ------------------------------------------------------------------ groups
    def new_group(self, ranks, name: str) -> Communicator | None:
        """Sub-communicator over `ranks` (group ranks of this communicator). Every rank must call this, in the
        same order; ranks outside the new group get None. The sub-communicator shares this ledger."""
        ranks = sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"new_group: ranks {ranks} must be distinct ranks of group '{self.name}' "
                             f"(0..{self.world_size - 1})")
        group = dist.new_group([self.global_ranks[r] for r in ranks])
        if self.rank not in ranks:
            return None
        return Communicator(group, name=name, ledger=self.ledger)

    def renamed(self, name: str) -> Communicator:
        """The same group under another name (its traffic is booked under `name` in the shared ledger)."""
        if self.world_size == 1:
            return Communicator(name=name, ledger=self.ledger, solo=True)
        return Communicator(self.group, name=name, ledger=self.ledger)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_contiguous(t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError("receive buffers must be contiguous (the data lands in the tensor's memory); "
                         "pass a contiguous tensor and copy it into your view afterwards")


def _reduce_op(op: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; use one of {sorted(_OPS) + ['avg']}") from None


def ping_pong(ctx_or_comm, sizes, repeats: int, *, tag: str = "ping") -> list[float]:
    """One-way time per message size between ranks 0 and 1 (half a round trip), the fastest of `repeats`. Takes a
    Communicator or a rank's context, so it runs as a worker itself: `launch(ping_pong, 2, sizes, repeats)`.

    Measured in rounds, each visiting every size (in reverse order every other round), so that a burst of load on a
    shared machine hits all sizes alike instead of inflating the few measured during it; and the fastest repeat is
    kept, since other programs can only slow a message down. Measuring one size after another with a median
    once fitted a slope below zero (t = α + S·β with β ≤ 0) on a loaded 2-core machine. A first round opens the
    connections and is dropped. Ranks other than 0 and 1 return at once; call it on both.
    """
    comm = getattr(ctx_or_comm, "comm", ctx_or_comm)
    if comm.rank > 1:
        return []
    other = 1 - comm.rank
    bufs = {m: torch.zeros(m, dtype=torch.uint8) for m in sizes}
    best = {m: float("inf") for m in sizes}
    for r in range(repeats + 1):
        for m in (sizes if r % 2 else list(reversed(sizes))):
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.send(bufs[m], other, tag=tag)
                comm.recv(bufs[m], other, tag=tag)
            else:
                comm.recv(bufs[m], other, tag=tag)
                comm.send(bufs[m], other, tag=tag)
            if r:
                best[m] = min(best[m], (time.perf_counter() - t0) / 2)
    return [best[m] for m in sizes]

