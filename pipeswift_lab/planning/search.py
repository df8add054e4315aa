"""The planner's search machinery: the evaluator that partitions and simulates configurations, sharing
work across replicas and micro-batch sizes (per-layer costs come from :mod:`.costs`).

Used by :func:`pipeswift_lab.planning.planner.plan`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..core.analytic import inflight_microbatches
from ..core.link import Link
from ..core.precision import state_bytes
from ..core.schedule import ScheduleLike
from ..core.vocabulary import stage_to_rank
from ..partitioning.bottleneck import Infeasible
from ..partitioning.layers import Layers, capped_split, split
from ..partitioning.memory import MEM_RTOL, Layout, memory_windows, no_fit_head, rank_totals, resolve_layout
from ..partitioning.stages import Partition
from ..simulation.simulator import simulate_step_ms
from .costs import MicrobatchCosts
from .memory_bound import held_counts, min_fullest_rank_bytes
from .peaks import SplitPeaks
from .recompute_search import (
    FORCED_MODES,
    RecomputedSplit,
    forced_costs,
    forced_label,
    has_recompute_columns,
    recompute_splits,
)
from .sharding import fsdp_state_ratio, tp_costs
from .splits import Bounds, Split, StageSums, check_average_fits, rank_max
from .step_bounds import split_step_lower_ms

if TYPE_CHECKING:
    from .inputs import PlanInputs

__all__ = ["Evaluator", "MicrobatchCosts", "Split"]


class _Config(NamedTuple):
    """One configuration at one micro-batch size, in the order :meth:`Evaluator.peak_memory` takes it."""

    P: int
    m: int
    b: int
    schedule: ScheduleLike
    v: int
    D: int
    fsdp: int = 1


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

    An evaluator weighs one tensor-parallel degree on one pipeline link: ``inputs.costs`` are the per-layer costs
    as one tensor-parallel rank sees them (:func:`~pipeswift_lab.planning.sharding.tp_costs`). The FSDP degree
    ``fsdp`` is an argument of :meth:`split`, like ``D``: its splits share the balanced bounds and the simulations.
    """

    def __init__(self, inputs: PlanInputs, *, replay: bool = False) -> None:
        self.inputs, self.replay = inputs, replay
        # recompute="full" / "selective": every layer costs recomputed so (after tensor parallelism divides it)
        self.forced = inputs.recompute if inputs.recompute in FORCED_MODES else None
        self._raw_costs = inputs.costs
        self._family: dict[tuple[int, Link | None], Evaluator] = {(1, inputs.link): self}
        self._tp_costs: dict[int, MicrobatchCosts] = {1: forced_costs(inputs.costs, self.forced)}
        costs, link, optimizer, precision = self._tp_costs[1], inputs.link, inputs.optimizer, inputs.precision
        self.costs, self.link, self.optimizer, self.precision = costs, link, optimizer, precision
        # where memory binds, choose each stage's recomputation too
        self.recompute_search = inputs.recompute == "search"
        self.mem_per_gpu_bytes = inputs.mem_per_gpu_bytes
        # bound a split's step by its schedule's dependencies (step_bounds), not by its busiest rank alone: the
        # 3-D search's pruning; the search of pipelines × replicas keeps the busiest rank's bound it always had
        self.schedule_bounds = inputs.three_d
        self.calibration = inputs.calibration  # fixed per-action costs do not scale with b: no sharing across sizes
        self.shared = costs.proportional and link is None and self.calibration is None
        self._partition = partial(Partition.from_bounds, optimizer=optimizer, link=link, precision=precision)
        self._sims: dict[tuple, tuple[float, float]] = {}
        self._layers: dict[int, Layers] = {}
        self._bounds: dict[tuple, Bounds] = {}
        self._capped: dict[tuple, Bounds | None] = {}
        self._stages: dict[tuple, StageSums] = {}
        self._inflight: dict[tuple, tuple[tuple[int, ...], list[float]]] = {}
        self.split_peaks = SplitPeaks(costs, self.layers, optimizer=optimizer, precision=precision, replay=replay)
        """Each rank's peak of the splits weighed (:class:`~pipeswift_lab.planning.peaks.SplitPeaks`)."""
        self._solved: dict[tuple, Bounds | None] = {}
        self._window_layers: dict[tuple[int, int], Layers] = {}

    def costs_at(self, tp: int) -> MicrobatchCosts:
        """The per-layer costs as one of ``tp`` tensor-parallel ranks sees them, its collectives inside a node of the
        plan's topology (:func:`~pipeswift_lab.planning.sharding.tp_costs`; cached, shared by the family)."""
        if tp not in self._tp_costs:
            network = self.inputs.degrees.network if self.inputs.degrees is not None else None
            if network is None:
                raise ValueError(f"tp={tp} needs a topology: plan(..., topology=...) or tp=...")
            sequence_parallel = self.inputs.degrees is not None and self.inputs.degrees.sequence_parallel
            sharded = tp_costs(self._raw_costs, tp, network.intra_node, sequence_parallel)
            self._tp_costs[tp] = forced_costs(sharded, self.forced)
        return self._tp_costs[tp]

    def at(self, tp: int, link: Link | None) -> Evaluator:
        """The evaluator of the same inputs for ``tp`` tensor-parallel ranks whose pipeline sends run on ``link``
        (this one for ``tp == 1`` on the plan's ``link``); each is built once and shares the family's caches of
        per-tp costs."""
        key = (tp, link)
        if key not in self._family:
            sibling = Evaluator(
                dataclasses.replace(self.inputs, costs=self.costs_at(tp), link=link), replay=self.replay
            )
            sibling._family, sibling._tp_costs, sibling._raw_costs = self._family, self._tp_costs, self._raw_costs
            self._family[key] = sibling
        return self._family[key]

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

    def peak_memory(
        self, P: int, m: int, b: int, schedule: ScheduleLike, v: int, D: int, bounds: Bounds, fsdp: int = 1
    ) -> list[float]:
        """Each rank's peak (:func:`~pipeswift_lab.partitioning.rank_memory.rank_memory`'s ``predicted_peak_bytes``)
        of ``bounds`` at micro-batch size ``b`` with ``fsdp`` shards, from the nearest profile (cached). Returns a
        list, one per rank."""
        return self.split_peaks.of(P, m, b, schedule, v, D, bounds, self._placement(P, m, schedule, v)[0], fsdp)

    def _peaks_of(self, config: _Config, bounds: Bounds) -> list[float]:
        """:meth:`peak_memory` of ``bounds`` for a configuration."""
        P, m, b, schedule, v, D, fsdp = config
        return self.peak_memory(P, m, b, schedule, v, D, bounds, fsdp)

    @property
    def peaks(self) -> dict[tuple, list[float]]:
        """Every :meth:`peak_memory` answer so far, by its arguments ``(P, m, b, schedule, v, D, bounds)``: a new
        dict."""
        return self.split_peaks.answers

    def split(self, P: int, m: int, b: int, schedule: ScheduleLike, v: int, D: int = 1, fsdp: int = 1) -> Split:
        """The balanced split of ``P`` ranks at micro-batch size ``b``; where it does not fit memory, of the splits
        that do, the one whose simulated step is the shortest (simulated only where there are several).

        ``D`` is the replica count a ZeRO-1 ``precision`` shards the optimizer state over; ``fsdp`` the FSDP shards
        of each replica (:mod:`~pipeswift_lab.planning.sharding`).
        ``P``, ``m``, ``schedule`` and ``v`` must already be valid together.

        Raises ``ValueError`` when no split fits ``mem_per_gpu_bytes``.
        """
        config = _Config(P, m, b, schedule, v, D, fsdp)
        base = self.costs.b0 if self.shared else b
        shards = self._state_shards(D)
        _, inflight_by_rank = self._placement(P, m, schedule, v)
        bounds = self._balanced_bounds(P, m, schedule, v, base)
        stages = self._stage_sums(base, bounds, shards, fsdp)
        limit = self.mem_per_gpu_bytes
        if limit is not None and sum(stages.state_bytes) / P > limit * (1 + MEM_RTOL):
            # no rank's peak is below its state (it holds it all at its optimizer step), so no split fits: raise
            # the error the replay of the balanced split would lead to, without replaying it
            check_average_fits(sum(stages.state_bytes) / P, limit)
        mem = self._peaks_of(config, bounds)
        if limit is None or max(mem) <= limit:
            return self._split_of(config, bounds, mem, base, None)
        # the time-balanced split does not fit at this micro-batch size: take the split whose simulated step is the
        # shortest of those that fit, moving layers and (with recompute="search") recomputing stages
        check_average_fits(sum(stages.state_bytes) / P, limit)
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
            head = str(error) if error is not None else no_fit_head(limit, "balanced", P, v)
            busiest = int(max(range(P), key=lambda rank: mem[rank]))
            peak = f"{mem[busiest] / 2**30:.4g} GiB"
            raise ValueError(f"{head} (the time-balanced split's busiest, rank {busiest}, peaks at {peak})")
        return options[0] if len(options) == 1 else min(options, key=lambda option: self.simulate(option)[0])

    def split_at(
        self, P: int, m: int, b: int, schedule: ScheduleLike, v: int, D: int, fsdp: int, bounds: Bounds
    ) -> Split:
        """The :class:`Split` of the given ``bounds`` (a configuration priced as written, :mod:`.pricing`), whether
        or not it fits ``mem_per_gpu_bytes``: its ``peak_mem_bytes`` says."""
        return self._split_of(_Config(P, m, b, schedule, v, D, fsdp), tuple(bounds), None, b, None)

    def _state_shards(self, D: int) -> int:
        """What the optimizer state is sharded over: ``D`` replicas under a ZeRO-1 ``precision``, else 1 (only
        ZeRO-1 state depends on ``D``)."""
        return D if self.precision is not None and self.precision.endswith("zero1") else 1

    def average_state_bytes(self, P: int, D: int = 1, fsdp: int = 1) -> float:
        """The training state one of ``P`` ranks holds on average (weights, gradients, optimizer state, master
        weights) with ``D`` replicas and ``fsdp`` shards: no split of ``P`` ranks has a rank below it."""
        bounds = ((0, self.costs.n_layers),)
        return sum(self._stage_sums(self.costs.b0, bounds, self._state_shards(D), fsdp).state_bytes) / P

    def fullest_rank_lower_bytes(
        self, P: int, m: int, b: int, schedule: ScheduleLike, v: int, D: int, fsdp: int = 1
    ) -> float:
        """A lower bound on the fullest rank's peak of every split of ``P`` ranks at micro-batch size ``b``
        (:func:`~pipeswift_lab.planning.memory_bound.min_fullest_rank_bytes`): no split fits a smaller cap. Where
        stages may recompute (``recompute="search"``), each layer's activations are the least it can hold."""
        state, activations = self.split_peaks.state_and_activations(b, D, fsdp)
        if self.recompute_search:
            df = self.layers(self.costs.nearest(b)).df
            scale = b / self.costs.nearest(b)
            for column in ("full_activation_bytes", "selective_activation_bytes"):
                if column in df.columns:
                    least = np.nan_to_num(df[column].to_numpy(float), nan=np.inf) * scale
                    activations = np.minimum(activations, least)
        return min_fullest_rank_bytes(state, activations, held_counts(P, m, schedule, v))

    def check_average_fits(self, P: int, D: int = 1, fsdp: int = 1) -> None:
        """Raise the ``ValueError`` :meth:`split` raises for every split of ``P`` ranks when not even their average
        state fits ``mem_per_gpu_bytes`` (nothing without a cap)."""
        limit = self.mem_per_gpu_bytes
        average = self.average_state_bytes(P, D, fsdp) if limit is not None else 0.0
        if limit is not None and average > limit * (1 + MEM_RTOL):
            check_average_fits(average, limit)

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
        P, m, b, schedule, v, D, fsdp = config
        stages = self._stage_sums(base, bounds, self._state_shards(D), fsdp)
        placement, _ = self._placement(P, m, schedule, v)
        if mem is None:
            mem = self._peaks_of(config, bounds)
        scale = b / base
        stage_ms = stages.stage_ms if recomputing is None else recomputing.stage_ms
        bound = m * max(rank_totals(stage_ms, placement, P)) * scale
        if self.schedule_bounds:  # the schedule's dependencies too (step_bounds), in the 3-D search
            timing = self.layers(base) if recomputing is None else recomputing.timing
            starts = [a for a, _ in bounds]
            fwd, bwd = np.add.reduceat(timing.fwd, starts), np.add.reduceat(timing.bwd, starts)
            bound = max(bound, split_step_lower_ms(fwd, bwd, placement, P, m, schedule) * scale)
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
            rank_param_bytes=rank_max(stages.param_bytes, placement, P),
            rank_params=rank_max(stages.params, placement, P),
            lower_bound_ms=bound,
            evaluator=self,
            build=(self.layers(base) if recomputing is None else recomputing.timing, bounds, v, schedule, m, D),
            fsdp=fsdp,
            recompute=recomputing.label if recomputing is not None else forced_label(self.forced, P * v),
        )

    def _recomputed_splits(self, config: _Config, limit: float) -> list[RecomputedSplit]:
        """The splits whose stages recompute to fit ``limit`` at micro-batch size ``b``
        (:func:`~pipeswift_lab.planning.recompute_search.recompute_splits`); refuses a profile without the recompute
        columns."""
        from ..core.memory_model import default_optimizer_memory

        P, m, b, schedule, v, D, fsdp = config
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
            fsdp=fsdp,
        )

    def partition(self, layers: Layers, bounds: Bounds, v: int, schedule: ScheduleLike, m: int, D: int) -> Partition:
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

    def _timed(self, part: Partition, m: int, schedule: ScheduleLike, v: int) -> tuple[float, float]:
        step = simulate_step_ms(part, m, schedule, v=v, link=self.link, calibration=self.calibration)
        busy = m * sum(part.stage_ms)
        if self.calibration is not None:
            step += self.calibration.step_overhead_ms(schedule)
            busy *= self.calibration.scale(part.P)
        return step, (1.0 - busy / (part.P * step) if step > 0 else 0.0)

    def _placement(self, P: int, m: int, schedule: ScheduleLike, v: int) -> tuple[tuple[int, ...], list[float]]:
        """``(rank of each stage, micro-batches in flight on each rank)`` (cached)."""
        key = (P, m, schedule, v)
        if key not in self._inflight:
            self._inflight[key] = (stage_to_rank(P, v, schedule), inflight_microbatches(P, m, schedule, v=v))
        return self._inflight[key]

    def _balanced_bounds(self, P: int, m: int, schedule: ScheduleLike, v: int, b: int) -> Bounds:
        """The time-balanced split at micro-batch size ``b``, memory not considered (cached by what it depends on:
        the stage count ``P * v``, not the schedule)."""
        key = (P * v, b)
        if key not in self._bounds:
            layers = self.layers(b)
            layout = resolve_layout(P, v, schedule, m, self.optimizer, None, 1)  # no cap: only the placement counts
            self._bounds[key] = split(layers, layout, "balanced", self.link, None)
        return self._bounds[key]

    def _stage_sums(self, b: int, bounds: Bounds, D: int, fsdp: int = 1) -> StageSums:
        """Per-stage sums of the layers at micro-batch size ``b``, the optimizer state sharded over ``D`` (ZeRO-1)
        and the training state held as one of ``fsdp`` shards holds it (cached)."""
        key = (b, bounds, D, fsdp)
        if key not in self._stages:
            layers: Any = self.layers(b)  # its optional columns (params, param_bytes, ...) are set by name

            def sums(values: np.ndarray | None) -> tuple[float, ...]:
                if values is None:
                    return tuple(math.nan for _ in bounds)
                return tuple(float(values[a:e].sum()) for a, e in bounds)

            state = state_bytes(layers.params, layers.param_bytes, self.precision, self.optimizer, D)
            if fsdp > 1 and state is not None:
                state = state * fsdp_state_ratio(self.precision, self.optimizer, fsdp)
            params = tuple(int(round(x)) for x in sums(layers.params)) if layers.params is not None else sums(None)
            fwd, bwd = sums(layers.fwd), sums(layers.bwd)
            self._stages[key] = StageSums(
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
        P, m, b, schedule, v, D, fsdp = config
        key = (P, m, v, schedule, b, D, fsdp, inflight_by_rank)
        if key not in self._capped:
            layers = self._windowed(b, fsdp)
            layout = resolve_layout(P, v, schedule, m, self.optimizer, self.precision, self._state_shards(D))
            self._capped[key] = capped_split(
                layers,
                layout,
                "balanced",
                self.link,
                limit,
                lambda bounds: self._peaks_of(config, bounds),
                lambda budget: self._solve(b, layout, budget, fsdp),
            )
        capped = self._capped[key]
        if capped is None:
            raise ValueError(no_fit_head(limit, "balanced", P, v))
        return capped

    def _windowed(self, b: int, fsdp: int) -> Layers:
        """The layers at micro-batch size ``b`` whose memory windows count the training state one of ``fsdp`` shards
        holds: parameter bytes and counts scaled by
        :func:`~pipeswift_lab.planning.sharding.fsdp_state_ratio` (the same layers at ``fsdp == 1``)."""
        if fsdp == 1:
            return self.layers(b)
        key = (b, fsdp)
        if key not in self._window_layers:
            layers = copy.copy(self.layers(b))
            ratio = fsdp_state_ratio(self.precision, self.optimizer, fsdp)
            layers.param_bytes = None if layers.param_bytes is None else layers.param_bytes * ratio
            layers.params = None if layers.params is None else layers.params * ratio
            self._window_layers[key] = layers
        return self._window_layers[key]

    def _solve(self, b: int, layout: Layout, budget: float, fsdp: int = 1) -> Bounds:
        """The balanced split of ``layout`` at micro-batch size ``b`` within ``budget`` bytes per GPU (cached by
        the memory windows it is solved in, which many budgets, ``m`` and ``D`` share); raises ``Infeasible``."""
        layers = self._windowed(b, fsdp)
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
