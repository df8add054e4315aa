"""Predicted vs measured: exact metrics on hand-made timelines, and a real run of layers that sleep a known time."""

import math
from dataclasses import replace

import matplotlib
import pandas as pd
import pytest
import torch
from sleep_layers import SleepLayer
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.fidelity import Comparison, compare
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.steady import MEASURED_STEP, steady_step_index
from pipeswift_lab.simulation.timeline import Timeline

FWD_MS, BWD_MS = 20.0, 40.0


def timeline(rows, source):
    return Timeline(
        pd.DataFrame(rows, columns=["step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms"]), source=source
    )


def test_compare_on_known_timelines():
    predicted = timeline(
        [(0, 0, 0, 0, "F", 0, 10), (0, 1, 1, 0, "F", 10, 20), (0, 1, 1, 0, "B", 20, 40), (0, 0, 0, 0, "B", 40, 60)],
        "simulated",
    )
    # step 0 is a slow warm-up; steps 1 (span 80) and 2 (span 100) follow, each shifted in time
    measured = timeline(
        [
            (0, 0, 0, 0, "F", 0, 50),
            (0, 1, 1, 0, "F", 50, 60),
            (0, 1, 1, 0, "B", 60, 80),
            (0, 0, 0, 0, "B", 80, 300),
            (1, 0, 0, 0, "F", 1000, 1010),
            (1, 1, 1, 0, "F", 1015, 1025),
            (1, 1, 1, 0, "B", 1025, 1050),
            (1, 0, 0, 0, "B", 1060, 1080),
            (2, 0, 0, 0, "F", 2000, 2020),
            (2, 1, 1, 0, "F", 2020, 2030),
            (2, 1, 1, 0, "B", 2030, 2060),
            (2, 0, 0, 0, "B", 2060, 2100),
        ],
        "measured",
    )
    c = compare(predicted, measured)
    assert isinstance(c, Comparison)
    assert c.measured_step == 1  # the median of steps 1 and 2 (lower one), leaving out warm-up step 0
    assert c.step_ms == (60.0, 80.0)
    assert c.step_rel_error == pytest.approx(-0.25)
    df = c.df.set_index(["metric", "rank"])
    assert df.loc[("busy_ms", 0), "predicted"] == 30 and df.loc[("busy_ms", 0), "measured"] == 30
    assert df.loc[("idle_ms", 1), "predicted"] == 30 and df.loc[("idle_ms", 1), "measured"] == 45
    assert df.loc[("mean_B_ms", 1), "measured"] == 25
    assert c.bubble_ratio == pytest.approx((0.5, 1 - 65 / 160))
    assert (c.df["rel_error"].dropna() == ((c.df["predicted"] - c.df["measured"]) / c.df["measured"]).dropna()).all()
    assert compare(predicted, measured, step=2).step_ms == (60.0, 100.0)
    assert c.statistic.startswith("action span") and math.isnan(
        c.replayed_step_ms
    )  # no schedule in meta: nothing to replay
    assert "Predicted vs measured" in c._repr_html_() and "step_rel_error" in str(c)

    with pytest.raises(ValueError, match="step=5 is not a step of the measured run"):
        compare(predicted, measured, step=5)
    with pytest.raises(ValueError, match=r"predicted has ranks \[0\] but measured \[0, 1\]"):
        compare(timeline([(0, 0, 0, 0, "F", 0, 1)], "simulated"), measured)
    with pytest.raises(TypeError, match="predicted must be a Timeline"):
        compare(pd.DataFrame(), measured)


@pytest.fixture(scope="module")
def sleepy_run():
    profile = Profile.synthetic(fwd_ms=[FWD_MS] * 2, bwd_ms=[BWD_MS] * 2)
    part = Partition.from_bounds(profile, [(0, 1), (1, 2)], schedule="1F1B")
    model = nn.Sequential(SleepLayer(FWD_MS, BWD_MS), SleepLayer(FWD_MS, BWD_MS))
    result = run(
        model,
        (torch.randn(4, 3), torch.randn(4, 3)),
        nn.functional.mse_loss,
        part,
        4,
        steps=3,
        progress=False,
        launch=Launch(timeout_s=120),
    )
    return part, result


@pytest.mark.processes
def test_measured_actions_take_the_time_the_layers_sleep_and_clocks_line_up(sleepy_run):
    _, result = sleepy_run
    df = result.timeline.df
    dur = (df["end_ms"] - df["start_ms"]).groupby(df["kind"]).agg(["min", "median"])
    assert FWD_MS <= dur.loc["F", "min"] and BWD_MS <= dur.loc["B", "min"]  # a sleep never ends early
    # the clocks of both ranks line up: a micro-batch's forward on stage 1 starts after stage 0 finished it,
    # and its backward on stage 0 after stage 1 finished its backward
    ends = df.set_index(["step", "stage", "microbatch", "kind"])
    for row in df.itertuples(index=False):
        if row.kind == "F" and row.stage == 1:
            assert row.start_ms >= ends.loc[(row.step, 0, row.microbatch, "F"), "end_ms"]
        if row.kind == "B" and row.stage == 0:
            assert row.start_ms >= ends.loc[(row.step, 1, row.microbatch, "B"), "end_ms"]


@pytest.mark.processes
def test_simulation_predicts_the_sleeping_pipeline(sleepy_run):
    part, result = sleepy_run
    predicted = simulate(part, 4)
    assert predicted.step_ms == pytest.approx((4 + 2 - 1) * (FWD_MS + BWD_MS))
    c = compare(predicted, result)
    assert c.measured_step in (1, 2)
    # the sleeps in the same order are a lower bound of the run (every action at least its sleeps): the prediction is
    # short, never long (by how much, the runtime's own overhead and a busy core's: benchmarks/bench_fidelity.py)
    assert c.step_rel_error <= 0
    # the measured step is RunResult.steady_step_ms (whole step, optimizer included) and says so
    assert c.step_ms[1] == result.steady_step_ms == result.step_ms[c.measured_step]
    assert c.statistic == MEASURED_STEP and "optimizer step included" in c.statistic
    span = c.df.set_index("metric").loc["span_ms", "measured"]
    assert span <= c.step_ms[1]
    # the replay keeps the measured durations in the same order with no time between actions: at least the sleeps'
    # step, at most the measured span (which adds what a busy core leaves between actions)
    assert predicted.step_ms - 1e-6 <= c.replayed_step_ms <= span + 1e-6, (c.replayed_step_ms, span)
    parts = c.decomposition.set_index("component")["ms"]
    assert parts["durations"] + parts["schedule and communication model"] == pytest.approx(parts["total"])
    assert parts["total"] == pytest.approx(c.step_ms[0] - c.step_ms[1])
    assert 0 < c.bubble_ratio[0] < 1 and 0 <= c.bubble_ratio[1] < 1
    matplotlib.use("Agg")
    ax = c.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) == 2 * len(predicted.df[predicted.df["kind"].isin(["F", "B"])])
    ax2 = result.plot()
    assert ax2.get_xlabel() == "time since step start (ms)"
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.processes
def test_one_measured_step_and_step_stats(sleepy_run):
    _, result = sleepy_run
    assert steady_step_index([500.0, 30.0, 10.0, 20.0]) == 3  # the median of 30, 10, 20 after the warm-up
    assert steady_step_index([500.0, 30.0, 10.0]) == 2  # even count: the lower middle one
    assert steady_step_index([7.0]) == 0
    times = (900.0, 10.0, 12.0, 11.0, 30.0, 13.0)
    fake = replace(result, step_ms=times, steps=len(times), meta={**result.meta, "probed_steps": []})
    assert fake.steady_step_ms == 12.0 and fake.steady_step == 2
    probed = replace(fake, meta={**result.meta, "probed_steps": [2]})  # a step whose memory was measured is left out
    assert probed.steady_step == 3 and probed.step_stats(window=10)["steps"].tolist() == [4, 4]
    stats = fake.step_stats(window=3)
    assert stats["window"].tolist() == [0, 1, "all"]
    assert stats["steps"].tolist() == [3, 2, 5] and stats["first_step"].tolist() == [1, 4, 1]  # warm-up step 0 left out
    whole = stats.iloc[-1]
    assert whole["mean_ms"] == pytest.approx(15.2) and whole["max_ms"] == 30.0 and whole["p50_ms"] == 12.0
    assert whole["cv"] == pytest.approx(pd.Series(times[1:]).std() / 15.2)
    assert whole["p95_ms"] == pytest.approx(pd.Series(times[1:]).quantile(0.95))
    assert stats.iloc[0]["p95_ms"] < whole["p95_ms"]  # the slow step 4 is in the second window
    with pytest.raises(ValueError, match="window"):
        fake.step_stats(window=0)


@pytest.mark.processes
def test_a_resumed_run_numbers_its_steps_from_where_it_started(sleepy_run):
    _, result = sleepy_run
    times = (900.0, 10.0, 12.0, 11.0)
    resumed = replace(result, step_ms=times, steps=len(times))
    object.__setattr__(resumed, "first_step", 100)  # what a run resumed at step 100 reports (RunResult.first_step)
    assert resumed.steady_step == 103 and resumed.steady_step_ms == 11.0
    assert resumed.step_stats(window=10)["first_step"].tolist() == [101, 101]
