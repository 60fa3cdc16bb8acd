"""Transports: how bytes move from one process (or GPU) to another, and what each copy and each kernel crossing costs.

Measured on this machine, between two real processes (`measure_transports`), four paths with fewer and fewer copies:

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
reported; ratios between paths are taken pairwise (`speedup`). CPU involvement is measured separately, per path, over a block of large messages: `getrusage` user and
system seconds on each side, per GB moved (the total is exact; the user/system split is sampled on timer ticks).

Modeled (never measured here, labelled "modeled"): the three real-world paths for data that lives in GPU memory, as
data (`real_world_paths`: every copy and DMA with its engine), drawn from that data (`draw_paths`), and turned into
a time for one transfer between two nodes (`model_exchange`) with the link presets of `costmodel`.

The formulas everything is checked against: Hockney's α–β model (Parallel Computing 20(3), 1994)

    t(S) = α + S·β,   n½ = α/β  (the size at which half the time is latency: bandwidth dominates above it)

and, for a pipeline of stages i that each take t_i(c) for a chunk of c = S/k bytes, k chunks in flight

    T_pipelined = Σ_i t_i(c) + (k − 1)·max_i t_i(c)      (fill the pipe once, then the slowest stage sets the pace)
    T_serial    = Σ_i t_i(S)                                   (store and forward: each stage waits for all S bytes)
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import resource
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .costmodel import GB, Link, fit_alpha_beta, get_link

KiB, MiB = 2**10, 2**20
PATHS = ("tcp_naive", "tcp_zerocopy", "shm_write", "memcpy")
DEFAULT_TIMEOUT = 120.0
_RECV_CHUNK = 64 * KiB       # what a naive receiver asks recv() for, the classic idiom
_INNER_BYTES = 256 * KiB     # a size is sent this many bytes' worth of times per repeat (3 to 16 messages)


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
    """What `measure_transports` returns. Times are seconds per message (one-way + ack), medians over repeats."""
    sizes: np.ndarray                     # (n_sizes,) bytes
    paths: tuple
    samples: dict                         # path -> (repeats, n_sizes) seconds per message
    cpu: dict                             # path -> {"sender"|"receiver": {"user": s, "sys": s}} for cpu_bytes moved
    cpu_bytes: int                        # bytes moved per path in the CPU block
    cpu_wall: dict                        # path -> wall seconds of the CPU block
    verified: dict = field(default_factory=dict)   # path -> messages whose bytes the receiver compared, all equal
    method: str = "one-way + 1-byte ack; median over repeats; CPU from getrusage over a block of large messages"

    def latency(self, path: str) -> np.ndarray:
        """Median seconds per message, per size."""
        return np.median(self.samples[path], axis=0)

    def bandwidth(self, path: str) -> np.ndarray:
        """Bytes per second per size (size / median time)."""
        return self.sizes / self.latency(path)

    def large_bandwidth(self, path: str, top: int = 3) -> float:
        """Median bandwidth over the `top` largest sizes (bytes/s): the figure orderings are asserted on."""
        return float(np.median(self.bandwidth(path)[-top:]))

    def speedup(self, faster: str, slower: str, top: int = 3) -> float:
        """How many times the bandwidth of `slower` `faster` gets at the `top` largest sizes: the median over those
        sizes and all repeats of the paired ratio t_slower / t_faster (paired: measured back to back)."""
        return float(np.median(self.samples[slower][:, -top:] / self.samples[faster][:, -top:]))

    def fit(self, path: str) -> Link:
        """α–β fit of this path's medians (costmodel.fit_alpha_beta, relative weights); a Link of kind 'fitted'."""
        return fit_alpha_beta(self.sizes, self.latency(path), name=path)

    def cpu_per_gb(self, path: str, side: str, kind: str = "total") -> float:
        """CPU seconds per GB (10⁹ bytes) moved, on one side; kind is 'user', 'sys' or 'total'."""
        c = self.cpu[path][side]
        s = c["user"] + c["sys"] if kind == "total" else c[kind]
        return s / (self.cpu_bytes / GB)


# ------------------------------------------------------------------------------------------------ the data paths
# Each path is a pair of functions: what the sender does for one message, what the receiver does. Every wait has a
# timeout (sockets: settimeout; pipes: select), so a dead peer turns into an exception, never a hang.
def _read_exact_fd(fd: int, n: int, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no signal on the pipe within {timeout:g} s (is the other side alive?)")
    b = os.read(fd, n)
    if not b:
        raise ConnectionError("the other side closed the pipe")
    return b


def _recv_ack(sock: socket.socket) -> None:
    if not sock.recv(1):
        raise ConnectionError("the receiver closed the connection before acknowledging")


def send_tcp_naive(sock, src_np: np.ndarray, n: int) -> None:
    """Naive: copy the payload into a new bytes object, then the kernel copies it again into its socket buffer."""
    sock.sendall(src_np[:n].tobytes())          # copy 1 (tobytes), copy 2 (user → kernel, inside sendall)
    _recv_ack(sock)


def recv_tcp_naive(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        c = sock.recv(min(_RECV_CHUNK, n - got))  # copy 3: kernel → a fresh bytes object per call
        if not c:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        chunks.append(c)
        got += len(c)
    data = b"".join(chunks)                     # copy 4: the chunks into one buffer the application can use
    sock.sendall(b"k")
    return data


def send_tcp_zerocopy(sock, src_mv: memoryview, n: int) -> None:
    """sendall(memoryview): no user-space copy; the kernel still copies user → socket buffer (copy 1)."""
    sock.sendall(src_mv[:n])
    _recv_ack(sock)


def recv_tcp_zerocopy(sock, dst_mv: memoryview, n: int) -> None:
    got = 0
    while got < n:
        r = sock.recv_into(dst_mv[got:n], n - got)   # copy 2: kernel → the preallocated destination
        if r == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += r
    sock.sendall(b"k")


def send_shm_write(shared: torch.Tensor, src: torch.Tensor, n: int, doorbell_w: int, ack_r: int,
                   timeout: float) -> None:
    """One-sided write: store straight into the receiver's pre-mapped buffer (copy 1, no system call), then ring."""
    shared[:n].copy_(src[:n])
    os.write(doorbell_w, b"d")                  # control path only: 1 byte, like posting a completion
    _read_exact_fd(ack_r, 1, timeout)


def recv_shm_write(doorbell_r: int, ack_w: int, timeout: float) -> None:
    _read_exact_fd(doorbell_r, 1, timeout)      # the receiver's CPU never touches the payload to receive it
    os.write(ack_w, b"k")


def memcpy_once(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
    dst[:n].copy_(src[:n])


def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _transport_worker(ctx, res, sizes, paths, repeats, warmup, cpu_bytes, cpu_messages, verify, seed, timeout,
                      fault):
    """Rank 0 sends and times, rank 1 receives. Both walk the same deterministic plan, so no control messages."""
    listener, shared, (doorbell_r, doorbell_w), (ack_r, ack_w) = res
    sender = ctx.rank == 0
    max_n = max(max(sizes), cpu_bytes)
    # Close the pipe ends this side never uses, so a dead peer shows as EOF rather than silence.
    for fd in ((doorbell_r, ack_w) if sender else (doorbell_w, ack_r)):
        os.close(fd)
    if sender:
        addr = listener.getsockname()
        listener.close()
        sock = socket.create_connection(addr, timeout=timeout)
    else:
        listener.settimeout(timeout)
        sock, _ = listener.accept()
        listener.close()
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no Nagle delay on small messages and acks
    src = pattern(max_n, seed)
    src_np, src_mv = src.numpy(), memoryview(src.numpy())
    dst = torch.zeros(max_n, dtype=torch.uint8)                   # touched now, so no page faults when timed
    dst_mv = memoryview(dst.numpy())
    verified = {p: 0 for p in paths}

    def check(path, got: torch.Tensor, n: int):
        if not torch.equal(got, src[:n]):
            bad = int((got != src[:n]).nonzero()[0])
            raise AssertionError(f"{path}: message of {n} bytes arrived corrupted (first bad byte at {bad})")
        verified[path] += 1

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
                    dst[:n].zero_()
            return
        if path == "tcp_naive":
            data = recv_tcp_naive(sock, n)
            if verify:
                check(path, torch.frombuffer(bytearray(data), dtype=torch.uint8), n)
        elif path == "tcp_zerocopy":
            recv_tcp_zerocopy(sock, dst_mv, n)
            if verify:
                check(path, dst[:n], n)
                dst[:n].zero_()
        elif path == "shm_write":
            if verify:                       # check before the ack: the sender may overwrite right after it
                _read_exact_fd(doorbell_r, 1, timeout)
                check(path, shared[:n], n)
                shared[:n].zero_()
                os.write(ack_w, b"k")
            else:
                recv_shm_write(doorbell_r, ack_w, timeout)
        if fault == "raise":
            raise RuntimeError("injected fault: the receiver failed after its first message")
        if fault == "hang":
            time.sleep(10 * timeout)

    try:
        samples = {p: np.zeros((repeats, len(sizes))) for p in paths}
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
        cpu, cpu_wall = {}, {}
        for path in paths:
            u0, s0 = _rusage()
            t0 = time.perf_counter()
            for _ in range(cpu_messages):
                one(path, cpu_bytes)
            cpu_wall[path] = time.perf_counter() - t0
            u1, s1 = _rusage()
            cpu[path] = {"user": u1 - u0, "sys": s1 - s0}
    finally:
        sock.close()
    if sender:
        return {"samples": samples, "cpu": cpu, "cpu_wall": cpu_wall, "verified": verified}
    return {"cpu": cpu, "verified": verified}


def measure_transports(sizes=None, paths=PATHS, *, repeats: int = 5, warmup: int = 1, cpu_bytes: int | None = None,
                       cpu_messages: int | None = None, verify: bool = False, seed: int = 0,
                       timeout: float = DEFAULT_TIMEOUT, fault: str | None = None) -> TransportMeasurement:
    """Measure every path between two real processes (ranks of `course_lib.dist.launch.launch`); see the module docstring.

    sizes: message sizes in bytes (default `message_sizes()`, 8 B … 16 MiB); cpu_bytes: message size of the CPU
    block (default: the largest size), sent `cpu_messages` times per path (default: enough for 128 MiB, so the
    block lasts long enough for the kernel's CPU accounting to resolve it). verify=True makes the receiver compare
    every message with the expected bytes (slower; timings then mean nothing). `fault` ('raise' or 'hang' in the
    receiver after its first message) exists for the tests that prove nothing is left behind when a rank fails.

    The listening socket, the shared buffer and the pipes are made here, before the ranks fork, so the ranks inherit
    them (the shared buffer is "registered" before any message, like RDMA memory registration) and this function
    closes them whatever happens; `launch` kills both ranks on error or timeout.
    """
    from .dist.launch import launch

    sizes = [int(s) for s in (sizes if sizes is not None else message_sizes())]
    paths = tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown path(s) {unknown}; choose from {PATHS}")
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be positive byte counts")
    cpu_bytes = int(cpu_bytes or max(sizes))
    cpu_messages = int(cpu_messages or math.ceil(128 * MiB / cpu_bytes))
    if repeats < 1 or warmup < 0 or cpu_messages < 1 or cpu_bytes < 1:
        raise ValueError("repeats >= 1, warmup >= 0, cpu_messages >= 1, cpu_bytes >= 1")
    if fault not in (None, "raise", "hang"):
        raise ValueError("fault must be None, 'raise' or 'hang'")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    pipes: list[int] = []
    buf = None
    shared = None
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        # MAP_SHARED | MAP_ANONYMOUS: one physical buffer both forked ranks see; nothing to unlink afterwards.
        buf = mmap.mmap(-1, max(max(sizes), cpu_bytes))
        shared = torch.frombuffer(buf, dtype=torch.uint8)
        shared.zero_()                                   # fault the pages in now, not inside a timed write
        doorbell, ack = os.pipe(), os.pipe()
        pipes = [*doorbell, *ack]
        res = (listener, shared, doorbell, ack)
        out = launch(_transport_worker, 2, res, sizes, paths, repeats, warmup, cpu_bytes, cpu_messages, verify,
                     seed, timeout, fault, timeout=timeout)
    finally:
        listener.close()
        for fd in pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        del shared
        if buf is not None:
            with contextlib.suppress(BufferError):
                buf.close()
    snd, rcv = out
    verified = {p: (snd if p == "memcpy" else rcv)["verified"][p] for p in paths}   # who compared the bytes
    return TransportMeasurement(np.array(sizes, dtype=float), paths, snd["samples"],
                                {p: {"sender": snd["cpu"][p], "receiver": rcv["cpu"][p]} for p in paths},
                                cpu_bytes * cpu_messages, snd["cpu_wall"], verified)


# ------------------------------------------------------------------------------------------------ real-world paths
BOXES = ("gpu", "host", "kernel", "nic")
BOX_LABEL = {"gpu": "GPU memory", "host": "host memory\n(bounce buffer)", "kernel": "kernel\nsocket buffer",
             "nic": "NIC"}
ENGINES = {   # who moves the bytes → (colour, model stage it is charged to)
    "GPU copy engine": ("#4C72B0", "staging"),       # cudaMemcpy over PCIe
    "CPU (kernel)": ("#C44E52", "cpu_protocol"),    # the TCP/IP stack copies and runs the protocol
    "NIC DMA": ("#55A868", None),                   # streams from/to memory as it transmits: overlaps the wire
    "network": ("#333333", "wire"),
}


@dataclass(frozen=True)
class Move:
    """One movement of the payload: from a box to a box, by an engine. `copy`: lands in another memory buffer."""
    src: tuple          # (side, box): side 'send' or 'recv', box in BOXES
    dst: tuple
    engine: str
    copy: bool


@dataclass(frozen=True)
class RealPath:
    name: str
    moves: tuple
    cpu_role: str
    source: str

    def copies(self, side: str) -> int:
        """Memory-to-memory copies on one side ('send' or 'recv'); NIC DMA and the wire are not copies."""
        return sum(1 for m in self.moves if m.copy and m.src[0] == side)

    @property
    def kernel_on_data_path(self) -> bool:
        return any(m.engine == "CPU (kernel)" for m in self.moves)

    def boxes(self) -> set:
        return {m.src for m in self.moves} | {m.dst for m in self.moves}


def real_world_paths() -> dict[str, RealPath]:
    """The three ways a gradient in GPU memory reaches a GPU in another node (FACTS §9, derived from NVIDIA's
    GPUDirect RDMA docs): every copy and DMA, in order, sender side, wire, receiver side."""
    S, R = "send", "recv"

    def mirror(sender_moves):   # the receiver does the same steps in reverse order and direction
        return tuple(Move((R, m.dst[1]), (R, m.src[1]), m.engine, m.copy) for m in reversed(sender_moves))

    def path(name, sender_moves, cpu_role, source):
        wire = Move((S, "nic"), (R, "nic"), "network", False)
        return RealPath(name, (*sender_moves, wire, *mirror(sender_moves)), cpu_role, source)

    return {p.name: p for p in (
        path("TCP", (Move((S, "gpu"), (S, "host"), "GPU copy engine", True),       # cudaMemcpy device → host
                     Move((S, "host"), (S, "kernel"), "CPU (kernel)", True),       # send(): user → socket buffer
                     Move((S, "kernel"), (S, "nic"), "NIC DMA", False)),
             "CPU copies user↔kernel and runs TCP/IP for every byte, on both sides",
             "FACTS §9: cudaMemcpy to a host buffer, then user → kernel socket buffer, then NIC DMA (≈2 copies)"),
        path("RDMA", (Move((S, "gpu"), (S, "host"), "GPU copy engine", True),      # into registered host memory
                      Move((S, "host"), (S, "nic"), "NIC DMA", False)),
             "CPU only posts work requests and polls completions (control path); no kernel on the data path",
             "FACTS §9: GPU → registered host buffer, then the NIC DMAs it: 1 copy, no kernel (RoCEv2 / IB verbs)"),
        path("GPUDirect RDMA", (Move((S, "gpu"), (S, "nic"), "NIC DMA", False),),  # NIC reads GPU memory over PCIe
             "CPU only posts work requests; the NIC reads and writes GPU memory directly over PCIe",
             "FACTS §9 / NVIDIA GPUDirect RDMA docs: the NIC DMAs to and from GPU memory, 0 host copies"),
    )}


_X = {("send", b): 1.35 * i for i, b in enumerate(BOXES)}
_X.update({("recv", b): 1.35 * (2 * len(BOXES)) + 0.4 - 1.35 * (i + 1) for i, b in enumerate(BOXES)})
_W, _H = 1.05, 0.62


def draw_paths(paths: "dict[str, RealPath] | None" = None, *, axes=None, title: str = "How a gradient crosses two "
               "nodes: copies, kernel, NIC (modeled after NVIDIA's GPUDirect RDMA docs)"):
    """One row per path: the boxes of both nodes, each movement an arrow numbered in order and coloured by engine.

    Everything is placed from the data (`RealPath.moves`): a box the path never touches is drawn faded and dashed,
    an arrow that skips boxes arcs over them. Returns the list of Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    paths = paths or real_world_paths()
    if axes is None:
        fig, axes = plt.subplots(len(paths), 1, figsize=(12, 1.9 * len(paths) + 0.6))
        fig.suptitle(title, fontsize=11)
    axes = list(np.atleast_1d(axes))
    for ax, p in zip(axes, paths.values()):
        used = p.boxes()
        for key, x in _X.items():
            on = key in used
            ax.add_patch(FancyBboxPatch((x - _W / 2, -_H / 2), _W, _H, boxstyle="round,pad=0.02",
                                        fc="#F3F3F3" if on else "white", ec="black" if on else "#BBBBBB",
                                        ls="-" if on else "--", lw=1.0))
            ax.text(x, 0, BOX_LABEL[key[1]], ha="center", va="center", fontsize=7.5,
                    color="black" if on else "#AAAAAA")
        for step, m in enumerate(p.moves, 1):
            x0, x1 = _X[m.src], _X[m.dst]
            skips = round(abs(x1 - x0) / 1.35) > 1 and m.engine != "network"
            color = ENGINES[m.engine][0]
            y = 0.46 if skips else 0.0
            arrow = FancyArrowPatch((x0 + (0 if skips else _W / 2), y if skips else 0),
                                    (x1 - (0 if skips else _W / 2), y if skips else 0),
                                    connectionstyle="arc3,rad=-0.25" if skips else "arc3", arrowstyle="-|>",
                                    mutation_scale=12, lw=1.8, color=color, zorder=3)
            ax.add_patch(arrow)
            xm, ym = (x0 + x1) / 2, (0.75 if skips else 0.30)
            ax.text(xm, ym, str(step), ha="center", va="center", fontsize=8, color="white", zorder=4,
                    bbox=dict(boxstyle="circle,pad=0.15", fc=color, ec="none"))
        ax.text(_X[("send", "gpu")] - _W / 2, 1.22,
                f"{p.name}:  copies per side = {p.copies('send')} (sender), {p.copies('recv')} (receiver)  ·  "
                f"kernel on the data path: {'yes' if p.kernel_on_data_path else 'no'}  ·  {p.cpu_role}",
                fontsize=8, va="top")
        ax.text(_X[("send", "gpu")], -0.55, "sender node", fontsize=7, ha="left", va="top", color="#555555")
        ax.text(_X[("recv", "gpu")], -0.55, "receiver node", fontsize=7, ha="right", va="top", color="#555555")
        ax.set_xlim(_X[("send", "gpu")] - 0.7, _X[("recv", "gpu")] + 0.7)
        ax.set_ylim(-0.75, 1.25)
        ax.axis("off")
    axes[-1].legend(handles=[Patch(color=c, label=e) for e, (c, _) in ENGINES.items()], loc="upper center",
                    bbox_to_anchor=(0.5, -0.05), ncol=len(ENGINES), fontsize=8, frameon=False)
    return axes


# ------------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Stage:
    """One stage of a modeled transfer: its time for S bytes is link.time(S) = α + S·β."""
    name: str
    category: str       # 'staging' (PCIe copies), 'cpu_protocol' (kernel TCP), 'wire'
    link: Link


def exchange_stages(link: "Link | str", path: "RealPath | str", *, pcie: "Link | str" = "PCIe Gen5 x16",
                    cpu_s_per_byte: float | None = None) -> list[Stage]:
    """The stages of one transfer, read off `path.moves`: a GPU copy-engine move costs a PCIe transfer, a kernel
    move costs `cpu_s_per_byte` of CPU protocol work, the wire costs `link`. NIC DMA is not a stage of its own: the
    NIC streams from memory while it transmits, and its PCIe link is faster than the wire (FACTS §6, §9)."""
    link, pcie = get_link(link), get_link(pcie)
    path = real_world_paths()[path] if isinstance(path, str) else path
    tcp_link = link.name.upper().startswith("TCP")
    if tcp_link != (path.name == "TCP"):
        raise ValueError(f"path {path.name!r} does not run over link {link.name!r}: TCP runs over a TCP link; RDMA "
                         f"and GPUDirect RDMA need an RDMA link (RoCEv2 or InfiniBand)")
    stages = []
    for m in path.moves:
        category = ENGINES[m.engine][1]
        side = "sender" if m.src[0] == "send" else "receiver"
        if category == "staging":
            what = "device → host" if m.src[1] == "gpu" else "host → device"
            stages.append(Stage(f"{what} copy ({side})", category, pcie))
        elif category == "cpu_protocol":
            if cpu_s_per_byte is None or cpu_s_per_byte <= 0:
                raise ValueError("a TCP path needs cpu_s_per_byte > 0: the CPU seconds the kernel spends per byte")
            stages.append(Stage(f"CPU protocol ({side})", category,
                                Link(f"CPU protocol ({side})", 0.0, 1.0 / cpu_s_per_byte, "calibrated", False)))
        elif category == "wire":
            stages.append(Stage(f"wire ({link.name})", category, link))
    return stages


def pipelined_time(stages, nbytes: float, chunks: int) -> float:
    """Σ_i t_i(c) + (k − 1)·max_i t_i(c) with c = S/k: the first chunk fills the pipe, then one chunk leaves per
    slowest-stage time. chunks = 1 is the store-and-forward (serial) time Σ_i t_i(S)."""
    if chunks < 1:
        raise ValueError("chunks must be >= 1")
    t = [s.link.time(nbytes / chunks) for s in stages]
    return sum(t) + (chunks - 1) * max(t)


@dataclass(frozen=True)
class Exchange:
    """A modeled transfer of `nbytes` from GPU memory in one node to GPU memory in another."""
    link: str
    path: str
    nbytes: float
    chunks: int
    stages: tuple
    serial: float               # seconds, every stage waits for the whole buffer
    pipelined: float            # seconds, `chunks` chunks in flight

    def by_category(self) -> dict:
        """Serial seconds split into staging / cpu_protocol / wire (they add up to `serial`)."""
        out = {"staging": 0.0, "cpu_protocol": 0.0, "wire": 0.0}
        for s in self.stages:
            out[s.category] += s.link.time(self.nbytes)
        return out

    @property
    def label(self) -> str:
        return f"{self.path} over {self.link}"


def model_exchange(nbytes: float, link: "Link | str", path: "RealPath | str", *, pcie: "Link | str" = "PCIe Gen5 x16",
                   cpu_s_per_byte: float | None = None, chunk_bytes: float = 4 * MiB) -> Exchange:
    """Modeled time to move `nbytes` GPU → GPU across two nodes, serial and pipelined in chunks of ≤ chunk_bytes."""
    stages = tuple(exchange_stages(link, path, pcie=pcie, cpu_s_per_byte=cpu_s_per_byte))
    chunks = max(1, math.ceil(nbytes / chunk_bytes))
    name = path if isinstance(path, str) else path.name
    return Exchange(get_link(link).name, name, float(nbytes), chunks, stages, pipelined_time(stages, nbytes, 1),
                    pipelined_time(stages, nbytes, chunks))


SCENARIOS = (("TCP 100GbE", "TCP"), ("RoCEv2 200G", "RDMA"), ("RoCEv2 200G", "GPUDirect RDMA"),
             ("InfiniBand NDR", "RDMA"), ("InfiniBand NDR", "GPUDirect RDMA"))
CATEGORY_COLORS = {"staging": ENGINES["GPU copy engine"][0], "cpu_protocol": ENGINES["CPU (kernel)"][0],
                   "wire": ENGINES["network"][0]}


def plot_exchanges(exchanges, *, ax=None, title: str = "1 GB GPU → GPU across two nodes (modeled)"):
    """Stacked bars of the serial time by category, with the pipelined time as a black tick on each bar."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6))
    names = [e.label.replace(" over ", "\nover ") for e in exchanges]
    bottom = np.zeros(len(exchanges))
    for cat, color in CATEGORY_COLORS.items():
        vals = np.array([e.by_category()[cat] * 1e3 for e in exchanges])
        ax.bar(names, vals, bottom=bottom, color=color, label=cat.replace("_", " ") + " (serial)")
        bottom += vals
    ax.scatter(names, [e.pipelined * 1e3 for e in exchanges], marker="_", s=900, color="orange", linewidths=3,
               zorder=3, label="pipelined (chunks overlap)")
    ax.set_ylabel("time (ms, modeled)")
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="upper right")
    return ax


# ------------------------------------------------------------------------------------------------ staged sends (lab 01)
class CopyEngine:
    """A stand-in for a GPU's copy engine over PCIe: the bytes are really copied (dst.copy_(src)), then the call
    waits until `bandwidth` says a DMA of that size would be done. Waiting costs no CPU, as with a real DMA engine,
    so a second thread can drive the socket meanwhile. One copy at a time (a serial engine)."""

    def __init__(self, bandwidth: float, alpha: float = 0.0):
        if bandwidth <= 0:
            raise ValueError("bandwidth must be positive (bytes/s)")
        self.bandwidth, self.alpha = float(bandwidth), float(alpha)
        self._lock = threading.Lock()
        self.bytes_copied = 0
        self.busy: list[tuple[float, float]] = []     # (start, end) of every copy, for the overlap measurement

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} bytes into a {dst.numel()}-byte destination")
        with self._lock:
            start = time.perf_counter()
            done = start + self.alpha + src.numel() / self.bandwidth
            dst.copy_(src)
            self.bytes_copied += src.numel()
            while (left := done - time.perf_counter()) > 0:
                time.sleep(left)
            self.busy.append((start, time.perf_counter()))


class LoggedSocket:
    """A socket whose sendall calls are timed, so a test can see whether staging overlapped the wire."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.busy: list[tuple[float, float]] = []

    def sendall(self, data) -> None:
        start = time.perf_counter()
        self._sock.sendall(data)
        self.busy.append((start, time.perf_counter()))

    def __getattr__(self, name):
        return getattr(self._sock, name)


def overlap_fraction(a: list, b: list) -> float:
    """Fraction of the total length of intervals `a` covered by the union of intervals `b` (both lists of (s, e))."""
    total = sum(e - s for s, e in a)
    if total <= 0:
        return 0.0
    covered = 0.0
    for s, e in a:
        for bs, be in b:
            covered += max(0.0, min(e, be) - max(s, bs))   # b's intervals never overlap each other (one socket)
    return covered / total


def send_staged_serial(sock: socket.socket, device: torch.Tensor, bounce: torch.Tensor, engine: CopyEngine) -> None:
    """Chunked but not pipelined: stage one chunk into the bounce buffer, send it, only then stage the next.

    device: (n,) uint8, the payload in (simulated) GPU memory; bounce: (slots, chunk) uint8 host buffers.
    """
    chunk = bounce.shape[1]
    for off in range(0, device.numel(), chunk):
        m = min(chunk, device.numel() - off)
        engine.copy(bounce[0, :m], device[off:off + m])           # staging: device → host
        sock.sendall(memoryview(bounce[0].numpy())[:m])          # wire: host → kernel → peer


def _staged_worker(ctx, listener, send_fns, nbytes, chunk_bytes, slots, staging_bandwidth, staging_ratio, repeats,
                   seed, timeout, sock_buffer):
    order = list(send_fns)
    calib = 3                                                   # wire-only sends that calibrate the staging rate
    if ctx.rank == 0:
        addr = listener.getsockname()
        listener.close()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buffer)   # before connect: fixes the window
        sock.settimeout(timeout)
        sock.connect(addr)
    else:
        listener.settimeout(timeout)
        sock, _ = listener.accept()
        listener.close()
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if ctx.rank == 0:
            device = pattern(nbytes, seed)
            bounce = torch.zeros(slots, chunk_bytes, dtype=torch.uint8)

            def timed(fn) -> tuple[float, bool]:
                t0 = time.perf_counter()
                fn()
                _recv_ack(sock)                                 # the receiver holds every byte …
                dt = time.perf_counter() - t0
                verdict = sock.recv(1)                          # … and has compared them, outside the clock
                if not verdict:
                    raise ConnectionError("the receiver closed the connection")
                return dt, verdict == b"y"

            wire = [timed(lambda: sock.sendall(memoryview(device.numpy())))[0] for _ in range(calib + 1)][1:]
            wire_time = float(np.median(wire))
            bw = staging_bandwidth or staging_ratio * nbytes / wire_time
            times = {name: [] for name in order}
            overlap = {name: [] for name in order}
            intact = {name: True for name in order}
            for rep in range(repeats + 1):                      # repeat 0 warms up
                for name in (order if rep % 2 else order[::-1]):   # alternate who goes first
                    engine, logged = CopyEngine(bw), LoggedSocket(sock)
                    dt, ok = timed(lambda: send_fns[name](logged, device, bounce, engine))
                    if engine.bytes_copied != nbytes:
                        raise AssertionError(f"{name}: the copy engine staged {engine.bytes_copied:,} bytes, the "
                                             f"message has {nbytes:,}: every byte must go through the bounce buffer")
                    intact[name] &= ok
                    if rep:
                        times[name].append(dt)
                        overlap[name].append(overlap_fraction(engine.busy, logged.busy))
            return {"times": times, "overlap": overlap, "intact": intact, "wire_time": wire_time,
                    "staging_bandwidth": bw}
        expect = pattern(nbytes, seed)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst_mv = memoryview(dst.numpy())
        for _ in range(calib + 1 + (repeats + 1) * len(order)):
            got = 0
            while got < nbytes:
                r = sock.recv_into(dst_mv[got:], nbytes - got)
                if r == 0:
                    raise ConnectionError(f"the sender closed the connection after {got:,} of {nbytes:,} bytes")
                got += r
            sock.sendall(b"k")
            sock.sendall(b"y" if torch.equal(dst, expect) else b"n")
            dst.zero_()
        return None
    finally:
        sock.close()


def measure_staged_send(send_fns: dict, nbytes: int = 32 * MiB, chunk_bytes: int = 2 * MiB, *,
                        staging_ratio: float = 63.0 / 50.0, staging_bandwidth: float | None = None, slots: int = 2,
                        repeats: int = 5, seed: int = 0, sock_buffer: int = 256 * KiB,
                        timeout: float = DEFAULT_TIMEOUT) -> dict:
    """Time each `send_fn(sock, device, bounce, engine)` moving `nbytes` from simulated device memory, through a
    bounce buffer of `slots` × `chunk_bytes` host memory, over TCP loopback to a second process that checks every
    byte.

    The staging link (`CopyEngine`) runs at `staging_bandwidth`, or by default at `staging_ratio` × the wire rate
    measured first with plain sends of the whole message: 63/50 is PCIe Gen5 x16 against InfiniBand NDR (FACTS §6,
    §9), the case where staging and wire take about as long. Returns {"times": {name: [s per repeat]},
    "overlap": {name: [fraction of staging time spent while a sendall was running, per repeat]},
    "intact": {name: bool}, "wire_time": s, "staging_bandwidth": B/s}. `sock` is a `LoggedSocket`: use sendall.
    The variants alternate within each repeat so load drift hits them alike; the clock stops at the receiver's ack
    (all bytes there), and the byte comparison happens outside it. Functions defined in a notebook cell work (ranks
    are forked).
    """
    from .dist.launch import launch
    if nbytes < 1 or chunk_bytes < 1 or slots < 1 or repeats < 1 or staging_ratio <= 0:
        raise ValueError("need nbytes >= 1, chunk_bytes >= 1, slots >= 1, repeats >= 1, staging_ratio > 0")
    if staging_bandwidth is not None and staging_bandwidth <= 0:
        raise ValueError("staging_bandwidth must be positive (bytes/s)")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Small kernel buffers on both ends: otherwise the socket buffer itself stages megabytes and sendall returns
        # long before the bytes have crossed, hiding the very overlap being measured.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(sock_buffer))
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        out = launch(_staged_worker, 2, listener, dict(send_fns), int(nbytes), int(chunk_bytes), int(slots),
                     staging_bandwidth, float(staging_ratio), int(repeats), seed, timeout, int(sock_buffer),
                     timeout=timeout)
    finally:
        listener.close()
    return out[0]
