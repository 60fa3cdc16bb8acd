"""A modeled GPU → GPU transfer between two nodes, built from the stages of a real-world path (`paths`).

Each `Move` of a path becomes a stage with an α–β link (`costmodel.Stage`): a GPU copy-engine move is a PCIe
transfer, a kernel move is CPU protocol work at a calibrated cost per byte, the wire is a link preset; NIC DMA
overlaps the wire and is not a stage. The transfer's time, serial and pipelined in k chunks of c = S/k bytes, is
`costmodel.pipelined_time` (docs/formulas.md §9):

    T_serial = Σ_i t_i(S)          T_pipelined = Σ_i t_i(c) + (k − 1)·max_i t_i(c)

Everything here is modeled (link presets from docs/formulas.md §6, §9), never measured, and says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.costmodel import Link, Stage, get_link, pipelined_time
from .measure import MiB
from .paths import ENGINES, RealPath, real_world_paths


def exchange_stages(link: Link | str, path: RealPath | str, *, pcie: Link | str = "PCIe Gen5 x16",
                    cpu_s_per_byte: float | None = None) -> list[Stage]:
    """The stages of one transfer, read off `path.moves`: a GPU copy-engine move costs a PCIe transfer, a kernel
    move costs `cpu_s_per_byte` of CPU protocol work, the wire costs `link`. NIC DMA is not a stage of its own: the
    NIC streams from memory while it transmits, and its PCIe link is faster than the wire (docs/formulas.md §6, §9)."""
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
            stages.append(Stage(f"{what} copy ({side})", pcie, category))
        elif category == "cpu_protocol":
            if cpu_s_per_byte is None or cpu_s_per_byte <= 0:
                raise ValueError("a TCP path needs cpu_s_per_byte > 0: the CPU seconds the kernel spends per byte")
            stages.append(Stage(f"CPU protocol ({side})",
                                Link(f"CPU protocol ({side})", 0.0, 1.0 / cpu_s_per_byte, "calibrated", False),
                                category))
        elif category == "wire":
            stages.append(Stage(f"wire ({link.name})", link, category))
    return stages


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
            out[s.category] += s.time(self.nbytes)
        return out

    @property
    def label(self) -> str:
        return f"{self.path} over {self.link}"


def model_exchange(nbytes: float, link: Link | str, path: RealPath | str, *, pcie: Link | str = "PCIe Gen5 x16",
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

