"""The per-layer arrays of a profile and the contiguous splits :func:`~pipeswift_lab.partitioning.balance.partition`
makes of them.

:class:`Layers` (defined in :mod:`.layer_arrays`) checks a profile table once and holds its columns as numpy arrays;
:func:`split` solves a split by method (uniform counts, or the exact min-max bottleneck of
:class:`~pipeswift_lab.partitioning.bottleneck.MinMaxSplit` over parameters or time, within the memory windows of
:func:`~pipeswift_lab.partitioning.memory.memory_windows`).
The planner's search reuses both across candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..core.checks import check_int
from ..core.link import Link
from .bottleneck import Infeasible, MinMaxSplit
from .layer_arrays import Layers
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
