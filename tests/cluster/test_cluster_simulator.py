"""The event core and simulate(): JCT accounting by hand, invariants on a real trace window, determinism."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from cluster_tables import jobs

from pipeswift_lab import cluster
from pipeswift_lab.cluster.simulator import _library_model
from pipeswift_lab.core.jct import TERMS
from pipeswift_lab.data import philly_jobs

SMALL = _library_model("gpt-small")  # the profile a 1-GPU job gets


def check_invariants(result):
    j = result.jobs
    done = j[j["finished"]]
    assert np.allclose(done["jct_s"], done["end_s"] - done["submit_s"], rtol=0, atol=1e-6)
    assert np.allclose(done[list(TERMS)].sum(axis=1), done["jct_s"], rtol=1e-12, atol=1e-6)
    assert (done[list(TERMS)] >= -1e-9).all().all()
    assert (j.loc[~j["finished"], "reason"].str.len() > 0).all()
    assert (j.loc[j["finished"], "reason"] == "").all()
    u = result.usage
    assert (u["gpus_used"] <= u["capacity"]).all() and (u["gpus_used"] >= 0).all()
    assert (j["restarts"] == j["resizes"] + j["preemptions"] + j["suspensions"]).all()


def test_one_job_by_hand():
    r = cluster.simulate(jobs((100.0, 1, 1000.0)), 4, progress=False)
    row = r.jobs.iloc[0]
    assert row["start_s"] == 100.0 and row["queue_s"] == 0.0
    assert row["assembly_s"] == SMALL.assembly_s[1] == 62.25  # AssemblyModel: 60 + 2·P + 0.25·P·D
    assert row["training_s"] == 1000.0
    assert row["cleanup_s"] == SMALL.cleanup_s[1]
    assert row["jct_s"] == pytest.approx(62.25 + 1000.0 + SMALL.cleanup_s[1])
    assert row["end_s"] == pytest.approx(100.0 + row["jct_s"])
    check_invariants(r)


def test_fifo_queue_by_hand():
    r = cluster.simulate(jobs((0.0, 1, 1000.0), (10.0, 1, 500.0)), 1, progress=False)
    a, b = r.jobs.iloc[0], r.jobs.iloc[1]
    assert b["start_s"] == pytest.approx(a["end_s"])
    assert b["queue_s"] == pytest.approx(a["end_s"] - 10.0)
    check_invariants(r)
    assert r.summary["utilization"] == pytest.approx(1.0)


def test_capacity_drop_loses_work_since_the_last_checkpoint():
    every = 100.0
    r = cluster.simulate(jobs((0.0, 1, 1000.0)), [(0, 1), (500, 0), (600, 1)], checkpoint_every_s=every, progress=False)
    row = r.jobs.iloc[0]
    stall, restore = SMALL.stall_s[1], SMALL.restore_s[1]  # a periodic checkpoint stalls for its staging copy
    assert 0 < stall < SMALL.save_s[1]  # asynchronous saves by default: less than the whole write
    x = 500.0 - SMALL.assembly_s[1]  # training phase elapsed when the GPU vanished
    cycles = int(x // (every + stall))
    lost = x - cycles * (every + stall)
    assert row["preemptions"] == 1 and row["restarts"] == 1
    assert row["lost_work_s"] == pytest.approx(lost)
    assert row["training_s"] == pytest.approx(1000.0)  # the kept 400 s plus the 600 s redone after the restart
    assert row["queue_s"] == pytest.approx(100.0)
    assert row["assembly_s"] == pytest.approx(2 * SMALL.assembly_s[1])
    later = math.ceil((1000.0 - cycles * every) / every) - 1
    assert row["preemption_loss_s"] == pytest.approx(cycles * stall + lost + restore + later * stall)
    check_invariants(r)


def test_without_checkpoints_a_preempted_job_starts_over():
    r = cluster.simulate(jobs((0.0, 1, 1000.0)), [(0, 1), (500, 0), (600, 1)], progress=False)
    row = r.jobs.iloc[0]
    assert row["lost_work_s"] == pytest.approx(500.0 - SMALL.assembly_s[1])
    assert row["training_s"] == pytest.approx(1000.0)
    check_invariants(r)


def test_jobs_that_can_never_run_are_reported_and_counted():
    with pytest.warns(UserWarning, match="1 of 2 jobs did not finish"):
        r = cluster.simulate(jobs((0.0, 8, 100.0), (0.0, 2, 100.0)), [(0, 4), (50, 2)], progress=False)
    big = r.jobs.iloc[0]
    assert not big["finished"] and "asks for at least 8 GPUs" in big["reason"] and "never exceeds 4" in big["reason"]
    assert r.summary["unfinished"] == 1 and r.jobs.iloc[1]["finished"]
    check_invariants(r)


def test_jobs_left_waiting_when_capacity_ends_low_are_reported():
    with pytest.warns(UserWarning, match="still queued"):
        r = cluster.simulate(jobs((0.0, 1, 1000.0), (100.0, 4, 100.0)), [(0, 1), (50, 4), (60, 1)], progress=False)
    assert r.jobs["finished"].tolist() == [True, False]
    assert "needs 4 GPUs" in r.jobs.iloc[1]["reason"]
    check_invariants(r)


@pytest.fixture(scope="module")
def window():
    return philly_jobs(window=(21 * 86400, 22 * 86400))


@pytest.mark.parametrize("policy", ["static", "elastic", "preemptive", "jct"])
@pytest.mark.parametrize("every", [None, 1800.0])
def test_invariants_on_a_trace_window_with_varying_capacity(window, policy, every):
    capacity = [(0, 64), (21.3 * 86400, 16), (21.5 * 86400, 128), (21.8 * 86400, 40), (22.5 * 86400, 128)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jobs over 128 GPUs are reported, checked below
        r = cluster.simulate(window, capacity, policy=policy, checkpoint_every_s=every, progress=False)
    check_invariants(r)
    assert len(r.jobs) == len(window)
    assert r.jobs["finished"].sum() + (r.jobs["reason"] != "").sum() == len(window)
    assert r.jobs["preemptions"].sum() > 0  # the drops to 16 and 40 GPUs preempt running jobs


@pytest.mark.parametrize("policy", ["static", "elastic", "preemptive", "jct"])
def test_same_seed_same_result(window, policy):
    a = cluster.simulate(window, 64, policy=policy, seed=3, progress=False)
    b = cluster.simulate(window, 64, policy=policy, seed=3, progress=False)
    pd.testing.assert_frame_equal(a.jobs, b.jobs)
    pd.testing.assert_frame_equal(a.usage, b.usage)


def test_progress_bar_respects_flags(window, capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    cluster.simulate(window, 64, progress=False)
    assert "cluster static" not in capsys.readouterr().err
    cluster.simulate(window, 64, progress=True)
    assert "cluster static" in capsys.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    cluster.simulate(window, 64, progress=True)
    assert "cluster static" not in capsys.readouterr().err
