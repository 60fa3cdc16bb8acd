"""The three real-world paths of a gradient from GPU memory in one node to GPU memory in another, as data.

    path              copies per side   kernel on the data path   who moves the bytes
    TCP               2                 yes                       GPU copy engine, CPU (kernel), NIC DMA, wire
    RDMA              1                 no                        GPU copy engine, NIC DMA, wire
    GPUDirect RDMA    0                 no                        NIC DMA (reads GPU memory over PCIe), wire

Each path is the ordered list of its `Move`s (from a box to a box, by an engine), the sender's side mirrored on the
receiver's; the copy counts, the drawing (`draw_paths`) and the modeled stages (`exchange.exchange_stages`) are all
read off that one list. Nothing here is measured: the paths follow NVIDIA's GPUDirect RDMA documentation
(docs.nvidia.com/cuda/gpudirect-rdma) and IBTA's RoCEv2 annex (2014); the copy counts are docs/formulas.md §9.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    """The three ways a gradient in GPU memory reaches a GPU in another node (docs/formulas.md §9, derived from
    NVIDIA's GPUDirect RDMA docs): every copy and DMA, in order, sender side, wire, receiver side."""
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
             "docs/formulas.md §9: cudaMemcpy to a host buffer, then user → kernel socket buffer, then NIC DMA "
             "(≈2 copies)"),
        path("RDMA", (Move((S, "gpu"), (S, "host"), "GPU copy engine", True),      # into registered host memory
                      Move((S, "host"), (S, "nic"), "NIC DMA", False)),
             "CPU only posts work requests and polls completions (control path); no kernel on the data path",
             "docs/formulas.md §9: GPU → registered host buffer, then the NIC DMAs it: 1 copy, no kernel "
             "(RoCEv2 / IB verbs)"),
        path("GPUDirect RDMA", (Move((S, "gpu"), (S, "nic"), "NIC DMA", False),),  # NIC reads GPU memory over PCIe
             "CPU only posts work requests; the NIC reads and writes GPU memory directly over PCIe",
             "NVIDIA GPUDirect RDMA docs; docs/formulas.md §9: the NIC DMAs to and from GPU memory, 0 host copies"),
    )}


_X = {("send", b): 1.35 * i for i, b in enumerate(BOXES)}
_X.update({("recv", b): 1.35 * (2 * len(BOXES)) + 0.4 - 1.35 * (i + 1) for i, b in enumerate(BOXES)})
_W, _H = 1.05, 0.62


def draw_paths(paths: dict[str, RealPath] | None = None, *, axes=None, title: str = "How a gradient crosses two "
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

