"""The joint-objective policy (policy="jct"): making room, costs from measurements, growing, and its inputs."""

import pandas as pd
import pytest
from cluster_tables import by_name, jobs

from pipeswift_lab import cluster
from pipeswift_lab.cluster.simulator import _library_model
from pipeswift_lab.core.costs import AssemblyModel, CheckpointModel


def simulate(table, gpus, policy="jct", **kwargs):
    return by_name(cluster.simulate(table, gpus, policy=policy, progress=False, **kwargs))


def test_shrinks_a_running_job_to_admit_a_queued_one_when_the_sum_drops():
    # A holds all 4 GPUs for ~28 h; B (2 GPUs, 1,000 s) would wait for all of it. Shrinking A to 2 GPUs costs A
    # its slower remaining run plus a move; B's wait saved is far larger.
    t = jobs((0, 4, 100_000.0), (1000, 2, 1000.0), name=["A", "B"])
    static = simulate(t, 4, policy="static")
    jct = simulate(t, 4)
    assert static.loc["B", "start_s"] == pytest.approx(static.loc["A", "end_s"])
    assert jct.loc["B", "start_s"] == 1000 and jct.loc["B", "queue_s"] == 0
    assert jct.loc["A", "min_gpus_held"] == 2 and jct.loc["A", "resizes"] >= 1 and jct.loc["A", "lost_work_s"] == 0
    assert jct["jct_s"].sum() < static["jct_s"].sum()


def test_suspends_a_long_job_for_a_short_one_and_loses_no_training():
    t = jobs((0, 1, 50_000.0), (1000, 1, 100.0), name=["long", "short"])
    r = simulate(t, 1)
    model = _library_model("gpt-small")
    assert r.loc["short", "start_s"] == 1000
    assert r.loc["long", "suspensions"] == 1 and r.loc["long", "preemptions"] == 0 and r.loc["long", "lost_work_s"] == 0
    # the suspension's save and the restore are charged to the long job when it restarts
    assert r.loc["long", "preemption_loss_s"] == pytest.approx(model.save_s[1] + model.restore_s[1])
    assert r.loc["long", "start_s"] == 0 and r.loc["long", "training_s"] == pytest.approx(50_000.0)


def test_does_not_move_a_job_when_the_saving_is_below_the_measured_cost():
    # "long" ends ~4,000 s after "short" arrives. With the default assembly (~1 min) suspending it pays; with an
    # assembly measured at 75 minutes the move costs more than the short job's wait, so it waits.
    t = jobs((0, 1, 5000.0), (1000, 1, 100.0), name=["long", "short"])
    cheap = simulate(t, 1)
    assert cheap.loc["short", "start_s"] == 1000 and cheap.loc["long", "suspensions"] == 1
    measured = AssemblyModel.calibrate([(1, 4500.0), (1, 4500.0)])
    slow = simulate(t, 1, costs=measured)
    assert slow["restarts"].sum() == 0
    assert slow.loc["short", "start_s"] == pytest.approx(slow.loc["long", "end_s"])
    assert slow.loc["long", "assembly_s"] == pytest.approx(measured.seconds(1, 1)) == 4500.0


def test_grows_onto_idle_gpus_and_gives_the_loan_back():
    t = jobs((0, 1, 20_000.0), (5000, 1, 1000.0), name=["A", "B"])
    r = simulate(t, 2)
    assert r.loc["A", "max_gpus_held"] == 2 and r.loc["A", "min_gpus_held"] == 1
    assert r.loc["B", "start_s"] == 5000 and r.loc["A", "lost_work_s"] == 0
    assert r.loc["A", "resizes"] >= 2  # grew to 2, gave one back for B (and grew again once B was done)


def test_never_moves_a_job_for_one_that_is_not_shorter():
    # B (1 GPU) asks for more GPU-time than A has left: A keeps its GPU under the mean objective
    t = jobs((0, 1, 3000.0), (100, 1, 50_000.0), name=["A", "B"])
    r = simulate(t, 1)
    assert r["restarts"].sum() == 0 and r.loc["B", "start_s"] == pytest.approx(r.loc["A", "end_s"])


def test_p95_objective_orders_by_virtual_finish_time():
    # X (long, early) and Y (short, late) queue behind a running job: SRPT runs Y first, the p95 objective X,
    # whose submission plus remaining run time comes first
    t = jobs((0, 1, 4000.0), (10, 1, 3000.0), (3000, 1, 2000.0), name=["run", "X", "Y"])
    mean = simulate(t, 1, policy=cluster.JointJCT("mean", margin=100.0))
    tail = simulate(t, 1, policy=cluster.JointJCT("p95", margin=100.0))
    assert mean.loc["Y", "start_s"] < mean.loc["X", "start_s"]
    assert tail.loc["X", "start_s"] < tail.loc["Y", "start_s"]
    assert cluster.JointJCT("p95").name == "jct-p95" and cluster.JointJCT().name == "jct"


def test_capacity_drop_preempts_the_lowest_priority_first():
    # "long" first: the base policy's tie-break (the later row first) would take "short"
    t = jobs((0, 1, 90_000.0), (0, 1, 1000.0), name=["long", "short"])
    r = simulate(t, [(0, 2), (100, 1), (200, 2)])
    assert r.loc["long", "preemptions"] == 1 and r.loc["short", "preemptions"] == 0


def test_named_policy_and_bad_arguments():
    assert isinstance(cluster.registry.get_policy("JCT"), cluster.JointJCT)
    with pytest.raises(ValueError, match="objective"):
        cluster.JointJCT(objective="p99")
    with pytest.raises(ValueError, match="margin"):
        cluster.JointJCT(margin=0.5)


def test_costs_from_calibrated_models_reach_every_job():
    checkpoint = CheckpointModel(write_GBps=0.1, read_GBps=0.05, teardown_s=1.0)
    t = jobs((0, 1, 1000.0), name=["A"])
    r = simulate(t, 1, costs={"checkpoint": checkpoint, "assembly": AssemblyModel(base_s=5.0)})
    model = _library_model("gpt-small", AssemblyModel(base_s=5.0), checkpoint)
    assert r.loc["A", "assembly_s"] == pytest.approx(model.assembly_s[1]) and model.assembly_s[1] < 10
    assert r.loc["A", "cleanup_s"] == pytest.approx(model.cleanup_s[1])
    assert model.cleanup_s[1] == pytest.approx(checkpoint.cleanup_s(model._stage_of(1)[3]))
    both = simulate(t, 1, costs=[AssemblyModel(base_s=5.0), checkpoint])
    pd.testing.assert_frame_equal(both, r)


@pytest.mark.parametrize(
    ("costs", "error", "match"),
    [
        (30.0, TypeError, "costs is float 30.0"),
        ([AssemblyModel(), "fast"], TypeError, r"costs\[1\] is str"),
        ({"assembly": CheckpointModel()}, TypeError, r"costs\['assembly'\] is CheckpointModel"),
        ((AssemblyModel(), AssemblyModel()), ValueError, "two AssemblyModels"),
        ({"restore": CheckpointModel()}, ValueError, "unknown keys"),
    ],
)
def test_bad_costs_are_refused(costs, error, match):
    with pytest.raises(error, match=match):
        cluster.simulate(jobs((0, 1, 10.0)), 1, costs=costs, progress=False)


def test_workload_label_reaches_the_result():
    r = cluster.simulate(jobs((0, 1, 10.0)), 1, policy="jct", workload="tiny", progress=False)
    assert r.workload == "tiny" and r.label == "jct"
    with pytest.raises(TypeError, match="workload"):
        cluster.simulate(jobs((0, 1, 10.0)), 1, workload=3, progress=False)


def test_a_save_is_kept_when_its_segment_is_stopped_before_charging_it():
    # "long" is suspended for S1 (a slow save), restarts, and is suspended again for S2 during its restore: the first
    # save was written and must still be charged, on top of the second restart's restore
    checkpoint = CheckpointModel(write_GBps=0.01)
    t = jobs((0, 1, 50_000.0), (1000, 1, 100.0), name=["long", "S1"])
    model = _library_model("gpt-small", None, checkpoint)
    once = simulate(t, 1, costs=checkpoint)
    restart = once.loc["long", "end_s"] - once.loc["long", "jct_s"]  # submit; find when it restarted
    restarted_at = once.loc["S1", "end_s"]
    in_restore = restarted_at + model.assembly_s[1] + 5.0
    twice = simulate(
        jobs((0, 1, 50_000.0), (1000, 1, 100.0), (in_restore, 1, 100.0), name=["long", "S1", "S2"]), 1, costs=checkpoint
    )
    assert restart == 0 and twice.loc["long", "suspensions"] == 2
    assert twice.loc["S2", "start_s"] == pytest.approx(in_restore)
    save, restore = model.save_s[1], model.restore_s[1]
    # the first restore never ran (stopped 5 s in, inside the save it carried): one save and one restore in all
    assert twice.loc["long", "preemption_loss_s"] == pytest.approx(save + restore)
    assert once.loc["long", "preemption_loss_s"] == pytest.approx(save + restore)


def test_no_job_is_moved_twice_in_one_instant_and_plans_free_only_what_they_need():
    # two 1-GPU heads arrive at once on a cluster that A (4 GPUs, long) fills: A is moved once at that instant
    # (4 -> 3, for B), not again for C (which waits for B), and grows back to 4 at the end
    t = jobs((0, 4, 100_000.0), (1000, 1, 500.0), (1000, 1, 500.0), name=["A", "B", "C"])
    r = simulate(t, 4)
    assert r.loc["B", "start_s"] == 1000 and r.loc["C", "start_s"] == pytest.approx(r.loc["B", "end_s"])
    assert r.loc["A", "resizes"] == 2 and r.loc["A", "min_gpus_held"] == 3 and r.loc["A", "suspensions"] == 0
    # a 16-GPU head on 16 GPUs held by a long 16-GPU job and a shrinkable 4-GPU one: one suspension frees enough
    t = jobs(
        (0, 12, 200_000.0), (0, 4, 150_000.0), (100, 16, 1000.0), name=["big", "small", "head"], min_gpus=[6, 2, 16]
    )
    r = simulate(t, 16)
    assert r.loc["head", "start_s"] == 100
    assert r.loc["big", "suspensions"] + r.loc["small", "suspensions"] == 2  # both must go: 16 GPUs are needed
    assert r.loc["big", "min_gpus_held"] == 12 and r.loc["small", "min_gpus_held"] == 4  # no needless shrink first


def test_costs_accept_subclasses_of_the_models():
    class Measured(AssemblyModel):
        pass

    r = simulate(jobs((0, 1, 100.0), name=["A"]), 1, costs=Measured(base_s=1.0))
    assert r.loc["A", "assembly_s"] == pytest.approx(Measured(base_s=1.0).seconds(1, 1))


def test_orders_by_the_declared_length_when_one_is_given():
    # X is truly short but declares itself long: SRPT on the declarations runs Y first
    t = jobs((0, 1, 4000.0), (10, 1, 500.0), (20, 1, 3000.0), name=["run", "X", "Y"])
    truth = simulate(t, 1, policy=cluster.JointJCT(margin=100.0))
    fooled = simulate(t.assign(declared_s=[4000.0, 50_000.0, 3000.0]), 1, policy=cluster.JointJCT(margin=100.0))
    assert truth.loc["X", "start_s"] < truth.loc["Y", "start_s"]
    assert fooled.loc["Y", "start_s"] < fooled.loc["X", "start_s"]
    assert fooled.loc["X", "training_s"] == pytest.approx(truth.loc["X", "training_s"])  # the truth still runs
    with pytest.raises(ValueError, match="declared_s"):
        cluster.simulate(t.assign(declared_s=[1.0, 0.0, 1.0]), 1, progress=False)
