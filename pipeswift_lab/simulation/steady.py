"""Which step of a measured Timeline is "the measured step": one definition, read by ``RunResult.steady_step_ms``,
:func:`~pipeswift_lab.fidelity.compare`, :func:`~pipeswift_lab.fidelity.calibrate` and the report.

The first step warms up (allocations, autotuning, the fork server's caches), so it is left out; of the rest the
median-time step is taken, which a single descheduled step cannot move.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pandas as pd

from ..core.checks import check_int

#: The one definition of "the measured step", in words: the step ``RunResult.steady_step_ms`` reports and
#: ``compare``, ``calibrate`` and the report take (``Comparison.statistic`` prints it). Public as
#: ``pipeswift_lab.simulation.MEASURED_STEP``; :func:`steady_step_index` is its rule in code.
MEASURED_STEP = (
    "median step after the first (the lower middle one for an even count; the step whose memory was measured "
    "left out when others remain), from the first rank starting it to the last rank finishing it, optimizer step "
    "included"
)


def first_step(obj: Any) -> int:
    """The step number of ``obj.step_ms[0]``: 0, or where a resumed run started (``RunResult.first_step``)."""
    return int(getattr(obj, "first_step", 0) or 0)


def steady_step_index(times: Sequence[float] | pd.Series, skip: Collection[int] = ()) -> int:
    """Index of the step :data:`MEASURED_STEP` picks from per-step ``times``: the median after the first (lower
    middle for an even count). ``skip`` are indices left out too while others remain (a step whose memory was
    measured, slower for it)."""
    times = pd.Series(list(times), index=range(len(times))) if not isinstance(times, pd.Series) else times
    if times.empty:
        raise ValueError("there are no steps to pick the measured step from")
    candidates = times.iloc[1:] if len(times) > 1 else times
    kept = candidates.drop([i for i in skip if i in candidates.index])
    candidates = kept if len(kept) else candidates
    order = candidates.sort_values(kind="stable")
    return int(order.index[(len(order) - 1) // 2])


def step_time_stats(steps: pd.Series) -> dict[str, Any]:
    """Dispersion of step times (ms) indexed by step number: ``first_step``, ``last_step``, ``steps``, ``mean_ms``,
    ``std_ms`` (sample std, NaN for one step), ``cv`` (std / mean), ``p50_ms``, ``p95_ms`` (linear interpolation) and
    ``max_ms`` — one row of ``RunResult.step_stats`` and ``MeasuredRun.step_stats``."""
    std = float(steps.std(ddof=1)) if len(steps) > 1 else float("nan")
    return {
        "first_step": int(steps.index[0]),
        "last_step": int(steps.index[-1]),
        "steps": len(steps),
        "mean_ms": float(steps.mean()),
        "std_ms": std,
        "cv": std / float(steps.mean()),
        "p50_ms": float(steps.median()),
        "p95_ms": float(steps.quantile(0.95)),
        "max_ms": float(steps.max()),
    }


def timeline_of(obj: Any, name: str) -> Any:
    """``obj``'s Timeline: ``obj`` itself or its ``.timeline``; ``TypeError`` naming ``name`` otherwise."""
    timeline = getattr(obj, "timeline", obj)
    df = getattr(timeline, "df", None)
    if not isinstance(df, pd.DataFrame) or not {"step", "rank", "kind", "start_ms", "end_ms"} <= set(df.columns):
        raise TypeError(
            f"{name} must be a Timeline or have a .timeline (a RunResult, a simulation result); "
            f"got {type(obj).__name__}"
        )
    return timeline


def _step_spans(df: pd.DataFrame) -> pd.Series:
    grouped = df.groupby("step")
    return grouped["end_ms"].max() - grouped["start_ms"].min()


def pick_step(measured: Any, step: int | None = None) -> int:
    """The measured step to show: ``step`` if given, else the median-time step after the first (the only one if
    there is one)."""
    timeline = timeline_of(measured, "measured")
    df = timeline.df
    step_ms = getattr(measured, "step_ms", None) if measured is not timeline else None
    if step_ms:
        first = first_step(measured)
        times = pd.Series(list(step_ms), index=range(first, first + len(step_ms)))
    else:
        times = _step_spans(df)
    steps = list(times.index)
    if step is not None:
        step = check_int("step", step)
        if step not in steps:
            raise ValueError(f"step={step} is not a step of the measured run; it has steps {steps[0]}..{steps[-1]}")
        return step
    if not steps:
        raise ValueError("the measured timeline has no actions (was the run instrumented?)")
    return steady_step_index(times, skip=getattr(measured, "probed_steps", ()))


__all__ = ["MEASURED_STEP", "first_step", "pick_step", "steady_step_index", "step_time_stats", "timeline_of"]
