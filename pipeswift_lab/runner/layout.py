"""A run's layout beyond the pipeline, checked before launch: :func:`check_layout` turns ``run(..., D=, fsdp=, tp=,
tp_plan=)`` into a :class:`RunLayout`.

Each stage runs on ``fsdp * tp`` processes of each of ``D`` replicas (:mod:`~pipeswift_lab.core.layout`). Tensor
parallelism and FSDP2 need the model's own modules in every stage, so a model that is not an ``nn.Sequential`` is
cut with ``split="manual"`` (stage copies run by the model's own forward), not by torch's tracer, whose stage graphs
call the parameters, not the modules the plan names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.checks import check_int
from ..core.tp_plan import resolve_tp_plan
from .options import as_fsdp
from .stages.sequential import StagePlan
from .stages.sharding import check_reshard

__all__ = ["RunLayout", "check_layout"]


@dataclass(frozen=True)
class RunLayout:
    """The checked layout of one run."""

    fsdp: int
    """FSDP2 shard degree inside a replica."""
    tp: int
    """Tensor-parallel degree."""
    tp_plan: dict[str, str] | None
    """The plan applied when ``tp > 1`` (``None`` otherwise)."""
    reshard_after_forward: bool
    """Whether FSDP2 frees the gathered parameters after each forward."""
    split: str | None
    """How a model that is not an ``nn.Sequential`` is cut (``"manual"`` whenever ``fsdp * tp > 1``)."""

    def world(self, P: int, D: int) -> int:
        """Processes of the run: ``P * D * fsdp * tp``."""
        return P * D * self.fsdp * self.tp

    def check_built(self, tied: Sequence[Any], precision: str | None) -> None:
        """Refuse what the built stages show this layout cannot run: a parameter several stages hold (tied weights
        across stages), and ZeRO-1's sharded optimizer beside FSDP or tensor parallelism."""
        if self.fsdp * self.tp == 1:
            return
        if tied:
            names = [getattr(group, "canonical", group) for group in tied][:4]
            raise ValueError(
                f"fsdp={self.fsdp}, tp={self.tp}: the stages share tied parameters {names}, whose copies the runner "
                "keeps equal by summing their gradients between stages, which it does not do for sharded "
                "parameters; untie them (tie_word_embeddings=False) or put the tied layers on one stage"
            )
        if precision == "bf16-mixed-zero1":
            raise ValueError(
                "precision='bf16-mixed-zero1' shards the optimizer over the replicas with torch's "
                "ZeroRedundancyOptimizer; with fsdp or tp FSDP2 shards it already: use precision='bf16-mixed'"
            )


def check_layout(
    model: nn.Module,
    plan: StagePlan,
    D: int,
    fsdp: Any,
    tp: Any,
    tp_plan: Mapping[str, str] | None,
    split: str | None,
) -> RunLayout:
    """``fsdp`` (a degree or :class:`~pipeswift_lab.runner.options.FSDP`), ``tp`` and ``tp_plan`` checked against the
    model and the stage plan; returns the :class:`RunLayout`.

    Raises ``ValueError`` for a ``tp`` the plan's sharded sizes or the attention heads do not allow, ``tp > 1`` on a
    model with no plan and no ``tp_plan=``, a plan glob matching no module, an unknown style
    (:func:`~pipeswift_lab.core.tp_plan.resolve_tp_plan`), ``reshard_after_forward=True`` under a schedule that
    splits the backward, and ``split="trace"`` with ``fsdp`` or ``tp`` above 1."""
    record = as_fsdp(fsdp)
    tp = check_int("tp", tp, minimum=1)
    resolved = resolve_tp_plan(model, tp_plan, tp)
    reshard = record.reshard_after_forward if record.reshard_after_forward is not None else plan.P == 1
    if record.degree > 1:
        check_reshard(reshard, plan.schedule, plan.P)
    sharded = record.degree * tp > 1
    if sharded and not isinstance(model, nn.Sequential):
        if split == "trace":
            raise ValueError(
                f'split="trace" cannot run fsdp={record.degree}, tp={tp}: torch\'s traced stages call the parameters, '
                'not the modules FSDP and the tensor-parallel plan wrap; use split="manual" (the default then)'
            )
        split = "manual"
    return RunLayout(
        fsdp=record.degree,
        tp=tp,
        tp_plan=resolved if tp > 1 else None,
        reshard_after_forward=bool(reshard),
        split=split,
    )
