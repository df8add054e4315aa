"""The planner's search machinery: per-layer costs at any micro-batch size, and the evaluator that
partitions and simulates configurations, sharing work across replicas and micro-batch sizes.

Used by :func:`pipeswift_lab.planner.plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .partition import Partition, partition
from .simulate import simulate_step_ms


class MicrobatchCosts:
    """Per-layer costs at any micro-batch size, from one or more profiles.

    With one profile taken at micro-batch size ``b0``, times and bytes scale in proportion
    to ``b / b0``. With profiles at several sizes, each layer's times are interpolated
    piecewise-linearly in ``b`` (and extrapolated along the end segments, never below
    zero), which captures the fixed per-micro-batch cost that makes small micro-batches
    slow; bytes stay proportional to ``b`` from the nearest profile.
    """

    def __init__(self, profile):
        profiles = list(profile) if isinstance(profile, (list, tuple)) else [profile]
        if not profiles:
            raise ValueError("profile is empty; give a Profile or a list of Profiles at different micro-batch sizes")
        by_size = {}
        for i, prof in enumerate(profiles):
            df = prof.df if hasattr(prof, "df") else prof
            if not isinstance(df, pd.DataFrame):
                raise TypeError(f"profile must be a pipeswift_lab.Profile, a per-layer DataFrame or a list of Profiles; got {type(prof).__name__}")
            meta = getattr(prof, "meta", {}) or {}
            size = int(meta.get("batch_size") or 1)
            if size in by_size:
                raise ValueError(f"two profiles have micro-batch size {size}; give one profile per size")
            by_size[size] = (df.reset_index(drop=True), str(meta.get("device", "cuda")).split(":")[0])
        self.sizes = sorted(by_size)
        self.tables = {b: by_size[b][0] for b in self.sizes}
        self.device = by_size[self.sizes[0]][1]
        lengths = {len(t) for t in self.tables.values()}
        if len(lengths) != 1:
            raise ValueError(f"profiles have different layer counts {sorted(lengths)}; profile the same model at each size")
        self.n_layers = lengths.pop()
        self.proportional = len(self.sizes) == 1
        self._cache = {}

    @property
    def b0(self) -> int:
        """The smallest profiled micro-batch size."""
        return self.sizes[0]

    def table(self, b: int) -> pd.DataFrame:
        """Per-layer DataFrame at micro-batch size ``b``."""
        if b not in self._cache:
            nearest = min(self.sizes, key=lambda size: (abs(size - b), size))
            df = self.tables[nearest].copy()
            for col in ("activation_bytes", "output_bytes"):
                if col in df.columns:
                    df[col] = df[col] * (b / nearest)
            for col in ("fwd_ms", "bwd_ms", "wgrad_ms"):
                if col in df.columns:
                    df[col] = self._time(col, b)
            self._cache[b] = df
        return self._cache[b]

    def _time(self, col, b):
        if self.proportional:
            return self.tables[self.b0][col] * (b / self.b0)
        sizes = self.sizes
        hi = next((i for i, size in enumerate(sizes) if size >= b), len(sizes) - 1)
        hi = max(hi, 1)
        b1, b2 = sizes[hi - 1], sizes[hi]
        t1, t2 = self.tables[b1][col], self.tables[b2][col]
        return (t1 + (t2 - t1) * (b - b1) / (b2 - b1)).clip(lower=0.0)


class Evaluator:
    """Partitions and simulates configurations, sharing work across replicas and micro-batch sizes.

    When costs scale in proportion to the micro-batch size and there is no link, the
    balanced bounds do not depend on ``b`` and the simulated step scales with it, so
    each ``(P, m, schedule, v)`` is partitioned and simulated once.
    """

    def __init__(self, costs: MicrobatchCosts, link, mem_limit, optimizer, calibration=None, precision=None):
        self.costs, self.link, self.mem_limit, self.optimizer, self.precision = costs, link, mem_limit, optimizer, precision
        self.calibration = calibration  # fixed per-action costs do not scale with b: no sharing across sizes
        self.shared = costs.proportional and link is None and calibration is None
        self._bounds, self._sims = {}, {}

    def split(self, P, m, b, schedule, v, D=1) -> "Split":
        """The balanced split of ``P`` ranks at micro-batch size ``b`` (the fastest that fits memory), unsimulated.

        ``D`` is the replica count a ZeRO-1 ``precision`` shards the optimizer state over.

        Raises ``ValueError`` when no split fits ``mem_per_gpu_bytes``.
        """
        base = self.costs.b0 if self.shared else b
        table = self.costs.table(base)
        key = (P, v, schedule, base)
        if key not in self._bounds:
            self._bounds[key] = partition(table, P, "balanced", v=v, schedule=schedule, m=m, optimizer=self.optimizer, link=self.link).bounds
        part = Partition.from_bounds(table, self._bounds[key], v=v, schedule=schedule, m=m, optimizer=self.optimizer, link=self.link, precision=self.precision, dp=D)
        scale = b / base
        mem = self._rank_memory(part, scale)
        if self.mem_limit is not None and max(mem) > self.mem_limit:
            # no split can beat the average rank: static state plus the fewest in-flight activations
            static = sum(part.stage_state_bytes)
            activations = min(part.stage_inflight) * sum(part.stage_activation_bytes) * scale
            if (static + activations) / P > self.mem_limit:
                raise ValueError(f"needs at least {(static + activations) / P / 2**30:.3g} GiB per GPU on average > mem_per_gpu_bytes={self.mem_limit:.4g}")
            # the time-balanced split does not fit at this micro-batch size: take the fastest split that does
            part = partition(self.costs.table(b), P, "balanced", v=v, schedule=schedule, m=m, optimizer=self.optimizer, mem_limit_bytes=self.mem_limit, link=self.link, precision=self.precision, dp=D)
            base, scale, mem = b, 1.0, self._rank_memory(part, 1.0)
        busiest = max(sum(part.stage_ms[s] for s, r in enumerate(part.stage_to_rank) if r == rank) for rank in range(P))
        bound = m * busiest * scale
        if self.calibration is not None:  # calibrated actions take at least scale(P) x profiled, plus non-negative costs
            bound = bound * self.calibration.scale(P) + self.calibration.step_overhead_ms(schedule)
        return Split(part, m, schedule, v, base, scale, max(mem), _rank_params(part), bound)

    def simulate(self, split: "Split") -> tuple[float, float]:
        """``(pipeline_ms, bubble_ratio)`` of a split; the bubble is ``1 - m * sum(stage fwd+bwd) / (P * step)``.

        With a calibration the step is the calibrated span plus the runtime's per-step overhead.
        """
        key = (split.part.P, split.m, split.schedule, split.v, split.part.bounds, split.base)
        if key not in self._sims:
            self._sims[key] = self._timed(split.part, split.m, split.schedule, split.v, 1.0)
        step, bubble = self._sims[key]
        return step * split.scale, bubble

    def _timed(self, part, m, schedule, v, scale):
        step = simulate_step_ms(part, m, schedule, v, link=self.link, calibration=self.calibration) * scale
        busy = m * sum(part.stage_ms) * scale
        if self.calibration is not None:
            step += self.calibration.step_overhead_ms(schedule)
            busy *= self.calibration.scale(part.P)
        return step, (1.0 - busy / (part.P * step) if step > 0 else 0.0)

    def _rank_memory(self, part, scale):
        mem = [0.0] * part.P
        for s, r in enumerate(part.stage_to_rank):
            mem[r] += part.stage_state_bytes[s] + part.stage_activation_bytes[s] * part.stage_inflight[s] * scale
        return mem


@dataclass(frozen=True)
class Split:
    """A partition at one micro-batch size, with what the planner needs before simulating it."""

    part: Partition
    m: int
    schedule: str
    v: int
    base: int  # micro-batch size the partition's times are for
    scale: float  # b / base: the step scales by it
    peak_mem_bytes: float
    rank_param_bytes: float
    lower_bound_ms: float  # m times the busiest rank's compute: no pipeline step is shorter


def _rank_params(part) -> float:
    per_rank = [0.0] * part.P
    for s, r in enumerate(part.stage_to_rank):
        per_rank[r] += part.stage_param_bytes[s]
    return max(per_rank)
