"""Staged sends (lab 01): data in (simulated) GPU memory reaches the wire through a ring of host bounce buffers.

Without GPUDirect RDMA every byte is first staged from GPU memory into a host bounce buffer by the GPU's copy
engine, then sent. `CopyEngine` stands in for the copy engine (it really copies, then waits, without using CPU, until
a DMA at the staging bandwidth would be done); `send_staged_serial` stages and sends one chunk after another;
`measure_staged_send` times send functions against each other over TCP loopback to a second process that checks
every byte, and measures how much of the staging overlapped the wire (`overlap_fraction`). Lab 01 asks for the
pipelined sender, checked against `costmodel.pipelined_time` (docs/formulas.md §9):

    serial / pipelined = Σ_i t_i(S) / (Σ_i t_i(c) + (k − 1)·max_i t_i(c))   → k(1 + 1/r)/(k + 1/r) for two stages
                                                                              at rates r·B and B with α = 0
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import torch

from .measure import DEFAULT_TIMEOUT, KiB, MiB, connect_ranks, pattern, recv_ack, recv_tcp_zerocopy


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


def _staged_worker(ctx, send_fns, nbytes, chunk_bytes, slots, staging_bandwidth, staging_ratio, repeats,
                   seed, timeout, sock_buffer):
    order = list(send_fns)
    calib = 3                                                   # wire-only sends that calibrate the staging rate
    sock = connect_ranks(ctx.rank, timeout, sndbuf=sock_buffer, rcvbuf=sock_buffer)
    try:
        if ctx.rank == 0:
            device = pattern(nbytes, seed)
            bounce = torch.zeros(slots, chunk_bytes, dtype=torch.uint8)

            def timed(fn) -> tuple[float, bool]:
                t0 = time.perf_counter()
                fn()
                recv_ack(sock)                                  # the receiver holds every byte …
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
                    dt, ok = timed(lambda name=name, logged=logged, engine=engine:
                                   send_fns[name](logged, device, bounce, engine))
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
            recv_tcp_zerocopy(sock, dst_mv, nbytes)             # every byte, then the ack that stops the clock
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
    measured first with plain sends of the whole message: 63/50 is PCIe Gen5 x16 against InfiniBand NDR
    (docs/formulas.md §6, §9), the case where staging and wire take about as long. Returns
    {"times": {name: [s per repeat]}, "overlap": {name: [fraction of staging time spent while a sendall was running,
    per repeat]}, "intact": {name: bool}, "wire_time": s, "staging_bandwidth": B/s}. `sock` is a `LoggedSocket`:
    use sendall. The variants alternate within each repeat so load drift hits them alike; the clock stops at the
    receiver's ack (all bytes there), and the byte comparison happens outside it. Functions defined in a notebook
    cell work, under every start method.
    """
    from ..distributed.launch import launch
    if nbytes < 1 or chunk_bytes < 1 or slots < 1 or repeats < 1 or staging_ratio <= 0:
        raise ValueError("need nbytes >= 1, chunk_bytes >= 1, slots >= 1, repeats >= 1, staging_ratio > 0")
    if staging_bandwidth is not None and staging_bandwidth <= 0:
        raise ValueError("staging_bandwidth must be positive (bytes/s)")
    # Small kernel buffers on both ends: otherwise the socket buffer itself stages megabytes and sendall returns long
    # before the bytes have crossed, hiding the very overlap being measured.
    out = launch(_staged_worker, 2, dict(send_fns), int(nbytes), int(chunk_bytes), int(slots), staging_bandwidth,
                 float(staging_ratio), int(repeats), seed, timeout, int(sock_buffer), timeout=timeout)
    return out[0]
