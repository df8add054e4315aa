import matplotlib
import pytest

from pipeswift_lab import analytic
from pipeswift_lab.widgets import bubble_explorer, plot_bubble_curve

matplotlib.use("Agg")


def test_bubble_explorer_follows_its_sliders():
    explorer = bubble_explorer(P=4, m=8, schedule="1F1B")
    assert explorer.result["bubble_ratio"] == pytest.approx(3 / 11)
    explorer.P = 8
    explorer.m = 16
    explorer.schedule = "GPipe"
    assert (explorer.P, explorer.m, explorer.schedule) == (8, 16, "GPipe")
    assert round(explorer.result["bubble_ratio"], 3) == 0.304
    assert explorer.result["bubble_overhead"] == pytest.approx(7 / 16)
    assert explorer.result["inflight_rank0"] == 16
    assert "0.304" in explorer._numbers.value


def test_schedule_pins_v():
    explorer = bubble_explorer(P=4, m=8, schedule="Interleaved1F1B", v=3)
    assert explorer.result["bubble_overhead"] == pytest.approx(3 / 24)
    explorer.schedule = "ZBVZeroBubble"
    assert explorer.v == 2 and explorer.result["v"] == 2
    explorer.schedule = "1F1B"
    assert explorer.v == 1
    assert explorer.result["bubble_ratio"] == analytic.bubble_ratio(4, 8, "1F1B")


def test_bad_start_values():
    with pytest.raises(ValueError, match="v=2 is not allowed for schedule='GPipe'"):
        bubble_explorer(schedule="GPipe", v=2)


def test_bubble_curve_plot():
    ax = plot_bubble_curve((2, 8), m_max=16, convention="overhead")
    assert len(ax.lines) == 2
    ys = ax.lines[1].get_ydata()
    assert ys[0] == pytest.approx(7.0) and ys[-1] == pytest.approx(7 / 16)
    with pytest.raises(ValueError, match="convention='idle'"):
        plot_bubble_curve(convention="idle")
