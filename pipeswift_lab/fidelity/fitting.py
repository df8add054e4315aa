"""The fits behind :func:`pipeswift_lab.fidelity.calibrator.calibrate`: the least-squares and median fits of the
model's parameters (the model is stated in :mod:`pipeswift_lab.fidelity.calibrator`) from what
:mod:`pipeswift_lab.fidelity.measurements` read in the runs.

Every fit takes ``how`` (parameter -> how it was fitted) and ``missing`` (the parameters the runs cannot determine) and
adds to them; :func:`~pipeswift_lab.fidelity.calibrator.calibrate` publishes both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from ..core.link import fit_latency_bandwidth
from ..partitioning.stages import Partition
from ..simulation.calibration import RUNTIMES, SimulatorCalibration, runtime_of
from .measurements import Run, Sample

#: A calibration of any class (:func:`fit_gaps` returns one of the class it is given).
C = TypeVar("C", bound=SimulatorCalibration)


# --------------------------------------------------------------------------- fitting
def fit_compute(
    samples: Sequence[Sample], how: dict[str, str], missing: list[str]
) -> tuple[dict[int, float], float, tuple[float, float]]:
    """``({P: scale}, action_ms, (loss_fwd_ms, loss_bwd_ms))`` by least squares, the additive costs kept >= 0.

    ``measured = scale[P] * profiled + action_ms + loss_fwd_ms [last-stage F] + loss_bwd_ms [last-stage B/I]``;
    an additive cost the unconstrained fit makes negative is set to 0 and the rest refitted, and a scale it makes
    ``<= 0`` drops the additive costs (``action_ms`` first) until it is positive: at the end the proportional model
    through the origin, whose slope is positive because every measured time is; so every parameter is physical.
    """
    Ps = sorted({row[0] for row in samples})
    P_arr = np.array([row[0] for row in samples])
    x = np.array([row[1] for row in samples], float)
    y = np.array([row[2] for row in samples], float)
    for P in Ps:
        if not np.any(x[P_arr == P] > 0):
            raise ValueError(
                f"the profile gives 0 ms to every action of the runs at P={P}; a scale cannot be fitted from it"
            )
    scale_cols = [np.where(P_arr == P, x, 0.0) for P in Ps]
    extra = {
        "action_ms": np.ones(len(samples)),
        "loss_fwd_ms": np.array([row[3] for row in samples], float),
        "loss_bwd_ms": np.array([row[4] for row in samples], float),
    }
    active = list(extra)
    if np.ptp(x) <= 0.05 * np.max(x):
        active.remove("action_ms")
        how["action_ms"] = (
            "not fitted: every profiled action has the same duration, so a fixed cost and a scale cannot be told "
            "apart; 0"
        )
        missing.append("action_ms")
    scales, values = _physical_least_squares(scale_cols, extra, active, y, how, missing)
    for k in values:
        what = {
            "action_ms": "intercept",
            "loss_fwd_ms": "offset of the last stage's F",
            "loss_bwd_ms": "offset of the last stage's B/I",
        }[k]
        how[k] = f"least squares {what} over {len(samples)} (run, stage, kind) median action times"
    out = {}
    for P, scale in zip(Ps, scales):
        out[int(P)] = float(scale)
        how[f"compute_scale[P={P}]"] = (
            f"least squares slope of measured against profiled action time over {int(np.sum(P_arr == P))} "
            f"(run, stage, kind) medians at P={P}"
        )
    return (
        out,
        float(values.get("action_ms", 0.0)),
        (float(values.get("loss_fwd_ms", 0.0)), float(values.get("loss_bwd_ms", 0.0))),
    )


def _physical_least_squares(
    scale_cols: list[np.ndarray],
    extra: dict[str, np.ndarray],
    active: list[str],
    y: np.ndarray,
    how: dict[str, str],
    missing: list[str],
) -> tuple[np.ndarray, dict[str, float]]:
    """``(scales, {cost: value})`` of ``y`` on the scale columns and the ``active`` additive costs, refitted without
    a negative cost (the most negative set to 0 first) and, while a scale is ``<= 0``, without the additive costs one
    by one (``action_ms`` first). ``active`` is consumed."""
    n_scales = len(scale_cols)
    while True:
        design = np.column_stack(scale_cols + [extra[k] for k in active])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        values = dict(zip(active, coef[n_scales:]))
        if np.any(coef[:n_scales] <= 0) and active:
            # measured times do not grow with profiled ones here (noise, or actions too alike): a slope <= 0 is no
            # scale; drop the additive costs one by one (the fixed cost first) down to the proportional model,
            # measured = scale * profiled, whose slope is positive (every measured and some profiled time is)
            dropped = active.pop(0)
            how[dropped] = (
                f"not fitted: with it the least-squares scale came out {min(coef[:n_scales]):.3g} (measured times do "
                "not grow with profiled ones), so 0 and the scale fitted closer to the origin"
            )
            missing.append(dropped)
            continue
        negative = [k for k in active if values[k] < 0]
        if not negative:
            return coef[:n_scales], {k: float(v) for k, v in values.items()}
        worst = min(negative, key=lambda k: values[k])
        how[worst] = f"least squares gave {values[worst]:.3g} ms; a cost cannot be negative, so 0 and the rest refitted"
        active.remove(worst)


def fit_transfer(gaps: Sequence[tuple[float, float]], how: dict[str, str], missing: list[str]) -> tuple[float, float]:
    """``(latency_ms, bandwidth_GBps)`` from ``(bytes, gap_ms)`` hand-offs to idle receivers."""
    if not gaps:
        how["latency_ms"] = "not fitted: no hand-off between ranks reached an idle receiver; 0"
        how["bandwidth_GBps"] = "not fitted (no hand-offs); transfers take latency_ms only"
        missing += ["latency_ms", "bandwidth_GBps"]
        return 0.0, math.inf
    nbytes = np.array([b for b, _ in gaps], float)
    gap = np.clip(np.array([g for _, g in gaps], float), 0.0, None)
    if nbytes.max() > 0 and np.ptp(nbytes) > 0.1 * nbytes.max():
        line = fit_latency_bandwidth(nbytes.tolist(), gap.tolist())
        if line is not None:
            intercept, slope = line
            how["latency_ms"] = (
                f"least squares intercept of gap = latency + bytes/bandwidth over {len(gaps)} hand-offs to idle "
                "receivers"
            )
            how["bandwidth_GBps"] = (
                f"inverse least squares slope over the same {len(gaps)} hand-offs ({len(np.unique(nbytes))} sizes)"
            )
            return float(intercept), float(1.0 / (slope * 1e6))
    latency = float(np.median(gap))
    how["latency_ms"] = f"median gap from a sender's end to an idle receiver's start over {len(gaps)} hand-offs"
    how["bandwidth_GBps"] = (
        "not fitted: the hand-offs carry one size (or no size trend), so bandwidth cannot be told from latency; "
        "transfers take latency_ms only"
    )
    missing.append("bandwidth_GBps")
    return latency, math.inf


def minimize_scalar(f: Callable[[float], float], lo: float, hi: float, grid: int = 24, iterations: int = 30) -> float:
    """The minimizer of ``f`` on ``[lo, hi]``: a grid, then golden-section search around its best point."""
    xs = np.linspace(lo, hi, grid + 1)
    values = [f(x) for x in xs]
    k = int(np.argmin(values))
    a, b = xs[max(0, k - 1)], xs[min(grid, k + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    best = (a + b) / 2
    return float(min([(values[k], xs[k]), (f(best), best)])[1])


def fit_step_overhead(overheads: dict[str, list[float]], how: dict[str, str], missing: list[str]) -> dict[str, float]:
    """Per runtime kind, the median time a step spends outside its action span (NaN for a kind no run used)."""
    out = {}
    for kind in RUNTIMES:
        values = overheads[kind]
        name = f"step_overhead_ms[{kind}]"
        if values:
            out[kind] = max(0.0, float(np.median(values)))
            how[name] = f"median over {len(values)} steps of the step time minus its first-to-last action span"
        else:
            out[kind] = math.nan
            how[name] = f"not fitted: no run of a {kind} schedule; predicted as 0"
            missing.append(name)
    return out


def fit_step_cv(cvs: Sequence[float], how: dict[str, str], missing: list[str]) -> float:
    """The step dispersion: the median over runs of their coefficient of variation (NaN with none)."""
    if cvs:
        how["step_cv"] = f"median over {len(cvs)} runs of std/mean of the steps after the first"
        return float(np.median(cvs))
    how["step_cv"] = "not fitted: no run has 2 or more steps after the warm-up step"
    missing.append("step_cv")
    return math.nan


def fit_gaps(
    cal: C,
    runs: Sequence[Run],
    parts: Sequence[Partition],
    spans: Sequence[float],
    how: dict[str, str],
    missing: list[str],
) -> C:
    """``cal`` with the runtime's gap between actions per runtime kind, and its scale per P, fitted.

    Joint least squares of the relative error of the simulated action span against the measured median ``spans``
    over all runs, everything else fixed, by coordinate descent (each parameter by :func:`minimize_scalar`; three
    rounds when there are several). Returns a copy of ``cal`` (of its class).
    """
    from ..simulation.simulator import simulate_step_ms

    P_ref = min(run.P for run in runs)
    kinds = [k for k in RUNTIMES if any(runtime_of(run.schedule) == k for run in runs)]
    for kind in RUNTIMES:
        if kind not in kinds:
            how[f"gap_ms[{kind}]"] = f"not fitted: no run of a {kind} schedule; predicted as 0"
            missing.append(f"gap_ms[{kind}]")
    other_Ps = sorted({run.P for run in runs} - {P_ref})
    values: dict[tuple[str, Any], float] = {("gap", k): 0.0 for k in kinds}
    values.update({("scale", P): 1.0 for P in other_Ps})

    def trial(values: dict[tuple[str, Any], float]) -> C:
        return replace(
            cal,
            gap={k: values[("gap", k)] for k in kinds},
            gap_scale={P_ref: 1.0, **{P: values[("scale", P)] for P in other_Ps}} if other_Ps else {},
        )

    def loss(values: dict[tuple[str, Any], float]) -> float:
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
            values[key] = minimize_scalar(_along(loss, values, key), *bounds[key])
    _note_gaps(runs, kinds, other_Ps, P_ref, upper_gap, how)
    return trial(values)


def _note_gaps(
    runs: Sequence[Run], kinds: list[str], other_Ps: list[int], P_ref: int, upper_gap: float, how: dict[str, str]
) -> None:
    """How :func:`fit_gaps` fitted each gap and gap scale."""
    for kind in kinds:
        n = sum(runtime_of(run.schedule) == kind for run in runs)
        how[f"gap_ms[{kind}]"] = (
            f"least squares of the relative error of the simulated action span against the measured median span, "
            f"jointly over all {len(runs)} runs ({n} of them {kind}; searched in [0, {upper_gap:.3g}] ms), at P={P_ref}"
        )
    for P in other_Ps:
        n = sum(run.P == P for run in runs)
        how[f"gap_scale[P={P}]"] = f"the same least squares, jointly; {n} runs at P={P} (searched in [0.25, 8])"


def _along(
    loss: Callable[[dict[tuple[str, Any], float]], float], values: dict[tuple[str, Any], float], key: tuple[str, Any]
) -> Callable[[float], float]:
    """``loss`` as a function of the parameter ``key`` alone, the others held at ``values`` (as they are now)."""
    return lambda x: loss({**values, key: x})


__all__ = [
    "fit_compute",
    "fit_gaps",
    "fit_step_cv",
    "fit_step_overhead",
    "fit_transfer",
    "minimize_scalar",
]
