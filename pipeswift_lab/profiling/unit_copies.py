"""A copy of a model that holds only some of its units: a pipeline stage without the tracer, or one unit alone.

Some forwards cannot be exported at all (data-dependent Python control flow). A stage is then a
copy of the model in which the units of every other stage are removed, run eagerly by the model's
own ``forward``, as torchtitan builds its stages (``torchtitan/distributed/pipeline_parallel.py``,
``pipeline_module_split``). torchtitan's models skip a module that is ``None``; a model from
elsewhere does not, so a removed unit inside a ``ModuleList`` / ``ModuleDict`` / ``Sequential`` is
dropped from its container (the loop runs over the units left; the others keep their names, so
state keys are the model's), and any other removed unit is replaced by :class:`Skipped`, which
returns its first input unchanged. Modules outside the units (rotary tables, dropouts) stay in
every copy. ``run(..., split="manual")`` (:mod:`pipeswift_lab.runner.stages.manual`) and the
profiler's one-unit-at-a-time measure (:mod:`.unit_by_unit`) both build their pieces this way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .pipeline_settings import apply_training_settings

__all__ = ["Skipped", "StageForward", "describe", "stage_copy"]


def describe(obj: Any) -> str:
    """A short description of a model output for messages: its type and its tensors' shapes and dtypes."""
    leaves, _ = tree_flatten(obj)
    tensors = [f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves if isinstance(t, torch.Tensor)]
    if isinstance(obj, torch.Tensor):
        return f"a tensor {tensors[0]}"
    fields = ""
    if isinstance(obj, dict):
        fields = f" with keys {list(obj)}"
    return f"a {type(obj).__name__}{fields} holding tensors {tensors}"


class Skipped(nn.Module):
    """Stands in for a layer of another stage: returns its first input unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        return next(iter(kwargs.values()))


class StageForward:
    """The forward of a stage copy: the model's own forward, whose output is turned into what the stage sends.

    An intermediate stage returns the one tensor in the model's output; the last stage returns the
    output's tensors as a tuple (the loss rebuilds the structure).
    """

    def __init__(self, forward: Callable[..., Any], stage: int, last: bool) -> None:
        self.forward, self.stage, self.last = forward, stage, last

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.forward(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.contiguous() if not self.last else out
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.last:
            return tuple(leaves)
        if len(leaves) != 1:
            raise ValueError(
                f"stage {self.stage}, with the later layers skipped, returned {describe(out)}; a stage sends one "
                "tensor to the next (the hidden states), so the model's forward must carry one tensor from layer to "
                "layer"
            )
        return leaves[0].contiguous()


def _container(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def stage_copy(model: nn.Module, stage_layers: Sequence[Sequence[str]], stage: int) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage``'s layers (``stage_layers[stage]``) and every module outside
    the ``stage_layers``.

    Layers of other stages are not copied: one in a ``ModuleList`` / ``ModuleDict`` /
    ``Sequential`` is dropped from it (the others keep their names), any other one is a
    :class:`Skipped`. The copy's configs have the training settings (KV cache off); its
    forward returns what the stage sends (:class:`StageForward`).
    """
    mine = set(stage_layers[stage])
    others = [name for s, names in enumerate(stage_layers) if s != stage for name in names]
    memo: dict[int, Any] = {id(model.get_submodule(name)): Skipped() for name in others}
    copied = copy.deepcopy(model, memo)
    for name in others:
        if name in mine:
            continue
        parent, attr = _container(copied, name)
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            del parent._modules[attr]
        else:
            setattr(parent, attr, Skipped())
    apply_training_settings(copied)
    last = stage == len(stage_layers) - 1
    copied.forward = StageForward(copied.forward, stage, last)
    return copied
