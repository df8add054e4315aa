"""The per-layer columns of a profile as numpy arrays: :class:`Layers`, checked once.

The splits (:mod:`.layers`), the memory per stage (:mod:`.memory`, :mod:`.rank_memory`) and the planner's search read
a profile through it. It imports nothing else of the package's partitioning, so all of them can.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_table, nonnegative_column

__all__ = ["Layers"]


class Layers:
    """The per-layer columns of a profile as numpy arrays (None where an optional column is absent).

    ``profile`` is a :class:`~pipeswift_lab.profiling.Profile` (anything with a ``df``) or a DataFrame with one row
    per layer: ``fwd_ms``, ``bwd_ms``, and optionally ``wgrad_ms``, ``recomputed_ms``, ``params``, ``param_bytes``,
    ``activation_bytes``, ``output_bytes``, ``name`` and ``layer`` (the order, 0..L-1).
    """

    def __init__(self, profile: Any) -> None:
        df = _layer_table(profile)
        self.df = df
        self.n = len(df)
        self.names: tuple[str, ...] = (
            tuple(str(x) for x in df["name"]) if "name" in df.columns else tuple(f"layer_{i}" for i in range(self.n))
        )
        self.fwd = self._column(df, "fwd_ms")
        self.bwd = self._column(df, "bwd_ms")
        self.wgrad = self._optional(df, "wgrad_ms")
        self.recomputed = self._optional(df, "recomputed_ms")
        self.input_pass = _measured_or_none(df, "input_pass_ms")
        self.weight_pass = _measured_or_none(df, "weight_pass_ms")
        self.params = self._optional(df, "params")
        self.param_bytes = self._optional(df, "param_bytes")
        self.activation_bytes = self._optional(df, "activation_bytes")
        self.output_bytes = self._optional(df, "output_bytes")
        self.transient_bytes = _unknown_as_zero(df, "transient_bytes")
        self.largest_param_bytes = _unknown_as_zero(df, "largest_param_bytes")
        meta = getattr(profile, "meta", None) or {}
        self.meta: dict[str, Any] = dict(meta) if isinstance(meta, dict) else {}
        if self.wgrad is not None and np.any(self.wgrad > self.bwd * (1 + 1e-12)):
            bad = int(np.argmax(self.wgrad > self.bwd))
            raise ValueError(
                f"profile layer {bad} ({self.names[bad]!r}): wgrad_ms={self.wgrad[bad]} exceeds "
                f"bwd_ms={self.bwd[bad]}; it is a part of it"
            )

    @property
    def has_bytes(self) -> bool:
        """Whether the profile carries memory: a ``param_bytes`` or ``activation_bytes`` column with some layer not 0
        (a :meth:`~pipeswift_lab.profiling.Profile.synthetic` profile given only times has none)."""
        return any(c is not None and bool(np.any(c)) for c in (self.param_bytes, self.activation_bytes))

    def _optional(self, df: pd.DataFrame, col: str) -> np.ndarray | None:
        return self._column(df, col) if col in df.columns else None

    def _column(self, df: pd.DataFrame, col: str) -> np.ndarray:
        values, bad = nonnegative_column(df[col])
        if bad:
            i, given = bad
            raise ValueError(
                f"profile column {col!r}: layer {i} ({self.names[i]!r}) has {given!r}; "
                "values must be finite numbers >= 0"
            )
        return values


def _measured_or_none(df: pd.DataFrame, col: str) -> np.ndarray | None:
    """Column ``col`` as floats with NaN where unmeasured (a first layer's pass), or None where it is absent."""
    if col not in df.columns:
        return None
    values = pd.to_numeric(df[col], errors="coerce").to_numpy(float)
    return values if bool(np.any(np.isfinite(values))) else None


def _unknown_as_zero(df: pd.DataFrame, col: str) -> np.ndarray | None:
    """An optional memory column with its unknown (NaN) values as 0; None when the column is absent or unknown
    throughout (a synthetic profile)."""
    if col not in df.columns:
        return None
    values = pd.to_numeric(df[col], errors="coerce").to_numpy(float)
    if np.isnan(values).all():
        return None
    return np.nan_to_num(values, nan=0.0)


def _layer_table(profile: Any) -> pd.DataFrame:
    """The per-layer table of ``profile``, checked and sorted by its ``layer`` column when it has one."""
    if isinstance(profile, pd.DataFrame):
        df = profile
    elif hasattr(profile, "df") and isinstance(profile.df, pd.DataFrame):
        df = profile.df
    else:
        raise TypeError(
            "profile must be a pipeswift_lab.Profile or a pandas DataFrame with one row per layer; "
            f"got {type(profile).__name__}"
        )
    needs = " (a per-layer table needs fwd_ms and bwd_ms)"
    check_table("profile", df, ("fwd_ms", "bwd_ms"), needs=needs, rows=" (no layers)")
    if "layer" in df.columns:
        order = pd.to_numeric(df["layer"], errors="coerce")
        if order.isna().any() or sorted(order.astype(int)) != list(range(len(df))):
            raise ValueError(f"profile column 'layer' must number the layers 0..{len(df) - 1}; got {list(df['layer'])}")
        df = df.iloc[np.argsort(order.to_numpy(), kind="stable")]
    return df
