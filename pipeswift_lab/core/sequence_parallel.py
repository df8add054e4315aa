"""Sequence parallelism over a tensor-parallel plan: which modules run on a slice of the sequence.

Megatron's sequence parallelism (Korthikanti et al., *Reducing Activation Recomputation in Large Transformer
Models*, MLSys 2023, §4.2.2) splits what lies *between* the tensor-parallel regions of a layer (its norms, dropouts
and residual sums) along the sequence: each of the ``tp`` ranks holds ``S / tp`` positions there. A region's entry
all-gathers the sequence (where it would otherwise take the whole input as is) and its exit reduce-scatters it (where
it would all-reduce), so the step communicates the same bytes and the activations outside the regions shrink by
``tp``. The gathered input of an entry is what the column-parallel projections save for their backward: whole.

:func:`sequence_parallel_plan` reads it from a plan's matched modules (``{name: style}``,
:func:`~pipeswift_lab.core.tp_plan.tp_targets`):

* the **layers** are the modules that hold the plan's row-parallel exits, each the shallowest ancestor of an exit that
  is an item of an ``nn.ModuleList`` or ``nn.Sequential`` (a Hugging Face ``model.layers.3``, a reference model's
  ``block_3``); what lies outside them (an embedding, an LM head) sees the whole sequence;
* a **region** is a child of a layer that holds column-parallel entry points (an attention, an MLP): its hidden-state
  input is all-gathered once for all of its projections. An entry that is itself a child of the layer (a block
  whose forward runs the attention inline) is refused: the layer's own code would see the slice;
* the **exits** (row-parallel modules) reduce-scatter their output along the sequence;
* every other child of a layer that holds parameters must be a norm (its class is named ``...Norm``), which runs on
  the local slice (torch's ``SequenceParallel``). A child that holds parameters outside the regions (a mixture of
  experts the plan leaves whole) cannot: :func:`check_sequence_parallel` refuses it.

The sequence is dimension 1 (``(batch, sequence, hidden)``). Within a stage the hidden states stay sliced from the
first layer of a run of consecutive layers to the last; the stage's boundaries carry the whole sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

__all__ = ["SEQUENCE_DIM", "SequenceParallelPlan", "check_sequence_parallel", "sequence_parallel_plan"]

#: The dimension of the hidden states that sequence parallelism slices.
SEQUENCE_DIM = 1
_ENTRIES = ("colwise", "colwise_gather_output", "colwise_rep")
_EXITS = ("rowwise", "rowwise_split_input", "rowwise_rep")


@dataclass(frozen=True)
class SequenceParallelPlan:
    """What sequence parallelism changes in a model under a tensor-parallel plan (module names of the model)."""

    layers: tuple[str, ...]
    """The layers that hold the plan's regions, in module order; their inputs and outputs are sequence slices."""
    gathered_inputs: tuple[str, ...]
    """The regions: modules whose hidden-state input is all-gathered along the sequence."""
    exits: tuple[str, ...]
    """Row-parallel modules whose output is reduce-scattered along the sequence."""
    norms: tuple[str, ...]
    """Norms between the regions, run on the local slice of the sequence."""
    refused: dict[str, str]
    """``{module: why}`` of what sequence parallelism cannot run (empty when the plan allows it)."""
    positions: dict[str, int]
    """Each layer's position among its container's items."""

    def runs(self, names: set[str] | None = None) -> list[list[str]]:
        """The layers (among ``names``, all by default) grouped in runs of consecutive items of one container: the
        hidden states stay sliced along each run and are whole at its ends."""
        out: list[list[str]] = []
        previous: tuple[str, int] | None = None
        for layer in self.layers:
            if names is not None and layer not in names:
                previous = None
                continue
            parent = layer.rpartition(".")[0]
            position = self.positions[layer]
            if out and previous is not None and previous[0] == parent and position == previous[1] + 1:
                out[-1].append(layer)
            else:
                out.append([layer])
            previous = (parent, position)
        return out


def _layer_of(name: str, containers: set[str]) -> str | None:
    """The shallowest ancestor of ``name`` (itself included) whose parent is a container, ``None`` if none is."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        parent = ".".join(parts[: depth - 1])
        if parent in containers:
            return ".".join(parts[:depth])
    return None


def sequence_parallel_plan(model: nn.Module, targets: Mapping[str, str]) -> SequenceParallelPlan:
    """Where sequence parallelism slices ``model`` under the plan's matched modules ``targets`` (``{name: style}``);
    returns the :class:`SequenceParallelPlan`, its ``refused`` naming what cannot run sequence-parallel."""
    modules = dict(model.named_modules())
    containers = {name for name, m in modules.items() if isinstance(m, nn.ModuleList | nn.Sequential)}
    positions = {
        f"{parent}.{child}" if parent else child: i
        for parent in containers
        for i, (child, _) in enumerate(modules[parent].named_children())
    }
    refused: dict[str, str] = {}
    layers: dict[str, None] = {}
    for name, style in targets.items():
        layer = _layer_of(name, containers) if style in _EXITS else None
        if layer is not None and layer != name:
            layers[layer] = None
    gathered: list[str] = []
    exits: list[str] = []
    norms: list[str] = []
    for layer in layers:
        prefix = f"{layer}."
        for child, module in modules[layer].named_children():
            full = prefix + child
            inside = {n: s for n, s in targets.items() if n == full or n.startswith(full + ".")}
            if targets.get(full) in _ENTRIES:
                refused[full] = (
                    "is a column-parallel entry the layer calls itself: the layer's own forward would see a slice of "
                    "the sequence (and read its length from it); sequence parallelism needs each region in a "
                    "submodule, an attention or an MLP module, whose input it gathers"
                )
            elif any(s in _ENTRIES for s in inside.values()):
                gathered.append(full)
            elif targets.get(full) in _EXITS:
                pass
            elif type(module).__name__.endswith("Norm"):
                norms.append(full)
            elif any(True for _ in module.parameters()):
                refused[full] = (
                    f"holds parameters outside the plan's tensor-parallel regions ({type(module).__name__}); it would "
                    "see a slice of the sequence"
                )
            exits.extend(n for n, s in inside.items() if s in _EXITS)
    order = {name: i for i, name in enumerate(modules)}
    return SequenceParallelPlan(
        layers=tuple(sorted(layers, key=order.__getitem__)),
        gathered_inputs=tuple(gathered),
        exits=tuple(exits),
        norms=tuple(norms),
        refused=refused,
        positions={layer: positions[layer] for layer in layers},
    )


def check_sequence_parallel(model: nn.Module, plan: Mapping[str, str]) -> SequenceParallelPlan:
    """The :class:`SequenceParallelPlan` of ``model`` under ``plan`` (``{glob: style}``); raises ``ValueError`` naming
    the modules that cannot run on a slice of the sequence, or when the plan has no region to slice around."""
    from .tp_plan import tp_targets

    sp = sequence_parallel_plan(model, tp_targets(model, plan, strict=False))
    if sp.refused:
        raise ValueError(
            "sequence_parallel=True needs every parameter of a layer inside the plan's tensor-parallel regions or in a "
            f"norm between them: {sp.refused}; add those modules to tp_plan or run without sequence parallelism"
        )
    if not sp.layers:
        raise ValueError(
            "sequence_parallel=True: the tensor-parallel plan has no row-parallel module inside a layer of an "
            "nn.ModuleList or nn.Sequential, so there is no region to slice the sequence around"
        )
    return sp
