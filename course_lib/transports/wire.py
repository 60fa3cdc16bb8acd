"""The byte-moving halves of each measured path between two processes on one machine, one function per side:

    tcp_naive     send() from a pinned NumPy array; the receiver recv()s fresh bytes and joins them (2 extra copies)
    tcp_zerocopy  sendall() from a memoryview; recv_into() a preallocated buffer (the kernel's copies only)
    shm_write     the sender writes straight into a shared-memory tensor, a pipe rings the doorbell (1 copy, no
                  kernel on the data path)
    memcpy        one copy in one process: the floor every path is measured against

and what they run over, made inside the two ranks however those were started: the loopback connection
(`connect_ranks`) and the shared buffer with its doorbell and ack pipes (`SharedRegion`). `transports.measure` times
them; the paths and their costs are described there.
"""
from __future__ import annotations

import contextlib
import mmap
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


def _publish(value, src: int):
    """`value` from rank `src` to both ranks, over the process group `launch` already joined."""
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def connect_ranks(rank: int, timeout: float, sndbuf: int | None = None, rcvbuf: int | None = None) -> socket.socket:
    """The one TCP connection between rank 0 (connects; the sender) and rank 1 (listens on 127.0.0.1 at a free
    port and accepts; the receiver). Made inside the ranks, so it needs no inheritance and works however the ranks
    were started (fork, forkserver, spawn); the port goes from rank 1 to rank 0 over the process group. Every
    blocking call gets `timeout`, so a dead peer is an exception, never a hang; TCP_NODELAY, so small messages and
    1-byte acks leave at once instead of waiting for Nagle's timer. `sndbuf` fixes the sender's buffer and
    `rcvbuf` the receiver's (set before listen/connect, because the window is agreed in the handshake)."""
    listener = None
    if rank == 1:
        listener = _tcp_socket(socket.SO_RCVBUF, rcvbuf)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
        except OSError:
            listener.close()
            raise
    try:
        port = _publish(listener.getsockname()[1] if listener else None, src=1)
        if rank == 0:
            sock = _tcp_socket(socket.SO_SNDBUF, sndbuf)
            sock.settimeout(timeout)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                sock.close()
                raise
        else:
            listener.settimeout(timeout)
            sock, _ = listener.accept()
            sock.settimeout(timeout)     # an accepted socket does not inherit the listener's timeout
    finally:
        if listener is not None:
            listener.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class SharedRegion:
    """What `shm_write` needs, "registered" by both ranks before any message, as RDMA registers memory: a buffer of
    `nbytes` mapped into both processes (a file in shared memory, /dev/shm where there is one) and two one-way
    pipes (named FIFOs), the doorbell (rank 0 → 1) and the ack (1 → 0). Rank 1 makes them in a private directory,
    both ranks open them, and rank 1 removes the names at once: nothing is left on disk whatever happens next, and
    each side holds only the pipe ends it uses, so a dead peer shows as EOF rather than silence. POSIX only."""

    def __init__(self, rank: int, nbytes: int, timeout: float):
        import tempfile
        import torch.distributed as dist
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="course-shm-", dir=where) if rank == 1 else None
        try:
            if rank == 1:
                with open(os.path.join(folder, "buffer"), "wb") as f:
                    f.truncate(nbytes)
                os.mkfifo(os.path.join(folder, "doorbell"), 0o600)
                os.mkfifo(os.path.join(folder, "ack"), 0o600)
            folder = _publish(folder, src=1)
            mine, theirs = ("ack", "doorbell") if rank == 0 else ("doorbell", "ack")
            # read end first, without blocking; then the write end, which opens at once because a reader exists
            self.read_fd = os.open(os.path.join(folder, mine), os.O_RDONLY | os.O_NONBLOCK)
            dist.barrier()
            self.write_fd = os.open(os.path.join(folder, theirs), os.O_WRONLY)
            os.set_blocking(self.read_fd, True)
            with open(os.path.join(folder, "buffer"), "r+b") as f:
                self._map = mmap.mmap(f.fileno(), nbytes)      # MAP_SHARED: one physical buffer, both mappings
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
            self.buffer.zero_()                 # fault this side's pages in now, not inside a timed write
            dist.barrier()                      # both opened everything: the names can go
        finally:
            if rank == 1:
                import shutil
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        del self.buffer
        with contextlib.suppress(BufferError):
            self._map.close()


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
