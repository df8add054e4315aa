"""Memory per stage: the pipeline a split is made for (:class:`Layout`), the cap per GPU, and where stages may start.

A stage holds its training state (weights, gradients and optimizer state, :mod:`pipeswift_lab.core.precision`) plus
``activation_bytes`` times the micro-batches its rank keeps in flight under the schedule
(:func:`pipeswift_lab.core.analytic.inflight_microbatches`). With a cap, a rank's ``v`` stages share its memory
equally, and :func:`memory_windows` turns the cap into the smallest start each stage may have for each end, the
constraint of the exact bottleneck solver (:class:`~pipeswift_lab.partitioning.bottleneck.MinMaxSplit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import numpy as np

from ..core.analytic import inflight_microbatches
from ..core.checks import check_int, check_time
from ..core.precision import check_optimizer, check_precision, state_bytes
from ..core.schedule import ScheduleLike
from ..core.vocabulary import check_schedule_v, stage_to_rank
from ..core.vocabulary import validate as validate_schedule

if TYPE_CHECKING:
    from .layer_arrays import Layers

__all__ = [
    "CAP_RETRIES",
    "MEM_RTOL",
    "DoesNotFit",
    "Layout",
    "memory_cap",
    "memory_windows",
    "no_fit_head",
    "rank_totals",
    "resolve_layout",
    "resolve_m",
    "resolve_placement",
    "windowed_bytes",
]

#: Relative tolerance of memory comparisons (prefix sums and direct sums round differently).
MEM_RTOL = 1e-9
#: How many times a capped balanced split is solved again with the cap lowered by what its replayed peak exceeds:
#: the windows bound each stage's steady memory, the replay (:mod:`.rank_memory`) adds buffers and transients.
CAP_RETRIES = 6


class DoesNotFit(ValueError):
    """A rank of a given split exceeds the memory cap."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The pipeline a split is made for: where its stages sit and what each holds, checked by
    :func:`resolve_layout`."""

    P: int
    """Pipeline ranks."""
    v: int
    """Stages (chunks) per rank: a split has ``P * v`` stages."""
    schedule: ScheduleLike | None
    """The schedule that places stages on ranks (a V for ZBVZeroBubble/DualPipeV); None: round-robin."""
    mem_schedule: ScheduleLike
    """The schedule whose in-flight micro-batches the memory estimate counts: ``schedule``, or, without one, 1F1B
    (``v == 1``) or Interleaved1F1B."""
    m: int
    """Micro-batches per step: how many a rank can hold in flight."""
    optimizer: str = "adam"
    """Optimizer whose states count in the training state (one of ``OPTIMIZER_STATES``)."""
    precision: str | None = None
    """Bytes of training state per parameter (see :mod:`pipeswift_lab.core.precision`); None: the profile's own."""
    D: int = 1
    """Data-parallel replicas the ZeRO-1 optimizer state is sharded over."""

    @property
    def n_stages(self) -> int:
        """``P * v``."""
        return self.P * self.v

    def placement(self) -> tuple[int, ...]:
        """The rank of each stage, in stage order."""
        return stage_to_rank(self.P, self.v, self.schedule)

    def inflight(self) -> tuple[float, ...]:
        """Per stage, the micro-batches its rank holds in flight (the multiplier of its activation bytes)."""
        by_rank = inflight_microbatches(self.P, self.m, self.mem_schedule, v=self.v)
        return tuple(by_rank[r] for r in self.placement())

    def with_P(self, P: int) -> Layout:
        """The same pipeline with ``P`` ranks (the smallest-P search of the memory error)."""
        return replace(self, P=P)


def resolve_placement(P: int, v: int, schedule: ScheduleLike | None) -> tuple[ScheduleLike | None, int, ScheduleLike]:
    """Return ``(schedule or None, v, schedule used for the memory estimate)``."""
    if schedule is None:
        v = check_int("v", v, minimum=1)
        return None, v, ("1F1B" if v == 1 else "Interleaved1F1B")
    schedule, v = check_schedule_v(schedule, v)
    return schedule, v, schedule


def resolve_m(P: int, m: int | None, schedule: ScheduleLike | None, v: int) -> int:
    """``m`` checked against the schedule's rules; without one, as many micro-batches as ranks (``2P`` for
    DualPipeV, what it needs)."""
    if m is None:
        return 2 * P if schedule == "DualPipeV" else P
    m = check_int("m", m, minimum=1)
    if schedule is not None:
        validate_schedule(P, m, schedule, v)
    return m


def resolve_layout(
    P: int,
    v: int,
    schedule: ScheduleLike | None,
    m: int | None,
    optimizer: str,
    precision: str | None,
    D: int,
    *,
    n_layers: int | None = None,
) -> Layout:
    """The checked :class:`Layout` of ``P`` ranks (``P`` already checked): placement, enough of the ``n_layers``
    layers (when given) for the ``P * v`` stages, ``m``, optimizer, precision, ``D``, in the order their messages
    have always come."""
    schedule, v, mem_schedule = resolve_placement(P, v, schedule)
    if n_layers is not None and P * v > n_layers:
        what = f"P={P}" if v == 1 else f"P*v={P}*{v}={P * v} stages"
        raise ValueError(f"{what} exceeds the {n_layers} profiled layers; every stage needs at least one layer")
    return Layout(
        P=P,
        v=v,
        schedule=schedule,
        mem_schedule=mem_schedule,
        m=resolve_m(P, m, schedule, v),
        optimizer=check_optimizer(optimizer),
        precision=check_precision(precision),
        D=check_int("D", D, minimum=1),
    )


def memory_cap(mem_per_gpu_bytes: float | None) -> float | None:
    """The memory cap per GPU in bytes, checked: a finite number > 0, or ``None`` for no cap."""
    return None if mem_per_gpu_bytes is None else check_time("mem_per_gpu_bytes", mem_per_gpu_bytes, allow_zero=False)


def rank_totals(per_stage: Iterable[float], stage_to_rank: Sequence[int], P: int) -> list[float]:
    """Per rank, the sum of its stages' ``per_stage`` values: the one place a per-stage quantity becomes a rank's
    (memory in :class:`~pipeswift_lab.Partition`, the sweep and the planner's search)."""
    out = [0.0] * P
    for value, r in zip(per_stage, stage_to_rank):
        out[r] += value
    return out


def memory_windows(layers: Layers, layout: Layout, limit: float | None) -> list[np.ndarray] | None:
    """Per stage index: the smallest start allowed for each end under the memory cap ``limit`` (None if no cap)."""
    if limit is None:
        return None
    static, act = _cumulative_bytes(layers, layout)
    budget = limit / layout.v  # a rank's v stages share its memory; each stage gets an equal share
    inflight = layout.inflight()
    window: dict[float, np.ndarray] = {}  # stages that hold as many micro-batches share one window
    for count in set(inflight):
        mem = static + act * count
        window[count] = np.searchsorted(mem, mem - budget * (1 + MEM_RTOL), side="left")
    return [window[count] for count in inflight]


def windowed_bytes(layers: Layers, layout: Layout, bounds: Sequence[tuple[int, int]]) -> float:
    """The least cap whose :func:`memory_windows` still allow ``bounds``: ``v`` times the steady bytes (training
    state and activations in flight) of its fullest stage. Below it the balanced solver must return another split."""
    static, act = _cumulative_bytes(layers, layout)
    steady = (static[b] - static[a] + (act[b] - act[a]) * count for (a, b), count in zip(bounds, layout.inflight()))
    return layout.v * float(max(steady))


def _cumulative_bytes(layers: Layers, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums over layers of the training state and of the activation bytes per micro-batch, from 0."""
    if layers.param_bytes is None or layers.activation_bytes is None:
        raise ValueError(
            "mem_per_gpu_bytes is given but the profile lacks 'param_bytes' or 'activation_bytes'; "
            "memory per stage is unknown"
        )
    state = state_bytes(layers.params, layers.param_bytes, layout.precision, layout.optimizer, layout.D)
    static = np.concatenate([[0.0], np.cumsum(cast(np.ndarray, state))])  # known: param_bytes is
    return static, np.concatenate([[0.0], np.cumsum(layers.activation_bytes)])


def no_fit_head(limit: float, method: str, P: int, v: int) -> str:
    """The first clause of the error when no ``method`` split into ``P`` ranks fits ``mem_per_gpu_bytes=limit`` (the
    planner's reason)."""
    share = "" if v == 1 else f" (each of a rank's {v} stages gets mem_per_gpu_bytes / v = {limit / v:.6g})"
    return f"mem_per_gpu_bytes={limit:.6g}: no {method} split into P={P} ranks fits{share}"
