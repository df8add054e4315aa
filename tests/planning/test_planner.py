import math
import re

import matplotlib
import pytest
import torch
from sleep_layers import SleepLayer
from torch import nn

from pipeswift_lab import JCT, Launch, Link, Profile
from pipeswift_lab.core.costs import AssemblyModel, CheckpointModel, allreduce_ms, preemption_loss_s
from pipeswift_lab.planning.planner import plan
from pipeswift_lab.planning.search import MicrobatchCosts

matplotlib.use("Agg")

GB = 1e9


def model_profile(batch_size=1, layers=8, fixed_ms=0.0, per_sample_ms=1.0, param_bytes=1e8):
    """Equal layers of ``fixed_ms + per_sample_ms * batch_size`` forward, twice that backward."""
    fwd = fixed_ms + per_sample_ms * batch_size
    return Profile.synthetic(
        fwd_ms=[fwd] * layers,
        bwd_ms=[2 * fwd] * layers,
        param_bytes=[param_bytes] * layers,
        activation_bytes=[1e6 * batch_size] * layers,
        output_bytes=[1e5 * batch_size] * layers,
        meta={"batch_size": batch_size, "device": "cuda"},
    )


def test_table_is_ranked_and_best_is_its_first_row():
    result = plan(model_profile(), gpus=8, global_batch=32, steps=1000, progress=False)
    feasible = result.feasible
    assert feasible["total_s"].is_monotonic_increasing
    assert result.best.total_s == feasible["total_s"].min()
    terms = feasible[["queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"]].sum(axis=1)
    assert (terms - feasible["total_s"]).abs().max() < 1e-6
    assert set(result.table["schedule"]) >= {"GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"}
    best = result.best
    assert best.P * best.D <= 8 and best.m * best.microbatch_size * best.D == 32
    assert isinstance(best.jct, JCT) and best.jct.total_s == pytest.approx(best.total_s)


def test_exhaustive_search_agrees_with_branch_and_bound():
    kwargs = dict(gpus=8, global_batch=32, steps=1000, availability=[(0, 4), (600, 8)], progress=False)
    pruned = plan(model_profile(fixed_ms=0.5), **kwargs)
    full = plan(model_profile(fixed_ms=0.5), exhaustive=True, **kwargs)
    assert pruned.best.total_s == pytest.approx(full.best.total_s)
    assert pruned.table["reason"].str.startswith("not simulated").any()
    assert not full.table["reason"].str.startswith("not simulated").any()


def test_step_time_is_pipeline_plus_allreduce_plus_optimizer():
    dp_link = Link(0.01, 10.0)
    result = plan(
        model_profile(param_bytes=4e8),
        gpus=8,
        global_batch=32,
        steps=100,
        dp_link=dp_link,
        P=[2],
        schedules=["1F1B"],
        progress=False,
    )
    row = result.feasible.query("D == 4").iloc[0]
    rank_param_bytes = 4 * 4e8  # 8 equal layers on 2 ranks
    assert row["allreduce_ms"] == pytest.approx(allreduce_ms(rank_param_bytes, 4, 10.0, 0.01))
    assert row["step_ms"] == pytest.approx(row["pipeline_ms"] + row["allreduce_ms"] + row["optimizer_ms"])
    # equal stages, no link: 1F1B's closed form (m + P - 1) * rank time of one micro-batch
    m, b = int(row["m"]), int(row["microbatch_size"])
    assert row["pipeline_ms"] == pytest.approx((m + 1) * 4 * 3.0 * b)
    assert row["training_s"] == pytest.approx(100 * row["step_ms"] / 1000)


def test_waiting_for_more_gpus_loses_on_a_short_job_and_wins_on_a_long_one():
    availability = [(0, 4), (2 * 3600, 8)]
    kwargs = dict(gpus=8, global_batch=64, availability=availability, schedules=["1F1B"], progress=False)
    short = plan(model_profile(), steps=2_000, **kwargs)
    assert short.best.queue_s == 0 and short.best.gpus <= 4
    long = plan(model_profile(), steps=2_000_000, **kwargs)
    assert set(long.feasible["strategy"]) == {"now", "wait", "grow"}
    assert long.strategy_rows("grow")["change"].str.startswith("at 2.00 h from P").all()
    # a long job gains most from starting now on 4 and growing to 8 when they free up
    assert long.best.strategy == "grow"
    waits, stays = long.strategy_rows("wait"), long.strategy_rows("now")
    assert (waits["queue_s"] == 2 * 3600).all() and (stays["queue_s"] == 0).all() and (stays["gpus"] <= 4).all()
    assert long.best.total_s < waits["total_s"].min() and long.best.total_s < stays["total_s"].min()


def by_m_step(result):
    rows = result.feasible
    return dict(zip(rows["m"], rows["pipeline_ms"]))


def test_fixed_per_microbatch_cost_bounds_m():
    # with a fixed cost per micro-batch, cutting the batch ever finer stops paying
    profiles = [model_profile(batch_size=b, fixed_ms=0.5, per_sample_ms=0.25) for b in (1, 4, 16)]
    result = plan(
        profiles, gpus=4, global_batch=64, steps=1000, P=[4], schedules=["1F1B"], exhaustive=True, progress=False
    )
    # 1F1B step (m + 3) * 6 * (0.5 + 0.25 * 64 / m): 189, 165, 171, 210, 301 ms for m = 4 ... 64
    assert by_m_step(result) == pytest.approx({4: 189.0, 8: 165.0, 16: 171.0, 32: 210.0, 64: 301.5}, rel=1e-3)
    by_m = result.feasible.set_index("m")["total_s"]
    assert by_m.idxmin() not in (by_m.index.min(), by_m.index.max())
    assert result.bubble_best.m == by_m.index.max()
    assert result.bubble_best.total_s > result.best.total_s
    text = result.explain()
    assert result.best.label in text and "bubble-best" in text


def test_interpolates_between_profiled_microbatch_sizes():
    costs = MicrobatchCosts([model_profile(batch_size=2, fixed_ms=1.0), model_profile(batch_size=8, fixed_ms=1.0)])
    table = costs.table(4)
    assert table["fwd_ms"].iloc[0] == pytest.approx(1.0 + 4.0)
    assert table["activation_bytes"].iloc[0] == pytest.approx(4e6)
    assert costs.table(16)["fwd_ms"].iloc[0] == pytest.approx(1.0 + 16.0)  # extrapolated along the last segment
    with pytest.raises(ValueError, match="two profiles have micro-batch size 2"):
        MicrobatchCosts([model_profile(batch_size=2), model_profile(batch_size=2)])


def test_memory_cap_forces_more_stages_and_names_misses():
    prof = model_profile(param_bytes=4 * GB)  # 4 GB of weights a layer: weights+grads+Adam = 16 GB a layer
    result = plan(
        prof, gpus=8, global_batch=8, steps=100, mem_per_gpu_bytes=40 * GB, schedules=["1F1B"], progress=False
    )
    assert result.best.P >= 4 and result.best.peak_mem_bytes <= 40 * GB
    # one stage holds 8 layers x 16 GB of weights and state: 128 GB, ~119 GiB, whatever the split
    assert (
        result.table[result.table["P"] == 1]["reason"]
        .str.startswith("needs at least 119 GiB per GPU on average > mem_per_gpu_bytes=4e+10")
        .all()
    )
    with pytest.raises(ValueError, match="no feasible configuration") as info:
        plan(prof, gpus=2, global_batch=8, steps=100, mem_per_gpu_bytes=40 * GB, schedules=["1F1B"], progress=False)
    assert "gpus=2" in str(info.value)


def _preempted_plan(ckpt):
    return plan(
        model_profile(),
        gpus=8,
        global_batch=32,
        steps=100_000,
        mtbf_s=8 * 24 * 3600.0,
        costs=ckpt,
        schedules=["1F1B"],
        progress=False,
    )


def test_preemption_term_uses_young_daly_and_scales_with_gpus():
    ckpt = CheckpointModel(write_GBps=1, read_GBps=2, teardown_s=0, asynchronous=False)
    result = _preempted_plan(ckpt)
    row = result.feasible.iloc[0]
    shard = (8 / row["P"]) * 1e8 * 3  # parameters plus two Adam moments of the busiest rank
    job_mtbf_s = 8 * 24 * 3600.0 / row["gpus"]
    expected = preemption_loss_s(row["training_s"], shard / 1e9, row["assembly_s"] + shard / 2e9, job_mtbf_s)
    assert row["preemption_loss_s"] == pytest.approx(expected)
    assert row["preemption_loss_s"] > 0
    assert row["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * shard / 1e9 * job_mtbf_s))


def test_asynchronous_checkpoints_stall_for_the_staging_copy_at_a_floored_interval():
    ckpt = CheckpointModel(write_GBps=1, read_GBps=2, teardown_s=0, staging_GBps=4)
    row = _preempted_plan(ckpt).feasible.iloc[0]
    shard = (8 / row["P"]) * 1e8 * 3
    job_mtbf_s = 8 * 24 * 3600.0 / row["gpus"]
    stall, save = shard / 4e9, shard / 1e9
    interval = max(math.sqrt(2 * stall * job_mtbf_s), save)
    assert row["checkpoint_interval_s"] == pytest.approx(interval)
    expected = preemption_loss_s(
        row["training_s"], stall, row["assembly_s"] + shard / 2e9, job_mtbf_s, interval_s=interval
    )
    assert row["preemption_loss_s"] == pytest.approx(expected)
    assert row["cleanup_s"] == pytest.approx(save)  # the final save is waited for: the whole write


def test_a_cheaper_checkpoint_stall_gives_a_shorter_jct():
    sync = _preempted_plan(CheckpointModel(asynchronous=False))
    async_ = _preempted_plan(CheckpointModel(asynchronous=True))
    by_config = ["P", "D", "m", "microbatch_size", "schedule", "v"]
    both = sync.feasible.merge(async_.feasible, on=by_config, suffixes=("_sync", "_async"))
    assert len(both) == len(sync.feasible) > 1
    # same steps, same final save: only the periodic checkpoints' stall and their interval differ
    assert (both["training_s_sync"] == both["training_s_async"]).all()
    assert (both["cleanup_s_sync"] == both["cleanup_s_async"]).all()
    assert (both["preemption_loss_s_async"] < 0.75 * both["preemption_loss_s_sync"]).all()
    assert (both["total_s_async"] < both["total_s_sync"]).all()
    assert async_.best.total_s < sync.best.total_s


def test_calibrated_assembly_model():
    result = plan(
        model_profile(),
        gpus=4,
        global_batch=16,
        steps=10,
        costs=AssemblyModel.calibrate([(2, 5.0), (4, 9.0)]),
        P=[2],
        schedules=["1F1B"],
        progress=False,
    )
    assert result.feasible["assembly_s"].iloc[0] == pytest.approx(
        AssemblyModel(base_s=1.0, per_stage_s=2.0, per_gpu_s=0.0).seconds(2)
    )


def test_plot_and_html():
    result = plan(model_profile(), gpus=8, global_batch=32, steps=1000, progress=False)
    ax = result.plot(n=3)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) >= 3
    assert any(label.startswith(result.bubble_best.label) and "bubble-best" in label for label in labels)
    assert any(label.startswith(result.throughput_best.label) and "throughput-best" in label for label in labels)
    assert "Plan" in result._repr_html_() and result.best.label in result._repr_html_()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(steps=0), ValueError, "steps=0 is invalid"),
        (dict(gpus=0), ValueError, "gpus=0 is invalid"),
        (dict(global_batch=-1), ValueError, "global_batch=-1 is invalid"),
        (dict(mem_per_gpu_bytes=0), ValueError, "mem_per_gpu_bytes=0.0 is invalid"),
        (dict(mtbf_s=-5), ValueError, "mtbf_s=-5.0 is invalid"),
        (dict(dp_link="fast"), TypeError, "link must be a pipeswift_lab.Link"),
        (dict(availability=[(5, 8)]), ValueError, "must start at seconds_from_now=0"),
        (dict(schedules=["Pipedream"]), ValueError, "schedule='Pipedream' is not known"),
        (dict(microbatch_sizes=[3], global_batch=16), ValueError, "no feasible configuration"),
        (dict(P=[64]), ValueError, "leaves no stage count"),
    ],
)
def test_bad_input(kwargs, error, message):
    args = dict(gpus=4, global_batch=16, steps=10, progress=False)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        plan(model_profile(), **args)


def test_link_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="bandwidth_GBps=0.0 is invalid"):
        Link(0.0, 0.0)


# ---------------------------------------------------------------- validation against reality


@pytest.mark.processes
def test_the_planners_pick_runs_and_its_measured_step_holds_every_sleep_of_its_busiest_rank(one_torch_thread):
    """The planner's choice, planned from profiles of layers that sleep a known time, runs as planned.

    What holds on a loaded machine: the measured pipeline step is at least the sleeps of the busiest rank (a sleep
    never ends early and a rank runs its actions one at a time). How close the pick comes to the best measured
    configuration is a timing against a timing: ``benchmarks/bench_planner.py`` prints it (every feasible one run).
    """
    from pipeswift_lab import run

    # each layer costs fixed_ms + 1 ms per sample forward and twice that backward; the profiles say so exactly (the
    # profiler's own measurement of sleeping layers is tests/profiling/test_measure.py's)
    fixed = [6.0, 3.0, 3.0, 9.0]
    model = nn.Sequential(*[SleepLayer(f, 2 * f, per_sample_ms=1.0, split_backward=True) for f in fixed])
    loss_fn = nn.functional.mse_loss
    profiles = [
        Profile.synthetic(
            fwd_ms=[f + b for f in fixed], bwd_ms=[2 * (f + b) for f in fixed], meta={"batch_size": b, "device": "cpu"}
        )
        for b in (2, 8)
    ]
    global_batch = 16
    result = plan(
        profiles,
        gpus=2,
        global_batch=global_batch,
        steps=100,
        P=[2],
        microbatch_sizes=[2, 4, 8],
        schedules=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"],
        exhaustive=True,
        progress=False,
    )
    grid = result.feasible[result.feasible["D"] == 1]
    assert len(grid) >= 4 and set(grid["schedule"]) >= {"GPipe", "1F1B"}
    picked = grid.iloc[0]
    part, m = result.partition_of(picked), int(picked["m"])
    batch = (torch.randn(global_batch, 4), torch.randn(global_batch, 4))
    runs = run(model, batch, loss_fn, part, m, steps=3, progress=False, launch=Launch(timeout_s=120))
    assert runs.schedule.lower() == str(picked["schedule"]).lower() and len(runs.step_ms) == 3
    # a micro-batch's forward sleeps fixed + mb ms a layer, its backward at least half of 2 * (fixed + mb) (a first
    # layer whose input needs no gradient runs only its weight half)
    mb = global_batch // m
    sleeps = [m * ((f + mb) + (f + mb)) for f in fixed]
    rank_sleeps = [0.0] * part.P
    for (a, b), r in zip(part.bounds, part.stage_to_rank):
        rank_sleeps[r] += sum(sleeps[a:b])
    assert runs.timeline.step_ms >= max(rank_sleeps), (runs.timeline.step_ms, rank_sleeps)


def test_calibrated_plan_steps_and_its_bound_stays_a_bound():
    from pipeswift_lab.fidelity.calibrator import Calibration
    from pipeswift_lab.simulation.simulator import simulate_step_ms

    cal = Calibration(
        compute_scale={2: 1.5},
        action_ms=0.2,
        loss_ms=(0.1, 0.2),
        gap={"single-chunk": 0.3, "multi-chunk": 0.1},
        step_overhead={"single-chunk": 20.0, "multi-chunk": 4.0},
        latency_ms=0.05,
        bandwidth_GBps=math.inf,
        step_cv=0.0,
    )
    prof = model_profile()
    result = plan(prof, gpus=8, global_batch=32, steps=1000, calibration=cal, exhaustive=True, progress=False)
    rows = result.strategy_rows("now", "wait")
    assert (rows["jct_lower_bound_s"] <= rows["total_s"] + 1e-9).all()  # the branch and bound's bound holds calibrated
    row = rows[rows["P"] > 1].iloc[0]
    part = result.partition_of(row)
    want = simulate_step_ms(part, int(row["m"]), row["schedule"], calibration=cal) + cal.step_overhead_ms(
        row["schedule"]
    )
    assert row["pipeline_ms"] == pytest.approx(want)
    pruned = plan(prof, gpus=8, global_batch=32, steps=1000, calibration=cal, progress=False)
    assert pruned.best.label == result.best.label and pruned.best.total_s == pytest.approx(result.best.total_s)
    with pytest.raises(TypeError, match="calibration must be"):
        plan(prof, gpus=8, global_batch=32, steps=1000, calibration="cal.json", progress=False)


def test_every_feasible_row_is_ranked_and_pruned_reasons_read_differently():
    result = plan(model_profile(), gpus=8, global_batch=8, steps=100, progress=False)
    table = result.table
    feasible = table[table["feasible"]]
    assert list(feasible["rank"]) == list(range(1, len(feasible) + 1))  # simulated and pruned alike
    assert table.loc[~table["feasible"], "rank"].isna().all()
    pruned = feasible[~feasible["simulated"]]
    assert not pruned.empty and (pruned["ranked_by"] == "jct_lower_bound_s").all()
    assert (feasible.loc[feasible["simulated"], "ranked_by"] == "total_s").all()
    assert pruned["jct_lower_bound_s"].is_monotonic_increasing
    for _, row in pruned.iterrows():
        bound, best = re.search(
            r"lower bound (.+?) is no shorter than the best (.+?) at its wait", row["reason"]
        ).groups()
        assert bound != best or row["jct_lower_bound_s"] == result.best.total_s


def test_distinct_hours_adds_digits_until_values_differ():
    from pipeswift_lab.core.display import distinct_hours as _distinct_hours

    assert _distinct_hours(6012.0, 6000.0) == ("1.670 h", "1.667 h")
    assert _distinct_hours(6000.0, 6000.0) == ("1.67 h", "1.67 h")
    assert _distinct_hours(90.0, 30.0) == ("1.5 min", "30 s")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedules=[]), r"schedules=\[\] is empty; give at least one of \['GPipe'"),
        (dict(mtbf_s=1e-3), r"do not survive mtbf_s=0.001 .*preempted more often than it can save a checkpoint"),
        (dict(global_batch=3, profile_batch=4), r"global_batch=3 is smaller than the profiled micro-batch size 4"),
    ],
)
def test_bad_plan_inputs_name_the_argument(kwargs, message):
    b = kwargs.pop("profile_batch", 1)
    args = dict(gpus=8, global_batch=8, steps=100, progress=False) | kwargs
    with pytest.raises(ValueError, match=message):
        plan(model_profile(batch_size=b), **args)


def test_profile_without_batch_size_warns_that_it_is_planned_at_size_one():
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    with pytest.warns(
        UserWarning, match=r"profile has no meta\['batch_size'\]: it is planned as if profiled at micro-batch size 1"
    ):
        plan(prof, gpus=4, global_batch=4, steps=10, progress=False)


def test_explain_says_why_no_pipeline_wins():
    result = plan(model_profile(param_bytes=1e6), gpus=8, global_batch=8, steps=100, progress=False)
    assert result.best.P == 1
    text = result.explain()
    assert "No pipeline (P=1, 8 data-parallel replicas) wins because no memory cap is given" in text
    assert "the best pipelined configuration, P" in text
    capped = plan(
        model_profile(param_bytes=1e9), gpus=8, global_batch=8, steps=100, mem_per_gpu_bytes=12e9, progress=False
    )
    assert capped.best.P > 1 and "No pipeline" not in capped.explain()  # 8 GB of layers x 4 do not fit 12 GB


def test_the_room_docstring_example():
    prof = Profile.synthetic(
        fwd_ms=[1.0] * 8,
        bwd_ms=[2.0] * 8,
        params=[1000] * 8,
        param_bytes=[4000.0] * 8,
        activation_bytes=[1e5] * 8,
        meta={"batch_size": 1},
    )
    p = plan(prof, gpus=16, steps=20_000, global_batch=64, progress=False)
    assert p.best.total_s == p.table["total_s"].min()
    args = p.run_arguments(p.best)
    assert set(args) == {"partition", "m", "schedule", "D", "fsdp", "tp"} and args["m"] == p.best.m
    assert args["D"] == p.best.D and args["fsdp"] == args["tp"] == 1  # no topology, tp or fsdp: pipelines x replicas
