"""The p95 job: the Monte Carlo tail of the planner, against closed forms, and a ranking that flips."""

import numpy as np
import pandas as pd
import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.costs import CheckpointModel, preemption_loss_s
from pipeswift_lab.planning.quantiles import check_quantile, failure_wall_s, jct_quantile, quantile_column


def test_without_failures_the_quantile_is_the_normal_one():
    rows = pd.DataFrame(
        {"queue_s": [100.0], "assembly_s": [20.0], "cleanup_s": [5.0], "training_s": [1000.0], "gpus": [4]}
    )
    q = jct_quantile(rows, 0.95, step_cv=0.1, samples=20_000)
    # persistent dispersion: the p95 job trains 1 + 1.645 * cv times as long
    assert q.iloc[0] == pytest.approx(125 + 1000 * (1 + 1.6449 * 0.1), rel=0.01)
    assert jct_quantile(rows, 0.95, step_cv=0.0).iloc[0] == pytest.approx(1125.0)
    assert (
        jct_quantile(rows, 0.95, step_cv=0.1, samples=500).iloc[0]
        == jct_quantile(rows, 0.95, step_cv=0.1, samples=500).iloc[0]
    )  # fixed seed


def test_failure_monte_carlo_mean_matches_the_closed_form():
    rng = np.random.default_rng(1)
    work, save, restart, mtbf = 50_000.0, 30.0, 120.0, 5_000.0
    wall = failure_wall_s(np.full(20_000, work), save, restart, mtbf, rng)
    expected = work + preemption_loss_s(work, save, restart, mtbf)
    # the closed form redoes half an interval per failure and solves wall as a fixed point: a few percent apart
    assert wall.mean() == pytest.approx(expected, rel=0.05)
    assert np.quantile(wall, 0.95) > wall.mean() > work
    # free checkpoints lose only the restarts
    free = failure_wall_s(np.full(5_000, work), 0.0, restart, mtbf, np.random.default_rng(2))
    assert free.mean() == pytest.approx(work / (1 - restart / mtbf), rel=0.03)


def test_failure_monte_carlo_at_a_given_interval_and_the_asynchronous_stall():
    work, restart, mtbf = 50_000.0, 120.0, 5_000.0
    stall, interval = 2.0, 600.0  # an asynchronous save: a short stall, but no closer than its write
    wall = failure_wall_s(np.full(20_000, work), stall, restart, mtbf, np.random.default_rng(1), interval_s=interval)
    expected = work + preemption_loss_s(work, stall, restart, mtbf, interval_s=interval)
    assert wall.mean() == pytest.approx(expected, rel=0.05)
    rows = pd.DataFrame(
        {
            "queue_s": [0.0],
            "assembly_s": [60.0],
            "cleanup_s": [10.0],
            "training_s": [work],
            "gpus": [1],
            "_shard_bytes": [30e9],
        }
    )
    q_async = jct_quantile(rows, 0.95, mtbf_s=mtbf, checkpoint=CheckpointModel()).iloc[0]
    q_sync = jct_quantile(rows, 0.95, mtbf_s=mtbf, checkpoint=CheckpointModel(asynchronous=False)).iloc[0]
    assert q_async < q_sync  # each checkpoint stalls 7.5 s of staging instead of the 30 s write
    with pytest.raises(ValueError, match="interval_s=0.0 is invalid"):
        failure_wall_s(np.full(3, work), stall, restart, mtbf, np.random.default_rng(1), interval_s=0.0)


def test_bad_quantile_arguments():
    assert check_quantile("mean") == (None, "total_s")
    assert check_quantile("p95") == (0.95, "total_s_p95")
    assert check_quantile("p99.5") == (0.995, "total_s_p99.5")
    assert quantile_column(0.995) == "total_s_p99.5"
    with pytest.raises(ValueError, match="objective='fastest' is not known; valid values are \\['mean', 'p50'"):
        check_quantile("fastest")
    with pytest.raises(ValueError, match="objective='p100' is not known"):
        check_quantile("p100")
    prof = psl.Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, meta={"batch_size": 1})
    with pytest.raises(TypeError, match=r'quantile= is now objective="p95"'):
        psl.plan(prof, 4, 8, 10, quantile=0.95)


def test_p95_ranking_differs_from_the_mean_ranking():
    """Growing from 2 GPUs now to 8 in ten minutes has the shortest expected JCT; waiting ten minutes for 8 the
    shortest p95.

    Growing swaps 600 s of certain queue for about 400 s more training (the first ten minutes
    run on 2 GPUs). The queue is the same in every outcome, but the training term's spread
    grows with its length, so at p95 the longer training costs more than the queue it saves.
    """
    prof = psl.Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8, meta={"batch_size": 1})
    kwargs = dict(
        gpus=8,
        global_batch=64,
        steps=20_000,
        availability=[(0, 2), (600, 8)],
        schedules=["1F1B"],
        microbatch_sizes=[1],
        step_cv=0.3,
        progress=False,
    )
    by_p95 = psl.plan(prof, objective="p95", **kwargs)
    by_mean = by_p95.ranked_by("total_s")
    assert by_mean.feasible["ranked_by"].eq("total_s").all() and by_mean.feasible["rank"].tolist() == list(
        range(1, len(by_mean.feasible) + 1)
    )
    assert (
        "total_s_p95" in by_mean.table.columns
        and by_mean.table.columns.get_loc("total_s_p95") == by_mean.table.columns.get_loc("total_s") + 1
    )
    grow, wait = by_mean.best, by_p95.best
    assert grow.strategy == "grow" and wait.strategy == "wait" and wait.queue_s == 600
    rows = by_mean.feasible.set_index(by_mean.feasible.apply(lambda r: (r["strategy"], r["P"], r["D"], r["m"]), axis=1))
    g, w = (
        rows.loc[[(grow.strategy, grow.P, grow.D, grow.m)]].iloc[0],
        rows.loc[[("wait", wait.P, wait.D, wait.m)]].iloc[0],
    )
    assert g["total_s"] < w["total_s"] and g["total_s_p95"] > w["total_s_p95"]
    assert g["training_s"] > w["training_s"]  # the reason: more training time, a wider tail
    assert (by_p95.feasible["total_s_p95"].diff().dropna() >= 0).all()  # ranked by it
    # without dispersion (and no failures) the quantile is the mean and both rankings agree
    flat = psl.plan(prof, objective="p95", **{**kwargs, "step_cv": 0.0})
    assert flat.best.label == grow.label and (flat.feasible["total_s_p95"] == flat.feasible["total_s"]).all()
