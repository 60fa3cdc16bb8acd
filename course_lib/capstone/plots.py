"""Pictures of the capstone (notebook 13): one per-rank timeline with computation and each mesh axis's
communication in its own colour, the model states per rank by category beside their formula, and the planner's
decision flow."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

AXIS_COLORS = {"compute": "#4C72B0", "pp": "#DD8452", "dp": "#55A868", "tp": "#C44E52", "cp": "#8172B3",
               "ep": "#937860", "edp": "#DA8BC3", "dp×cp": "#55A868", "edp×cp": "#DA8BC3",
               "world": "#8C8C8C"}


def plot_axis_timeline(ledgers, *, ax=None, title: str = "Per-rank timeline", coords=None):
    """Gantt rows, one per rank: computation spans on the upper lane, every send, receive or collective on the
    lower lane coloured by the mesh axis it ran on (the ledger books each under its group's name). `coords`: the
    ranks' mesh coordinates, for the row labels."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.7 + 0.6 * len(ledgers)))
    events = [e for L in ledgers for e in L.events]
    if not events:
        raise ValueError("plot_axis_timeline: the ledgers hold no events")
    t0 = min(e.t0 for e in events)
    seen = set()
    for row, L in enumerate(ledgers):
        y = len(ledgers) - 1 - row
        bars: dict = {}                       # one broken_barh per rank and colour (thousands of spans per step)
        for e in L.events:
            key = "compute" if e.kind == "compute" else e.group
            bars.setdefault(key, []).append(((e.t0 - t0) * 1e3, max((e.t1 - e.t0) * 1e3, 1e-3)))
        for key, spans in bars.items():
            seen.add(key)
            lane = (y + 0.42, 0.38) if key == "compute" else (y + 0.02, 0.37)
            ax.broken_barh(spans, lane, facecolors=AXIS_COLORS.get(key, "#999999"), edgecolor="none")
    ax.set_yticks([len(ledgers) - 1 - i + 0.4 for i in range(len(ledgers))])
    names = [f"rank {L.rank}" for L in ledgers]
    if coords is not None:
        names = [f"{n} (pp{c['pp']} dp{c['dp']}" + (f" cp{c['cp']}" if any(k.get("cp") for k in coords) else "")
                 + f" tp{c['tp']})" for n, c in zip(names, coords)]
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    order = [k for k in AXIS_COLORS if k in seen]
    ax.legend(handles=[Patch(color=AXIS_COLORS[k], label=k if k == "compute" else f"{k} communication")
                       for k in order], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(left=0)
    return ax


def plot_states(measured: dict, formula: dict, *, ax=None, title: str = "Model states per rank", unit: int = 1024):
    """Bars of parameters, gradients and optimizer state per rank (KiB), measured (solid) beside the formula
    (hatched). `measured`, `formula`: {label: {category: bytes}}."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    cats = ("parameters", "gradients", "optimizer")
    colors = ("#4C72B0", "#DD8452", "#55A868")
    labels = list(measured)
    for i, label in enumerate(labels):
        for side, (src, hatch) in enumerate(((measured, None), (formula, "//"))):
            bottom = 0
            for c, col in zip(cats, colors):
                v = src[label][c] / unit
                ax.bar(i + (side - 0.5) * 0.38, v, 0.36, bottom=bottom, color=col, hatch=hatch,
                       edgecolor="white" if hatch else None, label=c if i == 0 and side == 0 else None)
                bottom += v
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("KiB per rank")
    ax.set_title(title + " (left: measured, right hatched: formula)")
    ax.legend(fontsize=8)
    return ax


__all__ = ["plot_axis_timeline", "plot_states", "AXIS_COLORS"]


def plot_decision_flow(flow, *, ax=None, title: str = "The decision flow, answered by the planner"):
    """The survey's decision flow as a picture, from `calculator.planner.decision_flow`: one question per row (top
    to bottom, in the flow's order), its answer on the arrow, and where it leads on the right — filled where the
    planner's best option adds a technique at that step, outlined where it adds none."""
    if not flow:
        raise ValueError("plot_decision_flow: the flow is empty")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 * len(flow) + 0.6))
    n = len(flow)
    for i, d in enumerate(flow):
        y = n - 1 - i
        ax.text(0.0, y, d.question, ha="left", va="center", fontsize=9,
                bbox=dict(boxstyle="round,pad=0.4", fc="#F2F2F2", ec="#555555"))
        if i + 1 < n:
            ax.annotate("", xy=(0.02, y - 0.72), xytext=(0.02, y - 0.28),
                        arrowprops=dict(arrowstyle="->", color="#555555"))
        ax.annotate(d.answer, xy=(0.72, y), xytext=(0.60, y), ha="right", va="center", fontsize=9,
                    arrowprops=dict(arrowstyle="->", color="#555555"))
        ax.text(0.73, y, d.outcome, ha="left", va="center", fontsize=9,
                color="white" if d.taken else "#333333",
                bbox=dict(boxstyle="round,pad=0.4", fc=AXIS_COLORS["compute"] if d.taken else "white",
                          ec=AXIS_COLORS["compute"]))
    ax.set_xlim(-0.02, 1.0)
    ax.set_ylim(-0.6, n - 0.4)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=AXIS_COLORS["compute"], label="a technique the best option adds"),
                       Patch(fc="white", ec=AXIS_COLORS["compute"], label="none added at this step")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax
