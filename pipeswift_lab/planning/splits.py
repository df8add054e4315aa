"""What the planner's search knows of a split before it simulates it: its per-stage sums (:class:`StageSums`) and
the :class:`Split` record the search bounds, ranks and simulates (:mod:`.search` makes both)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from ..core.schedule import ScheduleLike
from ..partitioning.layers import Layers
from ..partitioning.memory import rank_totals
from ..partitioning.stages import Partition

__all__ = ["Bounds", "Split", "StageSums", "check_average_fits", "rank_max"]

#: Stage bounds of a split: ``((first_layer, end_layer), ...)``, one pair per stage.
Bounds = tuple[tuple[int, int], ...]


class _PartitionMaker(Protocol):
    """What builds and simulates a split's :class:`~pipeswift_lab.Partition` (the search's evaluator)."""

    def partition(
        self, layers: Layers, bounds: Bounds, v: int, schedule: ScheduleLike, m: int, D: int
    ) -> Partition: ...

    def simulate(self, split: Split) -> tuple[float, float]: ...


@dataclass(frozen=True, kw_only=True)
class StageSums:
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
    schedule: ScheduleLike
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
    evaluator: _PartitionMaker = field(repr=False, compare=False)
    """The evaluator that builds the :class:`~pipeswift_lab.Partition` on first use."""
    build: tuple[Layers, Bounds, int, ScheduleLike, int, int] = field(repr=False, compare=False)
    """The arguments of :meth:`Evaluator.partition`."""
    recompute: str = ""
    """The stages that recompute and how, ``"0:full 1:selective"`` (``""``: none)."""
    fsdp: int = 1
    """FSDP shards per replica the peak was taken with."""

    @cached_property
    def part(self) -> Partition:
        """The :class:`~pipeswift_lab.Partition` of this split (built on first use)."""
        return self.evaluator.partition(*self.build)


def check_average_fits(average: float, limit: float) -> None:
    """Raise ``ValueError`` when ``average`` bytes per rank exceed ``limit``: no split can beat it (weights, gradients
    and optimizer state, which every rank holds at its optimizer step)."""
    if average > limit:
        raise ValueError(f"needs at least {average / 2**30:.3g} GiB per GPU on average > mem_per_gpu_bytes={limit:.4g}")


def rank_max(per_stage: Sequence[float], placement: Sequence[int], P: int) -> float:
    """The largest per-rank sum of ``per_stage`` over the ranks of ``placement``."""
    return max(rank_totals(per_stage, placement, P))
