"""How far the analytic time model is from published runs: calibrate on a few, measure the rest.

:func:`published_check` calibrates (:func:`~pipeswift_lab.fidelity.calibrate`, one compute scale) on some
:class:`~pipeswift_lab.fidelity.PublishedRun` values (by default the three smallest) and reports, on the others, the
mean absolute percentage error (:func:`mape`) of the iteration before and after, Spearman's rank correlation
(:func:`spearman`) of the layouts of each model, and whether the predicted best layout of a model at one GPU count
is within 5% of the measured best (:func:`pick_regret`). ``benchmarks/bench_analytic.py`` prints it for the shipped
runs (:func:`pipeswift_lab.data.published_runs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .published import PublishedRun, load_published

__all__ = ["PublishedCheck", "mape", "pick_regret", "published_check", "spearman"]


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, ``mean(|predicted - measured| / measured)`` (a share: 0.1 is 10%); NaN for
    none."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if p.shape != m.shape:
        raise ValueError(f"predicted and measured differ in length: {p.shape} against {m.shape}")
    return float(np.mean(np.abs(p - m) / m)) if len(m) else math.nan


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y``: Pearson's of their ranks, ties given their mean rank (NaN
    for fewer than two points or a constant side)."""
    a, b = pd.Series(np.asarray(x, float)).rank(), pd.Series(np.asarray(y, float)).rank()
    if len(a) != len(b):
        raise ValueError(f"x and y differ in length: {len(a)} against {len(b)}")
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def pick_regret(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and GPU count with two layouts or more in ``table`` (columns ``model``, ``gpus``, ``run``,
    ``measured_step_ms``, ``predicted_after_ms``): the layout the predictions pick (the shortest predicted), the
    measured best, and ``regret`` (the pick's measured iteration over the best's, less 1); ``within_5pct``:
    ``regret <= 0.05``. Returns a DataFrame (no rows where no model has alternatives)."""
    rows = []
    for (model, gpus), group in table.groupby(["model", "gpus"], sort=False):
        if len(group) < 2:
            continue
        pick = group.loc[group["predicted_after_ms"].idxmin()]
        best = group.loc[group["measured_step_ms"].idxmin()]
        regret = float(pick["measured_step_ms"] / best["measured_step_ms"] - 1.0)
        rows.append(
            {
                "model": model,
                "gpus": gpus,
                "layouts": len(group),
                "pick": pick["run"],
                "measured_best": best["run"],
                "regret": regret,
                "within_5pct": regret <= 0.05,
            }
        )
    columns = ["model", "gpus", "layouts", "pick", "measured_best", "regret", "within_5pct"]
    return pd.DataFrame(rows, columns=columns)


@dataclass(frozen=True)
class PublishedCheck:
    """What :func:`published_check` found: ``table`` (per run, :meth:`Calibration.error`'s columns with ``group``,
    ``measured_gpu_s_per_token`` and ``predicted_gpu_s_per_token``), the runs ``held_in`` (calibrated on), the
    ``calibrations`` per group, the held-out ``mape_before`` / ``mape_after`` (shares), ``spearman`` per model of
    three layouts or more (calibrated predicted against measured GPU-seconds per token: a ranking across GPU counts)
    and ``picks`` (:func:`pick_regret`)."""

    table: pd.DataFrame
    held_in: tuple[str, ...]
    calibrations: dict[str, Any]
    mape_before: float
    mape_after: float
    spearman: dict[str, float]
    picks: pd.DataFrame

    def __str__(self) -> str:
        held_out = int((~self.table["in_fit"]).sum())
        ranks = ", ".join(f"{k}: {v:.2f}" for k, v in self.spearman.items()) or "no model has 3 layouts"
        picks = (
            "no model has alternatives at one GPU count"
            if self.picks.empty
            else (f"{int(self.picks['within_5pct'].sum())} of {len(self.picks)} picks within 5% of the measured best")
        )
        return (
            f"calibrated on {', '.join(self.held_in)}; {held_out} runs held out: MAPE {self.mape_before:.1%} "
            f"uncalibrated, {self.mape_after:.1%} calibrated; Spearman within a model: {ranks}; {picks}"
        )


def published_check(
    runs: Sequence[PublishedRun] | None = None, held_in: int | Sequence[str] = 3, *, group: str | None = None
) -> PublishedCheck:
    """Calibrate on some published runs, measure the error on the rest (:class:`PublishedCheck`).

    ``runs``: default :func:`load_published`. ``held_in``: the names of the runs to calibrate on, or how many (the
    smallest by GPU count, then by measured iteration). ``group="hardware"``: one calibration per GPU (each on its own
    held-in runs), as one would calibrate each GPU type apart; None: one over all. Returns a PublishedCheck."""
    from .calibrator import calibrate

    runs = load_published() if runs is None else list(runs)
    if group not in (None, "hardware"):
        raise ValueError(f"group must be None or 'hardware'; got {group!r}")
    groups: dict[str, list[PublishedRun]] = {}
    for run in runs:
        groups.setdefault(run.hardware.name if group else "all", []).append(run)
    tables, calibrations, held = [], {}, []
    for key, members in groups.items():
        if isinstance(held_in, int):
            fit = sorted(members, key=lambda r: (r.gpus, r.measured_s))[:held_in]
        else:
            fit = [r for r in members if r.name in set(held_in)]
        if not fit:
            raise ValueError(f"published_check: no held-in run in group {key!r}; held_in={held_in!r}")
        calibrations[key] = calibrate(fit)
        tables.append(calibrations[key].error(members).assign(group=key))
        held += [r.name for r in fit]
    table = pd.concat(tables, ignore_index=True)
    per_token = {r.name: r.gpus / r.tokens for r in runs}
    for side, col in (("measured", "measured_step_ms"), ("predicted", "predicted_after_ms")):
        table[f"{side}_gpu_s_per_token"] = table[col] / 1e3 * table["run"].map(per_token)
    out = table[~table["in_fit"]]
    ranks = {
        model: spearman(sub["predicted_gpu_s_per_token"], sub["measured_gpu_s_per_token"])
        for model, sub in table.groupby("model", sort=False)
        if len(sub) >= 3
    }
    return PublishedCheck(
        table=table,
        held_in=tuple(held),
        calibrations=calibrations,
        mape_before=mape(out["predicted_before_ms"], out["measured_step_ms"]),
        mape_after=mape(out["predicted_after_ms"], out["measured_step_ms"]),
        spearman=ranks,
        picks=pick_regret(table),
    )
