"""Pictures used across the notebooks: per-rank timelines (Gantt rows), memory by category, traffic bars.

Each function draws one idea on one Axes, titled, with labelled axes and units, and returns the Axes.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..memory import CATEGORIES, CATEGORY_COLORS, MemoryReport, fmt_bytes

COLORS = {"compute": "#4C72B0", "send": "#DD8452", "recv": "#55A868", "collective": "#8172B3", "barrier": "#937860",
          "idle": "#EEEEEE"}
MEM_COLORS = CATEGORY_COLORS    # one colour per memory category, shared with course_lib.memory (open: new ones too)


def _ax(ax, figsize=(9, 3)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_timeline(ledgers, *, ax=None, title: str = "Per-rank timeline", labels: bool = False, t0: float | None = None):
    """Gantt rows, one per rank: computation on the upper lane, communication on the lower lane, so overlap shows.

    `ledgers`: a list of `course_lib.distributed.comm.Ledger` (what the ranks returned). Gaps are idle time.
    """
    ax = _ax(ax, (10, 0.6 + 0.7 * len(ledgers)))
    events = [e for L in ledgers for e in L.events]
    if not events:
        raise ValueError("plot_timeline: the ledgers hold no events")
    t0 = min(e.t0 for e in events) if t0 is None else t0
    for row, L in enumerate(ledgers):
        y = len(ledgers) - 1 - row
        for e in L.events:
            # upper lane: compute; lower lane: communication (sends below receives, so both show)
            lane, height = {"compute": (y + 0.42, 0.38), "send": (y + 0.02, 0.18), "recv": (y + 0.21, 0.18)}.get(
                e.kind, (y + 0.02, 0.37))
            ax.broken_barh([((e.t0 - t0) * 1e3, max((e.t1 - e.t0) * 1e3, 1e-3))], (lane, height),
                           facecolors=COLORS.get(e.kind, "#999999"), edgecolor="none")
            if labels and e.kind == "compute" and e.t1 - e.t0 > 0:
                ax.text((e.t0 + e.t1 - 2 * t0) / 2 * 1e3, lane + 0.19, e.tag, ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks([len(ledgers) - 1 - i + 0.4 for i in range(len(ledgers))])
    ax.set_yticklabels([f"rank {L.rank}" for L in ledgers])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    kinds = sorted({e.kind for e in events}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds] + [Patch(color="white", label="idle (gap)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(left=0)
    return ax


def plot_memory(report: MemoryReport, *, ax=None, title: str = "Live memory by category", unit: str = "MiB",
                placement: str = "device", t0: float | None = None):
    """Stacked live bytes by category over time at one placement, with the report's marks as vertical lines.

    Times are milliseconds since `t0` (default: when the tracker started). Memory and ledger share one clock
    (`time.perf_counter`), so pass the t0 of a `plot_timeline` to draw both on the same axis.
    """
    ax = _ax(ax, (10, 3.5))
    series = report.at(placement)["timeline"]
    if not series:
        raise ValueError("plot_memory: the report has no timeline (was timeline=False?)")
    t0 = report.t0 if t0 is None else t0
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    t = [1e3 * (s - t0) for s, _ in series]
    cats = [c for c in CATEGORIES if any(snap.get(c, 0) for _, snap in series)]
    ys = [[snap.get(c, 0) / scale for _, snap in series] for c in cats]
    ax.stackplot(t, ys, labels=cats, colors=[MEM_COLORS[c] for c in cats], step="post")
    top = ax.get_ylim()[1] * 1.2              # headroom above the peak for the mark labels
    ax.set_ylim(top=top)
    for i, (s, label) in enumerate(report.marks):
        ax.axvline(1e3 * (s - t0), color="k", lw=0.6, ls=":")
        # two alternating heights: marks an optimizer step apart ("opt 0", "fwd 1") would print over each other
        ax.text(1e3 * (s - t0), top * (0.98 - 0.08 * (i % 2)), f" {label}", fontsize=7, va="top",
                bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(f"live bytes ({unit})")
    peak = report.at(placement)["peak"]
    ax.set_title(f"{title} — peak {fmt_bytes(peak)}" + ("" if placement == "device" else f" ({placement})"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def plot_memory_split(splits: dict, *, ax=None, title: str = "Where memory goes", unit: str = "MiB",
                      categories=CATEGORIES):
    """Stacked bars, one per configuration: {label: {category: bytes}}."""
    ax = _ax(ax, (1.8 + 1.3 * len(splits), 3.5))
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    names = list(splits)
    bottom = [0.0] * len(names)
    for c in categories:
        vals = [splits[n].get(c, 0) / scale for n in names]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, color=MEM_COLORS[c], label=c)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    return ax


def _bytes_label(v: float, _pos=None) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= k:
            return f"{v / k:.3g} {unit}"
    return f"{v:.3g} B"


def plot_traffic(ledgers, *, key: str = "op", ax=None, title: str = "Bytes sent per rank", unit: str = "KiB",
                 log: bool | None = None):
    """Grouped bars: bytes each rank sent, split by op (or tag), each bar labelled with its value. Nominal
    (backend) entries are hatched. `log=None` picks a log axis when the bars span more than 100× (an 8-byte token
    next to a 384 KiB all-reduce would otherwise be invisible); the linear axis is in `unit`."""
    ax = _ax(ax, (8, 3.2))
    names = sorted({getattr(e, key) for L in ledgers for e in L.events if e.sent})
    sent = {name: [sum(e.sent for e in L.events if getattr(e, key) == name) for L in ledgers] for name in names}
    nonzero = [v for vals in sent.values() for v in vals if v > 0]
    if log is None:
        log = bool(nonzero) and max(nonzero) > 100 * min(nonzero)
    scale = 1 if log else {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        nominal = any(e.nominal for L in ledgers for e in L.events if getattr(e, key) == name)
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(ledgers))]
        vals = [v / scale if v > 0 or not log else float("nan") for v in sent[name]]
        bars = ax.bar(xs, vals, width, label=f"{name}{' (nominal)' if nominal else ''}",
                      hatch="//" if nominal else None)
        ax.bar_label(bars, labels=[_bytes_label(v) if v > 0 else "" for v in sent[name]], fontsize=7, padding=1,
                     rotation=90 if len(names) > 2 else 0)
    ax.set_xticks(range(len(ledgers)))
    ax.set_xticklabels([f"rank {L.rank}" for L in ledgers])
    if log:
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(_bytes_label)
        ax.set_ylim(min(1, min(nonzero) / 2), max(nonzero) * 8)   # from 1 byte; room above for the labels
        ax.set_ylabel("bytes sent (log scale)")
    else:
        if nonzero:   # headroom for the labels (taller when rotated)
            ax.set_ylim(0, max(nonzero) / scale * (1.35 if len(names) > 2 else 1.15))
        ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_title(title)
    if names:   # outside the axes: inside, it covered the last rank's bars
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def plot_losses(curves: dict, *, ax=None, title: str = "Training loss", ref_line: float | None = None):
    """{label: [loss per step]} as lines; an optional horizontal reference (e.g. ln V)."""
    ax = _ax(ax, (7, 3.2))
    for label, losses in curves.items():
        ax.plot(range(len(losses)), losses, label=label)
    if ref_line is not None:
        ax.axhline(ref_line, color="grey", ls="--", lw=0.8, label=f"uniform guess ln V = {ref_line:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def explorer(draw, /, **controls) -> Explorer:
    """Controls that redraw ``draw(**their values)`` in place; display the result (``display(explorer(...))``).

    The default figure is drawn once, when the explorer is built (so ``.result`` holds what ``draw`` returned for
    the defaults, for the notebook to assert on), and shown when the explorer is displayed: the controls, then
    what ``draw`` printed and the figures it drew, each output under a display id. Moving a control draws again
    and updates those outputs in place, so the cell always ends with one figure. A reader without a live kernel
    (papermill, nbval, the book) sees the default figure as ordinary output.

    Nothing is drawn into an Output widget: a notebook runner (papermill's nbclient) keeps an Output widget's
    state by messaging the kernel while it waits for the cell to finish, and drawing into one while the cell ran
    sometimes left that cell waiting out its whole timeout (jupyter/nbclient#312). Output printed by a redraw
    would go to JupyterLab's log console, so it is captured and shown in the cell's text output instead.
    """
    if not controls:
        raise ValueError("explorer needs at least one control, e.g. n=IntSlider(value=4, min=1, max=8)")
    return Explorer(draw, controls)


_EMPTY = ({"text/plain": ""}, {})


class Explorer:
    """What `explorer` returns: `.controls` (the widget box), `.result` (what the last draw returned)."""

    def __init__(self, draw, controls: dict):
        from ipywidgets import VBox
        self.draw, self._widgets, self.controls = draw, controls, VBox(list(controls.values()))
        self.result, self._text, self._rich = self._run()          # the default: errors here stop the cell
        self._slots = max(1, len(self._rich))                      # one text output, then the figures
        self._handles = []
        for w in controls.values():
            w.observe(self._redraw, names="value")

    def _run(self):
        """Call draw with the controls' values; return (result, printed text, [(data, metadata)] displayed)."""
        from IPython.display import display
        from IPython.utils.capture import capture_output
        before = set(plt.get_fignums())
        with capture_output() as cap:
            result = self.draw(**{name: w.value for name, w in self._widgets.items()})
            for num in plt.get_fignums():           # figures drawn but not shown (a non-inline backend)
                if num not in before:
                    fig = plt.figure(num)
                    display(fig)
                    plt.close(fig)
        rich = [(o.data, o.metadata or {}) for o in cap.outputs]
        return result, cap.stdout + cap.stderr, rich

    def _outputs(self):
        rich = self._rich[:self._slots]
        text = self._text
        if len(self._rich) > self._slots:
            text += f"({len(self._rich) - self._slots} more figure(s) than the default drew, not shown)\n"
        return [({"text/plain": text.rstrip("\n")}, {})] + rich + [_EMPTY] * (self._slots - len(rich))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.controls)
        self._handles = [display(data, metadata=md, raw=True, display_id=True) for data, md in self._outputs()]

    def _redraw(self, _change=None):
        try:
            self.result, self._text, self._rich = self._run()
        except Exception as err:                    # shown in the cell: a callback's traceback goes to the log
            self._text, self._rich = f"{type(err).__name__}: {err}", []
        for handle, (data, md) in zip(self._handles, self._outputs()):
            handle.update(data, metadata=md, raw=True)
