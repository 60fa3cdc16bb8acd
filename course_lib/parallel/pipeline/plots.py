"""Pictures of pipelines: per-rank Gantt rows of F / B / W, from the simulator or measured on real ranks, and the
activation memory a stage holds over time."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _parse(op) -> tuple[str, int, int]:
    """'2F0' or Op('F', 2, 0) → ('F', 2, 0)."""
    if isinstance(op, str):
        i = next(i for i, ch in enumerate(op) if ch in OP_COLORS)
        return op[i], int(op[:i]), int(op[i + 1:])
    return op.kind, op.stage, op.mb


def plot_pipeline(timeline, *, ax=None, title: str = "Pipeline schedule", unit: str = "ms", scale: float = 1e3,
                  t0: float | None = None, labels: bool = True, num_stages: int | None = None):
    """Gantt rows, one per rank, of [(op, start, end)] per rank (`schedules.simulate` or `Pipeline.timeline`).
    Colour = F / B / W, the number in a box = its micro-batch (and `.c` its chunk when a rank holds several
    stages). Gaps are the bubble. `scale` converts the times to `unit` (1 for the simulator's time units)."""
    n = len(timeline)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * n))
    starts = [s for ops in timeline for _, s, _ in ops]
    if not starts:
        raise ValueError("plot_pipeline: the timeline holds no ops")
    t0 = min(starts) if t0 is None else t0
    S = num_stages or n
    chunks = max((_parse(op)[1] // S for ops in timeline for op, _, _ in ops), default=0) + 1
    span = (max(e for ops in timeline for _, _, e in ops) - t0) * scale
    placed = []               # (text, x0, width): each label must fit its box, checked once the axis is final
    for r, ops in enumerate(timeline):
        y = n - 1 - r
        boxes: dict = {}          # (kind, first chunk?) → [(x0, width)]: one collection each, not one per op (faster)
        for op, s, e in ops:
            kind, stage, mb = _parse(op)
            x0, w = (s - t0) * scale, max((e - s) * scale, 1e-9)
            boxes.setdefault((kind, stage // S == 0), []).append((x0, w))
            if labels and w > span / (90 if chunks == 1 else 60):    # no text in boxes too small to read
                text = f"{mb}" if chunks == 1 else f"{mb}.{stage // S}"
                placed.append((ax.text(x0 + w / 2, y + 0.5, text, ha="center", va="center", fontsize=7,
                                       color="white"), x0, w))
        for (kind, first), spans in boxes.items():
            ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=OP_COLORS[kind], edgecolor="white", lw=0.5,
                           alpha=1.0 if first else 0.65)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    kinds = sorted({_parse(op)[0] for ops in timeline for op, _, _ in ops}, key="FBW".index)
    names = {"F": "F: forward", "B": "B: backward" + (" (input)" if "W" in kinds else ""), "W": "W: weight gradient"}
    ax.legend(handles=[Patch(color=OP_COLORS[k], label=names[k]) for k in kinds] +
              [Patch(color="white", label="idle: bubble")], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(left=0)
    _fit_labels(ax, placed)
    return ax


def _fit_labels(ax, placed, sizes=(7, 6, 5)):
    """Shrink each label until it fits its box with a margin; drop the ones that fit at no readable size (the
    interleaved schedule's chunk-ops are narrow, and their "mb.chunk" labels printed over one another)."""
    if not placed:
        return
    renderer = ax.figure.canvas.get_renderer()
    widths: dict = {}         # (string, size) → width in pixels: the labels repeat ("0" … "M−1"), lay each out once
    for text, x0, w in placed:
        room = ax.transData.transform((x0 + w, 0))[0] - ax.transData.transform((x0, 0))[0]
        for size in sizes:
            text.set_fontsize(size)
            key = (text.get_text(), size)
            if key not in widths:
                widths[key] = text.get_window_extent(renderer).width
            if widths[key] <= 0.85 * room:
                break
        else:
            text.remove()


def plot_activation_memory(curves: dict, *, ax=None, title: str = "Activations held over one step", unit: str = "MiB"):
    """{label: [(seconds since start, bytes)]} as step lines: the activations a stage holds over time."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    div = {"KiB": 2**10, "MiB": 2**20}[unit]
    for label, series in curves.items():
        ax.step([1e3 * t for t, _ in series], [b / div for _, b in series], where="post", label=label)
    ax.set_xlabel("time since the step started (ms)")
    ax.set_ylabel(f"activations held ({unit})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


__all__ = ["plot_pipeline", "plot_activation_memory", "OP_COLORS"]
