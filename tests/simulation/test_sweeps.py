import math

import matplotlib
import pytest

from pipeswift_lab.core.link import Link
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.sweeps import SWEEP_COLUMNS, explore, heatmap, peak_memory_bytes, sweep
from pipeswift_lab.simulation.timeline import Timeline

matplotlib.use("Agg")


def gpt_like():
    return Profile.synthetic(
        fwd_ms=[0.5] + [4.0] * 6 + [16.0],
        bwd_ms=[1.0] + [8.0] * 6 + [30.0],
        param_bytes=[4000] + [2000] * 6 + [8000],
        activation_bytes=[10] + [100] * 6 + [50],
        output_bytes=[1000] * 8,
    )


def test_sweep_table_matches_direct_simulation():
    prof = gpt_like()
    df = sweep(
        prof,
        P=[2, 4],
        m=[4, 8],
        schedules=["1F1B", "GPipe"],
        methods=["uniform", "balanced"],
        steps=1000,
        progress=False,
    )
    assert list(df.columns) == list(SWEEP_COLUMNS)
    assert len(df) == 2 * 2 * 2 * 2
    assert df["feasible"].all()
    row = df[(df.P == 4) & (df.m == 8) & (df.schedule == "1F1B") & (df.method == "balanced")].iloc[0]
    part = partition(prof, 4)
    tl = simulate(part, 8, "1F1B")
    assert row["step_ms"] == tl.step_ms
    assert row["bubble_ratio"] == tl.bubble_ratio
    assert row["bottleneck_ms"] == part.bottleneck_ms
    assert row["training_s"] == pytest.approx(1000 * tl.step_ms / 1000)
    assert row["peak_mem_bytes"] == peak_memory_bytes(part, tl)
    # balanced never loses to uniform on the same configuration
    wide = df.pivot_table(index=["P", "m", "schedule"], columns="method", values="step_ms")
    assert (wide["balanced"] <= wide["uniform"] + 1e-9).all()


def test_peak_memory_by_hand():
    prof = Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[2.0, 2.0], param_bytes=[100, 10], activation_bytes=[7, 3])
    part = partition(prof, 2, method="uniform")
    tl = simulate(part, 4, "GPipe")  # GPipe holds all 4 micro-batches
    # rank 0 with Adam peaks in its optimizer step: weights, gradients, two moments, and the single-tensor loop's
    # temporaries (5/3 of the largest tensor + 1/3 of all; a synthetic layer counts as one tensor)
    assert peak_memory_bytes(part, tl) == pytest.approx(100 * 4 + 100 * (5 / 3 + 1 / 3))
    sgd = partition(prof, 2, method="uniform", optimizer="sgd")
    # plain SGD: in the first backward, the 4 micro-batches' activations and the gradients as they appear
    assert peak_memory_bytes(sgd, simulate(sgd, 4, "GPipe")) == 100 * 2 + 7 * 4
    no_memory = partition(Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[2.0, 2.0]).df[["fwd_ms", "bwd_ms"]], 2)
    assert math.isnan(peak_memory_bytes(no_memory, simulate(no_memory, 2)))


def test_combinations_torch_refuses_stay_with_a_reason():
    df = sweep(gpt_like(), P=[2, 3, 5], m=[2, 7], schedules=["1F1B", "Interleaved1F1B", "DualPipeV"], progress=False)
    bad = df[~df["feasible"]]
    assert bad["step_ms"].isna().all() and bad["training_s"].isna().all()
    reasons = dict(zip(zip(bad.P, bad.m, bad.schedule), bad.reason))
    assert "m >= P" in reasons[(3, 2, "1F1B")]
    assert "rounds" in reasons[(3, 7, "Interleaved1F1B")]
    assert "m >= 2*P" in reasons[(2, 2, "DualPipeV")]
    assert "exceed the 8 profiled layers" in reasons[(5, 2, "DualPipeV")]
    ok = df[df["feasible"]]
    assert set(zip(ok.P, ok.m, ok.schedule)) >= {
        (2, 2, "1F1B"),
        (2, 7, "1F1B"),
        (3, 7, "1F1B"),
        (2, 2, "Interleaved1F1B"),
    }
    assert math.isnan(ok["training_s"].iloc[0])  # no steps given


def test_v_values_and_memory_caps():
    prof = gpt_like()
    df = sweep(prof, P=[2], m=[4], schedules=["Interleaved1F1B", "ZBVZeroBubble", "GPipe"], v=[2, 4], progress=False)
    assert sorted(zip(df.schedule, df.v)) == [
        ("GPipe", 1),
        ("Interleaved1F1B", 2),
        ("Interleaved1F1B", 4),
        ("ZBVZeroBubble", 2),
        ("ZBVZeroBubble", 4),
    ]
    assert not df[(df.schedule == "ZBVZeroBubble") & (df.v == 4)]["feasible"].iloc[0]
    # replayed peaks (Adam's step on the largest tensors dominates): 71.3 kB with P=2, 56 kB with P=4
    capped = sweep(prof, P=[2, 4], m=[4], mem_per_gpu_bytes=60_000, progress=False)
    assert not capped.set_index("P").loc[2, "feasible"]
    assert "mem_per_gpu_bytes=60000" in capped.set_index("P").loc[2, "reason"]
    assert capped.set_index("P").loc[4, "feasible"]


def test_a_link_slows_every_configuration():
    prof = gpt_like()
    free = sweep(prof, P=[2, 4], m=[8], progress=False)
    slow = sweep(prof, P=[2, 4], m=[8], link=Link(1.0, 1.0), progress=False)
    assert (slow["step_ms"] > free["step_ms"]).all()


def test_bad_sweep_arguments():
    prof = gpt_like()
    with pytest.raises(ValueError, match="methods='fastest' is not known"):
        sweep(prof, methods=["fastest"], progress=False)
    with pytest.raises(ValueError, match="schedule='Zigzag'"):
        sweep(prof, schedules=["Zigzag"], progress=False)
    with pytest.raises(ValueError, match="P is empty"):
        sweep(prof, P=[], progress=False)
    with pytest.raises(ValueError, match="steps=0"):
        sweep(prof, steps=0, progress=False)
    with pytest.raises(TypeError, match="m must be an integer"):
        sweep(prof, m=[2.5], progress=False)


def test_heatmap():
    df = sweep(gpt_like(), P=[1, 2, 4], m=[4, 8, 16], progress=False)
    ax = heatmap(df)
    assert ax.get_xlabel() == "m" and ax.get_ylabel() == "P"
    assert len(ax.texts) == 9  # one annotation per cell
    assert "step_ms" in ax.get_title()
    both = sweep(gpt_like(), P=[2], m=[4], methods=["uniform", "balanced"], progress=False)
    with pytest.raises(ValueError, match="filter the table by \\['method'\\]"):
        heatmap(both)
    with pytest.raises(ValueError, match="column 'speed'"):
        heatmap(df, value="speed")


def test_explore_returns_what_the_widget_shows():
    part, tl = explore(gpt_like(), 2, 8, "Interleaved1F1B", method="balanced")
    assert part.v == 2 and part.P == 2 and part.stage_to_rank == (0, 1, 0, 1)
    assert isinstance(tl, Timeline) and tl.meta["schedule"] == "Interleaved1F1B"
    assert tl.step_ms == simulate(part, 8).step_ms
    part, tl = explore(gpt_like(), 4, 8, "gpipe", method="uniform")
    assert part.method == "uniform" and tl.meta["schedule"] == "GPipe"
    with pytest.raises(ValueError, match="P=4, m=2"):
        explore(gpt_like(), 4, 2, "1F1B", method="balanced")


def test_a_calibrated_sweep_reports_the_whole_predicted_step():
    from pipeswift_lab.fidelity.calibrator import Calibration, whole_step_ms

    cal = Calibration(
        compute_scale={2: 2.0},
        action_ms=0.5,
        loss_ms=(0.0, 0.0),
        gap={"single-chunk": 0.0, "multi-chunk": 0.0},
        step_overhead={"single-chunk": 10.0, "multi-chunk": 3.0},
        latency_ms=0.0,
        bandwidth_GBps=math.inf,
        step_cv=0.1,
    )
    prof = Profile.synthetic(fwd_ms=[1.0, 2.0, 1.0, 2.0], bwd_ms=[2.0, 4.0, 2.0, 4.0])
    table = sweep(prof, P=[2], m=[4], schedules=["1F1B", "Interleaved1F1B"], steps=100, calibration=cal, progress=False)
    for row in table.itertuples():
        v = 1 if row.schedule == "1F1B" else 2
        want = whole_step_ms(simulate(partition(prof, 2, v=v, schedule=row.schedule), 4, row.schedule, calibration=cal))
        assert row.step_ms == pytest.approx(want) and row.training_s == pytest.approx(100 * want / 1000)
    plain = sweep(prof, P=[2], m=[4], schedules=["1F1B"], progress=False)
    assert table.iloc[0]["step_ms"] == pytest.approx(5 * (2 * 9 + 2 * 0.5) + 10.0) and plain.iloc[0]["step_ms"] == 5 * 9


def test_one_progress_switch_everywhere(monkeypatch):
    """progress=False and TQDM_DISABLE turn every bar off through the one helper; otherwise it shows."""
    from pipeswift_lab.core.progress import progress_bar, progress_off

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert not progress_off() and not progress_bar(range(3), desc="x").disable
    assert progress_bar(range(3), desc="x", progress=False).disable
    for value, off in (("1", True), ("true", True), ("0", False), ("no", False), ("", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        assert progress_off() is off and progress_bar(range(3), desc="x").disable is off


def test_a_sweep_is_a_result_that_reads_as_its_table():
    from pipeswift_lab.simulation import Sweep

    result = sweep(gpt_like(), P=[2, 4], m=[4, 8], schedules=["1F1B", "GPipe"], steps=10, progress=False)
    assert isinstance(result, Sweep) and list(result.df.columns) == list(SWEEP_COLUMNS)
    assert len(result) == 8 and list(result) == list(SWEEP_COLUMNS) and "step_ms" in result
    assert result["step_ms"].equals(result.df["step_ms"]) and result.iloc[0]["P"] == 2
    one = result[result.schedule == "1F1B"]
    assert len(one) == 4 and set(one["schedule"]) == {"1F1B"}
    result["per_mb_ms"] = result["step_ms"] / result["m"]  # a column assigned goes to the table
    assert "per_mb_ms" in result.df.columns
    assert result.feasible.equals(result.df[result.df["feasible"]])
    assert result.meta["steps"] == 10 and result.meta["calibration"] is None
    assert "Sweep of 8 configurations" in result._repr_html_() and "fastest" in repr(result)
    with pytest.raises(AttributeError):
        _ = result.no_such_attribute


def test_sweep_plot_filters_by_keyword_and_heatmap_takes_either():
    result = sweep(gpt_like(), P=[2, 4], m=[4, 8], schedules=["1F1B", "GPipe"], progress=False)
    with pytest.raises(ValueError, match=r"filter the table by \['schedule'\] first \(e.g. .plot\(schedule=...\)\)"):
        result.plot()
    ax = result.plot(schedule="GPipe", value="bubble_ratio")
    assert len(ax.texts) == 4 and ax.get_title() == "bubble_ratio (schedule=GPipe, method=balanced)"
    gpipe = result[result.schedule == "GPipe"]
    assert heatmap(gpipe).get_title() == "step_ms (schedule=GPipe, method=balanced)"
    assert len(heatmap(sweep(gpt_like(), P=[2], m=[4], progress=False)).texts) == 1
    with pytest.raises(ValueError, match="column 'stage'"):
        result.plot(stage=1)
