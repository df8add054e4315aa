"""The planner's search machinery: the evaluator that partitions and simulates configurations, sharing
work across replicas and micro-batch sizes (per-layer costs come from :mod:`.costs`).

Used by :func:`pipeswift_lab.planning.planner.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..core.analytic import inflight_microbatches
from ..core.precision import state_bytes
from ..core.vocabulary import stage_to_rank
from ..partitioning.bottleneck import Infeasible
from ..partitioning.layers import Layers, capped_split, split
from ..partitioning.memory import MEM_RTOL, Layout, memory_windows, no_fit_head, rank_totals, resolve_layout
from ..partitioning.stages import Partition
from ..simulation.simulator import simulate_step_ms
from .costs import MicrobatchCosts
from .peaks import SplitPeaks
from .recompute_search import RecomputedSplit, has_recompute_columns, recompute_splits

if TYPE_CHECKING:
    from .inputs import PlanInputs

__all__ = ["Evaluator", "MicrobatchCosts", "Split"]

#: Stage bounds of a split: ``((first_layer, end_layer), ...)``, one pair per stage.
Bounds = tuple[tuple[int, int], ...]


class _Config(NamedTuple):
    """One configuration at one micro-batch size, in the order :meth:`Evaluator.peak_memory` takes it."""

    P: int
    m: int
    b: int
    schedule: str
    v: int
    D: int


class Evaluator:
    """Partitions and simulates the configurations of checked plan ``inputs``, sharing work across candidates.

    When costs scale in proportion to the micro-batch size and there is no link, the
    balanced bounds do not depend on ``b`` and the simulated step scales with it, so
    each ``(P, m, schedule, v)`` is partitioned and simulated once. The search stays on
    per-stage sums cached by their bounds; a :class:`~pipeswift_lab.Partition` is built only
    for a configuration that is simulated. Memory-capped splits are cached by what the cap
    depends on (``P``, ``v``, placement, micro-batch size, the in-flight count of each rank),
    so configurations that differ only in ``m`` or ``D`` but hold as much share one, and so is
    every split the capped search solves.

    Each rank's peak memory comes from the replay compiled once per ``(P, m, schedule, v)``
    (:class:`~pipeswift_lab.planning.peaks.SplitPeaks`); ``replay=True`` replays every action
    instead (:func:`~pipeswift_lab.partitioning.rank_memory.rank_memory`, the reference, far
    slower).
    """

    def __init__(self, inputs: PlanInputs, *, replay: bool = False) -> None:
        costs, link, optimizer, precision = inputs.costs, inputs.link, inputs.optimizer, inputs.precision
        self.costs, self.link, self.optimizer, self.precision = costs, link, optimizer, precision
        # where memory binds, choose each stage's recomputation too
        self.recompute_search = inputs.recompute == "search"
        self.mem_per_gpu_bytes = inputs.mem_per_gpu_bytes
        self.calibration = inputs.calibration  # fixed per-action costs do not scale with b: no sharing across sizes
        self.shared = costs.proportional and link is None and self.calibration is None
        self._partition = partial(Partition.from_bounds, optimizer=optimizer, link=link, precision=precision)
        self._sims: dict[tuple, tuple[float, float]] = {}
        self._layers: dict[int, Layers] = {}
        self._bounds: dict[tuple, Bounds] = {}
        self._capped: dict[tuple, Bounds | None] = {}
        self._stages: dict[tuple, _StageSums] = {}
        self._inflight: dict[tuple, tuple[tuple[int, ...], list[float]]] = {}
        self.split_peaks = SplitPeaks(costs, self.layers, optimizer=optimizer, precision=precision, replay=replay)
        """Each rank's peak of the splits weighed (:class:`~pipeswift_lab.planning.peaks.SplitPeaks`)."""
        self._solved: dict[tuple, Bounds | None] = {}

    def layers(self, b: int) -> Layers:
        """The per-layer arrays at micro-batch size ``b`` (cached), with the nearest profile's meta (the loss's bytes
        scaled to ``b``)."""
        if b not in self._layers:
            layers = Layers(self.costs.table(b))
            nearest = self.costs.nearest(b)
            meta = dict(self.costs.metas[nearest], batch_size=b)
            for key in ("loss_activation_bytes", "loss_transient_bytes"):
                if isinstance(meta.get(key), (int, float)):
                    meta[key] = meta[key] * b / nearest
            layers.meta = meta
            self._layers[b] = layers
        return self._layers[b]

    def peak_memory(self, P: int, m: int, b: int, schedule: str, v: int, D: int, bounds: Bounds) -> list[float]:
        """Each rank's peak (:func:`~pipeswift_lab.partitioning.rank_memory.rank_memory`'s ``predicted_peak_bytes``)
        of ``bounds`` at micro-batch size ``b``, from the nearest profile (cached). Returns a list, one per rank."""
        return self.split_peaks.of(P, m, b, schedule, v, D, bounds, self._placement(P, m, schedule, v)[0])

    @property
    def peaks(self) -> dict[tuple, list[float]]:
        """Every :meth:`peak_memory` answer so far, by its arguments ``(P, m, b, schedule, v, D, bounds)``: a new
        dict."""
        return self.split_peaks.answers

    def split(self, P: int, m: int, b: int, schedule: str, v: int, D: int = 1) -> Split:
        """The balanced split of ``P`` ranks at micro-batch size ``b``; where it does not fit memory, of the splits
        that do, the one whose simulated step is the shortest (simulated only where there are several).

        ``D`` is the replica count a ZeRO-1 ``precision`` shards the optimizer state over.
        ``P``, ``m``, ``schedule`` and ``v`` must already be valid together.

        Raises ``ValueError`` when no split fits ``mem_per_gpu_bytes``.
        """
        config = _Config(P, m, b, schedule, v, D)
        base = self.costs.b0 if self.shared else b
        shards = self._state_shards(D)
        _, inflight_by_rank = self._placement(P, m, schedule, v)
        bounds = self._balanced_bounds(P, m, schedule, v, base)
        stages = self._stage_sums(base, bounds, shards)
        limit = self.mem_per_gpu_bytes
        if limit is not None and sum(stages.state_bytes) / P > limit * (1 + MEM_RTOL):
            # no rank's peak is below its state (it holds it all at its optimizer step), so no split fits: raise
            # the error the replay of the balanced split would lead to, without replaying it
            _check_average_fits(stages, P, limit)
        mem = self.peak_memory(*config, bounds)
        if limit is None or max(mem) <= limit:
            return self._split_of(config, bounds, mem, base, None)
        # the time-balanced split does not fit at this micro-batch size: take the split whose simulated step is the
        # shortest of those that fit, moving layers and (with recompute="search") recomputing stages
        _check_average_fits(stages, P, limit)
        options: list[Split] = []
        try:
            capped = self._capped_bounds(config, tuple(inflight_by_rank), limit)
            options.append(self._split_of(config, capped, None, b, None))
            error = None
        except ValueError as exc:
            error = exc
        if self.recompute_search:
            options += [
                self._split_of(config, found.bounds, found.peaks, b, found)
                for found in self._recomputed_splits(config, limit)
            ]
        if not options:
            raise error if error is not None else ValueError(no_fit_head(limit, "balanced", P, v))
        return options[0] if len(options) == 1 else min(options, key=lambda option: self.simulate(option)[0])

    def _state_shards(self, D: int) -> int:
        """What the optimizer state is sharded over: ``D`` replicas under a ZeRO-1 ``precision``, else 1 (only
        ZeRO-1 state depends on ``D``)."""
        return D if self.precision is not None and self.precision.endswith("zero1") else 1

    def _split_of(
        self,
        config: _Config,
        bounds: Bounds,
        mem: Sequence[float] | None,
        base: int,
        recomputing: RecomputedSplit | None,
    ) -> Split:
        """The :class:`Split` of ``bounds`` whose times are at micro-batch size ``base`` (the step scales by
        ``b / base``), each stage recomputing as ``recomputing`` says (None: none do); ``mem``: its ranks' peaks
        (None: replayed here)."""
        P, m, b, schedule, v, D = config
        stages = self._stage_sums(base, bounds, self._state_shards(D))
        placement, _ = self._placement(P, m, schedule, v)
        if mem is None:
            mem = self.peak_memory(*config, bounds)
        scale = b / base
        stage_ms = stages.stage_ms if recomputing is None else recomputing.stage_ms
        bound = m * max(rank_totals(stage_ms, placement, P)) * scale
        if self.calibration is not None:  # calibrated actions take at least scale(P) x profiled, plus fixed costs
            bound = bound * self.calibration.scale(P) + self.calibration.step_overhead_ms(schedule)
        return Split(
            P=P,
            bounds=bounds,
            m=m,
            schedule=schedule,
            v=v,
            base=base,
            scale=scale,
            peak_mem_bytes=max(mem),
            rank_param_bytes=_rank_max(stages.param_bytes, placement, P),
            rank_params=_rank_max(stages.params, placement, P),
            lower_bound_ms=bound,
            evaluator=self,
            build=(self.layers(base) if recomputing is None else recomputing.timing, bounds, v, schedule, m, D),
            recompute=recomputing.label if recomputing is not None else "",
        )

    def _recomputed_splits(self, config: _Config, limit: float) -> list[RecomputedSplit]:
        """The splits whose stages recompute to fit ``limit`` at micro-batch size ``b``
        (:func:`~pipeswift_lab.planning.recompute_search.recompute_splits`); refuses a profile without the recompute
        columns."""
        from ..core.memory_model import default_optimizer_memory

        P, m, b, schedule, v, D = config
        nearest = self.costs.nearest(b)
        memory_table = self.costs.tables[nearest]
        if not has_recompute_columns(memory_table):
            raise ValueError(
                'recompute="search" needs the profile\'s recompute columns: profile the model with '
                "profile(..., recompute=True)"
            )
        timing_table = self.costs.table(b)  # the recomputation's times at b too (costs.TIME_COLUMNS)
        meta = dict(self.layers(nearest).meta)
        optimizer = default_optimizer_memory(self.optimizer, str(meta.get("device", "cpu")).split(":")[0])
        return recompute_splits(
            timing_table=timing_table,
            memory_table=memory_table,
            meta=meta,
            scale=b / nearest,
            P=P,
            v=v,
            m=m,
            schedule=schedule,
            limit=limit,
            optimizer=optimizer,
            precision=self.precision,
            D=D,
            link=self.link,
        )

    def partition(self, layers: Layers, bounds: Bounds, v: int, schedule: str, m: int, D: int) -> Partition:
        """The :class:`~pipeswift_lab.Partition` of a split (built when it is simulated), with the evaluator's
        optimizer, link and precision."""
        return self._partition(layers, bounds, v=v, schedule=schedule, m=m, D=D)

    def simulate(self, split: Split) -> tuple[float, float]:
        """``(pipeline_ms, bubble_ratio)`` of a split; the bubble is ``1 - m * sum(stage fwd+bwd) / (P * step)``.

        With a calibration the step is the calibrated span plus the runtime's per-step overhead.
        """
        key = (split.P, split.m, split.schedule, split.v, split.bounds, split.base, split.recompute)
        if key not in self._sims:
            self._sims[key] = self._timed(split.part, split.m, split.schedule, split.v)
        step, bubble = self._sims[key]
        return step * split.scale, bubble

    def _timed(self, part: Partition, m: int, schedule: str, v: int) -> tuple[float, float]:
        step = simulate_step_ms(part, m, schedule, v=v, link=self.link, calibration=self.calibration)
        busy = m * sum(part.stage_ms)
        if self.calibration is not None:
            step += self.calibration.step_overhead_ms(schedule)
            busy *= self.calibration.scale(part.P)
        return step, (1.0 - busy / (part.P * step) if step > 0 else 0.0)

    def _placement(self, P: int, m: int, schedule: str, v: int) -> tuple[tuple[int, ...], list[float]]:
        """``(rank of each stage, micro-batches in flight on each rank)`` (cached)."""
        key = (P, m, schedule, v)
        if key not in self._inflight:
            self._inflight[key] = (stage_to_rank(P, v, schedule), inflight_microbatches(P, m, schedule, v=v))
        return self._inflight[key]

    def _balanced_bounds(self, P: int, m: int, schedule: str, v: int, b: int) -> Bounds:
        """The time-balanced split at micro-batch size ``b``, memory not considered (cached by what it depends on:
        the stage count ``P * v``, not the schedule)."""
        key = (P * v, b)
        if key not in self._bounds:
            layers = self.layers(b)
            layout = resolve_layout(P, v, schedule, m, self.optimizer, None, 1)  # no cap: only the placement counts
            self._bounds[key] = split(layers, layout, "balanced", self.link, None)
        return self._bounds[key]

    def _stage_sums(self, b: int, bounds: Bounds, D: int) -> _StageSums:
        """Per-stage sums of the layers at micro-batch size ``b`` (cached)."""
        key = (b, bounds, D)
        if key not in self._stages:
            layers: Any = self.layers(b)  # its optional columns (params, param_bytes, ...) are set by name

            def sums(values: np.ndarray | None) -> tuple[float, ...]:
                if values is None:
                    return tuple(math.nan for _ in bounds)
                return tuple(float(values[a:e].sum()) for a, e in bounds)

            state = state_bytes(layers.params, layers.param_bytes, self.precision, self.optimizer, D)
            params = tuple(int(round(x)) for x in sums(layers.params)) if layers.params is not None else sums(None)
            fwd, bwd = sums(layers.fwd), sums(layers.bwd)
            self._stages[key] = _StageSums(
                stage_ms=tuple(f + w for f, w in zip(fwd, bwd)),
                state_bytes=sums(state),
                activation_bytes=sums(layers.activation_bytes),
                param_bytes=sums(layers.param_bytes),
                params=params,
            )
        return self._stages[key]

    def _capped_bounds(self, config: _Config, inflight_by_rank: tuple[float, ...], limit: float) -> Bounds:
        """The fastest split at size ``b`` that fits the cap ``limit`` (``mem_per_gpu_bytes``); raises ``ValueError``
        when none does.

        Cached by what the memory windows depend on, so ``m`` values with the same in-flight
        counts share one search.
        """
        P, m, b, schedule, v, D = config
        key = (P, m, v, schedule, b, D, inflight_by_rank)
        if key not in self._capped:
            layers = self.layers(b)
            layout = resolve_layout(P, v, schedule, m, self.optimizer, self.precision, self._state_shards(D))
            self._capped[key] = capped_split(
                layers,
                layout,
                "balanced",
                self.link,
                limit,
                lambda bounds: self.peak_memory(*config, bounds),
                lambda budget: self._solve(b, layout, budget),
            )
        capped = self._capped[key]
        if capped is None:
            raise ValueError(no_fit_head(limit, "balanced", P, v))
        return capped

    def _solve(self, b: int, layout: Layout, budget: float) -> Bounds:
        """The balanced split of ``layout`` at micro-batch size ``b`` within ``budget`` bytes per GPU (cached by
        the memory windows it is solved in, which many budgets, ``m`` and ``D`` share); raises ``Infeasible``."""
        layers = self.layers(b)
        windows = memory_windows(layers, layout, budget)
        key = (b, layout.n_stages, b"".join(w.tobytes() for w in windows or ()))
        if key not in self._solved:
            try:
                self._solved[key] = split(layers, layout, "balanced", self.link, budget)
            except Infeasible:
                self._solved[key] = None
        solved = self._solved[key]
        if solved is None:
            raise Infeasible
        return solved


@dataclass(frozen=True, kw_only=True)
class _StageSums:
    """Per-stage sums of a split's layers, the numbers the search needs before building a Partition."""

    stage_ms: tuple[float, ...]
    """Forward + backward per micro-batch."""
    state_bytes: tuple[float, ...]
    """Weights + gradients + optimizer state."""
    activation_bytes: tuple[float, ...]
    """Saved for the backward, per micro-batch in flight."""
    param_bytes: tuple[float, ...]
    """Bytes of the parameters."""
    params: tuple[float, ...]
    """Parameters (whole numbers; NaN where the profile has no ``params`` column)."""


@dataclass(frozen=True, kw_only=True)
class Split:
    """A balanced split at one micro-batch size, with what the planner needs before simulating it."""

    P: int
    """Ranks."""
    bounds: Bounds
    """``(first_layer, end_layer)`` of each of the ``P * v`` stages."""
    m: int
    """Micro-batches per step."""
    schedule: str
    """The schedule's name."""
    v: int
    """Stages (chunks) per rank."""
    base: int
    """The micro-batch size the split's times are for."""
    scale: float
    """``b / base``: the step scales by it."""
    peak_mem_bytes: float
    """The most memory one rank holds."""
    rank_param_bytes: float
    """The most parameter bytes one rank holds."""
    rank_params: float
    """The most parameters one rank holds (NaN when the profile does not count them)."""
    lower_bound_ms: float
    """``m`` times the busiest rank's compute: no pipeline step is shorter."""
    evaluator: Evaluator = field(repr=False, compare=False)
    """The evaluator that builds the :class:`~pipeswift_lab.Partition` on first use."""
    build: tuple[Layers, Bounds, int, str, int, int] = field(repr=False, compare=False)
    """The arguments of :meth:`Evaluator.partition`."""
    recompute: str = ""
    """The stages that recompute and how, ``"0:full 1:selective"`` (``""``: none)."""

    @cached_property
    def part(self) -> Partition:
        """The :class:`~pipeswift_lab.Partition` of this split (built on first use)."""
        return self.evaluator.partition(*self.build)


def _check_average_fits(stages: _StageSums, P: int, limit: float) -> None:
    """Raise ``ValueError`` when not even the average rank fits ``limit``: no split can beat it (weights, gradients
    and optimizer state, which every rank holds at its optimizer step)."""
    average = sum(stages.state_bytes) / P
    if average > limit:
        raise ValueError(f"needs at least {average / 2**30:.3g} GiB per GPU on average > mem_per_gpu_bytes={limit:.4g}")


def _rank_max(per_stage: Sequence[float], placement: Sequence[int], P: int) -> float:
    return max(rank_totals(per_stage, placement, P))
