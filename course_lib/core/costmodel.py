"""The α–β link model: the bridge from what we can measure on this machine to what a cluster would do.

    t(S) = α + S·β          α: per-message latency (s), β = 1/B: seconds per byte      (Hockney, Parallel
    n½ = α/β                the size at which latency and bandwidth cost the same       Computing 20(3), 1994)

Presets below carry their sources (docs/formulas.md §6, §9); bandwidths are nominal line rates per direction, and
latencies marked `verified=False` are typical figures no primary source confirmed. Everything computed from a
preset is a *model*: notebooks label such output "modeled", never "measured". `fit_alpha_beta` calibrates α and β
from measurements taken here, so the same formulas can be checked against this machine before they are trusted for
another.

A transfer through several stages (a staging copy, then the wire, …), each a `Stage` with its own link, cut into k
chunks of c = S/k bytes that flow through the stages one after another (docs/formulas.md §9):

    T_pipelined = Σ_i t_i(c) + (k − 1)·max_i t_i(c)      (fill the pipe once, then the slowest stage sets the pace)
    T_serial    = Σ_i t_i(S)                            (k = 1: store and forward, each stage waits for all S bytes)

Collective times (ring, docs/formulas.md §1, Thakur et al. 2005):
    all-gather / reduce-scatter   (p−1)·α + (p−1)/p·S·β
    all-reduce (ring)             2(p−1)·α + 2(p−1)/p·S·β
    all-reduce (halving-doubling) 2·log₂p·α + 2(p−1)/p·S·β  (p a power of two; else + 2(α + S·β))
    broadcast (binomial tree)     ⌈log₂p⌉·(α + S·β)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GB = 1e9


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float            # seconds per message
    bandwidth: float        # bytes per second, one direction
    source: str = ""
    verified: bool = True   # False: the latency (or rate) is a typical figure, not a confirmed one
    kind: str = "modeled"   # "modeled" for presets, "fitted" for calibrations on this machine

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def time(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """α + S·β, in seconds."""
        return self.alpha + np.asarray(nbytes, dtype=float) * self.beta if isinstance(nbytes, np.ndarray) \
            else self.alpha + float(nbytes) * self.beta

    def half_bandwidth_size(self) -> float:
        """n½ = α/β: the message size at which latency and bandwidth cost the same (Hockney's n½)."""
        return self.alpha / self.beta

    def label(self) -> str:
        flag = "" if self.verified else ", latency unverified"
        return f"{self.name} ({self.kind}: α={self.alpha * 1e6:.2f} µs, B={self.bandwidth / GB:.2f} GB/s{flag})"


PRESETS: dict[str, Link] = {
    "PCIe Gen4 x16": Link("PCIe Gen4 x16", 1e-6, 31.5 * GB,
                          "docs/formulas.md §6: 31.5 GB/s per direction (128b/130b); latency ~1 µs typical",
                          verified=False),
    "PCIe Gen5 x16": Link("PCIe Gen5 x16", 1e-6, 63.0 * GB,
                          "docs/formulas.md §6: 63.0 GB/s per direction; latency ~1 µs typical", verified=False),
    "NVLink 4": Link("NVLink 4", 1e-6, 450 * GB,
                     "docs/formulas.md §9: 900 GB/s bidirectional per H100/H200 GPU → ~450 GB/s per direction "
                     "(derived); latency ~1 µs typical", verified=False),
    "InfiniBand NDR": Link("InfiniBand NDR", 1e-6, 50 * GB,
                           "docs/formulas.md §9: 400 Gb/s per port = 50 GB/s; RDMA verbs ≈1 µs for small messages"),
    "RoCEv2 200G": Link("RoCEv2 200G", 1.5e-6, 25 * GB,
                        "docs/formulas.md §9: 200 GbE line rate 25 GB/s; RDMA verbs ≈1–1.6 µs (ib_send_lat testbed)"),
    "TCP 100GbE": Link("TCP 100GbE", 30e-6, 12.5 * GB,
                       "docs/formulas.md §9: 100 GbE line rate 12.5 GB/s; kernel TCP latency 'tens of µs' "
                       "(UNVERIFIED); sustained single-flow TCP throughput is UNVERIFIED and usually below line rate",
                       verified=False),
}


def get_link(name_or_link: str | Link) -> Link:
    if isinstance(name_or_link, Link):
        return name_or_link
    try:
        return PRESETS[name_or_link]
    except KeyError:
        raise ValueError(f"unknown link {name_or_link!r}; presets: {sorted(PRESETS)}") from None


def fit_alpha_beta(sizes, times, name: str = "this machine") -> Link:
    """Least-squares fit of t = α + S·β with relative weights (1/t), so small messages pin α and large ones β.

    A plain fit would let the largest message dominate and leave α meaningless. Returns a Link of kind 'fitted'.
    """
    S = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if S.shape != t.shape or S.size < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, time) pairs of equal length")
    if np.any(t <= 0) or np.any(S < 0):
        raise ValueError("times must be positive and sizes non-negative")
    A = np.stack([np.ones_like(S), S], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if beta <= 0:
        raise ValueError("fitted β is not positive: measure larger messages so bandwidth shows")
    return Link(name, max(float(alpha), 0.0), 1.0 / float(beta), "fitted on this machine", True, "fitted")


# ---------------------------------------------------------------------------- stages in a pipeline
@dataclass(frozen=True)
class Stage:
    """One stage of a modeled transfer: its time for S bytes is link.time(S) = α + S·β. `category` groups stages
    for a breakdown (e.g. 'staging', 'cpu_protocol', 'wire')."""
    name: str
    link: Link
    category: str = ""

    def time(self, nbytes: float) -> float:
        return self.link.time(nbytes)


def pipelined_time(stages, nbytes: float, chunks: int) -> float:
    """Σ_i t_i(c) + (k − 1)·max_i t_i(c) with c = S/k: the first chunk fills the pipe, then one chunk leaves per
    slowest-stage time. chunks = 1 is the store-and-forward (serial) time Σ_i t_i(S). Every chunk pays every
    stage's α, so with a single stage chunking only adds (k − 1)·α."""
    if chunks < 1:
        raise ValueError("chunks must be >= 1")
    t = [s.time(nbytes / chunks) for s in stages]
    return sum(t) + (chunks - 1) * max(t)


# ---------------------------------------------------------------------------- collectives under the model
def ring_all_reduce_time(link: Link | str, nbytes: float, p: int) -> float:
    link = get_link(link)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def rhd_all_reduce_time(link: Link | str, nbytes: float, p: int) -> float:
    """Recursive halving–doubling over p' = 2^⌊log₂p⌋ ranks; when p is not a power of two the p − p' extra ranks
    fold in first and get the result back last — two more full messages (as in collectives.all_reduce_rhd, MPICH)."""
    link = get_link(link)
    if p == 1:
        return 0.0
    pp = 1 << (p.bit_length() - 1)
    core = 2 * int(math.log2(pp)) * link.alpha + 2 * (pp - 1) / pp * nbytes * link.beta
    return core + (2 * (link.alpha + nbytes * link.beta) if pp != p else 0.0)


def tree_all_reduce_time(link: Link | str, nbytes: float, p: int) -> float:
    """Binomial reduce + broadcast without pipelining: 2⌈log₂p⌉(α + S·β)."""
    link = get_link(link)
    return 2 * math.ceil(math.log2(p)) * (link.alpha + nbytes * link.beta) if p > 1 else 0.0


def naive_all_reduce_time(link: Link | str, nbytes: float, p: int) -> float:
    """Gather to one rank and send back: its link carries 2(p−1)·S, one message after another."""
    link = get_link(link)
    return 2 * (p - 1) * (link.alpha + nbytes * link.beta)


def ring_all_gather_time(link: Link | str, nbytes: float, p: int) -> float:
    """nbytes = the full gathered size S."""
    link = get_link(link)
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta if p > 1 else 0.0


ring_reduce_scatter_time = ring_all_gather_time

ALL_REDUCE_TIME = {"naive": naive_all_reduce_time, "ring": ring_all_reduce_time, "rhd": rhd_all_reduce_time,
                   "tree": tree_all_reduce_time}


def bus_bandwidth(op: str, nbytes: float, seconds: float, p: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s as nccl-tests defines them (docs/formulas.md §1): algbw = S/t,
    busbw = algbw × factor."""
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
              "broadcast": 1.0, "reduce": 1.0}[op]
    algbw = nbytes / seconds
    return algbw, algbw * factor
