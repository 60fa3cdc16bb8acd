"""The byte-moving halves of each measured path between two processes on one machine, one function per side:

    tcp_naive     send() from a pinned NumPy array; the receiver recv()s fresh bytes and joins them (2 extra copies)
    tcp_zerocopy  sendall() from a memoryview; recv_into() a preallocated buffer (the kernel's copies only)
    shm_write     the sender writes straight into a shared-memory tensor, a pipe rings the doorbell (1 copy, no
                  kernel on the data path)
    memcpy        one copy in one process: the floor every path is measured against

and the loopback sockets they run over. `transports.measure` times them; the paths and their costs are described
there.
"""
from __future__ import annotations

import os
import select
import socket

import numpy as np
import torch

KiB, MiB = 2**10, 2**20
_RECV_CHUNK = 64 * KiB       # what a naive receiver asks recv() for, the classic idiom


def _tcp_socket(buffer_option: int, size: int | None) -> socket.socket:
    """A TCP socket whose send or receive buffer (`buffer_option`) is fixed to `size` bytes; None leaves the kernel's
    autotuning. Set before listen/connect, because the window is agreed in the handshake."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if size:
        sock.setsockopt(socket.SOL_SOCKET, buffer_option, int(size))
    return sock


def loopback_listener(rcvbuf: int | None = None) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 at a free port. Made in the parent before the ranks fork, so both inherit
    it; the parent closes it whatever happens. `rcvbuf` fixes the receive buffer of the connection it will accept."""
    listener = _tcp_socket(socket.SO_RCVBUF, rcvbuf)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    return listener


def connect_ranks(listener: socket.socket, rank: int, timeout: float, sndbuf: int | None = None) -> socket.socket:
    """The one connection between rank 0 (connects; the sender) and rank 1 (accepts; the receiver), each closing
    its inherited copy of the listener. Every blocking call gets `timeout`, so a dead peer is an exception, never a
    hang; TCP_NODELAY, so small messages and 1-byte acks leave at once instead of waiting for Nagle's timer.
    `sndbuf` fixes the sender's buffer, as the listener's `rcvbuf` fixes the receiver's."""
    if rank == 0:
        addr = listener.getsockname()
        listener.close()
        sock = _tcp_socket(socket.SO_SNDBUF, sndbuf)
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
        except OSError:
            sock.close()
            raise
    else:
        listener.settimeout(timeout)
        sock, _ = listener.accept()
        listener.close()
        sock.settimeout(timeout)     # an accepted socket does not inherit the listener's timeout
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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


def recv_ack(sock: socket.socket) -> None:
    if not sock.recv(1):
        raise ConnectionError("the receiver closed the connection before acknowledging")


def send_tcp_naive(sock, src_np: np.ndarray, n: int) -> None:
    """Naive: copy the payload into a new bytes object, then the kernel copies it again into its socket buffer."""
    sock.sendall(src_np[:n].tobytes())          # copy 1 (tobytes), copy 2 (user → kernel, inside sendall)
    recv_ack(sock)


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
    recv_ack(sock)


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
