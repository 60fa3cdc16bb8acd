"""Measured: how bytes move between two real processes on this machine, and what each copy and kernel crossing costs.

Four paths with fewer and fewer copies, timed and CPU-accounted by `measure_transports`:

    path           sender                                   receiver                                CPU copies
    tcp_naive      tobytes() copy, sendall → kernel buffer  recv() chunks (kernel → user), join      4
    tcp_zerocopy   sendall(memoryview) → kernel buffer      recv_into a preallocated buffer          2
    shm_write      one-sided write into a buffer mapped     nothing on the data path: wakes on the   1
                   by both sides before the run, doorbell   doorbell (a pipe) and acknowledges
    memcpy         dst.copy_(src) inside one process: the ceiling of any path on this machine       1

`shm_write` is the RDMA analogue: the buffer is "registered" (mapped into both processes) once, before any message,
and the data path is one store into it with no system call; only the 1-byte doorbell and the ack cross the kernel.
Here the sender's CPU plays the NIC's DMA engine, so its copy costs CPU time that real RDMA hardware would not.

Method, per message size: one-way + ack. The sender starts a clock, pushes the message, and stops when the
receiver's 1-byte acknowledgement arrives (the receiver acks only once it holds every byte). This is the time until
the sender *knows* the data is delivered, which is also what an RDMA write's completion means (the reliable-
connection transport completes a write when the remote NIC's ACK returns). Small messages are sent `inner` times in a
row (at least 3, at most 16; each timed, their median kept); each size is measured `repeats` times, the paths
interleaved at every size so that bursts of load from other programs hit every path alike, and the median is
reported; ratios between paths are taken pairwise (`time_ratio`, `speedup`).

CPU involvement: `getrusage` user and system seconds on each side around a block of large messages, per GB moved.
The total is the scheduler's own run time (exact to the µs); the user/system split is sampled on timer ticks, so it is
approximate. CPU seconds per byte are not a constant of a path: other programs move them (shared caches and memory
bandwidth, how the two ranks and everything else share the cores). So the blocks come in rounds, one block per path
per round, the order reversed every round, and paths are compared round by round (`cpu_rounds`): a paired ratio
compares two blocks that ran next to each other, and its median over rounds ignores a round that load disturbed.

Checked against Hockney's α–β model (Parallel Computing 20(3), 1994; docs/formulas.md §9), fitted per path:

    t(S) = α + S·β,   n½ = α/β  (the size at which half the time is latency: bandwidth dominates above it)
"""
from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.costmodel import GB, Link, fit_alpha_beta
from .wire import (KiB, MiB, SharedRegion, _read_exact_fd, connect_ranks, memcpy_once,  # noqa: F401
                   recv_ack, recv_shm_write, recv_tcp_naive, recv_tcp_zerocopy, send_shm_write, send_tcp_naive,
                   send_tcp_zerocopy)

PATHS = ("tcp_naive", "tcp_zerocopy", "shm_write", "memcpy")
DEFAULT_TIMEOUT = 120.0
_INNER_BYTES = 256 * KiB     # a size is sent this many bytes' worth of times per repeat (3 to 16 messages)
_CPU_BLOCK_BYTES = 32 * MiB  # bytes per path per round of the CPU measurement


@dataclass(frozen=True)
class MeasuredPath:
    """What one measured path does to the bytes (the copy count is the lesson: fewer copies, more bandwidth)."""
    name: str
    copies: int                  # CPU copies of the payload between the sender's buffer and the receiver's
    kernel_on_data_path: bool    # does the payload pass through the kernel (system calls copy it)?
    how: str


MEASURED_PATHS = {
    "tcp_naive": MeasuredPath("tcp_naive", 4, True,
                              "tobytes() copy → kernel (sendall) → kernel → user (recv) → join"),
    "tcp_zerocopy": MeasuredPath("tcp_zerocopy", 2, True, "user → kernel (sendall(memoryview)) → recv_into user"),
    "shm_write": MeasuredPath("shm_write", 1, False, "one store into the shared, pre-mapped buffer; doorbell + ack"),
    "memcpy": MeasuredPath("memcpy", 1, False, "dst.copy_(src) in one process: no second party, no signal"),
}


def message_sizes(max_bytes: int = 16 * MiB, min_bytes: int = 8, factor: int = 2) -> list[int]:
    """Geometric message sizes min_bytes, min_bytes·factor, … ≤ max_bytes (max_bytes always included)."""
    if not (1 <= min_bytes <= max_bytes) or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes = []
    n = min_bytes
    while n < max_bytes:
        sizes.append(n)
        n *= factor
    return sizes + [max_bytes]


def _inner(nbytes: int) -> int:
    return max(3, min(16, _INNER_BYTES // nbytes))


def pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    """Deterministic uint8 payload, cheap to make on both sides: a random block of prime length, tiled."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=g)
    return block.repeat(nbytes // block.numel() + 1)[:nbytes].clone()


# ------------------------------------------------------------------------------------------------ measured result
@dataclass
class TransportMeasurement:
    """What `measure_transports` returns. Times are seconds per message (one-way + ack), medians over repeats; CPU
    seconds come in rounds, one block of `cpu_bytes` per path per round, so that paths can be compared round by
    round (paired) as well as in total."""
    sizes: np.ndarray                     # (n_sizes,) bytes
    paths: tuple
    samples: dict                         # path -> (repeats, n_sizes) seconds per message
    cpu: dict                             # path -> {"sender"|"receiver": {"user": (rounds,) s, "sys": (rounds,) s}}
    cpu_bytes: int                        # bytes moved per path per round
    cpu_wall: dict                        # path -> (rounds,) wall seconds of each block
    verified: dict = field(default_factory=dict)   # path -> messages whose bytes the receiver compared, all equal
    fastest: dict = field(default_factory=dict)    # path -> (repeats, n_sizes) fastest of the inner messages
    method: str = ("one-way + 1-byte ack; median over repeats; CPU from getrusage in rounds of one block per path, "
                   "the order reversed every round")

    def latency(self, path: str) -> np.ndarray:
        """Median seconds per message, per size."""
        return np.median(self.samples[path], axis=0)

    def floor(self, path: str, at: int = 0) -> float:
        """The fastest single message of size index `at` over every repeat, in seconds. A busy machine can only add
        to a message's time, so the floor is the path's own cost; it needs one undisturbed message among all
        repeats × inner messages, where a floor of the medians needs a whole undisturbed repeat."""
        return float(self.fastest[path][:, at].min())

    def bandwidth(self, path: str) -> np.ndarray:
        """Bytes per second per size (size / median time)."""
        return self.sizes / self.latency(path)

    def large_bandwidth(self, path: str, top: int = 3) -> float:
        """Median bandwidth over the `top` largest sizes (bytes/s)."""
        return float(np.median(self.bandwidth(path)[-top:]))

    def time_ratio(self, a: str, b: str, at=slice(None)) -> float:
        """Median over repeats (and the sizes `at` picks: an index or a slice) of the paired ratio t_a / t_b.
        Paired: at each size and repeat the paths were measured back to back, so load from other programs hits
        both alike, and one preempted measurement cannot move a median."""
        return float(np.median(self.samples[a][:, at] / self.samples[b][:, at]))

    def speedup(self, faster: str, slower: str, top: int = 3) -> float:
        """How many times the bandwidth of `slower` `faster` gets at the `top` largest sizes (paired, `time_ratio`)."""
        return self.time_ratio(slower, faster, slice(-top, None))

    def fit(self, path: str) -> Link:
        """α–β fit of this path's medians (costmodel.fit_alpha_beta, relative weights); a Link of kind 'fitted'."""
        return fit_alpha_beta(self.sizes, self.latency(path), name=path)

    def model_checks(self, path: str) -> dict:
        """How well t = α + S·β describes `path`, judged inside each repeat against that repeat's own fit, then the
        median over repeats: 'flat', the median time of the sizes ≤ n½/16 ÷ α (1 + at most 1/16 by the model: those
        sizes are latency-bound); 'grown', the time of the first size ≥ 16·n½ ÷ α (≥ 17 by the model); 'peak', the
        highest bandwidth at sizes ≥ 16·n½ ÷ B (≤ 1 by the model). NaN where no repeat has a size in the range.

        Why per repeat: a repeat measures every size within a fraction of a second, so a change of load from another
        program (this machine's small-message time moves between about 15 and 70 µs with how busy its cores are)
        hits all of its sizes alike, and a repeat caught mid-change cannot move the median. The medians over repeats
        (`latency`, `fit`) mix sizes measured seconds apart: one size's median may come from a busy phase and its
        neighbour's from an idle one."""
        rows = []
        for t in self.samples[path]:
            try:
                L = fit_alpha_beta(self.sizes, t, name=path)
            except ValueError:                     # this repeat shows no bandwidth term (β ≤ 0): it judges nothing
                continue
            n_half = L.half_bandwidth_size()
            below, above = self.sizes <= n_half / 16, self.sizes >= 16 * n_half
            rows.append((float(np.median(t[below])) / L.alpha if below.any() and L.alpha > 0 else math.nan,
                         float(t[above][0]) / L.alpha if above.any() and L.alpha > 0 else math.nan,
                         float(np.max(self.sizes[above] / t[above])) / L.bandwidth if above.any() else math.nan))
        cols = np.array(rows, dtype=float).reshape(-1, 3).T          # one column per check, a row per repeat
        return {k: float(np.nanmedian(c)) if (~np.isnan(c)).any() else math.nan
                for k, c in zip(("flat", "grown", "peak"), cols)}

    def cpu_rounds(self, path: str, side: str = "both", kind: str = "total") -> np.ndarray:
        """CPU seconds per GB (10⁹ bytes) moved in each round, on one side ('sender', 'receiver') or 'both' added;
        kind is 'user', 'sys' or 'total'."""
        if side == "both":
            return self.cpu_rounds(path, "sender", kind) + self.cpu_rounds(path, "receiver", kind)
        c = self.cpu[path][side]
        s = np.asarray(c["user"]) + np.asarray(c["sys"]) if kind == "total" else np.asarray(c[kind])
        return s / (self.cpu_bytes / GB)

    def cpu_per_gb(self, path: str, side: str = "both", kind: str = "total") -> float:
        """CPU seconds per GB moved over all rounds (the mean of `cpu_rounds`: every round moves the same bytes)."""
        return float(np.mean(self.cpu_rounds(path, side, kind)))


# ------------------------------------------------------------------------------------------------ the connection
def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _transport_worker(ctx, sizes, paths, repeats, warmup, cpu_bytes, cpu_messages, cpu_rounds, verify, seed,
                      timeout, fault):
    """Rank 0 sends and times, rank 1 receives. Both walk the same deterministic plan, so no control messages."""
    sender = ctx.rank == 0
    max_n = max(max(sizes), cpu_bytes)
    region = SharedRegion(ctx.rank, max_n, timeout)     # registered before any message, as RDMA memory is
    shared = region.buffer
    # each side holds only the pipe ends it uses: the sender writes the doorbell and reads the ack
    doorbell_w, ack_r = (region.write_fd, region.read_fd) if sender else (None, None)
    doorbell_r, ack_w = (None, None) if sender else (region.read_fd, region.write_fd)
    sock = connect_ranks(ctx.rank, timeout)
    src = pattern(max_n, seed)
    src_np, src_mv = src.numpy(), memoryview(src.numpy())
    dst = torch.zeros(max_n, dtype=torch.uint8)                   # touched now, so no page faults when timed
    dst_mv = memoryview(dst.numpy())
    verified = {p: 0 for p in paths}

    def check(path, got: torch.Tensor, n: int):
        """Compare with what was sent, then wipe a reused buffer, so stale bytes cannot pass the next check."""
        if not torch.equal(got, src[:n]):
            bad = int((got != src[:n]).nonzero()[0])
            raise AssertionError(f"{path}: message of {n} bytes arrived corrupted (first bad byte at {bad})")
        verified[path] += 1
        if path != "tcp_naive":                  # the naive receiver gets a fresh buffer per message
            got.zero_()

    def one(path: str, n: int):
        if sender:
            if path == "tcp_naive":
                send_tcp_naive(sock, src_np, n)
            elif path == "tcp_zerocopy":
                send_tcp_zerocopy(sock, src_mv, n)
            elif path == "shm_write":
                send_shm_write(shared, src, n, doorbell_w, ack_r, timeout)
            elif path == "memcpy":
                memcpy_once(dst, src, n)
                if verify:
                    check(path, dst[:n], n)
            return
        if path == "tcp_naive":
            data = recv_tcp_naive(sock, n)
            if verify:
                check(path, torch.frombuffer(bytearray(data), dtype=torch.uint8), n)
        elif path == "tcp_zerocopy":
            recv_tcp_zerocopy(sock, dst_mv, n)
            if verify:
                check(path, dst[:n], n)
        elif path == "shm_write":
            if verify:                       # check before the ack: the sender may overwrite right after it
                _read_exact_fd(doorbell_r, 1, timeout)
                check(path, shared[:n], n)
                os.write(ack_w, b"k")
            else:
                recv_shm_write(doorbell_r, ack_w, timeout)
        if fault == "raise":
            raise RuntimeError("injected fault: the receiver failed after its first message")
        if fault == "hang":
            time.sleep(10 * timeout)

    try:
        samples = {p: np.zeros((repeats, len(sizes))) for p in paths}
        fastest = {p: np.zeros((repeats, len(sizes))) for p in paths}
        # Paths interleaved at every size: the measurements compared with each other are milliseconds apart, so a
        # burst of load from another program (CPU or memory bandwidth) hits both sides of a ratio alike.
        for rep in range(warmup + repeats):
            for i, n in enumerate(sizes):
                for path in paths:
                    one(path, sizes[0])     # untimed: wake the peer and warm this path after the previous one
                    dts = []
                    for _ in range(_inner(n)):
                        t0 = time.perf_counter()
                        one(path, n)
                        dts.append(time.perf_counter() - t0)
                    if rep >= warmup:   # median of the inner messages: a preemption by another process is not α
                        samples[path][rep - warmup, i] = float(np.median(dts))
                        fastest[path][rep - warmup, i] = min(dts)
        # CPU in rounds, one block per path per round, the order reversed every round: the blocks compared with
        # each other are adjacent in time, so load from other programs (which moves CPU seconds per byte through
        # caches, memory bandwidth and how the two ranks interleave) hits both sides of a paired ratio alike.
        cpu = {p: np.zeros((cpu_rounds, 2)) for p in paths}          # (user, sys) seconds per round
        cpu_wall = {p: np.zeros(cpu_rounds) for p in paths}
        for r in range(cpu_rounds):
            for path in (paths if r % 2 == 0 else paths[::-1]):
                u0, s0 = _rusage()
                t0 = time.perf_counter()
                for _ in range(cpu_messages):
                    one(path, cpu_bytes)
                cpu_wall[path][r] = time.perf_counter() - t0
                u1, s1 = _rusage()
                cpu[path][r] = (u1 - u0, s1 - s0)
    finally:
        sock.close()
        region.close()
    if sender:
        return {"samples": samples, "fastest": fastest, "cpu": cpu, "cpu_wall": cpu_wall, "verified": verified}
    return {"cpu": cpu, "verified": verified}


def measure_transports(sizes=None, paths=PATHS, *, repeats: int = 5, warmup: int = 1, cpu_bytes: int | None = None,
                       cpu_messages: int | None = None, cpu_rounds: int = 9, verify: bool = False, seed: int = 0,
                       timeout: float = DEFAULT_TIMEOUT, fault: str | None = None) -> TransportMeasurement:
    """Measure every path between two real processes (ranks of `course_lib.distributed.launch.launch`); see the module
    docstring.

    sizes: message sizes in bytes (default `message_sizes()`, 8 B … 16 MiB). CPU time is measured in `cpu_rounds`
    rounds of one block per path, a block being `cpu_messages` messages of `cpu_bytes` (default: the largest size,
    as many as make 32 MiB); the rounds give paired ratios between paths (`TransportMeasurement.cpu_rounds`).
    verify=True makes the receiver compare
    every message with the expected bytes (slower; timings then mean nothing). `fault` ('raise' or 'hang' in the
    receiver after its first message) exists for the tests that prove nothing is left behind when a rank fails.

    The connection, the shared buffer and the pipes are made inside the ranks before any message (the shared
    buffer is "registered" like RDMA memory), so this runs however `launch` starts its ranks, and no name is left
    on disk; `launch` kills both ranks on error or timeout.
    """
    from ..distributed.launch import launch

    sizes = [int(s) for s in (sizes if sizes is not None else message_sizes())]
    paths = tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown path(s) {unknown}; choose from {PATHS}")
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be positive byte counts")
    cpu_bytes = int(cpu_bytes or max(sizes))
    cpu_messages = int(cpu_messages or math.ceil(_CPU_BLOCK_BYTES / cpu_bytes))
    if repeats < 1 or warmup < 0 or cpu_messages < 1 or cpu_bytes < 1 or cpu_rounds < 1:
        raise ValueError("repeats >= 1, warmup >= 0, cpu_messages >= 1, cpu_bytes >= 1, cpu_rounds >= 1")
    if fault not in (None, "raise", "hang"):
        raise ValueError("fault must be None, 'raise' or 'hang'")
    out = launch(_transport_worker, 2, sizes, paths, repeats, warmup, cpu_bytes, cpu_messages, int(cpu_rounds),
                 verify, seed, timeout, fault, timeout=timeout)
    snd, rcv = out
    verified = {p: (snd if p == "memcpy" else rcv)["verified"][p] for p in paths}   # who compared the bytes
    cpu = {p: {side: {"user": out[rank]["cpu"][p][:, 0], "sys": out[rank]["cpu"][p][:, 1]}
               for rank, side in enumerate(("sender", "receiver"))} for p in paths}
    return TransportMeasurement(np.array(sizes, dtype=float), paths, snd["samples"], cpu, cpu_bytes * cpu_messages,
                                snd["cpu_wall"], verified, snd["fastest"])

