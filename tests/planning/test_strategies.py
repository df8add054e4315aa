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
        (table["strategy"] == "now") & (table["gpus"] > 4) & table["reason"].str.contains("drops to 4", na=False)
    ]
    assert len(on_8) and not on_8["feasible"].any()  # they cannot keep 8 GPUs past the first hour
    shrinks = result.strategy_rows("shrink")
    assert len(shrinks) and (shrinks["gpus"] <= 4).all() and shrinks["change"].str.startswith("at 1.00 h from P").all()
    stays = result.strategy_rows("now", "wait")
    assert (stays["gpus"] <= 4).all() and (stays["strategy"] == "now").all()  # 4 are free from now to the end
    # an hour on 8 GPUs, then 4: faster than 4 all along when the move is cheap next to an hour of training
    assert shrinks["total_s"].min() < stays["total_s"].min()
    assert result.best.strategy == "shrink" and result.best.label.startswith("shrink at 1.00 h from P")
    best = shrinks.loc[shrinks["total_s"].idxmin()]
    assert best["total_s"] == pytest.approx(
        sum(best[t] for t in ("queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"))
    )


def test_a_short_job_that_ends_before_the_drop_keeps_its_gpus():
    result = plan(model_profile(), steps=2_000, availability=[(0, 8), (36_000, 4)], **KW)
    assert result.best.strategy == "now" and result.best.gpus == 8 and result.best.change == ""
    assert result.strategy_rows("shrink").empty


def test_an_expensive_move_makes_shrinking_lose():
    costly = AssemblyModel(base_s=50_000.0, per_stage_s=0.0)
    result = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], costs=costly, **KW)
    assert result.best.strategy != "shrink"


def test_measured_moves_feed_the_shrink_rows():
    slow_disk = CheckpointModel(write_GBps=0.01, read_GBps=0.01, teardown_s=1.0)
    fast = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], **KW)
    slow = plan(model_profile(), steps=2_000_000, availability=[(0, 8), (3600, 4)], costs=slow_disk, **KW)

    def shrink_assembly_s(result):
        return result.strategy_rows("shrink")["assembly_s"].min()

    assert shrink_assembly_s(slow) > shrink_assembly_s(fast)


def test_first_drop():
    availability = Availability([(0, 8), (100, 4), (200, 8)])
    assert first_drop(availability, 8, 0, 50) is None
    assert first_drop(availability, 8, 0, 150) == (100, 4)
    assert first_drop(availability, 4, 0, math.inf) is None


def test_strategies_are_named_by_what_they_do_and_the_old_name_says_what_it_became():
    from pipeswift_lab.planning.result import PlannedConfig
    from pipeswift_lab.planning.strategies import STRATEGIES

    result = plan(model_profile(), steps=2_000_000, availability=[(0, 2), (3600, 8), (7200, 4)], **KW)
    table = result.table
    assert set(table["strategy"]) <= set(STRATEGIES) and set(result.feasible["strategy"]) == set(STRATEGIES)
    holding = table[table["strategy"].isin(["now", "wait"]) & table["queue_s"].notna()]  # the queue is known
    assert ((holding["strategy"] == "wait") == (holding["queue_s"] > 0)).all() and (holding["change"] == "").all()
    moves = result.strategy_rows("grow", "shrink")
    assert moves["change"].str.match(r"at \d").all()  # when, and from which configuration
    assert len(result.strategy_rows()) == len(result.feasible)
    with pytest.raises(ValueError, match='"start" was split into "now".*"wait"'):
        result.strategy_rows("start")
    with pytest.raises(ValueError, match="unknown strategy 'start'"):
        PlannedConfig.from_row(result.feasible.iloc[0].copy().replace(result.best.strategy, "start"))
