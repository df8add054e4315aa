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
  different sizes (Hockney's alpha-beta model, as :class:`~pipeswift_lab.link.Link`);
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
:data:`pipeswift_lab.runner.compare.MEASURED_STEP`.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from ._checks import COMPUTE_KINDS, MULTI_CHUNK_SCHEDULES, canonical_schedule
from ._calibrate_fit import (
    _check_runs, _fit_compute, _fit_transfer, _minimize_scalar, _model_of, _partition_of, _profile_table, _profiled_durations,
    _first, _run_key, _steady, _transfer_gaps,
)  # fmt: skip
from ._display import NOISE_CV, html_card, noise_note, text_card  # noqa: F401 - the noise rule, public here

#: Runtime kinds with a per-step overhead of their own.
RUNTIMES = ("single-chunk", "multi-chunk")
_FORMAT = "pipeswift_lab.calibration/1"


class CalibrationWarning(UserWarning):
    """A calibration parameter could not be fitted from the runs given; the warning names it and its default."""


def runtime_of(schedule: str) -> str:
    """``"multi-chunk"`` for schedules torch runs with ``_PipelineScheduleRuntime``, ``"single-chunk"`` for GPipe and 1F1B."""
    return "multi-chunk" if canonical_schedule(schedule) in MULTI_CHUNK_SCHEDULES else "single-chunk"


def whole_step_ms(timeline) -> float:
    """A simulated Timeline's whole step: its action span plus ``meta["step_overhead_ms"]`` (0 without a calibration)."""
    return float(timeline.step_ms) + float(timeline.meta.get("step_overhead_ms", 0.0) or 0.0)


def check_calibration(calibration):
    """Return ``calibration`` if it is a :class:`Calibration` or None; raise ``TypeError`` otherwise."""
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a pipeswift_lab.calibrate.Calibration (from psl.calibrate(runs, profile)) or None; got {type(calibration).__name__}")
    return calibration


# --------------------------------------------------------------------------- the fitted model


@dataclass(frozen=True, repr=False)
class Calibration:
    """The fitted parameters (see the module docstring) and the profile they apply to.

    ``df`` lists every parameter: ``parameter``, ``value``, ``unit``, ``how`` (how it was
    fitted, from how many samples, or why it kept its default).
    """

    compute_scale: dict  # number of co-running ranks P -> measured / profiled action time
    action_ms: float  # fixed cost inside every action, ms
    loss_ms: tuple  # (forward, backward) extra ms of the last stage: the loss, which the profile does not time
    gap: dict  # runtime kind -> ms between consecutive actions of a rank
    step_overhead: dict  # runtime kind -> ms a step spends outside its action span
    latency_ms: float  # per transfer, ms
    bandwidth_GBps: float  # inf when not fitted (transfers take latency_ms only)
    step_cv: float  # coefficient of variation of the step after warm-up (nan when not fitted)
    how: dict = field(default_factory=dict, compare=False)  # parameter -> how it was fitted
    profile_table: pd.DataFrame = field(default=None, compare=False)  # per-layer profile the runs were predicted from
    profile_batch_size: int | None = None  # micro-batch size of that profile (None: use it as is)
    meta: dict = field(default_factory=dict, compare=False)  # runs fitted on (their keys), model fingerprint
    gap_scale: dict = field(default_factory=dict)  # P -> factor on gap_ms (1 at the smallest fitted P; none given: 1)

    # ------------------------------------------------------------------ applying it
    def scale(self, P: int) -> float:
        """The compute scale for ``P`` co-running ranks: the fitted one, else that of the nearest fitted P (ties: the larger)."""
        return float(self.compute_scale[_nearest(self.compute_scale, P)])

    def gap_ms(self, schedule: str, P: int | None = None) -> float:
        """Calibrated time between consecutive actions of a rank under ``schedule``'s runtime with ``P`` ranks (0 when not fitted).

        ``gap_ms[runtime] * gap_scale[P]``, the scale of the nearest fitted P (ties: the larger); 1 without ``P``.
        """
        value = self.gap.get(runtime_of(schedule), math.nan)
        if not math.isfinite(value):
            return 0.0
        if P is None or not self.gap_scale:
            return float(value)
        return float(value) * float(self.gap_scale[_nearest(self.gap_scale, P)])

    def action_durations(self, durations, P: int, schedule: str):
        """Per-kind per-stage durations ``(fwd, bwd, igrad, wgrad)`` as a calibrated run of ``P`` ranks under ``schedule`` takes them."""
        s, gap = self.scale(P), self.gap_ms(schedule, P)
        # the runtime's gap comes with the actions that communicate (F, B, I send or receive); a W follows its I locally
        out = [[s * d + self.action_ms + (gap if code < 3 else 0.0) for d in kind] for code, kind in enumerate(durations)]
        loss_f, loss_b = self.loss_ms
        out[0][-1] += loss_f
        out[1][-1] += loss_b
        out[2][-1] += loss_b
        return tuple(out)

    def transfer_ms(self, nbytes) -> list[float]:
        """Calibrated ms of a transfer of each boundary's ``nbytes``: ``latency_ms + bytes / bandwidth``."""
        bw = self.bandwidth_GBps
        return [self.latency_ms + (0.0 if not math.isfinite(bw) else float(b) / (bw * 1e6)) for b in nbytes]

    def step_overhead_ms(self, schedule: str) -> float:
        """Calibrated per-step overhead of ``schedule``'s runtime (0 when that runtime was not fitted)."""
        value = self.step_overhead.get(runtime_of(schedule), math.nan)
        return 0.0 if not math.isfinite(value) else float(value)

    @property
    def label(self) -> str:
        """``calibrated on N runs``."""
        return f"calibrated on {len(self.meta.get('runs', ()))} runs"

    # ------------------------------------------------------------------ tables
    @property
    def df(self) -> pd.DataFrame:
        """Every parameter: ``parameter``, ``value``, ``unit``, ``how``."""
        rows = [(f"compute_scale[P={P}]", v, "x profiled") for P, v in sorted(self.compute_scale.items())]
        rows += [("action_ms", self.action_ms, "ms per action"), ("loss_fwd_ms", self.loss_ms[0], "ms per last-stage F"),
                 ("loss_bwd_ms", self.loss_ms[1], "ms per last-stage B or I")]
        rows += [(f"gap_ms[{k}]", self.gap.get(k, math.nan), "ms per action") for k in RUNTIMES]
        rows += [(f"gap_scale[P={P}]", v, "x gap_ms") for P, v in sorted(self.gap_scale.items())]
        rows += [(f"step_overhead_ms[{k}]", self.step_overhead.get(k, math.nan), "ms per step") for k in RUNTIMES]
        rows += [("latency_ms", self.latency_ms, "ms per transfer"), ("bandwidth_GBps", self.bandwidth_GBps, "GB/s"),
                 ("step_cv", self.step_cv, "std / mean of the step")]
        return pd.DataFrame([{"parameter": p, "value": float(v), "unit": u, "how": self.how.get(p, "")} for p, v, u in rows])

    def error(self, runs) -> pd.DataFrame:
        """Per run: the measured step (:attr:`RunResult.steady_step_ms`), the prediction before and after calibration, both relative errors.

        Columns: ``run`` (index in ``runs``), ``schedule``, ``P``, ``v``, ``m``, ``in_fit``
        (whether the run was one this calibration was fitted on: ``False`` is the held-out
        check), ``measured_step_ms``, ``predicted_before_ms`` (the uncalibrated simulated
        step), ``predicted_after_ms`` (calibrated span plus the runtime's step overhead),
        ``rel_error_before``, ``rel_error_after`` (``(predicted - measured) / measured``).
        """
        from .simulate import simulate

        runs = _check_runs(runs, self.meta.get("model"))
        fitted = set(self.meta.get("runs", ()))
        rows = []
        for i, run in enumerate(runs):
            part = _partition_of(run, self.profile_table, self.profile_batch_size, i)
            measured = float(run.steady_step_ms)
            before = simulate(part, run.m, schedule=run.schedule).step_ms
            after = whole_step_ms(simulate(part, run.m, schedule=run.schedule, calibration=self))
            rows.append({"run": i, "schedule": run.schedule, "P": run.P, "v": run.v, "m": run.m, "in_fit": _run_key(run) in fitted,
                         "measured_step_ms": measured, "predicted_before_ms": before, "predicted_after_ms": after,
                         "rel_error_before": (before - measured) / measured, "rel_error_after": (after - measured) / measured})
        return pd.DataFrame(rows)

    def plot(self, runs, ax=None):
        """Predicted against measured step of ``runs``, before (hollow) and after (filled) calibration, with the y = x line. Returns the Axes."""
        from .plot import get_ax

        table = self.error(runs)
        ax = get_ax(ax, figsize=(5.0, 4.6))
        hi = float(np.nanmax(table[["measured_step_ms", "predicted_before_ms", "predicted_after_ms"]].to_numpy())) * 1.08
        ax.plot([0, hi], [0, hi], color="#888888", linestyle="--", linewidth=1, label="y = x")
        held = ~table["in_fit"]
        for mask, marker, name in ((held, "o", "held out"), (~held, "s", "fitted on")):
            if mask.any():
                sub = table[mask]
                ax.scatter(sub["measured_step_ms"], sub["predicted_before_ms"], marker=marker, facecolors="none", edgecolors="#d62728",
                           label=f"before ({name})")
                ax.scatter(sub["measured_step_ms"], sub["predicted_after_ms"], marker=marker, color="#1f77b4", label=f"after ({name})")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel("measured step (ms, steady_step_ms)")
        ax.set_ylabel("predicted step (ms)")
        med_b, med_a = table["rel_error_before"].abs().median(), table["rel_error_after"].abs().median()
        ax.set_title(f"median |error| {med_b:.0%} before, {med_a:.0%} after")
        ax.legend(fontsize="small")
        return ax

    # ------------------------------------------------------------------ files
    def save(self, path) -> str:
        """Write the calibration (parameters, how, the profile table) as JSON to ``path``; return the path."""
        data = {
            "format": _FORMAT, "compute_scale": {str(k): v for k, v in self.compute_scale.items()}, "action_ms": self.action_ms,
            "loss_ms": list(self.loss_ms), "gap": dict(self.gap), "gap_scale": {str(k): v for k, v in self.gap_scale.items()}, "step_overhead": dict(self.step_overhead), "latency_ms": self.latency_ms,
            "bandwidth_GBps": self.bandwidth_GBps, "step_cv": self.step_cv, "how": dict(self.how),
            "profile_table": None if self.profile_table is None else self.profile_table.to_dict(orient="list"),
            "profile_batch_size": self.profile_batch_size, "meta": _jsonable(self.meta),
        }
        Path(path).write_text(json.dumps(data, indent=1), encoding="utf-8")
        return str(path)

    @classmethod
    def load(cls, path) -> "Calibration":
        """Read a calibration written by :meth:`save`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{str(path)!r} is not a pipeswift_lab calibration (format {_FORMAT!r})")
        meta = dict(data["meta"])
        meta["runs"] = tuple(_tuples(k) for k in meta.get("runs", ()))
        if "model" in meta:
            meta["model"] = _tuples(meta["model"])
        table = None if data["profile_table"] is None else pd.DataFrame(data["profile_table"])
        return cls({int(k): float(v) for k, v in data["compute_scale"].items()}, float(data["action_ms"]),
                   tuple(float(x) for x in data["loss_ms"]), {k: float(v) for k, v in data["gap"].items()},
                   {k: float(v) for k, v in data["step_overhead"].items()}, float(data["latency_ms"]), float(data["bandwidth_GBps"]),
                   float(data["step_cv"]), dict(data["how"]), table, data["profile_batch_size"], meta,
                   {int(k): float(v) for k, v in data.get("gap_scale", {}).items()})

    # ------------------------------------------------------------------ display
    def _summary(self) -> dict:
        scales = ", ".join(f"P={P}: {v:.3g}x" for P, v in sorted(self.compute_scale.items()))
        return {"runs": len(self.meta.get("runs", ())), "compute_scale": scales, "action_ms": self.action_ms,
                "gap_ms": ", ".join(f"{k} {v:.3g}" for k, v in self.gap.items()),
                "gap_scale": ", ".join(f"P={P}: {v:.3g}x" for P, v in sorted(self.gap_scale.items())),
                "step_overhead_ms": ", ".join(f"{k} {v:.3g}" for k, v in self.step_overhead.items()),
                "latency_ms": self.latency_ms, "step_cv": self.step_cv}

    def _repr_html_(self) -> str:
        return html_card(f"Calibration ({self.label})", self._summary(), self.df)

    def __str__(self) -> str:
        return text_card(f"Calibration ({self.label})", self._summary())

    __repr__ = __str__


def _nearest(fitted: dict, P: int) -> int:
    """``P`` when fitted, else the nearest fitted P (ties: the larger)."""
    return P if P in fitted else min(fitted, key=lambda k: (abs(k - P), -k))


def _tuples(value):
    """JSON lists back to (nested) tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


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
    from .simulate import simulate_step_ms

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
        samples += [(run.P, profiled[(int(s), k)], float(d), int(s) == last and k == "F", int(s) == last and k in ("B", "I"))
                    for (s, k), d in med.items()]
        span = df.groupby("step")["end_ms"].max() - df.groupby("step")["start_ms"].min()
        spans.append(float(span.median()))
        overheads[runtime_of(run.schedule)] += [run.step_ms[k - _first(run)] - span[k] for k in steady if k in span.index]
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

    cal = Calibration(scale, action_ms, loss_ms, {}, step_overhead, latency_ms, bandwidth, step_cv, how, table, batch_size,
                      {"runs": tuple(_run_key(r) for r in runs), "model": _model_of(runs[0])})

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
        return replace(cal, gap={k: values[("gap", k)] for k in kinds},
                       gap_scale={P_ref: 1.0, **{P: values[("scale", P)] for P in other_Ps}} if other_Ps else {})

    def loss(values):
        t = trial(values)
        err = [(simulate_step_ms(part, run.m, run.schedule, calibration=t) - span) / span for run, part, span in zip(runs, parts, spans)]
        return float(np.sum(np.square(err)))

    upper_gap = max(spans) / min(2 * run.m * run.v for run in runs)
    bounds = {key: (0.0, upper_gap) if key[0] == "gap" else (0.25, 8.0) for key in values}
    for _ in range(3 if len(values) > 1 else 1):
        for key in values:
            values[key] = _minimize_scalar(lambda x, key=key: loss({**values, key: x}), *bounds[key])
    for kind in kinds:
        n = sum(runtime_of(run.schedule) == kind for run in runs)
        how[f"gap_ms[{kind}]"] = (f"least squares of the relative error of the simulated action span against the measured median span, "
                                  f"jointly over all {len(runs)} runs ({n} of them {kind}; searched in [0, {upper_gap:.3g}] ms), at P={P_ref}")
    for P in other_Ps:
        n = sum(run.P == P for run in runs)
        how[f"gap_scale[P={P}]"] = f"the same least squares, jointly; {n} runs at P={P} (searched in [0.25, 8])"
    cal = replace(trial(values), how=how)
    if missing:
        warnings.warn(f"calibrate: the runs cannot determine {', '.join(missing)}; see Calibration.df 'how' for the default used. "
                      f"Add runs that vary what they need (e.g. a run of the other runtime, other stage sizes).",
                      CalibrationWarning, stacklevel=2)
    return cal


__all__ = ["NOISE_CV", "Calibration", "CalibrationWarning", "RUNTIMES", "calibrate", "noise_note", "check_calibration", "runtime_of", "whole_step_ms"]
