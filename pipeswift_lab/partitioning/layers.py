"""The per-layer arrays of a profile and the contiguous splits :func:`pipeswift_lab.partitioning.balance.partition` makes of them.

:class:`_Layers` checks a profile table once and holds its columns as numpy arrays;
:func:`_split` solves a split by method (uniform counts, or the exact min-max bottleneck of
:class:`~pipeswift_lab.partitioning.bottleneck.MinMaxSplit` over parameters or time, within the memory
windows of :func:`_memory_windows`). The planner's search reuses both across candidates.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.analytic import inflight_microbatches
from ..core.checks import check_int, nonnegative_column
from ..core.link import Link
from ..core.precision import state_bytes
from ..core.vocabulary import check_schedule_v
from ..core.vocabulary import stage_to_rank as _stage_to_rank
from ..core.vocabulary import validate as _validate_schedule
from .bottleneck import MinMaxSplit

#: Relative tolerance of memory comparisons (prefix sums and direct sums round differently).
_MEM_RTOL = 1e-9

_OPTIONAL = ("wgrad_ms", "params", "param_bytes", "activation_bytes", "output_bytes")


# --------------------------------------------------------------------------- layers
class _Layers:
    """The per-layer columns of a profile as numpy arrays (None where a column is absent)."""

    def __init__(self, profile):
        if isinstance(profile, pd.DataFrame):
            df = profile
        elif hasattr(profile, "df") and isinstance(profile.df, pd.DataFrame):
            df = profile.df
        else:
            raise TypeError(
                f"profile must be a pipeswift_lab.Profile or a pandas DataFrame with one row per layer; got {type(profile).__name__}"
            )
        missing = [c for c in ("fwd_ms", "bwd_ms") if c not in df.columns]
        if missing:
            raise ValueError(
                f"profile has no column(s) {missing}; a per-layer table needs fwd_ms and bwd_ms (columns: {list(df.columns)})"
            )
        if len(df) == 0:
            raise ValueError("profile has no layers (0 rows)")
        if "layer" in df.columns:
            order = pd.to_numeric(df["layer"], errors="coerce")
            if order.isna().any() or sorted(order.astype(int)) != list(range(len(df))):
                raise ValueError(
                    f"profile column 'layer' must number the layers 0..{len(df) - 1}; got {list(df['layer'])}"
                )
            df = df.iloc[np.argsort(order.to_numpy(), kind="stable")]
        self.df = df
        self.n = len(df)
        self.names = (
            tuple(str(x) for x in df["name"]) if "name" in df.columns else tuple(f"layer_{i}" for i in range(self.n))
        )
        self.fwd = self._column(df, "fwd_ms")
        self.bwd = self._column(df, "bwd_ms")
        for col in _OPTIONAL:
            setattr(
                self,
                col.removesuffix("_ms") if col == "wgrad_ms" else col,
                self._column(df, col) if col in df.columns else None,
            )
        if self.wgrad is not None and np.any(self.wgrad > self.bwd * (1 + 1e-12)):
            bad = int(np.argmax(self.wgrad > self.bwd))
            raise ValueError(
                f"profile layer {bad} ({self.names[bad]!r}): wgrad_ms={self.wgrad[bad]} exceeds bwd_ms={self.bwd[bad]}; it is a part of it"
            )

    def _column(self, df, col):
        values, bad = nonnegative_column(df[col])
        if bad:
            i, given = bad
            raise ValueError(
                f"profile column {col!r}: layer {i} ({self.names[i] if hasattr(self, 'names') else i!r}) has {given!r}; values must be finite numbers >= 0"
            )
        return values


def _resolve_placement(P, v, schedule):
    """Return ``(schedule or None, v, schedule used for the memory estimate)``."""
    if schedule is None:
        v = check_int("v", v, minimum=1)
        return None, v, ("1F1B" if v == 1 else "Interleaved1F1B")
    schedule, v = check_schedule_v(schedule, v)
    return schedule, v, schedule


def _resolve_m(P, m, schedule, v):
    if m is None:  # the memory estimate's default: as many micro-batches as ranks, or what the schedule needs
        return 2 * P if schedule == "DualPipeV" else P
    m = check_int("m", m, minimum=1)
    if schedule is not None:
        _validate_schedule(P, m, schedule, v)
    return m


def _check_bounds(bounds, n_layers):
    if isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__iter__"):
        raise TypeError(f"bounds must be a sequence of (start, end) pairs; got {type(bounds).__name__} {bounds!r}")
    out = []
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
            f"bounds end at layer {out[-1][1]} but the profile has {n_layers} layers; the last stage must end at {n_layers}"
        )
    return tuple(out)


def _transfer_ms_array(layers: _Layers, link: Link | None):
    """Transfer time of the activation leaving each layer (``c[i]`` for a cut after layer ``i``)."""
    if link is None or layers.output_bytes is None:
        return np.zeros(layers.n)
    return link.latency_ms + layers.output_bytes / (link.bandwidth_GBps * 1e6)


def _stage_comm_ms(bounds, layers, link):
    c = _transfer_ms_array(layers, link)
    n = layers.n
    return tuple(float((c[b - 1] if b < n else 0.0) + (c[a - 1] if a > 0 else 0.0)) for a, b in bounds)


# --------------------------------------------------------------------------- splitting
def rank_totals(per_stage, stage_to_rank, P) -> list[float]:
    """Per rank, the sum of its stages' ``per_stage`` values: the one place a per-stage quantity becomes a rank's
    (memory in :class:`~pipeswift_lab.Partition`, the sweep and the planner's search)."""
    out = [0.0] * P
    for value, r in zip(per_stage, stage_to_rank):
        out[r] += value
    return out


def _uniform_bounds(n, K):
    base, extra = divmod(n, K)
    out, a = [], 0
    for k in range(K):
        b = a + base + (1 if k < extra else 0)
        out.append((a, b))
        a = b
    return tuple(out)


class _DoesNotFit(ValueError):
    """A rank of a given split exceeds the memory cap."""


def _memory_windows(layers: _Layers, P, v, schedule, mem_schedule, m, optimizer, limit, precision=None, D=1):
    """Per stage index: the smallest start allowed for each end under the memory cap (None if no cap)."""
    if limit is None:
        return None
    if layers.param_bytes is None or layers.activation_bytes is None:
        raise ValueError(
            "mem_per_gpu_bytes is given but the profile lacks 'param_bytes' or 'activation_bytes'; memory per stage is unknown"
        )
    placement = _stage_to_rank(P, v, schedule)
    inflight = inflight_microbatches(P, m, mem_schedule, v=v)
    static = np.concatenate([[0.0], np.cumsum(state_bytes(layers.params, layers.param_bytes, precision, optimizer, D))])
    act = np.concatenate([[0.0], np.cumsum(layers.activation_bytes)])
    budget = limit / v  # a rank's v stages share its memory; each stage gets an equal share
    out = []
    for k in range(P * v):
        mem = static + act * inflight[placement[k]]
        out.append(np.searchsorted(mem, mem - budget * (1 + _MEM_RTOL), side="left"))
    return out


def _split(layers: _Layers, P, v, schedule, mem_schedule, method, link, m, optimizer, limit, precision=None, D=1):
    K = P * v
    if method == "uniform":
        return _uniform_bounds(layers.n, K)
    if method == "params":
        if layers.params is None:
            raise ValueError("method='params' needs a 'params' column in the profile")
        cost = np.concatenate([[0.0], np.cumsum(layers.params)])
        up, down = cost, cost
    else:  # balanced
        c = _transfer_ms_array(layers, link)
        S = np.concatenate([[0.0], np.cumsum(layers.fwd + layers.bwd)])
        out = np.concatenate([[0.0], c[:-1], [0.0]])  # out[b]: activation leaving a stage that ends at b < L
        gin = np.concatenate([[0.0], c[:-1], [0.0]])  # gin[a]: gradient a stage starting at a > 0 sends back
        up, down = S + out, S - gin
    windows = _memory_windows(layers, P, v, schedule, mem_schedule, m, optimizer, limit, precision, D)
    bounds, _ = MinMaxSplit(up, down, K, windows).solve()
    return bounds
