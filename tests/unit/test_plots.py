"""plot_traffic: every bar can be seen and read, and the legend hides none of them; explorer draws only on change."""
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib.plots import plot_traffic  # noqa: E402


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


def test_explorer_draws_nothing_when_built_and_redraws_with_every_value_on_change():
    import pytest
    from ipywidgets import Dropdown, IntSlider

    from course_lib.plots import explorer

    calls = []
    n, link = IntSlider(value=4, min=1, max=8), Dropdown(options=["ib", "tcp"], value="ib")
    box = explorer(lambda n, link: calls.append((n, link)), n=n, link=link)
    assert calls == []                                  # the notebook draws the default itself
    assert box.children[:2] == (n, link)
    n.value = 6
    link.value = "tcp"
    assert calls == [(6, "ib"), (6, "tcp")]
    with pytest.raises(ValueError, match="at least one control"):
        explorer(print)
