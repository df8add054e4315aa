"""ClusterResult and compare(): summaries, breakdowns, plots and display."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from pipeswift_lab import cluster
from pipeswift_lab.core.jct import TERMS


@pytest.fixture(scope="module")
def results():
    jobs = pd.DataFrame(
        {"submit_s": [0.0, 0.0, 100.0, 200.0], "gpus": [2, 2, 1, 4], "duration_s": [3000.0, 500.0, 800.0, 1000.0]}
    )
    return [cluster.simulate(jobs, 4, policy=p, progress=False) for p in ("static", "elastic", "preemptive")]


def test_summary_matches_the_jobs(results):
    r = results[0]
    s = r.summary
    jct = r.jobs["jct_s"]
    assert s["jobs"] == 4 and s["finished"] == 4 and s["unfinished"] == 0
    assert s["mean_jct_s"] == pytest.approx(jct.mean())
    assert s["p50_jct_s"] == pytest.approx(np.percentile(jct, 50))
    assert s["p95_jct_s"] == pytest.approx(np.percentile(jct, 95))
    assert s["makespan_s"] == pytest.approx(r.jobs["end_s"].max())
    gpu_s = (
        (r.jobs["end_s"] - r.jobs["start_s"]) * r.jobs["gpus"]
    ).sum()  # static: each job holds its GPUs start to end
    assert s["utilization"] == pytest.approx(gpu_s / (4 * s["makespan_s"]))
    assert s["events"] > 0 and s["events_per_s"] > 0
    assert list(r.jobs.columns[:7]) == ["name", "submit_s", "gpus", "profile", "priority", "start_s", "end_s"]


def test_compare_table_breakdown_and_labels(results):
    comp = cluster.compare(*results)
    table = comp.table
    assert table["policy"].tolist() == ["static", "elastic", "preemptive"]
    assert table["mean_jct_vs_first"].iloc[0] == 0.0
    assert table["mean_jct_vs_first"].iloc[1] == pytest.approx(
        table["mean_jct_s"].iloc[1] / table["mean_jct_s"].iloc[0] - 1
    )
    b = comp.breakdown()
    assert list(b.columns) == [*TERMS, "jct_s"]
    assert np.allclose(b[list(TERMS)].sum(axis=1), b["jct_s"])
    with pytest.raises(ValueError, match="labels must be distinct"):
        cluster.compare(results[0], results[0])
    assert cluster.compare(results[0], results[0].relabel("again")).table["policy"].tolist() == ["static", "again"]
    with pytest.raises(TypeError, match="compare takes ClusterResult"):
        cluster.compare(results[0], "x")
    with pytest.raises(ValueError, match="at least one"):
        cluster.compare()


def test_plots_take_ax_and_return_axes(results):
    r = results[1]
    ax = r.plot()
    assert len(ax.figure.axes) == 2 and ax.get_xscale() == "log"
    _, mine = plt.subplots()
    assert r.plot(ax=mine) is mine
    assert r.plot_usage(ax=mine) is mine
    _, mine = plt.subplots()
    comp = cluster.compare(*results)
    assert comp.plot(ax=mine) is mine and len(mine.get_lines()) >= 3
    _, mine = plt.subplots()
    assert comp.plot_breakdown(ax=mine) is mine
    with pytest.raises(ValueError, match="unit='d' is not known; valid values are"):
        r.plot_cdf(unit="d")
    plt.close("all")


def test_display(results):
    html = results[0]._repr_html_()
    assert "ClusterResult static" in html and "mean_jct_s" in html and "<table" in html
    assert "mean_jct_s" in repr(results[0])
    assert "3 cluster simulations" in cluster.compare(*results)._repr_html_()
