"""Which stages recompute, chosen with the split: what ``plan(..., recompute="search")`` does where memory binds.

A configuration whose time-balanced split does not fit ``mem_per_gpu_bytes`` can still run if some stages
recompute their activations (:mod:`pipeswift_lab.core.recompute`): each stage keeps less per micro-batch in flight
and takes longer in its backward. AdaPipe (Sun et al., *AdaPipe: Optimizing Pipeline Parallelism with Adaptive
Recomputation and Partitioning*, ASPLOS 2024) chooses the recomputation of every stage together with the split,
for the shortest step that fits; the first stages, which hold the most micro-batches under 1F1B, often recompute
where the last do not. :func:`recompute_splits` finds candidates for it, which the planner's search simulates:

1. every stage starts recomputing nothing; the split is time-balanced with each layer's time as it is recomputed;
2. while a rank is over the cap, the stage of the fullest rank that saves the most bytes per millisecond it adds
   moves up, nothing → ``"selective"`` or ``"full"``, ``"selective"`` → ``"full"`` (whichever step saves the most
   per millisecond), and the split is balanced again with the new times (a stage's choice applies to whatever
   layers it holds), until every rank fits or the fullest rank has no stage left to raise;
3. from the other end, every stage recomputes fully on the split balanced within the cap
   (:func:`~pipeswift_lab.partitioning.layers.capped_split`), and on each split a tighter cap would give in turn
   (a cap just below the last one's fullest rank). A time-balanced split can pile onto one rank layers that are
   quick but large (weights, optimizer state) that no recomputation there makes fit; and a split balanced on every
   stage's time recomputed fully is not the fastest once some stages are lowered (under 1F1B the step also grows
   with the sum of the stages), so that without the tighter splits a looser cap could plan a slower step than a
   tighter one;
4. on every split that fits, every stage is lowered again as far as it still fits (a stage raised for an earlier
   split may not need it on the last), the one whose lowering saves the most time first.

Each candidate: its bounds and each stage's choice. The planner keeps the one whose simulated step is shortest.

It needs a profile measured with ``recompute=True`` (its recompute columns,
:mod:`pipeswift_lab.profiling.recompute_costs`).

``plan(..., recompute="full")`` (or ``"selective"``) forces instead: every layer of every stage recomputes so,
whether memory binds or not (:func:`forced_costs`, the costs the search then reads; :func:`forced_label`, what the
plan's table and :meth:`~pipeswift_lab.planning.result.Plan.run_arguments` carry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..core.memory_model import OptimizerMemory
from ..core.peak_forms import peak_form
from ..core.schedule import ScheduleLike
from ..core.vocabulary import stage_to_rank
from ..partitioning.layers import Bounds, Layers, capped_split, split
from ..partitioning.memory import MEM_RTOL, Layout
from ..partitioning.rank_memory import SplitBytes
from ..profiling.recompute_costs import FORWARD_COLUMNS, RECOMPUTE_COLUMNS, recomputed
from ..profiling.table import Profile
from .costs import MicrobatchCosts
from .sharding import fsdp_fields

__all__ = [
    "FORCED_MODES",
    "LEVELS",
    "TIGHTER_SPLITS",
    "RecomputedSplit",
    "forced_costs",
    "forced_label",
    "has_recompute_columns",
    "recompute_splits",
]

#: The recomputations ``plan(..., recompute=...)`` can force on every stage.
FORCED_MODES = ("full", "selective")

#: A stage's choices, from the least recomputation to the most.
LEVELS = ("", "selective", "full")

#: How many splits under tighter caps step 3 of the module docs tries, after the one balanced within the cap.
TIGHTER_SPLITS = 6


@dataclass(frozen=True)
class RecomputedSplit:
    """A split that fits with recomputation: its ``bounds``, each stage's ``modes`` (``""``: none), the per-layer
    table its times come from (``timing``) and each rank's ``peaks``."""

    bounds: Bounds
    modes: tuple[str, ...]
    timing: Layers
    peaks: list[float]

    @property
    def stage_ms(self) -> tuple[float, ...]:
        """Forward + backward per micro-batch of each stage (its backward recomputing as chosen)."""
        return tuple(float((self.timing.fwd[a:e] + self.timing.bwd[a:e]).sum()) for a, e in self.bounds)

    @property
    def label(self) -> str:
        """``"0:full 1:selective"``: the stages that recompute and how (``""`` for none)."""
        return " ".join(f"{s}:{mode}" for s, mode in enumerate(self.modes) if mode)


def has_recompute_columns(table: pd.DataFrame) -> bool:
    """Whether a per-layer table holds what recomputing its layers costs (``profile(..., recompute=True)``)."""
    return all(c in table.columns for c in RECOMPUTE_COLUMNS)


def forced_costs(costs: MicrobatchCosts, mode: str | None) -> MicrobatchCosts:
    """``costs`` with every layer recomputed as ``mode`` (one of :data:`FORCED_MODES`; None: ``costs`` itself):
    each profiled table as :func:`~pipeswift_lab.profiling.recompute_costs.recomputed` costs it (held activations,
    longer backward, ``recomputed_ms``), each meta saying so. A table already recomputed the same way stays as it
    is (forcing twice is forcing once); one recomputed otherwise is refused (``ValueError``). Returns a
    :class:`~pipeswift_lab.planning.costs.MicrobatchCosts`."""
    if mode is None:
        return costs
    profiles = {b: recomputed(Profile(table, dict(costs.metas[b])), mode) for b, table in costs.tables.items()}
    out = costs.derived(lambda df: df)
    out.tables = {b: prof.df for b, prof in profiles.items()}
    out.metas = {b: dict(prof.meta) for b, prof in profiles.items()}
    return out


def forced_label(mode: str | None, n_stages: int) -> str:
    """The ``recompute`` label of a split of ``n_stages`` stages that all recompute as ``mode``:
    ``"0:full 1:full ..."`` (``""`` for None), as :attr:`RecomputedSplit.label` writes a chosen one."""
    return " ".join(f"{s}:{mode}" for s in range(n_stages)) if mode else ""


def _by_layer(bounds: Bounds, modes: tuple[str, ...], names: list[str]) -> dict[str, str]:
    return {names[i]: mode for (a, b), mode in zip(bounds, modes) if mode for i in range(a, b)}


def recompute_splits(
    *,
    timing_table: pd.DataFrame,
    memory_table: pd.DataFrame,
    meta: dict[str, Any],
    scale: float,
    P: int,
    v: int,
    m: int,
    schedule: ScheduleLike,
    limit: float,
    optimizer: OptimizerMemory,
    precision: str | None,
    D: int,
    link: Any = None,
    fsdp: int = 1,
) -> list[RecomputedSplit]:
    """The splits of ``P * v`` stages with each stage's recomputation, found as the module docs say, whose every
    rank fits ``limit``, each once (empty when none does). ``timing_table`` is the per-layer table at the micro-batch
    size (times), ``memory_table`` the nearest profile's, whose bytes ``scale`` takes to it; ``fsdp`` the FSDP shards
    of a replica (:func:`~pipeswift_lab.planning.sharding.fsdp_fields`)."""
    names = [str(n) for n in timing_table["name"]]
    n_stages = P * v
    ranks = stage_to_rank(P, v, schedule)
    placement = np.asarray(ranks)
    form = peak_form(P, m, schedule, v)
    layout = Layout(P=P, v=v, schedule=schedule, mem_schedule=schedule, m=m)

    def layers_of(table: pd.DataFrame, bounds: Bounds | None, modes: tuple[str, ...]) -> Layers:
        chosen = _by_layer(bounds, modes, names) if bounds is not None else {}
        return Layers(recomputed(Profile(table, dict(meta)), chosen or None))

    def peaks_of(bounds: Bounds, modes: tuple[str, ...]) -> list[float]:
        memory = layers_of(memory_table, bounds, modes)
        split_bytes = SplitBytes(memory, scale=scale, precision=precision, optimizer=optimizer, D=1 if fsdp > 1 else D)
        fields = fsdp_fields(split_bytes.of(bounds, ranks), fsdp)
        return [float(x) for x in form.peaks(fields, optimizer)]

    answers: dict[tuple[Bounds, tuple[str, ...]], RecomputedSplit] = {}

    def keep(bounds: Bounds, modes: tuple[str, ...], peaks: list[float]) -> None:
        modes, peaks = _lowered(modes, bounds, timing_table, limit, peaks_of, peaks)
        answers.setdefault(
            (bounds, modes), RecomputedSplit(bounds, modes, layers_of(timing_table, bounds, modes), peaks)
        )

    modes: tuple[str, ...] = ("",) * n_stages
    bounds: Bounds | None = None
    for _ in range(2 * n_stages + 1):
        # balanced with each layer's time as the stage that held it last recomputes it
        bounds = split(layers_of(timing_table, bounds, modes), layout, "balanced", link, None)
        peaks = peaks_of(bounds, modes)
        if max(peaks) <= limit:
            keep(bounds, modes, peaks)
            break
        raised = _raise_one(modes, bounds, placement, int(np.argmax(peaks)), timing_table, scale)
        if raised is None:
            break
        modes = raised
    full = ("full",) * n_stages
    recomputing = layers_of(timing_table, ((0, len(names)),), ("full",))
    cap = limit
    for _ in range(1 + TIGHTER_SPLITS):
        capped = capped_split(recomputing, layout, "balanced", link, cap, lambda bounds: peaks_of(bounds, full))
        if capped is None:
            break
        peaks = peaks_of(capped, full)
        if max(peaks) <= limit:
            keep(capped, full, peaks)
        cap = min(cap, max(peaks)) * (1 - 4 * MEM_RTOL)  # the cap under which this split no longer fits
    return list(answers.values())


def _lowered(
    modes: tuple[str, ...],
    bounds: Bounds,
    table: pd.DataFrame,
    limit: float,
    peaks_of: Any,
    peaks: list[float],
) -> tuple[tuple[str, ...], list[float]]:
    """``modes`` with every stage lowered as far as the split still fits (a stage raised for an earlier split may
    not need it on the last), the stage whose lowering saves the most time first; and the peaks."""
    while True:
        options = []
        for s, now in enumerate(modes):
            for lower in LEVELS[: LEVELS.index(now)]:
                a, b = bounds[s]
                saved_ms = _added_ms(table.iloc[a:b], now) - _added_ms(table.iloc[a:b], lower)
                if saved_ms > 0:
                    options.append((saved_ms, s, lower))
        for _, s, lower in sorted(options, reverse=True):
            trial = tuple(lower if i == s else mode for i, mode in enumerate(modes))
            trial_peaks = peaks_of(bounds, trial)
            if max(trial_peaks) <= limit:
                modes, peaks = trial, trial_peaks
                break
        else:
            return modes, peaks


def _raise_one(
    modes: tuple[str, ...],
    bounds: Bounds,
    placement: np.ndarray,
    rank: int,
    table: pd.DataFrame,
    scale: float,
) -> tuple[str, ...] | None:
    """``modes`` with one stage of ``rank`` raised to a higher level: of every stage of the rank and every level
    above its own, the one that saves the most activation bytes per millisecond its backward gains (so a stage may
    go straight to ``"full"`` where selective recomputation saves less for more time, as where its dispatch costs
    more than the operators it spares); None when every stage of the rank already recomputes fully."""
    best: tuple[float, int, str] | None = None
    for s in (int(x) for x in np.flatnonzero(placement == rank)):
        a, b = bounds[s]
        rows = table.iloc[a:b]
        now = modes[s]
        for after in LEVELS[LEVELS.index(now) + 1 :]:
            saved = float((_held(rows, now) - _held(rows, after)).sum()) * scale
            added = max(_added_ms(rows, after) - _added_ms(rows, now), 1e-9)
            if saved > 0 and (best is None or saved / added > best[0]):
                best = (saved / added, s, after)
    if best is None:
        return None
    _, stage, level = best
    return tuple(level if i == stage else mode for i, mode in enumerate(modes))


def _held(rows: pd.DataFrame, mode: str) -> pd.Series:
    """What each layer of ``rows`` holds per micro-batch in flight recomputing as ``mode`` (``""``: not)."""
    return rows["activation_bytes"] if not mode else rows[f"{mode}_activation_bytes"]


def _added_ms(rows: pd.DataFrame, mode: str) -> float:
    """The milliseconds the layers of ``rows`` add to their forward and backward recomputing as ``mode``."""
    if not mode:
        return 0.0
    backward = float(rows["selective_recompute_ms" if mode == "selective" else "recompute_ms"].sum())
    forward = FORWARD_COLUMNS[mode]
    return backward + (float(rows[forward].sum()) if forward in rows.columns else 0.0)
