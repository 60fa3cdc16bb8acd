"""Pictures of notebook 10: Bamboo's recovery on the surviving ranks of a pipeline (Thorpe et al., NSDI 2023), drawn
from what each rank recorded (`RedundantPipeline`'s records and events)."""
from __future__ import annotations

import re

import matplotlib.pyplot as plt

OP_COLORS = {"F": "#4C72B0", "R": "#DD8452", "B": "#55A868", "sync": "#8C8C8C"}
PHASE_COLORS = {"detect, leave, new group": "#8172B3", "rebuild the replicas": "#C9A0DC"}


def plot_bamboo_recovery(alive: dict, *, killed_at: float, resumed: float, step_seconds: float, kill_rank: int,
                         kill_step: int, num_stages: int):
    """Per-rank rows around the kill (time 0): F / R (the successor's redundant forward) / B and the replica sync
    of each survivor in `alive` ({rank: {"records": [(group, step, op, t0, t1)], "events": [...]}}), then its
    recovery phases; from the step before the kill to `step_seconds` after `resumed` (seconds since the kill)."""
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * num_stages))
    lo = min(t0 for r in alive.values() for _, s, _, t0, _ in r["records"] if s == kill_step - 1) - killed_at
    hi = resumed + 1.2 * step_seconds
    for k, r in alive.items():
        spans = [("sync" if op == "sync" else re.fullmatch(r"\d+([FBR])\d+", op).group(1), t0, t1)
                 for _, _, op, t0, t1 in r["records"] if lo <= t0 - killed_at <= hi]
        for kind, t0, t1 in sorted(spans, key=lambda x: x[0] == "R"):     # R on top of the F span that holds it
            ax.broken_barh([(1e3 * (t0 - killed_at), 1e3 * (t1 - t0))], (k - 0.35, 0.7), color=OP_COLORS[kind])
        e = r["events"][0]
        for (a, b), color in zip((("caught", "regrouped"), ("regrouped", "replicated")), PHASE_COLORS.values()):
            ax.broken_barh([(1e3 * (e[a] - killed_at), 1e3 * (e[b] - e[a]))], (k - 0.35, 0.7), color=color)
    ax.axvline(0, color="#C44E52", lw=2)
    ax.text(0, kill_rank, f" rank {kill_rank} killed: its process, and its records, are gone", color="#C44E52",
            fontsize=8, va="center")
    ax.set_yticks(range(num_stages), [f"rank {k}" for k in range(num_stages)])
    ax.set_ylim(-0.8, num_stages - 0.2)
    ax.invert_yaxis()
    ax.set_xlim(1e3 * lo, 1e3 * hi)
    ax.set_xlabel("milliseconds since the kill")
    labels = {"forward": OP_COLORS["F"], "redundant forward (successor's)": OP_COLORS["R"],
              "backward": OP_COLORS["B"], "replica gradients + commit": OP_COLORS["sync"], **PHASE_COLORS}
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in labels.values()], labels=list(labels),
              fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.35))
    ax.set_title(f"Bamboo: stage {kill_rank} SIGKILLed in step {kill_step}; its predecessor takes over, "
                 f"step {kill_step} runs again on {num_stages - 1} stages")
    return fig
