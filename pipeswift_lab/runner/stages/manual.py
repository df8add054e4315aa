"""Stages without the tracer: each stage is a copy of the model with the other stages' layers removed.

Some forwards cannot be exported at all (data-dependent Python control flow: an ``if`` on a
tensor's value). For them ``run(..., split="manual")`` builds each stage as torchtitan does
(``torchtitan/distributed/pipeline_parallel.py``, ``pipeline_module_split``): a copy of the model
in which the profiled layers of every other stage are removed, run eagerly by the model's own
``forward``. torchtitan's models are written so that their forward skips a module that is
``None``; a model from elsewhere is not, so here a removed layer inside a ``ModuleList`` /
``ModuleDict`` / ``Sequential`` is dropped from its container (the loop runs over the layers that
are left; the others keep their names, so state keys are the model's), and any other removed
layer is replaced by :class:`Skipped`, which returns its first input unchanged.

This fits the models a pipeline cuts: a forward that passes one hidden-state tensor from layer to
layer (embedding, blocks, norm, head), where the code between layers depends on that tensor's
shape and not on the layers that are gone. Stage ``s > 0`` is called with the tensor the stage
before sent in place of the model's input; it reaches the first layer that is left through the
skipped ones. An intermediate stage sends its output's one tensor; the last stage's output reaches
``loss_fn`` in the model's structure (:mod:`.outputs`). Modules outside the profiled layers
(rotary tables, dropouts) stay in every copy; a parameter in several copies is kept in sync
(:mod:`.tied`).

:func:`check_manual` builds every stage copy before launch and runs one micro-batch through them
in order, so a forward that does not fit is a ``ValueError`` in the notebook, with the stage
named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from ...core.meta_device import shape_pass
from ...profiling.unit_copies import Skipped, StageForward, stage_copy
from .outputs import checked_structure, describe
from .sequential import TensorSpec
from .tied import TiedGroup, tied_groups, unheld_keys

if TYPE_CHECKING:
    from .trial import Trial


@dataclass(frozen=True)
class ManualPlan:
    """What the workers need to build their stage copies: every stage's layer names and the output structure."""

    stage_layers: tuple[tuple[str, ...], ...]
    """The profiled layers of every stage (``partition.layer_names``)."""
    output: TreeSpec | None = None
    """The structure of the model's output (``None``: a tensor)."""


def check_manual(
    trial: Trial,
) -> tuple[ManualPlan, tuple[tuple[TensorSpec, TensorSpec | None], ...], tuple[TiedGroup, ...]]:
    """Build every stage copy and run the ``trial``'s micro-batch through them in order, before launch (a meta model
    with fake tensors on the ranks' device).

    Returns the :class:`ManualPlan`, every stage's ``(input, output)`` specs (the last stage's
    output spec is ``None``: it goes to the loss) and the parameters several stages hold.
    Raises ``ValueError`` naming the stage whose copy cannot take what the stage before sent.
    """
    model, n_stages = trial.model, trial.n_stages
    layers = getattr(trial.partition, "layer_names", None)
    if not layers or len(layers) != n_stages or any(not stage for stage in layers):
        raise ValueError(
            'split="manual" cuts the model at the profiled layers of every stage, so partition must carry layer '
            'names (a Partition made from profile(model, x, layers=[...]) or layers="auto")'
        )
    modules = dict(model.named_modules())
    unknown = [name for stage in layers for name in stage if name not in modules or not name]
    if unknown:
        raise ValueError(
            f"partition names layers {unknown[:8]} that are not submodules of the {type(model).__name__}; was the "
            "partition made from a profile of another model?"
        )
    plan = ManualPlan(tuple(tuple(str(n) for n in stage) for stage in layers))
    copies = [stage_copy(model, plan.stage_layers, s) for s in range(n_stages)]
    specs: list[tuple[TensorSpec, TensorSpec | None]] = []
    with torch.no_grad(), torch.random.fork_rng(), shape_pass(model, trial.device, *copies) as lift:
        x = lift(trial.inputs.detach().clone())
        for s, stage in enumerate(copies):
            stage.train(model.training)
            try:
                y = stage(x)
            except Exception as exc:  # re-raised with the stage named
                source = "the data inputs" if s == 0 else f"the output of stage {s - 1}"
                raise ValueError(
                    f'split="manual": stage {s} (layers {list(plan.stage_layers[s])}) cannot take {source}, '
                    f"{describe(x)}: {type(exc).__name__}: {exc}. The model's forward must pass one tensor from layer "
                    "to layer, the code between layers depending only on its shape"
                ) from exc
            specs.append((TensorSpec.from_tensor(x), TensorSpec.from_tensor(y) if s < n_stages - 1 else None))
            x = y
        out = _eager_output(model, lift(trial.inputs))
        structure = checked_structure(trial.loss_fn, out, lift(trial.targets))
    stage_tensors = [stage.state_dict() for stage in copies]
    missing = unheld_keys(model, stage_tensors)
    if missing:
        raise ValueError(f'split="manual": no stage holds {missing[:8]} of model.state_dict()')
    return ManualPlan(plan.stage_layers, structure), tuple(specs), tied_groups(model, stage_tensors)


def _eager_output(model: nn.Module, inputs_mb: torch.Tensor) -> Any:
    """The whole model's output on one micro-batch with the training settings (the structure the loss sees)."""
    from ...profiling.pipeline_settings import training_settings

    with training_settings(model):
        return model(inputs_mb)


def build_manual_modules(model: nn.Module, plan: ManualPlan, stages: Sequence[int]) -> dict[int, nn.Module]:
    """The stage copies of ``stages`` (a rank's), ``{stage: module}``."""
    return {s: stage_copy(model, plan.stage_layers, s) for s in stages}


__all__ = ["build_manual_modules", "check_manual", "ManualPlan", "Skipped", "stage_copy", "StageForward"]
