"""plan(..., recompute="full" | "selective"): every stage of every configuration recomputes so, whether memory binds
or not, from the profile's recompute columns; the table and run_arguments() say so."""

import pytest

from pipeswift_lab import Link, Profile, Topology, plan
from pipeswift_lab.planning.inputs import check_plan_inputs
from pipeswift_lab.planning.planner import evaluator_of
from pipeswift_lab.planning.recompute_search import FORCED_MODES, forced_costs, forced_label
from pipeswift_lab.planning.sharding import tp_table

GB = 1e9
KW = dict(global_batch=8, steps=1000, schedules=["1F1B"], microbatch_sizes=[1], progress=False, exhaustive=True)


def recomputable(layers=8, tp=False):
    """Equal layers of 1 ms forward, 2 ms backward (0.5 of it weight gradients), 1 GB held per micro-batch:
    selective recomputation keeps half for 0.3 ms more, full keeps 5% for 1 ms more."""
    columns = dict(
        params=[2.5e7] * layers,
        param_bytes=[1e8] * layers,
        activation_bytes=[1e9] * layers,
        output_bytes=[1e6] * layers,
        wgrad_ms=[0.5] * layers,
        recompute_ms=[1.0] * layers,
        selective_recompute_ms=[0.3] * layers,
        full_activation_bytes=[5e7] * layers,
        selective_activation_bytes=[5e8] * layers,
        full_transient_bytes=[0.0] * layers,
        selective_transient_bytes=[0.0] * layers,
    )
    meta = {"batch_size": 1, "device": "cuda"}
    if tp:
        columns |= dict(
            tp_param_bytes=[9e7] * layers,
            tp_activation_bytes=[8e8] * layers,
            tp_flop_fraction=[0.9] * layers,
            tp_forward_bytes=[1e7] * layers,
            tp_backward_bytes=[1e7] * layers,
        )
        meta["tp_divides"] = [8]
    return Profile.synthetic(fwd_ms=[1.0] * layers, bwd_ms=[2.0] * layers, meta=meta, **columns)


@pytest.mark.parametrize("mode", FORCED_MODES)
def test_every_stage_recomputes_and_the_plan_carries_it(mode):
    plain = plan(recomputable(), gpus=4, P=[4], **KW)
    forced = plan(recomputable(), gpus=4, P=[4], recompute=mode, **KW)
    best = forced.best
    assert best.recompute == forced_label(mode, 4) == f"0:{mode} 1:{mode} 2:{mode} 3:{mode}"
    assert best.recompute_by_stage() == {s: mode for s in range(4)}
    assert best.step_ms > plain.best.step_ms and best.peak_mem_bytes < plain.best.peak_mem_bytes
    assert forced.inputs["recompute"] == mode
    args = forced.run_arguments(0)
    assert args["recompute"] == {s: mode for s in range(4)}
    held = {"full": 5e7, "selective": 5e8}[mode]
    assert list(args["partition"].layers.activation_bytes) == [held] * 8


@pytest.mark.parametrize("mode", FORCED_MODES)
def test_forcing_is_planning_the_profile_recomputed(mode):
    """The step, the bubble and the peak are those of the profile costed recomputed (Profile.with_recompute)."""
    forced = plan(recomputable(), gpus=4, recompute=mode, **KW).table
    given = plan(recomputable().with_recompute(mode), gpus=4, **KW).table
    keys = ["P", "D", "m", "schedule", "v"]
    merged = forced.merge(given, on=keys, suffixes=("_forced", "_given"))
    assert len(merged) == len(forced) == len(given)
    for column in ("step_ms", "peak_mem_bytes", "bubble_ratio"):
        assert merged[f"{column}_forced"].tolist() == pytest.approx(merged[f"{column}_given"].tolist())


def test_a_forced_plan_needs_no_memory_cap_and_fits_where_none_does_otherwise():
    cap = 3.5 * GB  # the first of 4 ranks holds 4 micro-batches of a layer's 1 GB
    with pytest.raises(ValueError, match=r"no feasible configuration"):
        plan(recomputable(), gpus=4, P=[4], mem_per_gpu_bytes=cap, **KW)
    fits = plan(recomputable(), gpus=4, P=[4], mem_per_gpu_bytes=cap, recompute="full", **KW)
    assert fits.best.peak_mem_bytes <= cap and fits.best.recompute.endswith("3:full")


def test_recomputed_times_follow_the_micro_batch_size():
    costs = forced_costs(check_plan_inputs(recomputable(), gpus=4, global_batch=8, steps=1).costs, "full")
    one, two = costs.table(1), costs.table(2)
    assert (two["recomputed_ms"] == 2 * one["recomputed_ms"]).all() and (one["recomputed_ms"] == 1.0).all()
    assert (one["bwd_ms"] == 3.0).all() and (one["wgrad_ms"] == 1.5).all()
    assert forced_costs(costs, "full").tables[1].equals(costs.tables[1])  # forcing twice is forcing once


def test_tensor_parallelism_divides_before_the_recomputation_is_costed():
    """A tp rank recomputes its shard: the recomputed layer holds the tp rank's share of what full recomputation
    keeps, and its recomputation is divided and carries the forward's all-reduce, as recompute="search" costs it."""
    link = Link(latency_ms=0.001, bandwidth_GBps=400.0)
    inputs = check_plan_inputs(
        recomputable(tp=True), gpus=8, global_batch=8, steps=1, tp=[2], topology=Topology(8, link), recompute="full"
    )
    evaluator = evaluator_of(inputs)
    sharded = tp_table(inputs.costs.tables[1], 2, link)
    forced = evaluator.costs_at(2).table(1)
    assert forced["activation_bytes"].tolist() == pytest.approx(sharded["full_activation_bytes"].tolist())
    assert forced["bwd_ms"].tolist() == pytest.approx((sharded["bwd_ms"] + sharded["recompute_ms"]).tolist())
    result = plan(
        recomputable(tp=True), gpus=8, tp=[2], fsdp=[1], topology=Topology(8, link), recompute="selective", **KW
    )
    assert set(result.feasible["tp"]) == {2}
    assert all(set(label.split()) and label.endswith(":selective") for label in result.feasible["recompute"])


def test_bad_forcing_is_refused():
    with pytest.raises(ValueError, match=r"recompute='sometimes' is not 'search' .*'full' or 'selective'"):
        plan(recomputable(), gpus=4, recompute="sometimes", **KW)
    bare = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, meta={"device": "cuda", "batch_size": 1})
    with pytest.raises(ValueError, match=r"recompute='full' needs the recompute columns: profile the model"):
        plan(bare, gpus=2, recompute="full", **KW)
    with pytest.raises(ValueError, match=r"already costs its layers recomputed"):
        plan(recomputable().with_recompute("selective"), gpus=4, recompute="full", **KW)
