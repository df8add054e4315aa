"""ClusterResult and compare(): summaries, rankings, breakdowns, plots and display."""

import dataclasses

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


# -- the ranking a researcher reads: per workload, policies by mean JCT ---------------------------------------------
SPOT = [(0.0, 16), (3 * 3600.0, 8), (5 * 3600.0, 16)]  # 16 GPUs, half of them gone from hour 3 to hour 5
POLICIES = ("static", "elastic", "preemptive")


@pytest.fixture(scope="module")
def windows():
    """Two workloads (60 jobs on 16 GPUs, the same jobs on a capacity that dips), each under the three policies."""
    rng = np.random.default_rng(7)
    n = 60
    jobs = pd.DataFrame(
        {
            "submit_s": np.sort(rng.uniform(0, 8 * 3600, n)).round(),
            "gpus": rng.choice([1, 2, 4, 8], n, p=[0.3, 0.3, 0.25, 0.15]),
            "duration_s": rng.uniform(600, 4 * 3600, n).round(),
        }
    )
    run = {p: cluster.simulate(jobs, 16, policy=p, checkpoint_every_s=1800, progress=False) for p in POLICIES}
    spot = {p: cluster.simulate(jobs, SPOT, policy=p, checkpoint_every_s=1800, progress=False) for p in POLICIES}
    return jobs, run, spot


def test_workload_label_names_the_jobs_and_the_capacity(windows):
    jobs, run, spot = windows
    assert {r.workload for r in run.values()} == {"60 jobs, hours 0.0-8.0, 16 GPUs"}
    assert {r.workload for r in spot.values()} == {"60 jobs, hours 0.0-8.0, ≤16 GPUs"}
    again = cluster.simulate(jobs, 16, policy="static", progress=False)
    assert again.workload == run["elastic"].workload  # same jobs, same capacity: same window
    fewer = cluster.simulate(jobs.iloc[:30], 16, policy="static", progress=False)
    assert fewer.workload != run["static"].workload and fewer.workload.startswith("30 jobs")
    days = jobs.assign(submit_s=jobs["submit_s"] + 42 * 86400, duration_s=600.0)
    days.loc[days.index[-1], "submit_s"] = 44.5 * 86400
    assert cluster.simulate(days, 16, progress=False).workload == "60 jobs, days 42.0-44.5, 16 GPUs"
    r = run["static"]
    named = dataclasses.replace(r, inputs={**r.inputs, "workload": "week 7"})
    assert named.workload == "week 7" and named.relabel("x").workload == "week 7"
    assert dataclasses.replace(r, inputs={**r.inputs, "workload": None}).workload == r.workload


def test_summary_counts_resizes_and_preemptions(windows):
    _, run, spot = windows
    for r in (*run.values(), *spot.values()):
        s = r.summary
        assert s["resizes"] == r.jobs["resizes"].sum() and s["preemptions"] == r.jobs["preemptions"].sum()
        assert s["restarts"] == s["resizes"] + s["preemptions"]
    assert run["elastic"].summary["resizes"] > 0 and run["preemptive"].summary["preemptions"] > 0
    assert run["static"].summary["resizes"] == run["static"].summary["preemptions"] == 0


def test_ranking_ranks_each_workload_by_mean_jct(windows):
    _, run, spot = windows
    results = [*run.values(), spot["preemptive"], spot["static"], spot["elastic"]]
    ranking = cluster.compare(*results).ranking
    terms = [f"{t.removesuffix('_s')}_h" for t in TERMS]
    assert list(ranking.columns) == [
        *("workload", "rank", "policy", "jobs", "finished", "mean_jct_h", "p50_jct_h", "p95_jct_h", *terms),
        *("utilization", "resizes", "restarts", "preemptions", "suspensions", "mean_vs_best"),
    ]
    assert ranking["workload"].tolist() == [run["static"].workload] * 3 + [spot["static"].workload] * 3
    for window in (run, spot):
        rows = ranking[ranking["workload"] == window["static"].workload]
        by_mean = sorted(window, key=lambda p: window[p].summary["mean_jct_s"])
        assert rows["policy"].tolist() == by_mean and rows["rank"].tolist() == [1, 2, 3]
        for row in rows.itertuples(index=False):
            s = window[row.policy].summary
            assert row.mean_jct_h == pytest.approx(s["mean_jct_s"] / 3600)
            assert row.p95_jct_h == pytest.approx(s["p95_jct_s"] / 3600)
            assert (row.jobs, row.finished, row.restarts) == (s["jobs"], s["finished"], s["restarts"])
            assert (row.resizes, row.preemptions, row.utilization) == (s["resizes"], s["preemptions"], s["utilization"])
        best = min(window[p].summary["mean_jct_s"] for p in window)
        assert rows["mean_vs_best"].iloc[0] == 0.0
        expected = [window[p].summary["mean_jct_s"] / best - 1 for p in rows["policy"]]
        assert rows["mean_vs_best"].tolist() == pytest.approx(expected)
        assert (rows["mean_vs_best"].iloc[1:] > 0).all()


def test_ranking_terms_sum_to_the_mean_jct(windows):
    _, run, spot = windows
    ranking = cluster.compare(*run.values(), *spot.values()).ranking
    terms = [f"{t.removesuffix('_s')}_h" for t in TERMS]
    assert np.allclose(ranking[terms].sum(axis=1), ranking["mean_jct_h"])
    elastic = ranking[(ranking["policy"] == "elastic") & (ranking["workload"] == run["elastic"].workload)].iloc[0]
    assert elastic["queue_h"] == pytest.approx(run["elastic"].finished["queue_s"].mean() / 3600)
    preemptive = ranking[ranking["policy"] == "preemptive"]
    assert (preemptive["preemption_loss_h"] > ranking[ranking["policy"] == "static"]["preemption_loss_h"].values).all()


def test_ranking_breaks_ties_by_p95(windows):
    _, run, _ = windows
    r = run["static"]
    spread, even = r.jobs.copy(), r.jobs.copy()
    spread["jct_s"] = np.where(np.arange(len(r.jobs)) % 2, 1000.0, 3000.0)  # mean 2000, p95 3000
    even["jct_s"] = 2000.0  # mean 2000, p95 2000
    spread_r = dataclasses.replace(r, jobs=spread, label="spread")
    even_r = dataclasses.replace(r, jobs=even, label="even")
    ranking = cluster.compare(spread_r, even_r, r.relabel("same"), r).ranking
    assert ranking["policy"].tolist() == ["even", "spread", "same", "static"]  # a tie on both keeps the order
    assert ranking["mean_vs_best"].iloc[1] == 0.0


def test_labels_distinct_within_a_workload_only(windows):
    _, run, spot = windows
    with pytest.raises(ValueError, match=r"labels must be distinct within a workload.*'static'.*16 GPUs"):
        cluster.compare(run["static"], run["elastic"], run["static"])
    with pytest.raises(ValueError, match="labels must be distinct"):
        cluster.compare(run["static"], run["elastic"].relabel("static"))
    both = cluster.compare(run["static"], spot["static"])
    assert both.ranking["policy"].tolist() == ["static", "static"] and both.ranking["rank"].tolist() == [1, 1]
    assert both.workloads == [run["static"].workload, spot["static"].workload]
    assert both.table["policy"].tolist() == ["static", "static"]


def test_result_compare_method_equals_compare(windows):
    _, run, spot = windows
    method = run["static"].compare(run["elastic"], run["preemptive"], spot["static"])
    function = cluster.compare(run["static"], run["elastic"], run["preemptive"], spot["static"])
    assert isinstance(method, cluster.ClusterComparison) and method.results == function.results
    pd.testing.assert_frame_equal(method.ranking, function.ranking)
    pd.testing.assert_frame_equal(method.table, function.table)
    assert run["static"].compare().results == (run["static"],)
    html = method._repr_html_()
    assert "4 cluster simulations" in html and "mean_vs_best" in html and "best (mean JCT)" in html


def test_comparison_plots_jct_cdfs_and_usage(windows):
    _, run, spot = windows
    comp = cluster.compare(*run.values(), *spot.values())
    ax = comp.plot()
    assert len(ax.figure.axes) == 2 and ax.get_xscale() == "log"
    assert [line.get_label() for line in ax.get_lines()] == list(POLICIES)  # one CDF per policy of the first window
    usage = ax.figure.axes[1]
    labels = [line.get_label() for line in usage.get_lines()]
    assert labels == ["capacity", *POLICIES] and max(usage.get_lines()[0].get_ydata()) == 16
    ax = comp.plot(workload=spot["static"].workload)
    assert min(ax.figure.axes[1].get_lines()[0].get_ydata()) == 8  # the dip of the spot capacity
    with pytest.raises(ValueError, match="workload='nope' is not known"):
        comp.plot(workload="nope")
    _, mine = plt.subplots()
    assert comp.plot(ax=mine) is mine and len(mine.get_lines()) == 6  # every result on a given Axes
    assert mine.get_lines()[3].get_label() == f"static ({spot['static'].workload})"
    used = comp.plot_usage(unit="min")
    assert len(used.get_lines()) == 4 and used.get_xlabel() == "time (min)"
    _, mine = plt.subplots()
    assert comp.plot_usage(ax=mine, workload=spot["static"].workload) is mine
    plt.close("all")
