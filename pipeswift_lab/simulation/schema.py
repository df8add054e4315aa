"""The Timeline table's schema: checking and normalizing a DataFrame of actions (see :class:`pipeswift_lab.Timeline`),
and the JSON form of the ``meta`` dicts written beside it (Timeline CSV and Chrome trace, calibration files).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..core.vocabulary import KINDS

#: Columns of ``Timeline.df``, in order.
COLUMNS = ("step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms")
#: Columns a Timeline may carry besides COLUMNS: ``segment`` (a run's configuration since its last resize or
#: rebalance), ``replica`` (the data-parallel replica; 0 when the rows do not say, as in a simulation), both integers,
#: ``time_source`` (an imported profiler trace's: ``"device"`` where the row spans the GPU kernels its action
#: launched, ``"host"`` where it spans the CPU work) and ``bytes`` (a measured run's: what a collective moved, 0 for
#: compute).
OPTIONAL_COLUMNS = ("segment", "replica", "time_source", "bytes")
#: Values of the ``time_source`` column.
TIME_SOURCES = ("device", "host")


def normalize(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` checked against :data:`COLUMNS` and :data:`OPTIONAL_COLUMNS`: integer ids, known kinds, finite times that
    do not run backwards, ``replica`` added as 0 when absent, rows sorted by step, rank and start. Returns a new frame;
    raises ``TypeError``/``ValueError`` naming the column and the first bad value."""
    _check_columns(df)
    if "replica" not in df.columns:
        df = df.assign(replica=np.zeros(len(df), np.int64))
    present = COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if c in df.columns)
    integers = ("step", "rank", "stage", "microbatch") + tuple(
        c for c in ("segment", "replica", "bytes") if c in present
    )
    cols = {c: _int_column(df, c) for c in integers}
    cols["kind"] = _choice_column(df, "kind", KINDS)
    if "time_source" in present:
        cols["time_source"] = _choice_column(df, "time_source", TIME_SOURCES)
    cols.update({c: _time_column(df, c) for c in ("start_ms", "end_ms")})
    if (cols["end_ms"] < cols["start_ms"]).any():
        i = int(np.flatnonzero(cols["end_ms"] < cols["start_ms"])[0])
        raise ValueError(
            f"Timeline row {i} ({ {c: cols[c][i] for c in COLUMNS} }) ends before it starts (end_ms < start_ms)"
        )
    order = np.lexsort((cols["end_ms"], cols["start_ms"], cols["rank"], cols["step"]))
    if not np.array_equal(order, np.arange(len(order))):
        cols = {c: v[order] for c, v in cols.items()}
    return pd.DataFrame({c: cols[c] for c in present})


def _check_columns(df: pd.DataFrame) -> None:
    """A DataFrame with the columns of :data:`COLUMNS`, maybe :data:`OPTIONAL_COLUMNS`, none else, and rows."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame with columns {list(COLUMNS)}; got {type(df).__name__}")
    missing = [c for c in COLUMNS if c not in df.columns]
    extra = [c for c in df.columns if c not in COLUMNS + OPTIONAL_COLUMNS]
    if missing or extra:
        raise ValueError(
            f"Timeline df must have the columns {list(COLUMNS)} (and optionally {list(OPTIONAL_COLUMNS)}); "
            f"missing {missing}, unexpected {extra}"
        )
    if len(df) == 0:
        raise ValueError("Timeline df has no rows")


def _int_column(df: pd.DataFrame, c: str) -> np.ndarray:
    """Column ``c`` as int64, every value a whole number >= 0."""
    values = df[c].to_numpy()
    if values.dtype.kind not in "iu":
        numeric = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float)
        bad = ~np.isfinite(numeric) | (numeric % 1 != 0)
        if bad.any():
            raise ValueError(f"Timeline column {c!r} must hold integers >= 0; got {df[c].to_numpy()[bad][0]!r}")
        values = numeric
    values = values.astype(np.int64)
    if (values < 0).any():
        raise ValueError(f"Timeline column {c!r} must hold integers >= 0; got {int(values[values < 0][0])}")
    return values


def _choice_column(df: pd.DataFrame, c: str, valid: tuple[str, ...]) -> np.ndarray:
    """Column ``c`` as an object array, every value one of ``valid`` (for ``kind``,
    :data:`~pipeswift_lab.core.vocabulary.KINDS`; for ``time_source``, :data:`TIME_SOURCES`)."""
    values = df[c].to_numpy(dtype=object)
    bad = sorted(set(pd.unique(values).tolist()) - set(valid), key=str)
    if bad:
        raise ValueError(f"Timeline column {c!r} holds {bad}; valid values are {list(valid)}")
    return values


def _time_column(df: pd.DataFrame, c: str) -> np.ndarray:
    """Column ``c`` as finite floats (ms)."""
    values = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float)
    if not np.isfinite(values).all():
        raise ValueError(f"Timeline column {c!r} must hold finite numbers; got {values[~np.isfinite(values)][0]!r}")
    return values


def row_arrays(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """The columns of a normalized Timeline table as numpy arrays, by the short names the metrics and exports use:
    ``replica``, ``step``, ``rank``, ``stage``, ``mb`` (the micro-batch), ``kind`` (objects), ``start`` and ``end``
    (ms)."""
    return {
        "replica": df["replica"].to_numpy(np.int64),
        "step": df["step"].to_numpy(np.int64),
        "rank": df["rank"].to_numpy(np.int64),
        "stage": df["stage"].to_numpy(np.int64),
        "mb": df["microbatch"].to_numpy(np.int64),
        "kind": df["kind"].to_numpy(object),
        "start": df["start_ms"].to_numpy(float),
        "end": df["end_ms"].to_numpy(float),
    }


def device_index(replicas: Sequence[int], ranks: Sequence[int], replica: Any, rank: Any) -> np.ndarray:
    """The device row of each (replica, rank): its replica's position times the number of ranks, plus its rank's
    position (without replicas, the rank's position). ``replicas`` and ``ranks`` are sorted; returns an int array."""
    return np.searchsorted(replicas, replica) * len(ranks) + np.searchsorted(ranks, rank)


def jsonable(value: Any) -> Any:
    """``value`` (a ``meta`` dict, nested) with only JSON types: keys as strings, tuples as lists, numpy scalars and
    arrays as Python numbers and lists, anything else JSON cannot hold as its ``str``. Returns the converted value."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # numpy scalars and arrays, pandas Series
        return jsonable(value.tolist())
    return str(value)


__all__ = ["COLUMNS", "OPTIONAL_COLUMNS", "TIME_SOURCES", "device_index", "jsonable", "normalize", "row_arrays"]
