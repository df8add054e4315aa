"""A run that recomputes is predicted as it ran: its backwards take the forward again (the profile's recompute
columns), in the simulator, in compare and in calibrate's predictions. Layers sleep a known time."""

import pytest
import torch
from sleep_layers import SleepLayer
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.fidelity import calibrate, compare
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.recompute_costs import RECOMPUTE_COLUMNS
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run
from pipeswift_lab.simulation.simulator import simulate

FWD_MS, BWD_MS = 10.0, 20.0
BOUNDS = [(0, 1), (1, 2)]

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def runs():
    """The sleeping model profiled with recompute=True, and a 1F1B run of it without and with full recomputation."""
    model = nn.Sequential(SleepLayer(FWD_MS, BWD_MS), SleepLayer(FWD_MS, BWD_MS))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    prof = profile(model, x[:1], target=y[:1], loss_fn=nn.functional.mse_loss, warmup=1, repeats=3, recompute=True,
                   progress=False)  # fmt: skip
    part = Partition.from_bounds(prof, BOUNDS, schedule="1F1B")
    out = {}
    for recompute in (None, "full"):  # two steps: the steady one after the warm-up is what compare and calibrate read
        out[recompute] = run(model, (x, y), nn.functional.mse_loss, part, 4, steps=2, progress=False,
                             recompute=recompute, launch=Launch(timeout_s=120))  # fmt: skip
    return prof, out


def test_the_profile_measures_the_forward_that_recomputation_repeats(runs):
    prof, _ = runs
    # recompute_ms is a difference of two measured backwards (with and without the forward again), either of which a
    # busy core stretches; the recomputing backward they add up to ran the forward again, so it takes at least both
    # sleeps (what the difference comes to on a quiet machine: benchmarks/bench_recompute.py)
    recomputing_backward = prof.df["bwd_ms"] + prof.df["recompute_ms"]
    assert (recomputing_backward >= FWD_MS + BWD_MS - 1e-9).all(), prof.df[["bwd_ms", "recompute_ms"]]


@pytest.mark.filterwarnings("ignore:calibrate. the runs cannot determine")
def test_a_recomputing_run_is_simulated_and_calibrated_with_its_backwards_recomputed(runs):
    prof, results = runs
    recomputed = results["full"]
    backward = recomputed.timeline.df.query("kind == 'B'")
    assert ((backward["end_ms"] - backward["start_ms"]) >= FWD_MS + BWD_MS).all(), "each backward ran its forward again"
    predicted = simulate(Partition.from_bounds(prof.with_recompute("full"), BOUNDS, schedule="1F1B"), 4)
    # the simulator's backwards take the profile's forward again
    simulated = predicted.df.query("kind == 'B'")
    want = (prof.df["bwd_ms"] + prof.df["recompute_ms"]).to_numpy()[simulated["stage"].to_numpy()]
    assert (simulated["end_ms"] - simulated["start_ms"]).to_numpy() == pytest.approx(want)
    # predicted from the sleeps themselves, the recomputing step is a lower bound of the measured one (every action
    # at least its sleeps, in the same order): compare says the prediction is short, never long
    columns = {**dict.fromkeys(RECOMPUTE_COLUMNS, 0.0), "recompute_ms": FWD_MS}  # no bytes: time alone matters here
    exact = Profile.synthetic(fwd_ms=[FWD_MS] * 2, bwd_ms=[BWD_MS] * 2, **columns)
    lower = simulate(Partition.from_bounds(exact.with_recompute("full"), BOUNDS, schedule="1F1B"), 4)
    assert lower.step_ms == pytest.approx((4 + 2 - 1) * (2 * FWD_MS + BWD_MS))
    assert compare(lower, recomputed).step_rel_error <= 0
    calibration = calibrate([results[None]], prof)
    errors = calibration.error([results[None], recomputed]).set_index("run")
    assert errors.loc[1, "predicted_before_ms"] == pytest.approx(predicted.step_ms)
    plain = simulate(Partition.from_bounds(prof, BOUNDS, schedule="1F1B"), 4)
    assert errors.loc[0, "predicted_before_ms"] == pytest.approx(plain.step_ms)
    with pytest.raises(ValueError, match=r"runs\[0\] \(1F1B P=2 m=4\) recomputed 2 layers but the profile has no"):
        calibrate([recomputed], prof.df.drop(columns=["recompute_ms"]))
