"""What crosses the stage boundaries and how the stages are built, found on one micro-batch before launch.

An ``nn.Sequential`` is run stage by stage (:mod:`.sequential`), any other model traced (:mod:`.traced`) or, with
``split="manual"``, built as stage copies (:mod:`.manual`); every way also finds the parameters several stages hold
(:mod:`.tied`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...core.meta_device import is_meta_model
from ...profiling.units import decoder_inputs_refusal
from .sequential import StagePlan, TensorSpec, boundary_specs, stage_module
from .tied import TiedGroup, tied_groups
from .trial import Trial

if TYPE_CHECKING:
    from ..sources import DataSource
    from .manual import ManualPlan
    from .traced import TracedPlan


@dataclass(frozen=True, kw_only=True)
class StageShapes:
    """How the stages are built and what crosses their boundaries, found on one micro-batch before launch."""

    boundaries: tuple[tuple[TensorSpec, TensorSpec | None], ...]
    """``(input, output)`` of every stage (empty for traced stages, which know theirs from the graph)."""
    traced: TracedPlan | None
    """How to re-trace (torch's tracer), or ``None``."""
    manual: ManualPlan | None
    """How to build stage copies (``split="manual"``), or ``None``."""
    tied: tuple[TiedGroup, ...]
    """Parameters several stages hold."""
    layer_names: list[str]
    """Every layer's name, in order."""


def stage_shapes(
    model: nn.Module,
    partition: Any,
    plan: StagePlan,
    source: DataSource,
    microbatch_size: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    split: str | None,
    device: torch.device,
) -> StageShapes:
    """Run one micro-batch through the stages before launch; return their :class:`StageShapes`.

    An ``nn.Sequential`` gets the shapes crossing every boundary; any other model is traced at the
    partition's split points (torch's traced stages know their boundary shapes from the graph), or
    with ``split="manual"`` built as stage copies and run in order. A model on the meta device is
    checked with the micro-batch on meta; a traced model is traced for ``device``, the ranks' device.
    """
    inputs, targets = source.batch(0)
    inputs_mb, targets_mb = inputs[:microbatch_size], targets[:microbatch_size]
    if is_meta_model(model):  # shapes only: the checks run on the meta device
        inputs_mb, targets_mb = inputs_mb.to("meta"), targets_mb.to("meta")
    if isinstance(model, nn.Sequential) and split is None:
        layer_names = [name for name, _ in model.named_children()]
        stage_tensors = [stage_module(model, b).state_dict() for b in plan.bounds]
        boundaries = boundary_specs(model, plan, inputs_mb, targets_mb, loss_fn)
        return StageShapes(
            boundaries=boundaries,
            traced=None,
            manual=None,
            tied=tied_groups(model, stage_tensors),
            layer_names=layer_names,
        )
    refusal = decoder_inputs_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    layer_names = [str(name) for stage in getattr(partition, "layer_names", None) or () for name in stage]
    trial = Trial(model, partition, plan.n_stages, inputs_mb, targets_mb, loss_fn, device)
    if split == "manual":
        from .manual import check_manual

        manual, specs, tied = check_manual(trial)
        return StageShapes(boundaries=specs, traced=None, manual=manual, tied=tied, layer_names=layer_names)
    from .traced import check_traceable

    traced, tied = check_traceable(trial)
    return StageShapes(boundaries=(), traced=traced, manual=None, tied=tied, layer_names=layer_names)


__all__ = ["stage_shapes", "StageShapes"]
