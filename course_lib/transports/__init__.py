"""Transports: how bytes move from one process (or GPU) to another, and what each copy and kernel crossing costs.

    measure    measured here, between two real processes: naive TCP, zero-copy TCP, a one-sided shared-memory
               write, memcpy — latency, bandwidth, CPU seconds per GB on each side (`measure_transports`,
               `TransportMeasurement`; the send/recv functions of each path, shown in notebook 01)
    paths      modeled: the real-world paths TCP / RDMA / GPUDirect RDMA from GPU memory to GPU memory, as data —
               every copy and DMA with its engine (`real_world_paths`) — and drawn from that data (`draw_paths`)
    exchange   modeled: one GPU → GPU transfer between two nodes built from a path's stages, serial and pipelined
               (`exchange_stages`, `model_exchange`, `Exchange`, `plot_exchanges`, `SCENARIOS`)
    staging    lab 01: sends staged through host bounce buffers by a simulated copy engine (`CopyEngine`,
               `LoggedSocket`, `overlap_fraction`, `send_staged_serial`, `measure_staged_send`)

The formulas (Hockney, Parallel Computing 20(3), 1994; docs/formulas.md §9) live in `course_lib.core.costmodel` and are
re-exported here (`Stage`, `pipelined_time`):

    t(S) = α + S·β,  n½ = α/β          T_pipelined = Σ_i t_i(c) + (k − 1)·max_i t_i(c),  c = S/k

`from course_lib import transports as T` gives every public name below.
    wire       the byte-moving halves of each measured path, one function per side (shown in notebook 01)
"""
from ..core.costmodel import Stage, pipelined_time
from .exchange import CATEGORY_COLORS, SCENARIOS, Exchange, exchange_stages, model_exchange, plot_exchanges
from .measure import (
                      DEFAULT_TIMEOUT,
                      MEASURED_PATHS,
                      PATHS,
                      KiB,
                      MeasuredPath,
                      MiB,
                      TransportMeasurement,
                      measure_transports,
                      memcpy_once,
                      message_sizes,
                      pattern,
                      recv_shm_write,
                      recv_tcp_naive,
                      recv_tcp_zerocopy,
                      send_shm_write,
                      send_tcp_naive,
                      send_tcp_zerocopy,
)
from .paths import BOXES, ENGINES, Move, RealPath, draw_paths, real_world_paths
from .staging import CopyEngine, LoggedSocket, measure_staged_send, overlap_fraction, send_staged_serial

__all__ = ["Stage", "pipelined_time",
           "CATEGORY_COLORS", "SCENARIOS", "Exchange", "exchange_stages", "model_exchange", "plot_exchanges",
           "DEFAULT_TIMEOUT", "MEASURED_PATHS", "PATHS", "KiB", "MeasuredPath", "MiB", "TransportMeasurement",
           "measure_transports", "memcpy_once", "message_sizes", "pattern", "recv_shm_write", "recv_tcp_naive",
           "recv_tcp_zerocopy", "send_shm_write", "send_tcp_naive", "send_tcp_zerocopy",
           "BOXES", "ENGINES", "Move", "RealPath", "draw_paths", "real_world_paths",
           "CopyEngine", "LoggedSocket", "measure_staged_send", "overlap_fraction", "send_staged_serial"]
