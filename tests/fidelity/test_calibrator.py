"""Calibration against runs whose layers sleep a known time: the fit sees what was injected.

Every layer sleeps ``SCALE * profiled`` ms in forward and backward (a known compute
slowdown), the first layer of each stage sleeps ``ACTION_MS`` more (a known fixed cost per
action), and the optimizer step sleeps ``STEP_MS`` (a known per-step overhead outside the
actions). Sleeping does not use the CPU, so co-running ranks do not disturb it; but a loaded
machine wakes a sleep late, so what is asserted is what load cannot undo (a sleep never ends
early: fitted costs at least the injected ones). How close the fit comes to the injected values,
and the calibrated error on a held-out run, are printed by ``benchmarks/bench_fidelity.py
--injected``.
"""

import math
import time
import warnings

import pandas as pd
import pytest
import torch
from sleep_layers import SleepLayer
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.fidelity.calibrator import Calibration, CalibrationWarning, calibrate, runtime_of, whole_step_ms
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation.simulator import simulate

FWD_MS = [6.0, 12.0, 6.0, 12.0]  # profiled, per layer
BWD_MS = [12.0, 24.0, 12.0, 24.0]
SCALE, ACTION_MS, STEP_MS = 1.5, 4.0, 60.0


class SleepySGD(torch.optim.SGD):
    """SGD whose step sleeps a known time: a per-step overhead outside every action."""

    def __init__(self, params, sleep_s):
        super().__init__(params, lr=0.01)
        self.sleep_s = sleep_s

    def step(self, closure=None):
        time.sleep(self.sleep_s)
        return super().step(closure)


def sleepy_model(bounds):
    """Layers sleeping SCALE x the profile, plus ACTION_MS in the first layer of every stage."""
    starts = {b[0] for b in bounds}
    return nn.Sequential(
        *[
            SleepLayer(SCALE * f + ACTION_MS * (i in starts), SCALE * b + ACTION_MS * (i in starts))
            for i, (f, b) in enumerate(zip(FWD_MS, BWD_MS))
        ]
    )


def sleepy_run(schedule, m, bounds, v=1, step_ms=STEP_MS, steps=5, instrument=True):
    profile = Profile.synthetic(fwd_ms=FWD_MS, bwd_ms=BWD_MS)
    part = Partition.from_bounds(profile, bounds, v=v, schedule=schedule)
    sleep_s = step_ms / 1e3
    return psl.run(
        sleepy_model(bounds),
        (torch.randn(4, 3), torch.randn(4, 3)),
        nn.functional.mse_loss,
        part,
        m,
        steps=steps,
        optimizer=lambda params: SleepySGD(params, sleep_s),
        launch=psl.Launch(timeout_s=120, instrument=instrument),
        progress=False,
    )


PROFILE = Profile.synthetic(fwd_ms=FWD_MS, bwd_ms=BWD_MS)
# the profile's boundaries carry no bytes: every calibration here warns that bandwidth_GBps cannot be fitted
pytestmark = [
    pytest.mark.filterwarnings("ignore::pipeswift_lab.fidelity.calibrator.CalibrationWarning"),
    pytest.mark.processes,
]  # its runs start worker processes
SPLIT2 = [(0, 2), (2, 4)]
SPLIT4 = [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.fixture(scope="module")
def runs():
    return {
        "1F1B": sleepy_run("1F1B", 4, SPLIT2),
        "GPipe": sleepy_run("GPipe", 2, SPLIT2),
        "Interleaved1F1B": sleepy_run("Interleaved1F1B", 4, SPLIT4, v=2),
        # only asserted finite (test_calibrate_recovers_the_injected_step_overhead): one steady step is enough
        "1F1B quick optimizer": sleepy_run("1F1B", 4, SPLIT2, step_ms=0.0, steps=2),
    }


def test_calibrate_recovers_the_injected_scale_and_fixed_cost(runs):
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    assert isinstance(cal, Calibration)
    # actions also pay the runtime's own dispatch (well under a ms each) and, on a loaded machine, late wake-ups: the
    # fit sees the slowdown (SCALE, 1.5) and a fixed cost, by how much exactly is the benchmark's figure
    assert cal.compute_scale[2] > 1 and cal.action_ms >= 0
    df = cal.df.set_index("parameter")
    assert list(cal.df.columns) == ["parameter", "value", "unit", "how"]
    assert df.loc["compute_scale[P=2]", "unit"] == "x profiled" and "least squares" in df.loc["action_ms", "how"]
    assert cal.loss_ms[0] >= 0 and cal.loss_ms[1] >= 0
    assert {
        "gap_ms[single-chunk]",
        "gap_ms[multi-chunk]",
        "loss_fwd_ms",
        "loss_bwd_ms",
        "latency_ms",
        "bandwidth_GBps",
        "step_cv",
        "step_overhead_ms[single-chunk]",
        "step_overhead_ms[multi-chunk]",
    } <= set(df.index)


def test_calibrate_recovers_the_injected_step_overhead(runs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        slow = calibrate([runs["1F1B"]], PROFILE)
        quick = calibrate([runs["1F1B quick optimizer"]], PROFILE)
    # the optimizer's known sleep is in the overhead of the run that has it (the difference between the two runs'
    # overheads, a timing against a timing, is the benchmark's figure)
    assert slow.step_overhead["single-chunk"] >= STEP_MS
    assert math.isfinite(quick.step_overhead["single-chunk"])
    both = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    assert both.step_overhead["multi-chunk"] >= STEP_MS


def test_calibrated_predictions_of_a_held_out_run_add_what_the_profile_misses(runs):
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    table = cal.error([runs["GPipe"], runs["1F1B"]])
    assert list(table.columns) == [
        "run",
        "schedule",
        "P",
        "v",
        "m",
        "in_fit",
        "measured_step_ms",
        "predicted_before_ms",
        "predicted_after_ms",
        "rel_error_before",
        "rel_error_after",
    ]
    assert table["in_fit"].tolist() == [False, True]
    held = table.iloc[0]
    assert held["measured_step_ms"] == runs["GPipe"].steady_step_ms
    # before: the profile alone misses the 1.5x scale, the fixed costs and the optimizer's sleep (> 35% short: the
    # sleeps alone make it so, and a load only lengthens the measured step)
    assert held["rel_error_before"] < -0.35
    # after: the fitted scale, costs and overhead (at least the optimizer's sleep) are added; how near the measured
    # step that lands is the benchmark's figure
    assert held["predicted_after_ms"] > held["predicted_before_ms"] + STEP_MS


def test_calibrated_simulate_sweep_and_whole_step(runs):
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    part = Partition.from_bounds(PROFILE, SPLIT2, schedule="1F1B")
    plain, calibrated = simulate(part, 4), simulate(part, 4, calibration=cal)
    assert calibrated.meta["step_overhead_ms"] == cal.step_overhead_ms("1F1B") and plain.meta["step_overhead_ms"] == 0.0
    assert whole_step_ms(calibrated) == pytest.approx(calibrated.step_ms + cal.step_overhead_ms("1F1B"))
    assert calibrated.step_ms > plain.step_ms  # every action is scaled and pays the fixed costs
    table = psl.sweep(PROFILE, P=[2], m=[4], schedules=["1F1B"], progress=False, calibration=cal)
    row = table.iloc[0]
    assert row["step_ms"] == pytest.approx(
        whole_step_ms(psl.simulate(psl.partition(PROFILE, 2, m=4), 4, calibration=cal))
    )
    with pytest.raises(TypeError, match=r"calibration must be a Calibration \(from psl.calibrate"):
        simulate(part, 4, calibration={"scale": 2})
    assert runtime_of("gpipe") == "single-chunk" and runtime_of("ZBVZeroBubble") == "multi-chunk"


def test_save_load_round_trip_and_display(runs, tmp_path):
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    path = cal.save(tmp_path / "cal.json")
    back = Calibration.load(path)
    assert back == cal
    pd.testing.assert_frame_equal(back.df, cal.df)
    pd.testing.assert_frame_equal(back.error([runs["GPipe"]]), cal.error([runs["GPipe"]]))
    assert "Calibration" in cal._repr_html_() and "compute_scale" in str(cal)
    (tmp_path / "other.json").write_text('{"format": "x"}')
    with pytest.raises(ValueError, match="is not a pipeswift_lab calibration"):
        Calibration.load(tmp_path / "other.json")
    import matplotlib

    matplotlib.use("Agg")
    ax = cal.plot([runs["GPipe"], runs["1F1B"]])
    assert ax.get_xlabel().startswith("measured step")
    import matplotlib.pyplot as plt

    plt.close("all")


def test_too_few_runs_warn_naming_the_parameter_and_fit_the_rest(runs):
    with pytest.warns(CalibrationWarning, match=r"step_overhead_ms\[multi-chunk\]"):
        cal = calibrate([runs["1F1B"]], PROFILE)
    assert math.isnan(cal.step_overhead["multi-chunk"]) and cal.step_overhead_ms("Interleaved1F1B") == 0.0
    assert "not fitted" in cal.df.set_index("parameter").loc["step_overhead_ms[multi-chunk]", "how"]
    assert cal.compute_scale[2] > 1  # the rest is still fitted


def test_bad_input_names_what_is_missing(runs):
    with pytest.raises(ValueError, match="runs is empty"):
        calibrate([], PROFILE)
    with pytest.raises(TypeError, match=r"runs\[0\] must be a pipeswift_lab.RunResult"):
        calibrate(["not a run"], PROFILE)
    bare = sleepy_run("1F1B", 2, SPLIT2, steps=1, instrument=False)  # refused for its missing Timeline alone
    with pytest.raises(ValueError, match=r"runs\[1\] .* has no Timeline: it ran with instrument=False"):
        calibrate([runs["1F1B"], bare], PROFILE)
    replicated = psl.run(
        sleepy_model(SPLIT2),
        (torch.randn(8, 3), torch.randn(8, 3)),
        nn.functional.mse_loss,
        Partition.from_bounds(PROFILE, SPLIT2, schedule="1F1B"),
        2,
        steps=1,
        progress=False,
        launch=psl.Launch(timeout_s=120),
        D=2,
    )
    with pytest.raises(ValueError, match=r"runs\[0\] \(1F1B P=2 m=2\) ran D=2 replicas; calibrate fits one pipeline"):
        calibrate([replicated], PROFILE)
    with pytest.raises(ValueError, match="the profile has 3 layers but runs\\[0\\]"):
        calibrate([runs["1F1B"]], Profile.synthetic(fwd_ms=FWD_MS[:3], bwd_ms=BWD_MS[:3]))
    renamed = Profile.synthetic(fwd_ms=FWD_MS, bwd_ms=BWD_MS, name=["w0", "w1", "w2", "w3"], params=[1, 1, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"the profile's layers \['w0', 'w1', 'w2'\] hold parameters but the model of runs\[0\] has no such layer",
    ):
        calibrate([runs["1F1B"]], renamed)
    matching = Profile.synthetic(fwd_ms=FWD_MS, bwd_ms=BWD_MS, name=["0", "1", "2", "3"], params=[1, 1, 1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        assert calibrate([runs["1F1B"]], matching).compute_scale[2] > 0
    other = psl.run(
        nn.Sequential(SleepLayer(1, 1), nn.Linear(3, 3), SleepLayer(1, 1), SleepLayer(1, 1)),
        (torch.randn(4, 3), torch.randn(4, 3)),
        nn.functional.mse_loss,
        Partition.from_bounds(PROFILE, SPLIT2, schedule="1F1B"),
        2,
        steps=1,  # refused for its model alone: no step of it is read
        progress=False,
        launch=psl.Launch(timeout_s=120),
    )
    with pytest.raises(ValueError, match=r"runs\[1\] .* is a run of a different model than runs\[0\]"):
        calibrate([runs["1F1B"], other], PROFILE)
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    with pytest.raises(ValueError, match="different model than the runs this calibration was fitted on"):
        cal.error([other])


def test_gap_scale_is_fitted_per_P_and_round_trips(runs, tmp_path):
    p4 = sleepy_run("1F1B", 4, SPLIT4, steps=4)
    cal = calibrate([runs["1F1B"], p4], PROFILE)
    assert set(cal.gap_scale) == {2, 4} and cal.gap_scale[2] == 1.0 and 0 < cal.gap_scale[4] < math.inf
    assert cal.compute_scale[4] > 1  # the injected slowdown, seen with 4 ranks too
    assert cal.gap_ms("1F1B", 4) == pytest.approx(cal.gap["single-chunk"] * cal.gap_scale[4])
    assert cal.gap_ms("1F1B", 8) == cal.gap_ms("1F1B", 4)  # an unfitted P takes the nearest fitted one
    assert "gap_scale[P=4]" in set(cal.df["parameter"])
    assert Calibration.load(cal.save(tmp_path / "c.json")).gap_scale == cal.gap_scale


def test_plan_uses_the_calibration(runs):
    cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
    kwargs = dict(gpus=2, global_batch=4, steps=1000, schedules=["1F1B"], P=[2], microbatch_sizes=[1], progress=False)
    plain, calibrated = psl.plan(PROFILE, **kwargs), psl.plan(PROFILE, calibration=cal, **kwargs)
    row = calibrated.feasible.iloc[0]
    part = calibrated.partition_of(row)
    expected = whole_step_ms(simulate(part, int(row["m"]), "1F1B", calibration=cal))
    assert row["pipeline_ms"] == pytest.approx(expected)
    assert row["pipeline_ms"] > plain.feasible.iloc[0]["pipeline_ms"]
    assert calibrated.inputs["step_cv"] == cal.step_cv  # the p95 uses the fitted dispersion by default


def test_a_slope_the_data_makes_negative_becomes_a_proportional_fit():
    """Measured times that fall as profiled ones grow (noise on alike stages) give no negative compute scale."""
    from pipeswift_lab.fidelity.fitting import fit_compute

    samples = [
        (2, 1.0, 3.0, False, False),
        (2, 2.0, 2.5, False, False),
        (2, 1.1, 3.1, False, False),
        (2, 2.1, 2.4, False, False),
    ]
    how, missing = {}, []
    scale, action_ms, loss_ms = fit_compute(samples, how, missing)
    assert scale[2] > 0 and action_ms == 0.0 and loss_ms == (0.0, 0.0)
    assert scale[2] == pytest.approx(sum(y * x for _, x, y, _, _ in samples) / sum(x * x for _, x, _, _, _ in samples))
    assert "action_ms" in missing and "scale fitted closer to the origin" in how["action_ms"]
