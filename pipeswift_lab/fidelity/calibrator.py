"""Fitting the simulator to measured runs, and publishing its error before and after.

A profile times each layer alone; inside a pipeline the same layer runs slower (ranks share
cores and memory bandwidth), torch's schedule runtime spends time outside the actions, and
transfers have latency. :func:`calibrate` fits a small model of these effects to the
measured Timelines of one or more :class:`~pipeswift_lab.runner.RunResult` of one model:

* ``compute_scale[P=k]`` — measured action time over profiled time when ``k`` ranks run
  at once; ``action_ms`` — a fixed cost inside every action (kernel launch, hooks,
  Python); ``loss_fwd_ms`` / ``loss_bwd_ms`` — the extra time of the last stage's forward
  and backward, the loss and its gradient, which a per-layer profile does not time: one
  least-squares fit ``measured = scale[P] * profiled + action_ms + loss terms`` over the
  median duration of every (run, stage, kind), costs kept non-negative;
* ``latency_ms`` and ``bandwidth_GBps`` — a transfer as seen by the runtime, from the gaps
  between a sender's action end and the receiver's action start, counted only where the
  receiver was already idle (so the gap is the transfer, not a queue): their median, or a
  least-squares line ``gap = latency + bytes / bandwidth`` when the boundaries carry
  different sizes (Hockney's alpha-beta model, as :class:`~pipeswift_lab.core.link.Link`);
* ``step_overhead_ms[single-chunk]`` / ``[multi-chunk]`` — the time a step spends outside
  its first-to-last action span (schedule runtime, optimizer step): the median over steps,
  per runtime (``ScheduleGPipe``/``Schedule1F1B`` against ``_PipelineScheduleRuntime``);
* ``gap_ms[single-chunk]`` / ``[multi-chunk]`` — the runtime's time between consecutive
  actions of a rank (posting and waiting on transfers, bookkeeping, descheduling), charged
  to the actions that communicate (``F``, ``B``, ``I``; a ``W`` follows its ``I`` locally), at the
  smallest P of the runs, and ``gap_scale[P=k]`` — how much longer it is when ``k`` ranks
  share the machine (Python work between actions is slowed by co-running ranks more than
  the kernels are): fitted last, jointly, by least squares of the relative error of the
  simulated against the measured action span over all runs (coordinate descent, each
  parameter by a bounded scalar search), with everything above fixed;
* ``step_cv`` — the step-time dispersion, the median over runs of the coefficient of
  variation of the steps after the warm-up; the planner's p95 uses it.

A calibrated simulation runs each action for ``scale[P] * profiled + action_ms + gap_ms * gap_scale[P]``
(no gap for ``W``)
(plus the loss terms on the last stage) and adds ``step_overhead_ms`` of its runtime to the
span. :meth:`Calibration.error` gives
the error before and after on any runs (held out or not). A parameter the runs cannot
determine (no multi-chunk run, one boundary size, one profiled duration) is left at a
stated default with a warning naming it; the rest are fitted.

"The measured step" is everywhere :attr:`RunResult.steady_step_ms`:
:data:`pipeswift_lab.fidelity.comparison.MEASURED_STEP`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pandas as pd

from ..core.display import NOISE_CV, noise_note  # noqa: F401 - the noise rule, public here
from ..core.vocabulary import COMPUTE_KINDS
from ..simulation.calibration import RUNTIMES, SimulatorCalibration, check_calibration, runtime_of, whole_step_ms
from .fitting import (
    _check_runs,
    _first,
    _fit_compute,
    _fit_transfer,
    _minimize_scalar,
    _model_of,
    _partition_of,
    _profile_table,
    _profiled_durations,
    _run_key,
    _steady,
    _transfer_gaps,
)  # fmt: skip


class CalibrationWarning(UserWarning):
    """A calibration parameter could not be fitted from the runs given; the warning names it and its default."""


class Calibration(SimulatorCalibration):
    """A :class:`~pipeswift_lab.simulation.calibration.SimulatorCalibration` fitted on measured runs, with its error
    on any runs (:meth:`error`, :meth:`plot`). ``df`` lists every parameter: ``parameter``, ``value``, ``unit``,
    ``how`` (how it was fitted, from how many samples, or why it kept its default)."""

    def error(self, runs) -> pd.DataFrame:
        """Per run: the measured step (:attr:`RunResult.steady_step_ms`), the prediction before and after calibration, both relative errors.

        Columns: ``run`` (index in ``runs``), ``schedule``, ``P``, ``v``, ``m``, ``in_fit``
        (whether the run was one this calibration was fitted on: ``False`` is the held-out
        check), ``measured_step_ms``, ``predicted_before_ms`` (the uncalibrated simulated
        step), ``predicted_after_ms`` (calibrated span plus the runtime's step overhead),
        ``rel_error_before``, ``rel_error_after`` (``(predicted - measured) / measured``).
        """
        from ..simulation.simulator import simulate

        runs = _check_runs(runs, self.meta.get("model"))
        fitted = set(self.meta.get("runs", ()))
        rows = []
        for i, run in enumerate(runs):
            part = _partition_of(run, self.profile_table, self.profile_batch_size, i)
            measured = float(run.steady_step_ms)
            before = simulate(part, run.m, schedule=run.schedule).step_ms
            after = whole_step_ms(simulate(part, run.m, schedule=run.schedule, calibration=self))
            rows.append(
                {
                    "run": i,
                    "schedule": run.schedule,
                    "P": run.P,
                    "v": run.v,
                    "m": run.m,
                    "in_fit": _run_key(run) in fitted,
                    "measured_step_ms": measured,
                    "predicted_before_ms": before,
                    "predicted_after_ms": after,
                    "rel_error_before": (before - measured) / measured,
                    "rel_error_after": (after - measured) / measured,
                }
            )
        return pd.DataFrame(rows)

    def plot(self, runs, ax=None):
        """Predicted against measured step of ``runs``, before (hollow) and after (filled) calibration, with the y = x line. Returns the Axes."""
        from ..core.plot import get_ax

        table = self.error(runs)
        ax = get_ax(ax, figsize=(5.0, 4.6))
        hi = (
            float(np.nanmax(table[["measured_step_ms", "predicted_before_ms", "predicted_after_ms"]].to_numpy())) * 1.08
        )
        ax.plot([0, hi], [0, hi], color="#888888", linestyle="--", linewidth=1, label="y = x")
        held = ~table["in_fit"]
        for mask, marker, name in ((held, "o", "held out"), (~held, "s", "fitted on")):
            if mask.any():
                sub = table[mask]
                ax.scatter(
                    sub["measured_step_ms"],
                    sub["predicted_before_ms"],
                    marker=marker,
                    facecolors="none",
                    edgecolors="#d62728",
                    label=f"before ({name})",
                )
                ax.scatter(
                    sub["measured_step_ms"],
                    sub["predicted_after_ms"],
                    marker=marker,
                    color="#1f77b4",
                    label=f"after ({name})",
                )
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel("measured step (ms, steady_step_ms)")
        ax.set_ylabel("predicted step (ms)")
        med_b, med_a = table["rel_error_before"].abs().median(), table["rel_error_after"].abs().median()
        ax.set_title(f"median |error| {med_b:.0%} before, {med_a:.0%} after")
        ax.legend(fontsize="small")
        return ax


# --------------------------------------------------------------------------- fitting


def calibrate(runs, profile) -> Calibration:
    """Fit the simulator to measured runs of one model; return a :class:`Calibration`.

    ``runs`` is one or more :class:`~pipeswift_lab.runner.RunResult` of the same model (any
    P, m, schedule, partition), instrumented (the default of :func:`~pipeswift_lab.run`);
    ``profile`` the :class:`~pipeswift_lab.Profile` (or per-layer DataFrame) their partitions
    came from. With ``profile.meta["batch_size"]`` and the runs' micro-batch size both
    known and different, layer times are scaled in proportion. The parameters, their units
    and how each was fitted are in ``Calibration.df`` (the module docstring gives the model).
    A parameter the runs cannot determine keeps a stated default and a
    :class:`CalibrationWarning` names it.
    """
    from ..simulation.simulator import simulate_step_ms

    runs = _check_runs(runs)
    table, batch_size = _profile_table(profile)
    parts = [_partition_of(run, table, batch_size, i) for i, run in enumerate(runs)]
    how: dict = {}
    missing: list[str] = []

    # 1. compute scale per P and the fixed cost per action: least squares over (run, stage, kind) medians
    samples = []  # (P, profiled, measured)
    spans, overheads, gaps, cvs = [], {k: [] for k in RUNTIMES}, [], []
    for run, part in zip(runs, parts):
        steady = _steady(run)
        df = run.timeline.df
        df = df[df["step"].isin(steady) & df["kind"].isin(COMPUTE_KINDS)]
        if df.empty:
            raise ValueError(f"the run {run.schedule} P={run.P} m={run.m} has no measured actions in steps {steady}")
        profiled = _profiled_durations(part)
        med = (df["end_ms"] - df["start_ms"]).groupby([df["stage"], df["kind"]]).median()
        last = len(part.stage_fwd_ms) - 1
        samples += [
            (run.P, profiled[(int(s), k)], float(d), int(s) == last and k == "F", int(s) == last and k in ("B", "I"))
            for (s, k), d in med.items()
        ]
        span = df.groupby("step")["end_ms"].max() - df.groupby("step")["start_ms"].min()
        spans.append(float(span.median()))
        overheads[runtime_of(run.schedule)] += [
            run.step_ms[k - _first(run)] - span[k] for k in steady if k in span.index
        ]
        gaps += _transfer_gaps(df, part)
        cv = float(run.step_stats().iloc[-1]["cv"])  # the dispersion the noise rule reads too
        if math.isfinite(cv):
            cvs.append(cv)
    scale, action_ms, loss_ms = _fit_compute(samples, how, missing)

    # 2. transfers from the idle receivers' gaps
    latency_ms, bandwidth = _fit_transfer(gaps, how, missing)

    # 3. per-step overhead per runtime
    step_overhead = {}
    for kind in RUNTIMES:
        values = overheads[kind]
        name = f"step_overhead_ms[{kind}]"
        if values:
            step_overhead[kind] = max(0.0, float(np.median(values)))
            how[name] = f"median over {len(values)} steps of the step time minus its first-to-last action span"
        else:
            step_overhead[kind] = math.nan
            how[name] = f"not fitted: no run of a {kind} schedule; predicted as 0"
            missing.append(name)

    # 4. step dispersion
    if cvs:
        step_cv = float(np.median(cvs))
        how["step_cv"] = f"median over {len(cvs)} runs of std/mean of the steps after the first"
    else:
        step_cv = math.nan
        how["step_cv"] = "not fitted: no run has 2 or more steps after the warm-up step"
        missing.append("step_cv")

    cal = Calibration(
        scale,
        action_ms,
        loss_ms,
        {},
        step_overhead,
        latency_ms,
        bandwidth,
        step_cv,
        how,
        table,
        batch_size,
        {"runs": tuple(_run_key(r) for r in runs), "model": _model_of(runs[0])},
    )

    # 5. the runtime's gap between actions, per runtime, and its scale per P: joint least squares of the relative
    #    span error over all runs (the rest fixed), by coordinate descent
    P_ref = min(run.P for run in runs)
    kinds = [k for k in RUNTIMES if any(runtime_of(run.schedule) == k for run in runs)]
    for kind in RUNTIMES:
        if kind not in kinds:
            how[f"gap_ms[{kind}]"] = f"not fitted: no run of a {kind} schedule; predicted as 0"
            missing.append(f"gap_ms[{kind}]")
    other_Ps = sorted({run.P for run in runs} - {P_ref})
    values = {("gap", k): 0.0 for k in kinds}
    values.update({("scale", P): 1.0 for P in other_Ps})

    def trial(values):
        return replace(
            cal,
            gap={k: values[("gap", k)] for k in kinds},
            gap_scale={P_ref: 1.0, **{P: values[("scale", P)] for P in other_Ps}} if other_Ps else {},
        )

    def loss(values):
        t = trial(values)
        err = [
            (simulate_step_ms(part, run.m, run.schedule, calibration=t) - span) / span
            for run, part, span in zip(runs, parts, spans)
        ]
        return float(np.sum(np.square(err)))

    upper_gap = max(spans) / min(2 * run.m * run.v for run in runs)
    bounds = {key: (0.0, upper_gap) if key[0] == "gap" else (0.25, 8.0) for key in values}
    for _ in range(3 if len(values) > 1 else 1):
        for key in values:
            values[key] = _minimize_scalar(lambda x, key=key: loss({**values, key: x}), *bounds[key])
    for kind in kinds:
        n = sum(runtime_of(run.schedule) == kind for run in runs)
        how[f"gap_ms[{kind}]"] = (
            f"least squares of the relative error of the simulated action span against the measured median span, "
            f"jointly over all {len(runs)} runs ({n} of them {kind}; searched in [0, {upper_gap:.3g}] ms), at P={P_ref}"
        )
    for P in other_Ps:
        n = sum(run.P == P for run in runs)
        how[f"gap_scale[P={P}]"] = f"the same least squares, jointly; {n} runs at P={P} (searched in [0.25, 8])"
    cal = replace(trial(values), how=how)
    if missing:
        warnings.warn(
            f"calibrate: the runs cannot determine {', '.join(missing)}; see Calibration.df 'how' for the default used. "
            f"Add runs that vary what they need (e.g. a run of the other runtime, other stage sizes).",
            CalibrationWarning,
            stacklevel=2,
        )
    return cal


__all__ = [
    "NOISE_CV",
    "Calibration",
    "CalibrationWarning",
    "RUNTIMES",
    "calibrate",
    "noise_note",
    "check_calibration",
    "runtime_of",
    "whole_step_ms",
]
