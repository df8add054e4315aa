"""The 3-D search of plan(): layouts P x D x fsdp x tp on a Topology, what they cost, and the bounds it prunes with."""

import math

import numpy as np
import pandas as pd
import pytest

from pipeswift_lab import TP, Link, Partition, Profile, Topology, plan
from pipeswift_lab.core.layout import state_bytes_per_rank
from pipeswift_lab.core.topology import (
    DEFAULT_INTRA_NODE_LINK,
    all_gather_ms,
    all_reduce_ms,
    reduce_scatter_ms,
)
from pipeswift_lab.partitioning.layers import uniform_bounds
from pipeswift_lab.planning.inputs import check_plan_inputs
from pipeswift_lab.planning.layouts import NOT_WEIGHED, closed_form_bounds, enumerate_layouts
from pipeswift_lab.planning.memory_bound import held_counts
from pipeswift_lab.planning.planner import evaluator_of
from pipeswift_lab.planning.sharding import tp_table
from pipeswift_lab.planning.step_bounds import closed_form_step_lower_ms, split_step_lower_ms
from pipeswift_lab.simulation.simulator import simulate_step_ms

GB = 1e9
FAST = Link(latency_ms=0.001, bandwidth_GBps=400.0)
SLOW = Link(latency_ms=0.01, bandwidth_GBps=25.0)


def tp_profile(layers=8, param_bytes=1 * GB, activation_bytes=0.1 * GB, tp_columns=True, divides=(16, 8), fwd_ms=1.0):
    """Equal layers of ``fwd_ms`` forward and twice that backward at micro-batch 1, with what a TP plan shards of
    each."""
    columns = dict(
        params=[param_bytes / 4] * layers,
        param_bytes=[param_bytes] * layers,
        activation_bytes=[activation_bytes] * layers,
        output_bytes=[0.01 * GB] * layers,
    )
    meta = {"batch_size": 1, "device": "cuda"}
    if tp_columns:
        columns.update(
            tp_param_bytes=[0.9 * param_bytes] * layers,
            tp_activation_bytes=[0.5 * activation_bytes] * layers,
            tp_flop_fraction=[0.9] * layers,
            tp_forward_bytes=[0.02 * GB] * layers,
            tp_backward_bytes=[0.02 * GB] * layers,
        )
        meta["tp_divides"] = list(divides)
    return Profile.synthetic(fwd_ms=[fwd_ms] * layers, bwd_ms=[2 * fwd_ms] * layers, meta=meta, **columns)


def plan_3d(prof=None, **kwargs):
    kwargs = {
        "gpus": 16,
        "global_batch": 16,
        "steps": 1000,
        "progress": False,
        "topology": Topology(4, FAST, SLOW),
    } | kwargs
    return plan(tp_profile() if prof is None else prof, **kwargs)


def test_the_table_has_tp_and_fsdp_and_gpus_is_their_product_with_p_and_d():
    result = plan_3d()
    table = result.table
    assert {"tp", "fsdp", "fsdp_ms"} <= set(table.columns)
    assert (table["gpus"] == table["P"] * table["D"] * table["fsdp"] * table["tp"]).all()
    assert (table["gpus"] <= 16).all()
    assert set(table["tp"]) == {1, 2, 4} and set(table["fsdp"]) == {1, 2, 4, 8, 16}
    assert (table["D"] * table["fsdp"] * table["m"] * table["microbatch_size"] == 16).all()
    assert (table.loc[table["fsdp"] == 1, "fsdp_ms"].fillna(0) == 0).all()
    assert result.best.gpus == result.best.P * result.best.D * result.best.fsdp * result.best.tp
    assert result.inputs["three_d"] and result.inputs["tp"] == (1, 2, 4)


def test_a_tensor_parallel_group_never_spans_a_node():
    result = plan_3d(topology=Topology(2, FAST, SLOW))
    assert set(result.table["tp"]) == {1, 2}
    with pytest.raises(ValueError, match=r"tp=4 does not divide gpus_per_node=2: a tensor-parallel group never"):
        plan_3d(topology=Topology(2, FAST, SLOW), tp=4)


def test_without_topology_tp_or_fsdp_the_search_stays_pipelines_times_replicas():
    result = plan(tp_profile(), gpus=16, global_batch=16, steps=1000, progress=False)
    assert set(result.table["tp"]) == {1} and set(result.table["fsdp"]) == {1}
    assert not result.inputs["three_d"] and (result.table["gpus"] == result.table["P"] * result.table["D"]).all()
    assert not result.table["reason"].str.startswith("not weighed").any()
    assert "without a pipeline" not in result.explain()
    # tp= alone weighs it on the default topology: 8-GPU nodes, NVLink-class inside
    result = plan(tp_profile(), gpus=16, global_batch=16, steps=1000, progress=False, tp=[1, 2])
    assert set(result.table["tp"]) == {1, 2} and set(result.table["fsdp"]) == {1, 2, 4, 8, 16}
    assert result.inputs["topology"] is None


def test_tensor_parallel_compute_and_collectives_are_priced_on_the_node_link():
    # one stage, one micro-batch of 16: the step is the layers' times as one of 2 TP ranks computes them
    result = plan(
        tp_profile(),
        gpus=2,
        global_batch=16,
        steps=10,
        progress=False,
        P=[1],
        tp=[2],
        fsdp=[1],
        microbatch_sizes=[16],
    )
    row = result.feasible.iloc[0]
    assert (row["P"], row["tp"], row["D"], row["m"]) == (1, 2, 1, 1)
    # per layer at the profiled size: 10% of the compute whole, 90% halved, and an all-reduce each way inside a
    # node; with one profile every time, the collectives' too, scales with the micro-batch (16 here)
    layer_ms = 3.0 * (0.1 + 0.9 / 2) + 2 * all_reduce_ms(0.02 * GB, 2, DEFAULT_INTRA_NODE_LINK)
    assert row["pipeline_ms"] == pytest.approx(16 * 8 * layer_ms)
    # the memory of one TP rank: the sharded parameters halve (state_bytes_per_rank), the rest stay whole
    held = state_bytes_per_rank(8 * GB, 8 * 0.9 * GB, tp=2)["grads"]
    assert row["optimizer_ms"] == pytest.approx(7.0 * held / (1500.0 * 1e6))


def test_tp_table_divides_compute_and_sharded_bytes():
    df = tp_profile().df
    two = tp_table(df, 2, FAST)
    ar = all_reduce_ms(0.02 * GB, 2, FAST)
    assert two["fwd_ms"].iloc[0] == pytest.approx(1.0 * (0.1 + 0.45) + ar)
    assert two["bwd_ms"].iloc[0] == pytest.approx(2.0 * (0.1 + 0.45) + ar)
    assert two["param_bytes"].iloc[0] == pytest.approx(0.1 * GB + 0.45 * GB)
    assert two["params"].iloc[0] == pytest.approx(0.55 * GB / 4)
    assert two["activation_bytes"].iloc[0] == pytest.approx(0.05 * GB + 0.025 * GB)
    assert two["output_bytes"].iloc[0] == df["output_bytes"].iloc[0]
    assert tp_table(df, 1, FAST) is df


def test_fsdp_collectives_are_priced_by_placement_and_hsdp_all_reduces_the_shards():
    result = plan_3d(P=[2], tp=[1], fsdp=[2, 8], exhaustive=True)
    rows = result.feasible.set_index(["D", "fsdp"])
    grads = 4 * GB  # the busiest of 2 ranks holds 4 of the 8 layers
    inside = rows.loc[(2, 2)].iloc[0]  # fsdp 2 x tp 1 in a node of 4: NVLink; the 2 replicas 2 ranks apart, inside
    assert inside["fsdp_ms"] == pytest.approx(all_gather_ms(grads, 2, FAST) + reduce_scatter_ms(grads, 2, FAST))
    assert inside["allreduce_ms"] == pytest.approx(all_reduce_ms(grads / 2, 2, FAST))
    across = rows.loc[(1, 8)].iloc[0]  # 8 shards span two nodes of 4
    assert across["fsdp_ms"] == pytest.approx(all_gather_ms(grads, 8, SLOW) + reduce_scatter_ms(grads, 8, SLOW))
    assert across["allreduce_ms"] == 0
    assert across["step_ms"] == pytest.approx(
        across["pipeline_ms"] + across["fsdp_ms"] + across["allreduce_ms"] + across["optimizer_ms"]
    )


def test_no_pipeline_rows_are_weighed_and_win_when_fsdp_makes_the_model_fit_one_gpu():
    # 8 GB of weights: 32 GB with gradients and Adam, over a 30 GB cap; FSDP over 8 holds 8 x (2 + 3/8) = 19 GB
    # layers of 50 ms: a pipeline's bubble costs more than FSDP's all-gather and reduce-scatter inside the node
    prof = tp_profile(param_bytes=1 * GB, activation_bytes=0.01 * GB, tp_columns=False, fwd_ms=50.0)
    result = plan_3d(prof, gpus=8, global_batch=8, mem_per_gpu_bytes=30 * GB, topology=Topology(8, FAST, SLOW))
    best = result.best
    assert (result.table["P"] == 1).any() and best.P == 1 and best.fsdp > 1 and best.tp == 1
    no_fsdp = result.table[(result.table["P"] == 1) & (result.table["fsdp"] == 1)]
    assert (~no_fsdp["feasible"]).all() and no_fsdp["reason"].str.contains("GiB per GPU").all()
    text = result.explain()
    assert f"No pipeline (P=1, {best.D} data-parallel replicas, fsdp={best.fsdp}) wins" in text
    assert "The best has no pipeline." in text and "Tensor parallelism was not weighed" in text


def test_memory_forces_tensor_parallelism_or_fsdp():
    # one stage of 8 GB of weights and 1.6 GB of activations a micro-batch under a 20 GB cap
    result = plan_3d(P=[1], mem_per_gpu_bytes=20 * GB, gpus=8, global_batch=8, topology=Topology(8, FAST, SLOW))
    feasible = result.feasible
    assert len(feasible) and ((feasible["tp"] > 1) | (feasible["fsdp"] > 1)).all()
    plain = result.table[(result.table["tp"] == 1) & (result.table["fsdp"] == 1)]
    assert (~plain["feasible"]).all()
    tp_only = plan_3d(P=[1], fsdp=[1], mem_per_gpu_bytes=20 * GB, gpus=8, global_batch=8, topology=Topology(8))
    assert tp_only.best.tp > 1 and tp_only.best.peak_mem_bytes <= 20 * GB


def test_run_arguments_carry_tp_and_fsdp_and_the_split_weighed():
    result = plan_3d(mem_per_gpu_bytes=20 * GB)
    best = result.best
    assert best.tp > 1 or best.fsdp > 1
    args = result.run_arguments(best)
    assert args["tp"] == best.tp and args["fsdp"] == best.fsdp and args["D"] == best.D and args["m"] == best.m
    assert isinstance(args["tp"], int) and isinstance(args["fsdp"], int)
    part = args["partition"]
    assert isinstance(part, Partition) and part.P == best.P
    assert " ".join(f"{a}-{e}" for a, e in part.bounds) == best.stage_bounds
    label = best.label
    assert (f"×tp{best.tp}" in label) == (best.tp > 1) and (f"×fsdp{best.fsdp}" in label) == (best.fsdp > 1)


def test_explain_compares_the_best_with_no_pipeline_and_no_tensor_parallelism():
    result = plan_3d(mem_per_gpu_bytes=20 * GB, availability=None)
    best = result.best
    assert best.P > 1 and best.tp > 1
    text = result.explain()
    no_pipe = result.feasible[result.feasible["P"] == 1].iloc[0]
    no_tp = result.feasible[result.feasible["tp"] == 1].iloc[0]
    assert f"The best without a pipeline (P=1) {result.config(no_pipe.name).label}" in text
    assert f"step {no_pipe['step_ms']:.4g} ms" in text
    assert f"The best without tensor parallelism (tp=1) {result.config(no_tp.name).label}" in text
    # where none fits, it says so
    tight = plan_3d(mem_per_gpu_bytes=6 * GB)
    assert "No configuration without a pipeline (P=1) fits mem_per_gpu_bytes=6e+09" in tight.explain()


def test_a_profile_without_tp_columns_weighs_tp_1_alone():
    result = plan_3d(tp_profile(tp_columns=False))
    assert set(result.table["tp"]) == {1} and set(result.table["fsdp"]) == {1, 2, 4, 8, 16}
    with pytest.raises(ValueError, match="tp=2 is not allowed: the profile has no tp_param_bytes column"):
        plan_3d(tp_profile(tp_columns=False), tp=2)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(tp=3), ValueError, r"tp=3 does not divide gpus_per_node=4"),
        (dict(tp=2, topology=Topology(6)), ValueError, r"tp=2 is not allowed: profile.meta\['tp_divides'\]=\[3, 9\]"),
        (dict(tp=8), ValueError, "tp=8 does not divide gpus_per_node=4"),
        (dict(tp="2"), TypeError, "tp must be an int, a sequence of ints or None"),
        (dict(tp=[]), ValueError, "tp is empty"),
        (dict(fsdp=0), ValueError, r"fsdp\[0\]=0 is invalid"),
        (dict(fsdp=3), ValueError, "fsdp=3 does not divide global_batch=16"),
        (dict(fsdp=32), ValueError, "fsdp=32 exceeds gpus=16"),
        (dict(fsdp=2, precision="bf16-mixed-zero1"), ValueError, "fsdp=2 with precision='bf16-mixed-zero1'"),
        (dict(topology="8 GPUs"), TypeError, "topology must be a pipeswift_lab.Topology"),
    ],
)
def test_bad_3d_input_names_the_argument(kwargs, error, message):
    prof = tp_profile(divides=(3, 9)) if "topology" in kwargs and kwargs["topology"] != "8 GPUs" else None
    with pytest.raises(error, match=message):
        plan_3d(prof, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((0,), {}, ValueError, "gpus_per_node=0 is invalid"),
        ((8.0,), {}, TypeError, "gpus_per_node must be an integer"),
        ((8,), {"intra_node": "nvlink"}, TypeError, "intra_node must be a pipeswift_lab.Link"),
        ((8,), {"inter_node": 25.0}, TypeError, "inter_node must be a pipeswift_lab.Link"),
    ],
)
def test_bad_topology_names_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        Topology(*args, **kwargs)


def test_topology_places_each_group_of_the_mesh():
    topo = Topology(8, FAST, SLOW)
    assert topo.within_node("tp", tp=8) and not topo.within_node("fsdp", fsdp=2, tp=8)
    assert topo.within_node("fsdp", D=2, fsdp=4, tp=2) and topo.link_of("dp", D=2, fsdp=4, tp=2) == SLOW
    assert topo.link_of("pp", P=2, D=2, tp=2) == FAST  # the whole job fits one node
    assert topo.link_of("pp", P=4, D=2, tp=2) == SLOW
    assert not Topology(6).within_node("fsdp", fsdp=2, tp=2, D=2)  # blocks of 4 straddle nodes of 6
    assert Topology.group("dp", P=2, D=3, fsdp=4, tp=2) == (3, 8)
    assert all_reduce_ms(1e9, 4, SLOW) == pytest.approx(all_gather_ms(1e9, 4, SLOW) + reduce_scatter_ms(1e9, 4, SLOW))
    assert all_gather_ms(1e9, 4, SLOW) == pytest.approx(0.75 * 1e9 / 25e6 + 3 * 0.01)
    assert all_reduce_ms(1e9, 1, SLOW) == 0.0
    assert "gpus_per_node" in str(topo) and "Topology" in topo._repr_html_()
    with pytest.raises(ValueError, match="dim='xy' is not"):
        topo.within_node("xy")


def test_branch_and_bound_plans_what_the_exhaustive_search_plans():
    kwargs = dict(mem_per_gpu_bytes=12 * GB, availability=[(0, 8), (3600, 16)], steps=20_000)
    pruned = plan_3d(**kwargs)
    full = plan_3d(exhaustive=True, **kwargs)
    assert pruned.best.label == full.best.label and pruned.best.total_s == pytest.approx(full.best.total_s)
    assert (pruned.table["reason"] == NOT_WEIGHED).any() and not (full.table["reason"] == NOT_WEIGHED).any()
    assert len(pruned.feasible) < len(full.feasible)
    # every bound it pruned with is below what the simulation gives
    simulated = full.feasible[full.feasible["strategy"].isin(["now", "wait"])]
    assert (simulated["jct_lower_bound_s"] <= simulated["total_s"] * (1 + 1e-9)).all()
    inputs = check_plan_inputs(
        tp_profile(), gpus=16, global_batch=16, progress=False, topology=Topology(4, FAST, SLOW), **kwargs
    )
    evaluator = evaluator_of(inputs)
    grid = enumerate_layouts(inputs)
    closed = closed_form_bounds(grid, inputs, evaluator)
    keys = ["P", "D", "fsdp", "tp", "m", "microbatch_size", "schedule", "v"]
    bounds = pd.DataFrame({k: getattr(grid, {"microbatch_size": "b"}.get(k, k)) for k in keys if k != "schedule"})
    bounds["schedule"] = [grid.choices[c][0] for c in grid.choice]
    bounds["v"] = grid.v
    bounds["closed_s"] = closed.bound_s
    joined = simulated.merge(bounds, on=keys)
    assert len(joined) == len(simulated)
    assert (joined["closed_s"] <= joined["total_s"] * (1 + 1e-9)).all()
    for _, row in full.feasible.iterrows():  # the memory bound never exceeds a peak found
        config = tuple(int(row[k]) for k in ("P", "m", "microbatch_size"))
        lower = evaluator.at(int(row["tp"]), None).fullest_rank_lower_bytes(
            *config, row["schedule"], int(row["v"]), int(row["D"]), int(row["fsdp"])
        )
        assert lower <= row["peak_mem_bytes"] * (1 + 1e-9)


@pytest.mark.parametrize(
    "schedule, v",
    [
        ("GPipe", 1),
        ("1F1B", 1),
        ("Interleaved1F1B", 2),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
        ("DualPipeV", 2),
    ],
)
def test_step_bounds_hold_on_random_stages(schedule, v):
    rng = np.random.default_rng(3)
    for P, m in ((2, 4), (4, 8), (3, 6), (4, 4)):
        if schedule == "DualPipeV" and m < 2 * P:
            m = 2 * P
        for _ in range(3):
            fwd = rng.uniform(0.5, 3.0, P * v)
            bwd = fwd * rng.uniform(1.5, 2.5, P * v)
            stages = pd.DataFrame({"fwd_ms": fwd, "bwd_ms": bwd, "wgrad_ms": bwd * 0.4})
            step = simulate_step_ms(stages, m, schedule, v=v)
            from pipeswift_lab.core.vocabulary import stage_to_rank

            assert split_step_lower_ms(fwd, bwd, stage_to_rank(P, v, schedule), P, m, schedule) <= step * (1 + 1e-9)
            total = float((fwd + bwd).sum())
            slowest = float((fwd + bwd).max())
            # the closed form needs layers no coarser than the stages: one layer a stage
            assert closed_form_step_lower_ms(total, float(fwd.sum()), slowest, P, m, schedule) <= step * (1 + 1e-9)


def test_held_counts_follow_the_schedules():
    assert held_counts(4, 8, "1F1B", 1) == (4, 3, 2, 1)
    assert held_counts(4, 8, "GPipe", 1) == (8, 8, 8, 8)
    assert held_counts(1, 5, "GPipe", 1) == (5,)


def test_random_splits_never_hold_less_than_the_memory_bound():
    inputs = check_plan_inputs(
        tp_profile(layers=12), gpus=16, global_batch=16, steps=10, progress=False, topology=Topology(4)
    )
    evaluator = evaluator_of(inputs)
    rng = np.random.default_rng(5)
    for schedule, v, P, m in (
        ("1F1B", 1, 4, 8),
        ("GPipe", 1, 3, 4),
        ("Interleaved1F1B", 2, 2, 4),
        ("ZBVZeroBubble", 2, 3, 6),
    ):
        for tp, fsdp, D in ((1, 1, 2), (2, 4, 1), (4, 2, 2)):
            sibling = evaluator.at(tp, None)
            lower = sibling.fullest_rank_lower_bytes(P, m, 1, schedule, v, D, fsdp)
            for _ in range(4):
                cuts = np.sort(rng.choice(np.arange(1, 12), P * v - 1, replace=False))
                edges = [0, *cuts.tolist(), 12]
                bounds = tuple(zip(edges[:-1], edges[1:]))
                assert lower <= max(sibling.peak_memory(P, m, 1, schedule, v, D, bounds, fsdp)) * (1 + 1e-9)
            assert lower <= max(sibling.peak_memory(P, m, 1, schedule, v, D, uniform_bounds(12, P * v), fsdp))
            assert math.isfinite(lower) and lower > 0


def test_compiled_peaks_of_sharded_layouts_equal_the_replay_and_hold_the_reduce_scatter():
    inputs = check_plan_inputs(
        tp_profile(layers=6), gpus=16, global_batch=16, steps=10, progress=False, topology=Topology(4)
    )
    fast, replay = evaluator_of(inputs), evaluator_of(inputs, replay=True)
    for schedule, v, P, m in (("1F1B", 1, 2, 4), ("Interleaved1F1B", 2, 3, 6), ("ZBVZeroBubble", 2, 3, 6)):
        bounds = uniform_bounds(6, P * v)
        for tp, fsdp, D in ((2, 1, 2), (1, 4, 1), (2, 2, 2)):
            compiled = fast.at(tp, None).peak_memory(P, m, 2, schedule, v, D, bounds, fsdp)
            replayed = replay.at(tp, None).peak_memory(P, m, 2, schedule, v, D, bounds, fsdp)
            assert compiled == pytest.approx(replayed, rel=1e-9)
    # one stage of 6 layers, tp 1, fsdp 4: weights 6 GB x (1 + 1/4), Adam's two states / 4, and the gradients twice
    # as they are copied into the reduce-scatter's input
    peak = fast.peak_memory(1, 1, 1, "GPipe", 1, 1, ((0, 6),), 4)[0]
    assert peak >= 6 * GB * (1.25 + 2 / 4 + 2)


def sp_profile(**kwargs):
    """:func:`tp_profile` whose plan allows sequence parallelism: 80% of each layer's activations divide then."""
    prof = tp_profile(**kwargs)
    df = prof.df.assign(sp_activation_bytes=0.8 * prof.df["activation_bytes"])
    return Profile(df, {**prof.meta, "sequence_parallel": True})


def test_sequence_parallelism_prices_gathers_and_scatters_and_divides_the_sliced_activations():
    df = sp_profile().df
    two, sliced = tp_table(df, 2, SLOW), tp_table(df, 2, SLOW, sequence_parallel=True)
    ag, rs = all_gather_ms(0.02 * GB, 2, SLOW), reduce_scatter_ms(0.02 * GB, 2, SLOW)
    assert sliced["fwd_ms"].iloc[0] == pytest.approx(1.0 * (0.1 + 0.45) + ag + rs)
    assert sliced["bwd_ms"].iloc[0] == pytest.approx(2.0 * (0.1 + 0.45) + rs + ag)
    # in the ring model an all-reduce is a reduce-scatter then an all-gather: the same time, less memory
    assert sliced["fwd_ms"].iloc[0] == pytest.approx(two["fwd_ms"].iloc[0])
    assert sliced["activation_bytes"].iloc[0] == pytest.approx(0.02 * GB + 0.04 * GB)
    assert two["activation_bytes"].iloc[0] == pytest.approx(0.05 * GB + 0.025 * GB)


def test_a_plan_with_sequence_parallelism_fits_where_one_without_does_not_and_runs_it():
    # one stage at tp=2 and b=16: 14.9 GB a GPU without sequence parallelism, 13.0 GB with it
    kwargs = dict(gpus=2, global_batch=16, P=[1], tp=[2], fsdp=[1], microbatch_sizes=[16], optimizer="sgd")
    cap = 14 * GB
    with pytest.raises(ValueError, match=r"(?s)no feasible configuration.*P=1 D=1 fsdp=1 tp=2 m=1 b=16"):
        plan_3d(sp_profile(), mem_per_gpu_bytes=cap, **kwargs)
    sliced = plan_3d(sp_profile(), mem_per_gpu_bytes=cap, sequence_parallel=True, **kwargs)
    assert sliced.best.peak_mem_bytes <= cap
    args = sliced.run_arguments(sliced.best)
    assert args["tp"] == TP(2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs a profile whose tensor-parallel plan allows"):
        plan_3d(tp_profile(), sequence_parallel=True)


def test_one_stage_is_weighed_under_1f1b_which_holds_one_micro_batch():
    # the same step under any schedule; GPipe would hold all m micro-batches' activations, 1F1B one at a time
    kwargs = dict(P=[1], tp=[2], fsdp=[1], microbatch_sizes=[1], gpus=2, global_batch=16)
    default = plan_3d(**kwargs).table
    assert set(default["schedule"]) == {"1F1B"}
    gpipe = plan_3d(schedules=["GPipe"], **kwargs).table
    assert default["step_ms"].iloc[0] == pytest.approx(gpipe["step_ms"].iloc[0])
    assert default["peak_mem_bytes"].iloc[0] < gpipe["peak_mem_bytes"].iloc[0]
