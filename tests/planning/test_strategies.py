"""The planner's grow and shrink strategies: a job whose GPUs come and go changes configuration once, paying the
move."""

import math

import pytest

from pipeswift_lab import Profile
from pipeswift_lab.core.costs import AssemblyModel, Availability, CheckpointModel
from pipeswift_lab.planning.planner import plan
from pipeswift_lab.planning.strategies import first_drop


def model_profile(layers=8):
    return Profile.synthetic(
        fwd_ms=[1.0] * layers,
        bwd_ms=[2.0] * layers,
        param_bytes=[1e8] * layers,
        activation_bytes=[1e6] * layers,
        output_bytes=[1e5] * layers,
        meta={"batch_size": 1, "device": "cuda"},
    )


KW = dict(gpus=8, global_batch=64, schedules=["1F1B"], progress=False)


def test_a_falling_availability_is_no_longer_ignored():
    drop = [(0, 8), (3600, 4)]
    result = plan(model_profile(), steps=2_000_000, availability=drop, **KW)
    table = result.table
    on_8 = table[
        (table["strategy"] == "start") & (table["gpus"] > 4) & table["reason"].str.contains("drops to 4", na=False)
    ]
    assert len(on_8) and not on_8["feasible"].any()  # they cannot keep 8 GPUs past the first hour
    shrinks = result.feasible[result.feasible["strategy"].str.startswith("shrink at 1.00 h")]
    assert len(shrinks) and (shrinks["gpus"] <= 4).all()
    stays = result.feasible[(result.feasible["strategy"] == "start") & (result.feasible["gpus"] <= 4)]
    # an hour on 8 GPUs, then 4: faster than 4 all along when the move is cheap next to an hour of training
    assert shrinks["total_s"].min() < stays["total_s"].min()
    assert result.best.strategy.startswith("shrink")
    best = shrinks.loc[shrinks["total_s"].idxmin()]
    assert best["total_s"] == pytest.approx(
        sum(best[t] for t in ("queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"))
    )


def test_a_short_job_that_ends_before_the_drop_keeps_its_gpus():
    result = plan(model_profile(), steps=2_000, availability=[(0, 8), (36_000, 4)], **KW)
    assert result.best.strategy == "start" and result.best.gpus == 8
    assert not result.feasible["strategy"].str.startswith("shrink").any()


def test_an_expensive_move_makes_shrinking_lose():
    costly = AssemblyModel(base_s=50_000.0, per_stage_s=0.0)
    result = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], assembly=costly, **KW)
    assert not result.best.strategy.startswith("shrink")


def test_measured_moves_feed_the_shrink_rows():
    slow_disk = CheckpointModel(write_GBps=0.01, read_GBps=0.01, teardown_s=1.0)
    fast = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], **KW)
    slow = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], checkpoint=slow_disk, **KW)

    def shrink_assembly_s(result):
        return result.feasible[result.feasible["strategy"].str.startswith("shrink")]["assembly_s"].min()

    assert shrink_assembly_s(slow) > shrink_assembly_s(fast)


def test_first_drop():
    availability = Availability([(0, 8), (100, 4), (200, 8)])
    assert first_drop(availability, 8, 0, 50) is None
    assert first_drop(availability, 8, 0, 150) == (100, 4)
    assert first_drop(availability, 4, 0, math.inf) is None
