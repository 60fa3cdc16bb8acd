"""plot_traffic: every bar can be seen and read, and the legend hides none of them; explorer shows one figure and
redraws it in place."""
from types import SimpleNamespace

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib.core.plots import plot_traffic  # noqa: E402


def _ledgers(sent_by_tag: dict, world_size: int):
    return [SimpleNamespace(rank=r, events=[SimpleNamespace(tag=t, sent=v[r], nominal=False)
                                            for t, v in sent_by_tag.items()]) for r in range(world_size)]


def _bars(ax):
    return [p for p in ax.patches if p.get_width() > 0]


def test_an_8_byte_bar_beside_384_kib_gets_a_log_axis_and_a_third_of_an_octave_at_least():
    ledgers = _ledgers({"ring all-reduce": [393_216] * 4, "token": [8] * 4}, 4)
    ax = plot_traffic(ledgers, key="tag")
    fig = ax.figure
    fig.canvas.draw()
    assert ax.get_yscale() == "log"
    lo, hi = ax.get_ylim()
    token_bars = [p for p in _bars(ax) if p.get_height() == 8]
    assert len(token_bars) == 4
    import math
    share = math.log2(8 / lo) / math.log2(hi / lo)      # the bar's share of the axis height
    assert share > 0.1, f"the 8-byte bars fill only {share:.0%} of the axis"
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("8 B") == 4 and labels.count("384 KiB") == 4, labels
    # the legend sits outside the axes, so it covers no bar
    legend = ax.get_legend().get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend.x0 >= axes_box.x1 - 1, "the legend overlaps the plotting area"
    plt.close(fig)


def test_bars_of_similar_size_stay_on_a_linear_axis_in_the_requested_unit():
    ax = plot_traffic(_ledgers({"ring": [1 << 20] * 2, "tree": [2 << 20, 1 << 20]}, 2), key="tag", unit="MiB")
    assert ax.get_yscale() == "linear" and "MiB" in ax.get_ylabel()
    assert max(p.get_height() for p in _bars(ax)) == 2.0
    plt.close(ax.figure)


class _Recorder:
    """An IPython display publisher that records what a frontend would receive."""

    def __init__(self):
        self.messages = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
        self.messages.append({"data": data, "id": (transient or {}).get("display_id"), "update": update})

    def clear_output(self, wait=False):
        self.messages.append({"clear": True})


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance()
    saved, sh.display_pub = sh.display_pub, _Recorder()
    yield sh
    sh.display_pub = saved


def _figures(messages):
    return [m for m in messages if "data" in m and "Figure" in m["data"].get("text/plain", "")]


def test_explorer_shows_one_default_figure_and_a_control_change_updates_it_in_place(shell):
    from IPython.display import display
    from ipywidgets import Dropdown, IntSlider

    from course_lib.core.plots import explorer

    calls = []

    def draw(n, link):
        calls.append((n, link))
        print(f"n = {n} over {link}")
        fig, ax = plt.subplots()
        ax.plot(range(n))
        plt.show()                                  # a no-op under Agg: explorer shows the figure itself
        return n * 2

    n, link = IntSlider(value=4, min=1, max=8), Dropdown(options=["ib", "tcp"], value="ib")
    box = explorer(draw, n=n, link=link)
    assert calls == [(4, "ib")] and box.result == 8 and shell.display_pub.messages == []   # drawn, not yet shown
    display(box)
    shown = shell.display_pub.messages
    figures = _figures(shown)
    assert len(figures) == 1 and not figures[0]["update"] and figures[0]["id"], shown     # one figure, with an id
    text = [m for m in shown if m.get("data", {}).get("text/plain") == "n = 4 over ib"]
    assert len(text) == 1 and text[0]["id"]
    assert not plt.get_fignums(), "the explorer left a figure open (it would be drawn again at the cell's end)"

    shell.display_pub.messages = []
    n.value = 6
    updates = shell.display_pub.messages
    assert calls[-1] == (6, "ib") and box.result == 12
    assert all(m["update"] for m in updates), "a control change displayed something new instead of updating"
    assert [m["id"] for m in _figures(updates)] == [figures[0]["id"]]
    assert {"data": {"text/plain": "n = 6 over ib"}, "id": text[0]["id"], "update": True} in updates


def test_a_redraw_that_fails_says_why_in_the_cell_and_a_draw_without_controls_is_refused(shell):
    from IPython.display import display
    from ipywidgets import IntSlider

    from course_lib.core.plots import explorer

    def draw(n):
        if n > 4:
            raise ValueError(f"{n} stages is too many")
        plt.subplots()

    n = IntSlider(value=2, min=1, max=8)
    display(explorer(draw, n=n))
    shell.display_pub.messages = []
    n.value = 6
    msgs = shell.display_pub.messages
    assert {"text/plain": "ValueError: 6 stages is too many"} in [m["data"] for m in msgs]
    assert all(m["update"] for m in msgs) and not _figures(msgs)      # the figure's output is emptied in place
    with pytest.raises(ValueError, match="at least one control"):
        explorer(print)


def test_pipeline_labels_fit_their_boxes_or_are_left_out():
    from course_lib.parallel import pipeline as P
    from course_lib.parallel.pipeline.plots import plot_pipeline

    timeline = P.simulate(P.make_schedule("interleaved", 4, 8, 2))
    ax = plot_pipeline(timeline, scale=1, num_stages=4)
    renderer = ax.figure.canvas.get_renderer()
    boxes = [b for coll in ax.collections for b in coll.get_paths()]
    assert ax.texts, "every label was dropped"
    for t in ax.texts:
        width = t.get_window_extent(renderer).width
        x = t.get_position()[0]
        # the box the label is centred in: the op whose span holds x on the label's row
        ext = [p.get_extents() for p in boxes]
        y = t.get_position()[1]
        box = next(e for e in ext if e.x0 <= x <= e.x1 and e.y0 <= y <= e.y1)
        room = ax.transData.transform((box.x1, 0))[0] - ax.transData.transform((box.x0, 0))[0]
        assert width <= room, f"label {t.get_text()!r} is {width:.0f} px wide in a {room:.0f} px box"
    plt.close(ax.figure)
