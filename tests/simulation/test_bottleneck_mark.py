"""The bottleneck mark of Timeline.plot: the shaded, labelled lane is the busiest rank."""

import matplotlib
import numpy as np
import pandas as pd
import pytest

from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation.gantt import BOTTLENECK_COLOR
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.timeline import COLUMNS, Timeline

matplotlib.use("Agg")


def marked_rows(ax):
    """Tick positions whose label names the bottleneck, and the shaded bands' (bottom, top) spans."""
    ticks = [i for i, t in enumerate(ax.get_yticklabels()) if "bottleneck" in t.get_text()]
    bands = []
    for c in ax.collections:
        if c.get_label() == "bottleneck (busiest rank)" or np.allclose(c.get_facecolor()[0][:3], _rgb()):
            ys = c.get_paths()[0].vertices[:, 1]
            bands.append((float(ys.min()), float(ys.max())))
    return ticks, sorted(bands)


def _rgb():
    return matplotlib.colors.to_rgb(BOTTLENECK_COLOR)


@pytest.mark.parametrize("slow", [0, 2, 3])
def test_the_marked_lane_is_the_rank_with_one_slow_stage(slow):
    fwd = [1.0] * 8
    fwd[2 * slow] = fwd[2 * slow + 1] = 3.0  # stage `slow` of the uniform split holds two slow layers
    part = partition(Profile.synthetic(fwd_ms=fwd, bwd_ms=[2 * f for f in fwd]), 4, method="uniform", m=8)
    tl = simulate(part, 8, "1F1B")
    busy = tl.idle_by_rank.set_index("rank")["busy_ms"]
    assert tl.bottleneck_rank() == slow == int(busy.idxmax())
    assert busy[slow] > busy.drop(slow).max()  # strictly the busiest: 8 micro-batches x 12 ms against x 6 ms
    ax = tl.plot()
    ticks, bands = marked_rows(ax)
    assert ticks == [slow] and bands == [(slow - 0.5, slow + 0.5)]
    assert ax.get_yticklabels()[slow].get_text() == f"rank {slow} · bottleneck"
    assert "bottleneck (busiest rank)" in {t.get_text() for t in ax.get_legend().get_texts()}
    assert len(ax.patches) == int(tl.df["kind"].isin(["F", "B"]).sum())  # the mark adds no bar
    assert marked_rows(tl.plot(bottleneck=False)) == ([], [])


def test_equal_stages_have_no_bottleneck_to_mark():
    tl = simulate(pd.DataFrame({"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3}), 4, "GPipe")
    assert tl.bottleneck_rank() is None
    assert marked_rows(tl.plot()) == ([], [])


def test_one_step_is_marked_by_its_own_busy_time():
    rows = [
        (0, 0, 0, 0, "F", 0.0, 3.0),  # step 0: rank 0 busy 3 + 3, rank 1 busy 1 + 1
        (0, 1, 1, 0, "F", 3.0, 4.0),
        (0, 1, 1, 0, "B", 4.0, 5.0),
        (0, 0, 0, 0, "B", 5.0, 8.0),
        (1, 0, 0, 0, "F", 10.0, 11.0),  # step 1: rank 0 busy 1 + 1, rank 1 busy 4 + 4
        (1, 1, 1, 0, "F", 11.0, 15.0),
        (1, 1, 1, 0, "B", 15.0, 19.0),
        (1, 0, 0, 0, "B", 19.0, 20.0),
    ]
    tl = Timeline(pd.DataFrame(rows, columns=COLUMNS), source="measured", meta={"P": 2})
    assert tl.bottleneck_rank(0) == 0 and tl.bottleneck_rank(1) == 1
    assert tl.bottleneck_rank() == 1  # mean busy: rank 0 4 ms, rank 1 5 ms
    assert marked_rows(tl.plot(step=0))[0] == [0]
    assert marked_rows(tl.plot(step=1))[0] == [1]
    with pytest.raises(ValueError, match="step=7 is not in this timeline"):
        tl.bottleneck_rank(7)


def test_every_replica_of_the_busiest_rank_is_marked():
    rows = []
    for d in (0, 1):
        rows += [
            (0, 0, 0, 0, "F", 0.0, 1.0, d),
            (0, 1, 1, 0, "F", 1.0, 4.0, d),
            (0, 1, 1, 0, "B", 4.0, 7.0, d),
            (0, 0, 0, 0, "B", 7.0, 8.0, d),
        ]
    tl = Timeline(pd.DataFrame(rows, columns=list(COLUMNS) + ["replica"]), source="measured", meta={"P": 2})
    assert tl.bottleneck_rank() == 1
    ticks, bands = marked_rows(tl.plot())
    assert ticks == [1, 3] and bands == [(0.5, 1.5), (2.5, 3.5)]  # replica 0 rank 1, replica 1 rank 1
