"""A run that recomputes is predicted as it ran: its backwards take the forward again (the profile's recompute
columns), in the simulator, in compare and in calibrate's predictions. Layers sleep a known time."""

import pytest
import torch
from sleep_layers import SLACK_MS, SleepLayer
from torch import nn

from pipeswift_lab.fidelity import calibrate, compare
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
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
    for recompute in (None, "full"):
        out[recompute] = run(model, (x, y), nn.functional.mse_loss, part, 4, steps=3, progress=False,
                             recompute=recompute, timeout_s=120)  # fmt: skip
    return prof, out


def test_the_profile_measures_the_forward_that_recomputation_repeats(runs):
    prof, _ = runs
    # a difference of two measured backwards (with and without the forward again): the plain one a load can stretch
    # too, so no exact lower bound; half a forward tells the repeated forward from none
    assert (prof.df["recompute_ms"] >= FWD_MS / 2).all() and (prof.df["recompute_ms"] < FWD_MS + SLACK_MS).all()


@pytest.mark.filterwarnings("ignore:calibrate. the runs cannot determine")
def test_a_recomputing_run_is_simulated_and_calibrated_with_its_backwards_recomputed(runs):
    prof, results = runs
    recomputed = results["full"]
    backward = recomputed.timeline.df.query("kind == 'B'")
    assert ((backward["end_ms"] - backward["start_ms"]) >= FWD_MS + BWD_MS).all(), "each backward ran its forward again"
    predicted = simulate(Partition.from_bounds(prof.with_recompute("full"), BOUNDS, schedule="1F1B"), 4)
    assert abs(compare(predicted, recomputed).step_rel_error) < 0.2  # the runtime's own overhead beside the sleeps
    calibration = calibrate([results[None]], prof)
    errors = calibration.error([results[None], recomputed]).set_index("run")
    assert errors.loc[1, "predicted_before_ms"] == pytest.approx(predicted.step_ms)
    assert errors.loc[1, "predicted_before_ms"] > errors.loc[0, "predicted_before_ms"] + (4 + 2 - 1) * FWD_MS * 0.9
    with pytest.raises(ValueError, match=r"runs\[0\] \(1F1B P=2 m=4\) recomputed 2 layers but the profile has no"):
        calibrate([recomputed], prof.df.drop(columns=["recompute_ms"]))
