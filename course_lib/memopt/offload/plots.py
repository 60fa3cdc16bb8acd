"""Pictures of notebook 07: one offloaded step (measured compute, modeled transfers, memory on one clock), the swap
planner's plans against the device budget, and what fits one device with each technique at what modeled cost."""
from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from ...core.plots import plot_memory


def _window(report, t0: float, t1: float):
    """The memory report cut to [t0, t1] (one step, with that step's marks only)."""
    inside = lambda series: [(t, s) for t, s in series if t0 <= t <= t1]      # noqa: E731
    placements = {p: dict(v, timeline=inside(v["timeline"])) for p, v in report.placements.items()}
    return dataclasses.replace(report, timeline=inside(report.timeline), placements=placements,
                               marks=[(t, m) for t, m in report.marks if t0 <= t <= t1])


def plot_offload_step(schedule, report, window: tuple[float, float], *, link: str):
    """Three rows on one clock: the blocks' measured compute and the modeled d2h / h2d transfers of
    `schedule` (a LinkSchedule), then device and host memory of `report` within `window` (seconds)."""
    win0, win1 = window
    shift = (schedule.start - win0) * 1e3
    fig, axes = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 2, 2]},
                             layout="constrained")
    ax = axes[0]
    for t0, t1, label in schedule.compute:
        ax.broken_barh([(shift + 1e3 * t0, 1e3 * (t1 - t0))], (2, 0.8),
                       facecolors="#4C72B0" if label.startswith("fwd") else "#C44E52")
        ax.text(shift + 1e3 * (t0 + t1) / 2, 2.4, label, ha="center", va="center", fontsize=7, color="white")
    for lane, t0, t1, _n, _layer in schedule.transfers:
        y = 1 if lane == "d2h" else 0
        ax.broken_barh([(shift + 1e3 * t0, max(1e3 * (t1 - t0), 0.05))], (y, 0.8), facecolors="#DD8452")
    ax.set_yticks([0.4, 1.4, 2.4], ["h2d (modeled)", "d2h (modeled)", "blocks (measured)"])
    ax.set_title(f"One step: measured compute of the blocks, modeled {link} transfers, and memory on the same clock")
    step = _window(report, win0, win1)
    for ax, place in zip(axes[1:], ("device", "host")):
        plot_memory(step, ax=ax, placement=place, t0=win0, unit="MiB", title=f"{place} memory, offloaded run")
    axes[-1].set_xlim(0, 1e3 * (win1 - win0))
    return fig


PLAN_STYLES = {"no offload": dict(marker="o", ls="-", lw=3.0, ms=9), "swap everything": dict(marker="s", ls="--", ms=7),
               "greedy": dict(marker="^", ls="-", ms=6), "search": dict(marker="D", ls=":", ms=4)}


def plot_swap_plans(table, *, least: float, peak: float, title: str):
    """Modeled step time of each plan at each device budget ({"budget": bytes, plan: seconds or None} rows);
    where two plans coincide the earlier one is drawn wider underneath, and the legend sits outside the axes."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for name, style in PLAN_STYLES.items():
        rows = [r for r in table if r[name] is not None]
        ax.plot([r["budget"] / 2**20 for r in rows], [1e6 * r[name] for r in rows], label=name, **style)
    ax.axvline(least / 2**20, color="grey", ls=":", label="least possible")
    ax.axvline(peak / 2**20, color="k", ls=":", label="peak without offload")
    ax.set_xlabel("device budget (MiB)")
    ax.set_ylabel("step time (µs, modeled)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              title="wider marks lie under\nnarrower ones", title_fontsize=7)
    fig.tight_layout()
    return fig


FIT_COLORS = ["k", "#DD8452", "#55A868", "#C44E52", "#8172B3"]


def plot_what_fits(psis, grid, limits: dict, *, title: str):
    """Top: the range of Ψ each technique fits (a bar up to its largest Ψ). Bottom: its modeled step time divided
    by compute alone, one row per technique on a shared Ψ axis, so that the lines that coincide at 1× do not
    hide each other. `grid[i][name]` is `fit_options(psis[i], machine)[name]`; `limits[name]` its largest Ψ."""
    names = list(limits)
    fig, axes = plt.subplots(2, 1, figsize=(11, 2.0 + 1.1 * len(names)), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1.6]}, layout="constrained")
    bars, cost = axes
    for i, (n, color) in enumerate(zip(names, FIT_COLORS)):
        y = len(names) - 1 - i
        bars.barh(y, limits[n] - psis[0], left=psis[0], color=color, height=0.6)
        bars.text(limits[n], y, f" {limits[n] / 1e9:.1f} B", va="center", fontsize=8)
        pts = [(p, g[n]["seconds"] / g["none"]["seconds"]) for p, g in zip(psis, grid) if g[n]["fits"]]
        cost.loglog(*zip(*pts), color=color, lw=2, label=n, marker="os^Dv"[i % 5], markevery=(i, len(names)), ms=5)
    bars.set_yticks(range(len(names)), names[::-1])
    bars.set_xscale("log")
    bars.set_title(title, fontsize=10)
    bars.set_xlim(psis[0], psis[-1] * 3)
    cost.set_xlabel("parameters Ψ")
    cost.set_ylabel("step time ÷ compute\nalone (modeled)")
    cost.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                title="markers staggered: lines\nat 1× lie on one another", title_fontsize=7)
    return fig


def plot_swap_trace(trace, plans: dict, *, title: str):
    """Top: each swappable tensor of `trace` (by birth) on the device (red) and idle between its last forward use
    and its backward use (grey), over the op index. Bottom: device memory over the ops under each of `plans`
    ({label: the swap planner's simulation})."""
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]},
                             layout="constrained")
    for i, c in enumerate(sorted(trace.candidates, key=lambda c: c.birth)):
        axes[0].broken_barh([(c.birth, c.drop - c.birth + 1), (c.need, c.release - c.need + 1)], (i, 0.8),
                            facecolors="#C44E52")
        axes[0].broken_barh([(c.drop + 1, c.need - c.drop - 1)], (i + 0.3, 0.2), facecolors="#BBBBBB")
    axes[0].set_ylabel("swappable tensor (by birth)")
    axes[0].set_title(title)
    for label, sim in plans.items():
        axes[1].plot(sim.memory / 2**20, label=label)
    axes[1].set_xlabel("op index")
    axes[1].set_ylabel("device MiB")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
