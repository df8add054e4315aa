"""Each policy's decisions on small hand-built traces, and custom policies."""

import numpy as np
import pandas as pd
import pytest
from cluster_tables import by_name, jobs

from pipeswift_lab import cluster
from pipeswift_lab.cluster.registry import get_policy
from pipeswift_lab.cluster.simulator import _library_model


def test_static_backfills_short_jobs_without_delaying_the_head():
    # 4 GPUs: A holds 2 for 10,000 s; B wants 4 (blocked until A ends); C (2 GPUs, short) fits before then
    t = jobs((0, 2, 10_000.0), (10, 4, 1000.0), (20, 2, 100.0), (30, 2, 20_000.0), name=["A", "B", "C", "D"])
    r = by_name(cluster.simulate(t, 4, progress=False))
    assert r.loc["C", "start_s"] == 20  # backfilled
    assert r.loc["B", "start_s"] == pytest.approx(r.loc["A", "end_s"])  # the head's reservation holds
    assert r.loc["D", "start_s"] >= r.loc["B", "end_s"]  # D would have delayed B: not backfilled


def test_elastic_starts_on_fewer_gpus_when_waiting_is_longer():
    t = jobs((0, 2, 50_000.0), (10, 4, 2000.0), name=["A", "B"])
    static = by_name(cluster.simulate(t, 4, progress=False))
    elastic = by_name(cluster.simulate(t, 4, policy="elastic", progress=False))
    assert static.loc["B", "queue_s"] > 40_000
    assert elastic.loc["B", "start_s"] == 10 and elastic.loc["B", "min_gpus_held"] == 2
    assert elastic.loc["B", "training_s"] > 2000.0  # slower on half the GPUs ...
    assert elastic.loc["B", "jct_s"] < static.loc["B", "jct_s"]  # ... but done far sooner


def test_elastic_waits_when_the_full_allocation_frees_up_soon():
    t = jobs((0, 2, 100.0), (10, 4, 50_000.0), name=["A", "B"])
    elastic = by_name(cluster.simulate(t, 4, policy="elastic", progress=False))
    assert elastic.loc["B", "start_s"] == pytest.approx(elastic.loc["A", "end_s"])
    assert elastic.loc["B", "min_gpus_held"] == 4


def test_elastic_grows_onto_idle_gpus_and_gives_them_back():
    t = jobs((0, 1, 20_000.0), (5000, 1, 1000.0), name=["A", "B"])
    static = by_name(cluster.simulate(t, 2, progress=False))
    r = by_name(cluster.simulate(t, 2, policy="elastic", progress=False))
    assert r.loc["A", "max_gpus_held"] == 2  # nobody waits: A takes twice its request
    # shrunk back to 1 when B arrived, grown to 2 again when B was done
    assert r.loc["A", "min_gpus_held"] == 1 and r.loc["A", "resizes"] == 2 and r.loc["A", "preemptions"] == 0
    assert r.loc["B", "start_s"] == 5000  # B did not wait for A to finish
    assert r.loc["A", "jct_s"] < static.loc["A", "jct_s"]
    model = _library_model("gpt-small")
    # each move paid a checkpoint on the old GPUs, a re-assembly and a restore on the new ones
    assert r.loc["A", "preemption_loss_s"] == pytest.approx(
        model.save_s[2] + model.restore_s[1] + model.save_s[1] + model.restore_s[2]
    )
    assert r.loc["A", "assembly_s"] == pytest.approx(2 * model.assembly_s[2] + model.assembly_s[1])
    assert r.loc["A", "training_s"] < 20_000.0 and r.loc["A", "lost_work_s"] == 0


def test_elastic_does_not_grow_when_the_move_costs_more_than_it_saves():
    t = jobs((0, 1, 10.0), (0, 1, 10.0), name=["A", "B"])
    r = by_name(cluster.simulate(t, 4, policy="elastic", progress=False))
    assert r["resizes"].sum() == 0


def test_elastic_respects_min_and_max_gpus_columns():
    t = jobs(
        (0, 2, 1000.0),
        (0, 4, 1000.0),
        (0, 1, 1000.0),
        name=["above", "below", "free"],
        min_gpus=[3, 1, 1],
        max_gpus=[3, 2, 1],
    )
    r = by_name(cluster.simulate(t, 8, policy="elastic", progress=False))
    assert (
        r.loc["above", "min_gpus_held"] == r.loc["above", "max_gpus_held"] == 3
    )  # never below min_gpus, even above its request
    assert r.loc["below", "max_gpus_held"] == 2  # never above max_gpus
    assert r.loc["free", "max_gpus_held"] == 1


def test_preemptive_with_priorities_preempts_lower_ones():
    t = jobs((0, 4, 10_000.0), (100, 2, 500.0), priority=[0, 5], name=["low", "high"])
    r = by_name(cluster.simulate(t, 4, policy="preemptive", checkpoint_every_s=60.0, progress=False))
    assert r.loc["high", "start_s"] == 100 and r.loc["high", "queue_s"] == 0
    assert r.loc["low", "preemptions"] == 1 and r.loc["low", "lost_work_s"] > 0
    assert r.loc["low", "start_s"] == 0 and r.loc["low", "end_s"] > r.loc["high", "end_s"]
    assert r.loc["high", "priority"] == 5


def test_preemptive_without_priorities_is_tiresias_las():
    # "old" has held more than threshold GPU-seconds when "new" arrives: it is demoted and preempted
    policy = cluster.Preemptive(threshold_gpu_s=1000.0)
    t = jobs((0, 2, 20_000.0), (3000, 2, 100.0), name=["old", "new"])
    r = by_name(cluster.simulate(t, 2, policy=policy, progress=False))
    assert r.loc["new", "queue_s"] == 0 and r.loc["old", "preemptions"] == 1
    assert r.loc["old", "priority"] == 0 and r.loc["new", "priority"] == 1
    # before the threshold, the newcomer waits
    r = by_name(
        cluster.simulate(t.assign(submit_s=[0, 100]), 2, policy=cluster.Preemptive(threshold_gpu_s=1e6), progress=False)
    )
    assert r.loc["old", "preemptions"] == 0 and r.loc["new", "queue_s"] > 0


def test_custom_policy_from_the_docs():
    class ShortestFirst(cluster.Static):
        name = "shortest-first"

        def queue_key(self, job):
            return (job.gpus * job.work, job.idx)

    t = jobs((0, 1, 1000.0), (1, 1, 900.0), (2, 1, 10.0), (3, 1, 300.0), name=list("ABCD"))
    fifo = by_name(cluster.simulate(t, 1, progress=False))
    sjf = by_name(cluster.simulate(t, 1, policy=ShortestFirst(), progress=False))
    assert fifo.sort_values("start_s").index.tolist() == list("ABCD")
    assert sjf.sort_values("start_s").index.tolist() == list("ACDB")
    assert sjf["jct_s"].mean() < fifo["jct_s"].mean()


class RandomOrder(cluster.Static):
    """A policy that draws: the queue order is random, from the simulation's seeded generator."""

    name = "random"

    def reset(self, c):
        self.rng = c.rng

    def queue_key(self, job):
        return (float(self.rng.random()), job.idx)


def test_seed_drives_a_random_policy():
    t = jobs(*[(0, 1, 100.0 + i) for i in range(8)])
    a = cluster.simulate(t, 1, policy=RandomOrder(), seed=1, progress=False).jobs
    b = cluster.simulate(t, 1, policy=RandomOrder(), seed=1, progress=False).jobs
    c = cluster.simulate(t, 1, policy=RandomOrder(), seed=2, progress=False).jobs
    pd.testing.assert_frame_equal(a, b)
    assert not np.array_equal(a["start_s"], c["start_s"])


def test_policy_lookup_and_bad_arguments():
    assert isinstance(get_policy("Elastic"), cluster.Elastic)
    assert isinstance(get_policy(cluster.Static), cluster.Static)
    with pytest.raises(ValueError, match="policy='fastest' is not known"):
        get_policy("fastest")
    with pytest.raises(ValueError, match="gain_factor=0.5 is invalid"):
        cluster.Elastic(gain_factor=0.5)
    with pytest.raises(ValueError, match="threshold_gpu_s=-1.0 is invalid; it must be > 0"):
        cluster.Preemptive(threshold_gpu_s=-1)
