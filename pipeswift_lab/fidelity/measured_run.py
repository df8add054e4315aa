"""A measured run the toolkit did not launch: a Timeline imported from a cluster job's ``torch.profiler`` traces,
with the partition it ran, read by :func:`~pipeswift_lab.fidelity.calibrate` and
:func:`~pipeswift_lab.fidelity.compare` as a :class:`~pipeswift_lab.runner.RunResult` is::

    tl = psl.Timeline.from_profiler("traces/")                      # torchtitan's, or any torch pipelining job's
    run = psl.MeasuredRun(tl, part)                                 # the Partition (or stage bounds) it ran
    cal = psl.calibrate([run], prof)                                # then simulate / plan with calibration=cal
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from os import PathLike
from typing import Any

import pandas as pd

from ..core.checks import check_int
from ..core.display import html_card, text_card
from ..partitioning.stages import Partition
from ..simulation.steady import steady_step_index, step_time_stats
from ..simulation.timeline import Timeline


@dataclass(frozen=True, eq=False)
class MeasuredRun:
    """An imported run: its measured :class:`~pipeswift_lab.simulation.timeline.Timeline` and the partition it ran.

    * ``timeline`` — measured (e.g. :meth:`Timeline.from_profiler`), with ``meta["step_ms"]`` (each step's whole
      time, optimizer included) or else each step's action span;
    * ``partition`` — the :class:`~pipeswift_lab.partitioning.Partition` the job ran, or its stage bounds
      (``[(0, 3), (3, 8), ...]``, layer ranges of the profiled model); its stage count must match the trace's;
    * ``microbatch_size`` — rows per micro-batch, when it differs from the profile's batch (calibration scales the
      profile's times by it);
    * ``model`` — the ``nn.Module`` (or its ``state_dict`` keys) the job trained: names the model, so runs of
      another model are refused when calibrated together (a RunResult carries the same).

    ``P``, ``v``, ``m``, ``schedule`` and ``D`` come from the Timeline's meta.
    """

    timeline: Timeline
    partition: Partition | Sequence[Sequence[int]]
    microbatch_size: int | None = None
    model: Any = None
    meta: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        tl = self.timeline
        if not isinstance(tl, Timeline) or tl.source != "measured":
            raise TypeError(
                f"timeline must be a measured Timeline (psl.Timeline.from_profiler(...)); got {type(tl).__name__}"
                + (f" with source={tl.source!r}" if isinstance(tl, Timeline) else "")
            )
        for key in ("P", "v", "m", "schedule"):
            if tl.meta.get(key) is None:
                raise ValueError(f"the Timeline's meta has no {key!r}; import it with psl.Timeline.from_profiler")
        given: Any = self.partition.bounds if isinstance(self.partition, Partition) else self.partition
        bounds = [tuple(int(x) for x in b) for b in given]
        stages = int(tl.df["stage"].max()) + 1
        if len(bounds) != stages:
            raise ValueError(
                f"the partition has {len(bounds)} stages but the trace ran {stages} "
                f"({tl.meta['schedule']}, P={tl.meta['P']}, v={tl.meta['v']}); give the partition the job ran"
            )
        if any(b[0] >= b[1] for b in bounds) or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"partition bounds {bounds} must be consecutive non-empty layer ranges from 0")
        meta: dict[str, Any] = {"bounds": bounds, "n_layers": bounds[-1][1], "imported_from": tl.meta.get("traces")}
        if self.microbatch_size is not None:
            meta["microbatch_size"] = check_int("microbatch_size", self.microbatch_size, minimum=1)
        if self.model is not None:
            keys = self.model.state_dict().keys() if hasattr(self.model, "state_dict") else self.model
            meta["state_keys"] = tuple(str(k) for k in keys)
        object.__setattr__(self, "meta", meta)

    @classmethod
    def from_profiler(
        cls,
        path_or_paths: str | PathLike[str] | Sequence[str | PathLike[str]],
        partition: Partition | Sequence[Sequence[int]],
        *,
        schedule: str | None = None,
        microbatch_size: int | None = None,
        model: Any = None,
    ) -> MeasuredRun:
        """Import the traces (:meth:`Timeline.from_profiler`) and pair them with the partition the job ran."""
        timeline = Timeline.from_profiler(path_or_paths, schedule=schedule)
        return cls(timeline, partition, microbatch_size=microbatch_size, model=model)

    # ------------------------------------------------------------------ what calibrate and compare read
    @property
    def schedule(self) -> str:
        """The schedule the job ran (torch's name)."""
        return str(self.timeline.meta["schedule"])

    @property
    def P(self) -> int:
        """Pipeline ranks."""
        return int(self.timeline.meta["P"])

    @property
    def v(self) -> int:
        """Stages per rank."""
        return int(self.timeline.meta["v"])

    @property
    def m(self) -> int:
        """Micro-batches per step."""
        return int(self.timeline.meta["m"])

    @property
    def D(self) -> int:
        """Data-parallel replicas."""
        return int(self.timeline.meta.get("D", 1))

    @property
    def instrumented(self) -> bool:
        """Always: an imported run has its actions."""
        return True

    @property
    def probed_steps(self) -> tuple[int, ...]:
        """No step of an imported run was slowed by a memory probe."""
        return ()

    @property
    def first_step(self) -> int:
        """The number of the first imported step (``ProfilerStep#N``)."""
        return int(self.timeline.meta.get("first_step", self.timeline.steps[0]))

    @cached_property
    def step_ms(self) -> list[float]:
        """Each imported step's whole time (ms): from the trace's ``ProfilerStep`` spans, else its action span."""
        given = self.timeline.meta.get("step_ms")
        steps = self.timeline.steps
        if given and len(given) == len(steps) and steps == list(range(steps[0], steps[0] + len(steps))):
            return [float(x) for x in given]
        spans = self.timeline.step_spans
        if spans["step"].tolist() != list(range(steps[0], steps[0] + len(steps))):
            raise ValueError(f"the imported steps {steps} are not consecutive; profile consecutive steps")
        return spans["span_ms"].astype(float).tolist()

    @property
    def steady_step(self) -> int:
        """The step :data:`~pipeswift_lab.simulation.steady.MEASURED_STEP` picks."""
        return self.first_step + steady_step_index(self.step_ms)

    @property
    def steady_step_ms(self) -> float:
        """The measured step (:data:`~pipeswift_lab.simulation.steady.MEASURED_STEP`), ms."""
        return float(self.step_ms[self.steady_step - self.first_step])

    def step_stats(self) -> pd.DataFrame:
        """Step-time dispersion of the steps after the first: one row ``window="all"`` with the columns of
        ``RunResult.step_stats`` (:func:`~pipeswift_lab.simulation.steady.step_time_stats`)."""
        steps = pd.Series(self.step_ms, index=range(self.first_step, self.first_step + len(self.step_ms)), dtype=float)
        return pd.DataFrame([{"window": "all", **step_time_stats(steps.iloc[1:] if len(steps) > 1 else steps)}])

    # ------------------------------------------------------------------ display
    def _summary(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "P": self.P,
            "v": self.v,
            "m": self.m,
            "D": self.D,
            "steps": len(self.step_ms),
            "steady_step_ms": self.steady_step_ms,
            "bubble_ratio": self.timeline.bubble_ratio,
            "clock_skew_ms": self.timeline.meta.get("clock_skew_ms"),
        }

    def _repr_html_(self) -> str:
        return html_card("MeasuredRun (imported)", self._summary(), self.timeline.idle_by_rank)

    def __repr__(self) -> str:
        return text_card("MeasuredRun", self._summary())


__all__ = ["MeasuredRun"]
