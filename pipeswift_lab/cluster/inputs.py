"""Checking and normalizing what :func:`~pipeswift_lab.cluster.simulate` is given: jobs and capacity.

Bad input raises ``ValueError``/``TypeError`` naming the argument, the bad value and what
is valid. Two things are handled rather than refused, and said so with a warning:
submissions out of order are sorted (stably), and every count is in the warning.
:func:`read_capacity` reads a published availability trace (a CSV or a DataFrame) into
the capacity ``simulate`` takes.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_int, check_table, check_time
from ..core.costs import AssemblyModel, CheckpointModel
from ..profiling.table import Profile

__all__ = [
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "TIME_UNITS",
    "Costs",
    "check_capacity",
    "check_jobs",
    "read_capacity",
]

#: Columns a job table must have.
REQUIRED_COLUMNS = ("submit_s", "gpus", "duration_s")
#: Columns a job table may have.
OPTIONAL_COLUMNS = ("name", "priority", "min_gpus", "max_gpus", "profile", "declared_s")
#: Seconds per unit of a numeric time column in :func:`read_capacity`.
TIME_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


def _numeric(jobs: pd.DataFrame, column: str, integer: bool, minimum: float, allow_equal: bool = True) -> np.ndarray:
    values = jobs[column]
    if not (pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)):
        bad = next(
            (v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)),
            values.iloc[0] if len(values) else None,
        )
        raise TypeError(f"jobs[{column!r}] must be numeric; found {bad!r} (dtype {values.dtype})")
    array = values.to_numpy(float)
    finite = np.isfinite(array)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"jobs[{column!r}] has a non-finite value {float(array[i])} at row {i}; it must be finite")
    low = array < minimum if allow_equal else array <= minimum
    if low.any():
        i = int(np.flatnonzero(low)[0])
        bound = f">= {minimum:g}" if allow_equal else f"> {minimum:g}"
        raise ValueError(
            f"jobs[{column!r}]={array[i]:g} at row {i} is invalid; it must be {bound} ({int(low.sum())} rows are not)"
        )
    if integer:
        whole = array == np.round(array)
        if not whole.all():
            i = int(np.flatnonzero(~whole)[0])
            raise ValueError(f"jobs[{column!r}]={array[i]:g} at row {i} is invalid; it must be a whole number of GPUs")
        return array.astype(np.int64)
    return array


def check_jobs(jobs: Any) -> pd.DataFrame:
    """Validate a job table; return a copy sorted by ``submit_s`` with ``name`` filled in.

    Required: ``submit_s`` (>= 0 s), ``gpus`` (whole, >= 1) and ``duration_s`` (> 0 s: the
    run time on the requested GPUs). Optional: ``name``, ``priority`` (numeric, larger is
    more important), ``min_gpus``/``max_gpus`` (whole, ``1 <= min_gpus <= max_gpus``),
    ``profile`` (a library name or a :class:`~pipeswift_lab.Profile`), ``declared_s`` (> 0 s: the
    run time the job declares, which may differ from ``duration_s``). Unsorted
    submissions are sorted (stable) with a warning that counts the rows out of order.
    """
    _check_frame(jobs)
    out = pd.DataFrame(
        {
            "submit_s": _numeric(jobs, "submit_s", False, 0.0),
            "gpus": _numeric(jobs, "gpus", True, 1.0),
            "duration_s": _numeric(jobs, "duration_s", False, 0.0, allow_equal=False),
        }
    )
    out.insert(0, "name", _names(jobs))
    _add_optional(jobs, out)
    return _sorted_by_submission(out)


def _check_frame(jobs: Any) -> None:
    """Refuse anything but a DataFrame with the required columns and at least one row."""
    if not isinstance(jobs, pd.DataFrame):
        raise TypeError(
            f"jobs must be a pandas DataFrame with columns {list(REQUIRED_COLUMNS)}; got {type(jobs).__name__}"
        )
    needs = f" (it needs {list(REQUIRED_COLUMNS)}, optional {list(OPTIONAL_COLUMNS)})"
    check_table("jobs", jobs, REQUIRED_COLUMNS, needs=needs, rows="; give at least one job")


def _names(jobs: pd.DataFrame) -> np.ndarray:
    """The jobs' names as strings (``job-<row>`` when there is no ``name`` column); refuses duplicates."""
    names = jobs["name"].astype(str) if "name" in jobs.columns else pd.Series([f"job-{i}" for i in range(len(jobs))])
    if names.duplicated().any():
        dup = names[names.duplicated()].iloc[0]
        raise ValueError(f"jobs['name'] must be unique; {dup!r} appears more than once")
    return names.to_numpy()


def _add_optional(jobs: pd.DataFrame, out: pd.DataFrame) -> None:
    """Check the optional columns ``priority``, ``min_gpus``, ``max_gpus``, ``profile`` and ``declared_s`` and add
    them to ``out``."""
    if "priority" in jobs.columns:
        out["priority"] = _numeric(jobs, "priority", False, -np.inf)
    if "declared_s" in jobs.columns:
        out["declared_s"] = _numeric(jobs, "declared_s", False, 0.0, allow_equal=False)
    for column in ("min_gpus", "max_gpus"):
        if column in jobs.columns:
            out[column] = _numeric(jobs, column, True, 1.0)
    if "min_gpus" in out and "max_gpus" in out:
        bad = out["min_gpus"] > out["max_gpus"]
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise ValueError(
                f"jobs row {i}: min_gpus={out['min_gpus'][i]} exceeds max_gpus={out['max_gpus'][i]}; "
                f"it must be <= max_gpus"
            )
    if "profile" in jobs.columns:
        for i, p in enumerate(jobs["profile"]):
            if not (isinstance(p, (str, Profile)) or p is None or (isinstance(p, float) and np.isnan(p))):
                raise TypeError(
                    f"jobs['profile'] row {i} is {type(p).__name__} {p!r}; give a library name (str), a Profile or None"
                )
        out["profile"] = jobs["profile"].to_numpy()


def _sorted_by_submission(out: pd.DataFrame) -> pd.DataFrame:
    """``out`` sorted by ``submit_s`` (stable), with a warning that counts the rows moved when it was not."""
    order = np.argsort(out["submit_s"].to_numpy(), kind="stable")
    if (np.diff(out["submit_s"].to_numpy()) < 0).any():
        moved = int((order != np.arange(len(order))).sum())
        warnings.warn(
            f"jobs are not sorted by submit_s; sorted them (stable), which moved {moved} of {len(out)} rows",
            stacklevel=4,  # _sorted_by_submission, check_jobs, simulate, the caller
        )
        out = out.iloc[order].reset_index(drop=True)
    return out


def check_capacity(gpus: Any) -> tuple[tuple[float, int], ...]:
    """Normalize ``gpus`` to a step function: return ``((time_s, gpus), ...)``, strictly increasing times from 0.

    ``gpus`` is an int (a fixed capacity, >= 1), a list of ``(time_s, gpus)`` pairs or a
    DataFrame with columns ``time_s`` and ``gpus`` (other columns are ignored); row ``i`` is
    ``gpus[i]`` in the errors. The pairs are a step function: a count holds from its time
    until the next point's, the last one for ever, and before the first time the first
    count holds. Times are finite seconds >= 0 and must not decrease; equal times are one
    instantaneous change and the later (last) count at a time holds, so a published trace
    with two points per change, ``(t, old), (t, new)``, is accepted as it is. Counts are
    whole numbers of GPUs >= 0 (``8.0`` is 8), and at least one time has a GPU.

    The result has one point per time and only points where the count changes (a point
    repeating the previous count is dropped), and its first point is at time 0 (a first time
    after 0 moves to 0, since the first count holds before it). A time going backwards raises ``ValueError``
    naming the row, e.g. ``gpus[5] time_s=100.0 is before gpus[4] time_s=200.0``. To read
    a CSV trace (other column names, minutes, datetimes, instances of several GPUs) use
    :func:`read_capacity`.
    """
    if isinstance(gpus, (bool, str, bytes)):
        raise TypeError(f"gpus must be an int or (time_s, gpus) pairs; got {type(gpus).__name__} {gpus!r}")
    if isinstance(gpus, numbers.Integral):
        fixed = check_int("gpus", gpus)
        if fixed < 1:
            raise ValueError(f"gpus={fixed} is invalid; a fixed capacity must be >= 1")
        return ((0.0, fixed),)
    points = [_capacity_point(i, pair) for i, pair in enumerate(_capacity_pairs(gpus))]
    if not points:
        raise ValueError("gpus is an empty capacity series; give at least one (time_s, gpus) pair")
    back = _first_decrease(np.array([t for t, _ in points]))
    if back is not None:
        raise ValueError(
            f"gpus[{back}] time_s={points[back][0]} is before gpus[{back - 1}] time_s={points[back - 1][0]}; "
            f"capacity times must not decrease (equal times are one change: the last count at a time holds)"
        )
    out = _steps(points)
    if max(n for _, n in out) < 1:
        raise ValueError("gpus is 0 at every time; the cluster must have at least 1 GPU at some time")
    if out[0][0] > 0:
        out[0] = (0.0, out[0][1])  # before the first time the first count holds
    return tuple(out)


def _first_decrease(times: np.ndarray) -> int | None:
    """The first row whose time is before the previous row's, or None when the times never decrease."""
    back = np.flatnonzero(np.diff(times) < 0)
    return int(back[0]) + 1 if len(back) else None


def _steps(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Sorted ``points`` as a step function: the last count at an equal time holds, unchanged counts are dropped."""
    out: list[tuple[float, int]] = []
    for t, n in points:
        if out and out[-1][0] == t:
            out.pop()  # an instantaneous change: the later count at this time holds
        if out and out[-1][1] == n:
            continue  # not a change
        out.append((t, n))
    return out


def _capacity_pairs(gpus: Any) -> list[tuple[Any, ...]]:
    """The ``(time_s, gpus)`` pairs of a list or a DataFrame, unchecked."""
    if isinstance(gpus, pd.DataFrame):
        missing = [c for c in ("time_s", "gpus") if c not in gpus.columns]
        if missing:
            raise ValueError(
                f"gpus as a DataFrame needs the columns ['time_s', 'gpus']; it is missing {missing} "
                f"(has {list(gpus.columns)})"
            )
        return list(zip(gpus["time_s"].tolist(), gpus["gpus"].tolist()))
    try:
        return [tuple(p) for p in gpus]
    except TypeError:
        raise TypeError(
            f"gpus must be an int, a list of (time_s, gpus) pairs or a DataFrame with time_s and gpus; "
            f"got {type(gpus).__name__} {gpus!r}"
        ) from None


def _capacity_point(i: int, pair: tuple[Any, ...]) -> tuple[float, int]:
    """``(time_s, gpus)`` of the ``i``-th pair, checked: a time >= 0 s and a whole count >= 0 (``8.0`` is 8)."""
    if len(pair) != 2:
        raise ValueError(f"gpus[{i}]={pair!r} is not a (time_s, gpus) pair")
    t, n = pair
    time_s = check_time(f"gpus[{i}] time_s", t)
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n != round(n):
        raise TypeError(f"gpus[{i}] gpus={n!r} is invalid; it must be a whole number of GPUs")
    if n < 0:
        raise ValueError(f"gpus[{i}] gpus={n!r} is invalid; a capacity must be >= 0 GPUs")
    return time_s, int(round(n))


def read_capacity(
    source: str | os.PathLike[str] | pd.DataFrame,
    *,
    time_column: str = "time_s",
    gpus_column: str = "gpus",
    time_unit: str = "s",
    scale: float = 1,
) -> pd.DataFrame:
    """Read a published GPU availability trace; return the capacity :func:`~pipeswift_lab.cluster.simulate` takes.

    ``source`` is a CSV file (a ``str`` or path) or a DataFrame with one row per point of a
    step function: a time (``time_column``) and the count available from that time on
    (``gpus_column``). Rows are in time order (times must not decrease); the count of a row
    holds until the next row's time, the last one for ever. Several rows may share a time:
    it is one instantaneous change and the later row's count holds, so the common form
    with two points per change, ``(t, old)`` then ``(t, new)``, is read as it is. Rows
    that repeat the previous count are not changes and are dropped. Before the first
    time the first count holds; time 0 of the result is the trace's first time.

    Times are numbers in ``time_unit`` (``"s"``, ``"min"`` or ``"h"``), or dates and times
    (a datetime column, or strings such as ``2024-03-01 08:00:00+00:00``, parsed one by one;
    offsets are honoured, ``time_unit`` is then unused). ``scale`` is GPUs per unit of
    the count: for a trace of 8-GPU instances give ``scale=8``. Counts times ``scale`` must
    be whole numbers of GPUs >= 0. Rows are numbered from 0, after the CSV header.

    Returns a DataFrame with ``time_s`` (float seconds since the first time, starting at 0,
    strictly increasing) and ``gpus`` (int), one row per change. Raises ``ValueError``
    for missing columns (naming them and the columns present), an empty trace, a bad
    unit, a time or count that is not a number (or date) naming its row, a time before the
    previous row's naming both rows, and a trace with no GPU at any time.

    Example, a CSV of 8-GPU spot instances counted per minute::

        minute,instances
        0,4
        30,4
        30,2
        90,2
        90,4

        capacity = read_capacity("spot.csv", time_column="minute", gpus_column="instances", time_unit="min", scale=8)
        # time_s: 0.0, 1800.0, 5400.0; gpus: 32, 16, 32
        psl.cluster.simulate(jobs, capacity, policy="preemptive")
    """
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit={time_unit!r} is invalid; give one of {list(TIME_UNITS)}")
    scale = check_time("scale", scale, allow_zero=False)
    frame = _read_trace(source)
    check_table(
        "the capacity trace",
        frame,
        (time_column, gpus_column),
        needs=" (name them with time_column= and gpus_column=)",
        rows=f"; give at least one ({time_column}, {gpus_column}) row",
    )
    seconds = _trace_seconds(frame[time_column], time_column, TIME_UNITS[time_unit])
    counts = _trace_counts(frame[gpus_column], gpus_column, scale)
    steps = _steps(list(zip(seconds.tolist(), counts)))
    if max(n for _, n in steps) < 1:
        raise ValueError(f"the capacity trace has 0 GPUs at every time (column {gpus_column!r})")
    return pd.DataFrame(
        {"time_s": np.array([t for t, _ in steps], float), "gpus": np.array([n for _, n in steps], np.int64)}
    )


def _read_trace(source: Any) -> pd.DataFrame:
    """The trace as a DataFrame: ``source`` itself, or the CSV file it names."""
    if isinstance(source, pd.DataFrame):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a CSV path or a pandas DataFrame; got {type(source).__name__} {source!r}")
    try:
        return pd.read_csv(source)
    except pd.errors.EmptyDataError:
        raise ValueError(f"the capacity trace {str(source)!r} is empty; it needs a header and rows") from None


def _trace_seconds(column: pd.Series, name: str, unit_s: float) -> np.ndarray:
    """Seconds since the first row: numbers times ``unit_s``, or dates and times; every row checked."""
    if pd.api.types.is_bool_dtype(column):
        raise ValueError(f"trace[{name!r}] is boolean; give times as numbers or dates")
    if pd.api.types.is_timedelta64_dtype(column):
        column = column.dt.total_seconds() / unit_s
    elif column.dtype == object:
        numbers = pd.to_numeric(column, errors="coerce")
        if numbers.notna().all() and not any(isinstance(v, (bool, str)) for v in column):
            column = numbers  # numbers held as objects are numbers, not nanoseconds
    if pd.api.types.is_numeric_dtype(column):
        raw = column.to_numpy(float)
        bad = np.flatnonzero(~np.isfinite(raw))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"trace[{name!r}]={_shown(column.iloc[i])} at row {i} is invalid; a time must be finite")
        seconds = (raw - raw[0]) * unit_s
    else:
        if pd.api.types.is_datetime64_any_dtype(column):
            stamps = column
        else:
            stamps = pd.to_datetime(column, errors="coerce", utc=True, format="mixed")
        bad = np.flatnonzero(stamps.isna().to_numpy())
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"trace[{name!r}]={_shown(column.iloc[i])} at row {i} is not a time; "
                f"give numbers (in time_unit) or dates"
            )
        seconds = (stamps - stamps.iloc[0]).dt.total_seconds().to_numpy(float)
    back = _first_decrease(seconds)
    if back is not None:
        raise ValueError(
            f"trace[{name!r}]={_shown(column.iloc[back])} at row {back} is before row {back - 1}'s "
            f"{_shown(column.iloc[back - 1])}; capacity times must not decrease"
        )
    return seconds


def _trace_counts(column: pd.Series, name: str, scale: float) -> list[int]:
    """Each row's count times ``scale`` as a whole number of GPUs >= 0; a bad row is named."""
    out = []
    for i, value in enumerate(column.tolist()):
        try:
            number = math.nan if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"trace[{name!r}]={_shown(value)} at row {i} is not a number; a count must be finite")
        gpus = number * scale
        if gpus < 0:
            raise ValueError(f"trace[{name!r}]={_shown(value)} at row {i} is invalid; a count must be >= 0")
        if gpus != round(gpus):
            raise ValueError(
                f"trace[{name!r}]={_shown(value)} at row {i} is invalid; times scale={scale:g} it is {gpus:g} GPUs, "
                f"not a whole number"
            )
        out.append(int(round(gpus)))
    return out


def _shown(value: Any) -> str:
    """A trace value as an error message shows it: ``100``, ``'n/a'``, ``2024-03-01 08:00:00`` (no numpy wrappers)."""
    if isinstance(value, pd.Timestamp):
        return str(value)
    return repr(value.item() if isinstance(value, np.generic) else value)


#: The cost models a cluster simulation takes: ``(assembly, checkpoint)``, ``None`` for the default of each.
Costs = tuple[AssemblyModel | None, CheckpointModel | None]
