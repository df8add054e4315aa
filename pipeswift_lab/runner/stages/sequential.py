"""How a Partition cuts an ``nn.Sequential`` into pipeline stages, checked before launch.

A stage is the ``nn.Sequential`` of the model's children ``bounds[s][0] .. bounds[s][1]-1``,
keeping their names, so a stage's ``state_dict`` keys are the model's own keys. Rank
``stage_to_rank[s]`` holds stage ``s``; with ``v > 1`` a rank holds several stages.

:func:`boundary_specs` runs one micro-batch through the stages before any process starts
(on the ``meta`` device, or for real on one micro-batch when an op has no meta kernel), so a
shape mismatch between stages, a data batch the first layer cannot take or a loss that does
not accept the last stage's output is a ``ValueError`` in the notebook, not a hung worker.
The shapes it finds are handed to every ``PipelineStage`` (torch's static metadata mode), so
the workers skip torch's own metadata inference at the first step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.meta_device import is_meta_model
from ...core.schedule import ScheduleLike
from ...simulation.reconciliation import reconcile

#: ``loss_fn(outputs, targets)`` -> a scalar tensor.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """Shape, stride, dtype and ``requires_grad`` of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor`` (any device, ``meta`` included)."""
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, bool(tensor.requires_grad))

    def empty(self, device: torch.device | str) -> torch.Tensor:
        """An uninitialised tensor with this spec on ``device`` (the example tensor torch's static mode needs)."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        return out.requires_grad_(self.requires_grad)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class StagePlan:
    """What the runner needs from a Partition, checked against the model and the schedule.

    ``bounds`` — half-open layer ranges, one per stage; ``P`` ranks; ``v`` stages per rank;
    ``schedule`` — canonical schedule name, or a ``Schedule``; ``stage_to_rank`` — the rank of every stage,
    which must be the mapping torch's schedule uses (round-robin, or the V of ZBV/DualPipeV).
    """

    bounds: tuple[tuple[int, int], ...]
    P: int
    v: int
    schedule: ScheduleLike
    stage_to_rank: tuple[int, ...]

    @property
    def n_stages(self) -> int:
        """``P * v``."""
        return len(self.bounds)

    def stages_of(self, rank: int) -> list[int]:
        """Stage indices held by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def first_rank(self) -> int:
        """The rank that holds stage 0 (reads the inputs)."""
        return self.stage_to_rank[0]

    @property
    def last_rank(self) -> int:
        """The rank that holds the last stage (reads the targets, computes the loss)."""
        return self.stage_to_rank[-1]


def plan_stages(model: nn.Module, partition: Any, schedule: ScheduleLike | None) -> StagePlan:
    """Check ``partition`` (a ``pipeswift_lab.partitioning.balance.Partition`` or any object with ``bounds``,
    ``P``, ``v``, ``schedule`` and ``stage_to_rank``) against ``model`` and ``schedule``.

    ``schedule=None`` takes the partition's schedule, or when it has none ``"1F1B"`` (``v == 1``)
    or ``"Interleaved1F1B"`` (``v > 1``), the defaults of ``partition()``. Returns a
    :class:`StagePlan`; raises ``TypeError``/``ValueError`` naming the bad field.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "model must be an nn.Module (an nn.Sequential whose children are the layers, or a model torch's tracer "
            f"can split at the partition's layer names); got {type(model).__name__}"
        )
    if not hasattr(partition, "bounds"):
        raise TypeError(
            "partition must be a Partition (with bounds, P, v, schedule, stage_to_rank); "
            f"{type(partition).__name__} has no 'bounds'"
        )
    shape = reconcile(partition, schedule, same_schedule=True)
    P, v, schedule, placement = shape.P, shape.v, shape.schedule, shape.placement
    bounds = tuple((int(a), int(b)) for a, b in partition.bounds)
    n_layers = len(model) if isinstance(model, nn.Sequential) else None
    if len(bounds) != P * v:
        raise ValueError(f"partition.bounds has {len(bounds)} stages; P={P} ranks with v={v} stages each need {P * v}")
    expected_start = 0
    for s, (a, b) in enumerate(bounds):
        if a != expected_start or b <= a:
            raise ValueError(
                f"partition.bounds={list(bounds)} is not a sequence of non-empty contiguous ranges from 0; stage {s} "
                f"is {(a, b)}"
            )
        expected_start = b
    if isinstance(model, nn.Sequential) and expected_start != n_layers:
        raise ValueError(
            f"partition.bounds ends at layer {expected_start} but the model has {n_layers} layers (children); "
            "was the partition made from a profile of another model?"
        )
    return StagePlan(bounds, P, v, schedule, placement)


class StageSequential(nn.Sequential):
    """An ``nn.Sequential`` stage whose output is made contiguous: what crosses a stage boundary.

    torch's point-to-point send and receive need contiguous tensors (a ViT's patch embedding
    returns ``flatten(2).transpose(1, 2)``, a strided view); the stage's state keys are the
    children's, as for a plain ``nn.Sequential``.
    """

    def forward(self, x: Any) -> Any:
        out = super().forward(x)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def stage_module(model: nn.Sequential, bounds: tuple[int, int]) -> nn.Sequential:
    """The children ``bounds[0] .. bounds[1]-1`` of ``model`` as a :class:`StageSequential` keeping their names.

    The modules are shared with ``model`` (no copy); the stage's output is contiguous.
    """
    children = list(model.named_children())
    return StageSequential(OrderedDict(children[bounds[0] : bounds[1]]))


def _layer_names(model: nn.Sequential, bounds: tuple[int, int]) -> str:
    names = [name for name, _ in list(model.named_children())[bounds[0] : bounds[1]]]
    return f"layers {bounds[0]}..{bounds[1] - 1} ({', '.join(names)})"


def _first_stage_for_real(model: nn.Sequential, plan: StagePlan, inputs_mb: torch.Tensor) -> None:
    """Run the first stage on one micro-batch of the data for real, without gradients: meta kernels do not check
    dtypes (int64 inputs to a ``Linear`` pass on ``meta``). Parameters are used as they are (a forward does not change
    them), buffers on copies; the random state (CPU and the stage's GPU) is left as it was."""
    from torch.func import functional_call

    stage = stage_module(model, plan.bounds[0])
    buffers = {name for name, _ in stage.named_buffers()}
    tensors = {
        k: (t.detach().clone() if k in buffers else t.detach()) for k, t in stage.state_dict(keep_vars=True).items()
    }
    home = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    x = inputs_mb.to(home)  # a whole micro-batch: BatchNorm refuses a single sample in training mode
    gpus = [home.index if home.index is not None else torch.cuda.current_device()] if home.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=gpus):  # a dropout here leaves the caller's RNG as it was
            functional_call(stage, tensors, (x,), strict=False)
    except Exception as exc:  # re-raised with the stage named
        raise _StageFailure(0, TensorSpec.from_tensor(inputs_mb), exc) from exc


def _pass(
    model: nn.Sequential,
    plan: StagePlan,
    inputs_mb: torch.Tensor,
    targets_mb: torch.Tensor,
    loss_fn: LossFn,
    device: str,
) -> tuple[tuple[TensorSpec, TensorSpec], ...]:
    """Run one micro-batch stage by stage on ``device`` with stand-in tensors; return specs or raise."""
    from torch.func import functional_call

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if device == "meta":
            return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        return t.detach().clone().requires_grad_(t.requires_grad)

    state = model.state_dict(keep_vars=True)
    tensors = {k: stand_in(t) for k, t in state.items()}
    home = next(iter(state.values())).device if state else torch.device("cpu")
    x = inputs_mb.to("meta") if device == "meta" else inputs_mb.to(home)
    specs = []
    with torch.enable_grad():
        for s, b in enumerate(plan.bounds):
            stage = stage_module(model, b)
            keys = set(stage.state_dict(keep_vars=True))
            in_spec = TensorSpec.from_tensor(x)
            try:
                y = functional_call(stage, {k: tensors[k] for k in keys}, (x,), strict=False)
            except Exception as exc:  # re-raised with the stage named
                raise _StageFailure(s, in_spec, exc) from exc
            if not isinstance(y, torch.Tensor):
                raise _StageFailure(
                    s, in_spec, TypeError(f"its output is a {type(y).__name__}, not a single tensor"), output=True
                )
            specs.append((in_spec, TensorSpec.from_tensor(y)))
            x = y
        target = targets_mb.to("meta") if device == "meta" else targets_mb.to(home)
        try:
            loss = loss_fn(x, target)
        except Exception as exc:  # re-raised naming what failed
            raise _LossFailure(TensorSpec.from_tensor(x), TensorSpec.from_tensor(target), exc) from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise _LossFailure(
                TensorSpec.from_tensor(x),
                TensorSpec.from_tensor(target),
                TypeError(
                    f"loss_fn returned {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}, not a scalar tensor"
                ),
            )
    return tuple(specs)


class _StageFailure(Exception):
    def __init__(self, stage: int, in_spec: TensorSpec, exc: BaseException, output: bool = False) -> None:
        super().__init__(str(exc))
        self.stage, self.in_spec, self.exc, self.output = stage, in_spec, exc, output


class _LossFailure(Exception):
    def __init__(self, out_spec: TensorSpec, target_spec: TensorSpec, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.out_spec, self.target_spec, self.exc = out_spec, target_spec, exc


def boundary_specs(
    model: nn.Sequential, plan: StagePlan, inputs_mb: torch.Tensor, targets_mb: torch.Tensor, loss_fn: LossFn
) -> tuple[tuple[TensorSpec, TensorSpec], ...]:
    """``((input_spec, output_spec), ...)`` of every stage for one micro-batch, checked before launch.

    Tries the ``meta`` device first (no compute, no memory), then runs the first stage on the
    micro-batch for real without gradients (meta kernels do not check dtypes); if an op has no meta kernel it runs
    the micro-batch for real on a copy of the parameters and buffers (the model is not
    changed, BatchNorm statistics included). A model on the meta device is checked on meta only. Raises
    ``ValueError`` naming the stage, its
    layers and the shape it could not take.
    """
    on_meta = is_meta_model(model)
    if not on_meta:
        try:
            specs = _pass(model, plan, inputs_mb, targets_mb, loss_fn, "meta")
            _first_stage_for_real(model, plan, inputs_mb)
            return specs
        except (_StageFailure, _LossFailure, Exception):
            pass  # no meta kernel, or a real error: the real pass below tells them apart
    try:
        return _pass(model, plan, inputs_mb, targets_mb, loss_fn, "meta" if on_meta else "real")
    except _StageFailure as f:
        where = _layer_names(model, plan.bounds[f.stage])
        if f.output:
            raise ValueError(
                f"stage {f.stage} ({where}) must return a single tensor to send to the next stage; {f.exc}"
            ) from None
        source = "the data inputs" if f.stage == 0 else f"the output of stage {f.stage - 1}"
        raise ValueError(
            f"stage {f.stage} ({where}) cannot take {source}, a micro-batch of shape {f.in_spec}: "
            f"{type(f.exc).__name__}: {f.exc}"
        ) from f.exc
    except _LossFailure as f:
        raise ValueError(
            f"loss_fn(outputs, targets) raised {type(f.exc).__name__}: {f.exc} (given the last stage's output "
            f"{f.out_spec} "
            f"and targets {f.target_spec})"
        ) from f.exc


__all__ = [
    "boundary_specs",
    "LossFn",
    "plan_stages",
    "stage_module",
    "StagePlan",
    "StageSequential",
    "TensorSpec",
]
