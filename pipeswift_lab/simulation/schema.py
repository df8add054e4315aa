"""The Timeline table's schema: checking and normalizing a DataFrame of actions (see :class:`pipeswift_lab.Timeline`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.vocabulary import KINDS

#: Columns of ``Timeline.df``, in order.
COLUMNS = ("step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms")
#: Integer columns a Timeline may carry besides COLUMNS: ``segment`` (a run's configuration since its last
#: resize or rebalance) and ``replica`` (the data-parallel replica; 0 when the rows do not say, as in a simulation).
OPTIONAL_COLUMNS = ("segment", "replica")


def normalize(df) -> pd.DataFrame:
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
    if "replica" not in df.columns:
        df = df.assign(replica=np.zeros(len(df), np.int64))
    present = COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if c in df.columns)
    cols = {}
    for c in ("step", "rank", "stage", "microbatch") + present[len(COLUMNS) :]:
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
        cols[c] = values
    kind = df["kind"].to_numpy(dtype=object)
    bad_kinds = sorted(set(pd.unique(kind).tolist()) - set(KINDS), key=str)
    if bad_kinds:
        raise ValueError(f"Timeline column 'kind' holds {bad_kinds}; valid kinds are {list(KINDS)}")
    cols["kind"] = kind
    for c in ("start_ms", "end_ms"):
        values = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float)
        if not np.isfinite(values).all():
            raise ValueError(f"Timeline column {c!r} must hold finite numbers; got {values[~np.isfinite(values)][0]!r}")
        cols[c] = values
    if (cols["end_ms"] < cols["start_ms"]).any():
        i = int(np.flatnonzero(cols["end_ms"] < cols["start_ms"])[0])
        raise ValueError(
            f"Timeline row {i} ({ {c: cols[c][i] for c in COLUMNS} }) ends before it starts (end_ms < start_ms)"
        )
    order = np.lexsort((cols["end_ms"], cols["start_ms"], cols["rank"], cols["step"]))
    if not np.array_equal(order, np.arange(len(order))):
        cols = {c: v[order] for c, v in cols.items()}
    return pd.DataFrame({c: cols[c] for c in present})
