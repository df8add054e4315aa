"""The per-layer arrays of a profile and the contiguous splits :func:`~pipeswift_lab.partitioning.balance.partition`
makes of them.

:class:`Layers` checks a profile table once and holds its columns as numpy arrays; :func:`split` solves a split by
method (uniform counts, or the exact min-max bottleneck of :class:`~pipeswift_lab.partitioning.bottleneck.MinMaxSplit`
over parameters or time, within the memory windows of :func:`~pipeswift_lab.partitioning.memory.memory_windows`).
The planner's search reuses both across candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_int, nonnegative_column
from ..core.link import Link
from .bottleneck import Infeasible, MinMaxSplit
from .memory import CAP_RETRIES, MEM_RTOL, Layout, memory_windows, windowed_bytes

__all__ = [
    "Bounds",
    "capped_split",
    "Layers",
    "check_bounds",
    "split",
    "stage_comm_ms",
    "transfer_ms_array",
    "uniform_bounds",
]

#: Half-open ``(start, end)`` layer ranges, one per stage in stage order.
Bounds = tuple[tuple[int, int], ...]


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
    missing = [c for c in ("fwd_ms", "bwd_ms") if c not in df.columns]
    if missing:
        raise ValueError(
            f"profile has no column(s) {missing}; a per-layer table needs fwd_ms and bwd_ms "
            f"(columns: {list(df.columns)})"
        )
    if len(df) == 0:
        raise ValueError("profile has no layers (0 rows)")
    if "layer" in df.columns:
        order = pd.to_numeric(df["layer"], errors="coerce")
        if order.isna().any() or sorted(order.astype(int)) != list(range(len(df))):
            raise ValueError(f"profile column 'layer' must number the layers 0..{len(df) - 1}; got {list(df['layer'])}")
        df = df.iloc[np.argsort(order.to_numpy(), kind="stable")]
    return df


def check_bounds(bounds: Any, n_layers: int) -> Bounds:
    """``bounds`` as a tuple of ``(start, end)`` int pairs: contiguous, non-empty, covering layers ``0..n_layers-1``."""
    if isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__iter__"):
        raise TypeError(f"bounds must be a sequence of (start, end) pairs; got {type(bounds).__name__} {bounds!r}")
    out: list[tuple[int, int]] = []
    for s, pair in enumerate(bounds):
        try:
            a, b = pair
        except (TypeError, ValueError):
            raise TypeError(f"bounds[{s}]={pair!r} is not a (start, end) pair") from None
        a = check_int(f"bounds[{s}] start", a, minimum=0)
        b = check_int(f"bounds[{s}] end", b, minimum=0)
        if b <= a:
            raise ValueError(
                f"bounds[{s}]=({a}, {b}) is empty or reversed; every stage needs at least one layer (start < end)"
            )
        expected = out[-1][1] if out else 0
        if a != expected:
            raise ValueError(
                f"bounds[{s}] starts at layer {a} but must start at {expected}; stages are contiguous from layer 0"
            )
        out.append((a, b))
    if not out:
        raise ValueError("bounds is empty; give at least one (start, end) stage")
    if out[-1][1] != n_layers:
        raise ValueError(
            f"bounds end at layer {out[-1][1]} but the profile has {n_layers} layers; "
            f"the last stage must end at {n_layers}"
        )
    return tuple(out)


def transfer_ms_array(layers: Layers, link: Link | None) -> np.ndarray:
    """Transfer time of the activation leaving each layer (``c[i]`` for a cut after layer ``i``)."""
    if link is None or layers.output_bytes is None:
        return np.zeros(layers.n)
    return link.latency_ms + layers.output_bytes / (link.bandwidth_GBps * 1e6)


def stage_comm_ms(bounds: Iterable[tuple[int, int]], layers: Layers, link: Link | None) -> tuple[float, ...]:
    """Per stage, the transfers it sends per micro-batch: its output activation forward (unless it is the last) and
    the gradient of its input backward (unless it is the first)."""
    c = transfer_ms_array(layers, link)
    n = layers.n
    return tuple(float((c[b - 1] if b < n else 0.0) + (c[a - 1] if a > 0 else 0.0)) for a, b in bounds)


def uniform_bounds(n: int, K: int) -> Bounds:
    """``K`` stages of equal layer counts, the remainder of ``n / K`` spread over the first stages."""
    base, extra = divmod(n, K)
    out, a = [], 0
    for k in range(K):
        b = a + base + (1 if k < extra else 0)
        out.append((a, b))
        a = b
    return tuple(out)


def split(layers: Layers, layout: Layout, method: str, link: Link | None, limit: float | None) -> Bounds:
    """The bounds of ``layout.n_stages`` stages by ``method`` (``"uniform"``, ``"params"`` or ``"balanced"``), each
    stage within ``limit`` bytes per GPU when a cap is given (raises ``Infeasible`` when none fits)."""
    if method == "uniform":
        return uniform_bounds(layers.n, layout.n_stages)
    if method == "params":
        if layers.params is None:
            raise ValueError("method='params' needs a 'params' column in the profile")
        cost = np.concatenate([[0.0], np.cumsum(layers.params)])
        up, down = cost, cost
    else:  # balanced
        c = transfer_ms_array(layers, link)
        S = np.concatenate([[0.0], np.cumsum(layers.fwd + layers.bwd)])
        out = np.concatenate([[0.0], c[:-1], [0.0]])  # out[b]: activation leaving a stage that ends at b < L
        gin = np.concatenate([[0.0], c[:-1], [0.0]])  # gin[a]: gradient a stage starting at a > 0 sends back
        up, down = S + out, S - gin
    windows = memory_windows(layers, layout, limit)
    bounds, _ = MinMaxSplit(up, down, layout.n_stages, windows).solve()
    return bounds


# -- the names the planner's search and the sweep import (planning.search, simulation.sweeps) -----------------------


def capped_split(
    layers: Layers,
    layout: Layout,
    method: str,
    link: Link | None,
    limit: float,
    peak_of: Callable[[Bounds], Sequence[float]],
    split_at: Callable[[float], Bounds] | None = None,
) -> Bounds | None:
    """The :func:`split` of ``layout`` whose ranks' replayed peaks (``peak_of(bounds)``, one per rank) fit
    ``limit`` bytes; ``None`` when none does.

    The exact solver's windows bound each stage's steady memory; the replay adds buffers and transients. When the
    fullest rank exceeds the cap, a balanced split is solved again with the cap lowered by the excess, and at least
    below the steady memory the windows saw in the split that did not fit (:func:`windowed_bytes`), so that every
    retry solves another split, up to :data:`~pipeswift_lab.partitioning.memory.CAP_RETRIES` times; another
    method's split is returned as it is, for the caller to check. ``split_at(budget)``, when given, stands for
    ``split(layers, layout, method, link, budget)`` (the planner's search remembers the splits it solved)."""
    budget = limit
    for _ in range(CAP_RETRIES):
        try:
            bounds = split_at(budget) if split_at is not None else split(layers, layout, method, link, budget)
        except Infeasible:
            return None
        excess = max(peak_of(bounds)) - limit
        if excess <= limit * MEM_RTOL or method != "balanced":
            return bounds
        # lowered by the excess alone, the windows may still allow the same split: its transients do not move
        budget = min(budget - excess, windowed_bytes(layers, layout, bounds) * (1 - 4 * MEM_RTOL))
    return None
