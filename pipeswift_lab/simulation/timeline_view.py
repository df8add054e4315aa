"""What the exports of a Timeline read of it: :class:`TimelineView`.

The Gantt chart (:mod:`.gantt`) and the Chrome trace (:mod:`.chrome_trace`) are called by
:class:`~pipeswift_lab.simulation.timeline.Timeline`'s own methods (``plot``, ``to_chrome_trace``). They name this
shape instead of the class, so that they do not import the module that imports them.
"""

from __future__ import annotations

from typing import Any, Protocol

import pandas as pd

__all__ = ["TimelineView"]


class TimelineView(Protocol):
    """A Timeline as its exports read it: the rows, where they come from, and the metrics a chart prints.

    :class:`~pipeswift_lab.simulation.timeline.Timeline` has every member.
    """

    @property
    def df(self) -> pd.DataFrame:
        """One row per action (the Timeline's columns)."""
        ...

    @property
    def source(self) -> str:
        """``"simulated"`` or ``"measured"``."""
        ...

    @property
    def meta(self) -> dict[str, Any]:
        """What the timeline was made of: schedule, ``P``, ``m``, ``v``, ..."""
        ...

    @property
    def steps(self) -> list[int]:
        """Step numbers present, sorted."""
        ...

    @property
    def ranks(self) -> list[int]:
        """Pipeline ranks, sorted."""
        ...

    @property
    def replicas(self) -> list[int]:
        """Data-parallel replicas present, sorted."""
        ...

    @property
    def step_ms(self) -> float:
        """The median step span (ms)."""
        ...

    @property
    def bubble_ratio(self) -> float:
        """The idle share of the span, averaged over devices and steps."""
        ...

    def bottleneck_rank(self, step: int | None = None) -> int | None:
        """The busiest rank of ``step`` (of every step when None); None when all ranks are equally busy."""
        ...
