"""One configuration of a :class:`~pipeswift_lab.planning.result.Plan` and its predicted JCT: a row of its table as a
value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..core.jct import JCT, TERMS
from ..core.schedule import Schedule, ScheduleLike
from .placement import layout_name
from .strategies import HOLDING, check_strategy

__all__ = ["PlannedConfig"]


@dataclass(frozen=True)
class PlannedConfig:
    """One configuration and its predicted JCT terms (seconds) and step.

    ``strategy`` is one of :data:`~pipeswift_lab.planning.strategies.STRATEGIES` (``"now"``, ``"wait"``, ``"grow"``,
    ``"shrink"``); for a move (grow, shrink), ``change`` says when and from which configuration, and the other fields
    are the configuration it finishes on.
    """

    P: int
    D: int
    m: int
    microbatch_size: int
    schedule: ScheduleLike
    v: int
    queue_s: float
    assembly_s: float
    training_s: float
    cleanup_s: float
    preemption_loss_s: float
    step_ms: float
    bubble_ratio: float
    peak_mem_bytes: float
    strategy: str = "now"
    change: str = ""
    recompute: str = ""
    """The stages that recompute and how, ``"0:full 1:selective"`` (``""``: none; ``plan(recompute="search")``)."""
    stage_bounds: str = ""
    """The split the search weighed where it is not the profile's balanced one, ``"0-3 3-7"``: a recomputing
    configuration's, or a tensor-parallel or FSDP layout's, found on the memory one of its ranks holds (``""``: the
    balanced split)."""
    tp: int = 1
    """Tensor-parallel ranks of each stage (``tp`` adjacent ranks inside a node)."""
    fsdp: int = 1
    """FSDP shards of each replica (HSDP with ``D > 1``)."""

    def __post_init__(self) -> None:
        check_strategy(self.strategy)

    @property
    def total_s(self) -> float:
        """The predicted JCT."""
        return self.queue_s + self.assembly_s + self.training_s + self.cleanup_s + self.preemption_loss_s

    @property
    def gpus(self) -> int:
        """GPUs used: ``P * D * fsdp * tp``."""
        return self.P * self.D * self.fsdp * self.tp

    @property
    def label(self) -> str:
        """A short name: ``P4×D2 m16 b2 1F1B`` (``P4×D2×fsdp4×tp8 ...`` where FSDP or tensor parallelism is used,
        ``... 1F1B recompute 0:full`` where stages recompute); a move's starts with its strategy and change,
        ``grow at 2.00 h from P4×D2 m32 b2 1F1B: P4×D4 m16 b2 1F1B``."""
        v = f" v{self.v}" if self.v > 1 else ""
        prefix = "" if self.strategy in HOLDING else f"{self.strategy} {self.change}: "
        recompute = f" recompute {self.recompute}" if self.recompute else ""
        return (
            f"{prefix}{layout_name(self.P, self.D, self.fsdp, self.tp)} m{self.m} b{self.microbatch_size} "
            f"{self.schedule}{v}{recompute}"
        )

    @property
    def jct(self) -> JCT:
        """The predicted :class:`~pipeswift_lab.JCT`."""
        return JCT(
            self.queue_s, self.assembly_s, self.training_s, self.cleanup_s, self.preemption_loss_s, label=self.label
        )

    @classmethod
    def from_row(cls, row: pd.Series) -> PlannedConfig:
        """The configuration of a row of :attr:`Plan.table`."""
        ints = ("P", "D", "m", "microbatch_size", "v")
        floats = ("step_ms", "bubble_ratio", "peak_mem_bytes", *TERMS)
        values: dict[str, Any] = {k: int(row[k]) for k in ints} | {k: float(row[k]) for k in floats}
        for k in ("tp", "fsdp"):  # a table saved before the 3-D search has neither: 1
            value = row.get(k, 1)
            values[k] = 1 if pd.isna(value) else int(value)

        def text(key: str) -> str:
            value = row.get(key, "")
            return value if isinstance(value, str) else ""

        return cls(
            **values,
            schedule=row["order"] if isinstance(row.get("order"), Schedule) else str(row["schedule"]),
            strategy=str(row["strategy"]),
            change=text("change"),
            recompute=text("recompute"),
            stage_bounds=text("stage_bounds"),
        )

    def recompute_by_stage(self) -> dict[int, str]:
        """``{stage: "full" | "selective"}`` of the stages that recompute (what :func:`pipeswift_lab.run` takes)."""
        return {int(s): mode for s, mode in (item.split(":") for item in self.recompute.split())}
