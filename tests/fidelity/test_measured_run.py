"""``MeasuredRun``: a job the toolkit did not launch (a plain torch pipelining job's profiler traces, the partition
it ran) serves ``calibrate`` and ``compare`` as a ``RunResult`` does."""

import warnings

import pytest
import torch
from torch_jobs import job_module

import pipeswift_lab as psl
from pipeswift_lab.fidelity import CalibrationWarning
from pipeswift_lab.fidelity.calibrator import whole_step_ms

pytestmark = pytest.mark.processes  # the trace fixtures launch torchrun jobs

M = 4


@pytest.fixture(scope="module")
def job_profile(one_torch_thread):
    """The traced job's model and its per-layer profile at the job's micro-batch (64 rows / 4)."""
    model = job_module().build_model()
    return model, psl.profile(model, torch.randn(16, 256), progress=False, repeats=5)


def equal_bounds(n_stages, n_layers=9):
    return [(s * n_layers // n_stages, (s + 1) * n_layers // n_stages) for s in range(n_stages)]


def test_calibrating_on_an_imported_run_predicts_it_and_serves_another_schedule(
    interleaved_traces, gpipe_traces, job_profile
):
    model, prof = job_profile
    interleaved = psl.MeasuredRun.from_profiler(interleaved_traces, equal_bounds(4), model=model)
    gpipe = psl.MeasuredRun.from_profiler(gpipe_traces, equal_bounds(2), model=model)
    assert (interleaved.schedule, interleaved.P, interleaved.v, interleaved.m) == ("Interleaved1F1B", 2, 2, M)
    assert interleaved.first_step == interleaved.timeline.steps[0] and len(interleaved.step_ms) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        cal = psl.calibrate([interleaved], prof)
    error = cal.error([interleaved, gpipe]).set_index("schedule")
    assert error["in_fit"].to_dict() == {"Interleaved1F1B": True, "GPipe": False}
    # the fitted run is predicted closer than the profile alone predicts it, and within 20% or, on a machine whose
    # steps vary more than that, within twice the run's own step dispersion (the fit prices median components; the
    # measured step is one step)
    fitted = error.loc["Interleaved1F1B"]
    dispersion = float(interleaved.step_stats()["cv"].iloc[0])
    assert abs(fitted["rel_error_after"]) < abs(fitted["rel_error_before"])
    assert abs(fitted["rel_error_after"]) < max(0.2, 2 * dispersion)
    # the held-out schedule (the other runtime) is predicted from the same fit; how close a held-out run is
    # predicted is a figure of the machine, reported by benchmarks/bench_fidelity.py, not asserted here
    part = psl.Partition.from_bounds(prof.df, equal_bounds(2), schedule="GPipe", m=M)
    calibrated = psl.simulate(part, m=M, calibration=cal)
    assert error.loc["GPipe", "predicted_after_ms"] == pytest.approx(whole_step_ms(calibrated))
    assert error.loc["GPipe", "predicted_before_ms"] == pytest.approx(psl.simulate(part, m=M).step_ms)
    comparison = psl.compare(calibrated, gpipe)
    assert comparison.measured is gpipe.timeline and comparison.measured_step in gpipe.timeline.steps[1:]
    assert "MeasuredRun" in repr(interleaved) and "clock_skew_ms" in interleaved._repr_html_()


def test_a_measured_run_refuses_what_does_not_fit_the_trace(interleaved_traces, job_profile):
    model, _ = job_profile
    tl = psl.Timeline.from_profiler(interleaved_traces)
    with pytest.raises(ValueError, match="the partition has 2 stages but the trace ran 4"):
        psl.MeasuredRun(tl, equal_bounds(2))
    with pytest.raises(ValueError, match="consecutive"):
        psl.MeasuredRun(tl, [(0, 2), (3, 4), (4, 6), (6, 9)])
    with pytest.raises(TypeError, match="measured Timeline"):
        psl.MeasuredRun(psl.Timeline(tl.df, source="simulated", meta=tl.meta), equal_bounds(4))
    with pytest.raises(ValueError, match="microbatch_size"):
        psl.MeasuredRun(tl, equal_bounds(4), microbatch_size=0)
    # runs of two models do not calibrate together
    other = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(9)])
    a = psl.MeasuredRun(tl, equal_bounds(4), model=model)
    b = psl.MeasuredRun(tl, equal_bounds(4), model=other)
    prof = psl.Profile.synthetic(fwd_ms=[0.2] * 9, bwd_ms=[0.4] * 9)
    with pytest.raises(ValueError, match="different model"):
        psl.calibrate([a, b], prof)
