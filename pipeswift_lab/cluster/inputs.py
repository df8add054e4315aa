"""Checking and normalizing what :func:`~pipeswift_lab.cluster.simulate` is given: jobs and capacity.

Bad input raises ``ValueError``/``TypeError`` naming the argument, the bad value and what
is valid. Two things are handled rather than refused, and said so with a warning:
submissions out of order are sorted (stably), and every count is in the warning.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_int, check_time
from ..profiling.table import Profile

__all__ = ["OPTIONAL_COLUMNS", "REQUIRED_COLUMNS", "check_capacity", "check_jobs"]

#: Columns a job table must have.
REQUIRED_COLUMNS = ("submit_s", "gpus", "duration_s")
#: Columns a job table may have.
OPTIONAL_COLUMNS = ("name", "priority", "min_gpus", "max_gpus", "profile")


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
    ``profile`` (a library name or a :class:`~pipeswift_lab.Profile`). Unsorted
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
    missing = [c for c in REQUIRED_COLUMNS if c not in jobs.columns]
    if missing:
        raise ValueError(
            f"jobs is missing the columns {missing}; it needs {list(REQUIRED_COLUMNS)} "
            f"(optional {list(OPTIONAL_COLUMNS)}) and has {list(jobs.columns)}"
        )
    if len(jobs) == 0:
        raise ValueError("jobs has no rows; give at least one job")


def _names(jobs: pd.DataFrame) -> np.ndarray:
    """The jobs' names as strings (``job-<row>`` when there is no ``name`` column); refuses duplicates."""
    names = jobs["name"].astype(str) if "name" in jobs.columns else pd.Series([f"job-{i}" for i in range(len(jobs))])
    if names.duplicated().any():
        dup = names[names.duplicated()].iloc[0]
        raise ValueError(f"jobs['name'] must be unique; {dup!r} appears more than once")
    return names.to_numpy()


def _add_optional(jobs: pd.DataFrame, out: pd.DataFrame) -> None:
    """Check the optional columns ``priority``, ``min_gpus``, ``max_gpus`` and ``profile`` and add them to ``out``."""
    if "priority" in jobs.columns:
        out["priority"] = _numeric(jobs, "priority", False, -np.inf)
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
    """Normalize ``gpus`` to ``((time_s, gpus), ...)`` starting at time 0, strictly increasing times.

    ``gpus`` is an int (fixed capacity), a list of ``(time_s, gpus)`` pairs or a DataFrame
    with columns ``time_s`` and ``gpus``. Before the first time the first count holds.
    Counts must be whole and >= 0; times finite and >= 0.
    """
    if isinstance(gpus, (bool, str, bytes)):
        raise TypeError(f"gpus must be an int or (time_s, gpus) pairs; got {type(gpus).__name__} {gpus!r}")
    if isinstance(gpus, numbers.Integral):
        fixed = check_int("gpus", gpus)
        if fixed < 1:
            raise ValueError(f"gpus={fixed} is invalid; a fixed capacity must be >= 1")
        return ((0.0, fixed),)
    out = [_capacity_point(i, pair) for i, pair in enumerate(_capacity_pairs(gpus))]
    if not out:
        raise ValueError("gpus is an empty capacity series; give at least one (time_s, gpus) pair")
    times = [t for t, _ in out]
    if any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError(f"gpus times must be strictly increasing; got {times[:10]}{' ...' if len(times) > 10 else ''}")
    if max(n for _, n in out) < 1:
        raise ValueError("gpus is 0 at every time; the cluster must have at least 1 GPU at some time")
    if out[0][0] > 0:
        out.insert(0, (0.0, out[0][1]))
    return tuple(out)


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
