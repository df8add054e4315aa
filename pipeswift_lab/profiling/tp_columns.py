"""The tensor-parallel columns of a :class:`~pipeswift_lab.profiling.table.Profile`: what each layer's parameters,
activations, compute and communication become under the model's tensor-parallel plan.

``profile(model, sample, tp_plan=None)`` takes ``tp_plan=`` when given, else the model's own plan
(:func:`~pipeswift_lab.core.tp_plan.model_tp_plan`: a Hugging Face model's ``tp_plan``, the reference models'
``tp_plan`` attribute), and adds one value per layer, per micro-batch at the profile's batch size, bytes in the
profile's dtype, at the full (``tp = 1``) size:

=======================  ==================================================================================
column                   what it holds
=======================  ==================================================================================
``tp_param_bytes``       the layer's parameters the plan cuts (divide by ``tp``; the rest is replicated)
``tp_activation_bytes``  the part of what the layer saves for its backward that is a local shard under TP
``tp_flop_fraction``     the share (0..1) of the layer's forward FLOPs on sharded tensors or weights
``tp_forward_bytes``     what the forward all-reduces (rowwise, embedding_rowwise) or all-gathers
                         (colwise_gather_output, embedding_colwise) at the plan's exit points
``tp_backward_bytes``    what the backward all-reduces (colwise input gradients, a shared input once) or
                         all-gathers (rowwise_split_input input gradients)
``sp_activation_bytes``  the part of what the layer saves that is a local shard or a slice of the sequence
                         under TP with sequence parallelism (``tp_activation_bytes`` where the plan does not
                         allow it; ``meta["sequence_parallel"]`` says whether it does)
``tp_duplicated_bytes``  what TP saves whole beside a slice that one process saves as one tensor: the whole
                         input of a ``rowwise_split_input`` module another operator saves too (an attention's
                         output; torch's split makes a new tensor). Under ``tp > 1`` a rank saves
                         ``activation_bytes - tp_activation_bytes + tp_activation_bytes / tp + tp_duplicated_bytes``
=======================  ==================================================================================

``meta["tp_plan"]`` is the plan and ``meta["tp_divides"]`` the sorted sizes ``tp`` must divide (sharded dimensions,
attention and key/value heads): the degrees a run can take are their common divisors. The columns other than
``tp_param_bytes`` come from one forward of the whole model on fake tensors (:mod:`.tp_dataflow`): no process group,
no memory, deterministic, a meta model too. A model without a plan, or ``tp_plan={}``, gets none of them; a model's own
plan may name modules it lacks (a mixture of experts' plan names a dense MLP), and one that does not fit it otherwise
(a style on a module it does not apply to, a forward fake tensors cannot run) gives none either, and
``meta["tp_plan_error"]`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.display import first_line
from ..core.sequence_parallel import sequence_parallel_plan
from ..core.tp_plan import model_tp_plan, resolve_tp_plan, tp_divides, tp_targets
from .table import TP_COLUMNS, Profile
from .tp_dataflow import sharded_parameters, trace_tp_dataflow

__all__ = ["TP_COLUMNS", "TensorParallelColumns", "tp_param_bytes"]


def tp_param_bytes(unit: nn.Module, unit_name: str, targets: Mapping[str, str]) -> int:
    """Bytes of ``unit``'s parameters (``unit_name`` in the model) that the plan's matched modules ``targets`` cut
    (``{module name: style}``): colwise and rowwise weights, colwise biases, embedding weights; each parameter once."""
    prefix = f"{unit_name}." if unit_name else ""
    seen: set[int] = set()
    total = 0
    for name, module in unit.named_modules():
        style = targets.get(prefix + name if name else unit_name)
        if style is None:
            continue
        for p in sharded_parameters(module, style):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True, kw_only=True)
class TensorParallelColumns:
    """The tensor-parallel columns of one profile, measured before its layers are timed."""

    rows: dict[str, dict[str, float]]
    """``{unit name: {column: value}}`` for every :data:`TP_COLUMNS`."""
    meta: dict[str, Any]
    """What the profile's ``meta`` gains: ``tp_plan`` and ``tp_divides`` (or ``tp_plan_error`` alone)."""

    @classmethod
    def measured(
        cls,
        model: nn.Module,
        units: Sequence[tuple[str, nn.Module]],
        tp_plan: Mapping[str, str] | None,
        sample: tuple[tuple[Any, ...], dict[str, Any]],
        *,
        device: torch.device | str | None,
        precision: str | None,
    ) -> TensorParallelColumns | None:
        """The columns of ``model``'s ``units`` under ``tp_plan`` (else the model's own plan) for one forward of
        ``sample`` (``(args, kwargs)``) on ``device`` (default: the model's; the CPU for a meta model) at
        ``precision``; None for a model with no plan or ``tp_plan={}``.

        Raises ``TypeError`` for a ``tp_plan`` that is not a ``{glob: style}`` dict and ``ValueError`` for one with an
        unknown style or a glob that matches no module (:func:`~pipeswift_lab.core.tp_plan.resolve_tp_plan`) or a
        model whose forward cannot run on fake tensors;
        the model's own plan failing either way gives the reason alone (``meta["tp_plan_error"]``)."""
        given = tp_plan is not None
        # a given plan is checked here, before anything runs; the model's own is checked below and never refused
        plan = resolve_tp_plan(model, tp_plan) if tp_plan is not None else model_tp_plan(model)
        if not plan:
            return None
        try:  # a model's own plan may name modules some of its layers lack (a mixture of experts' dense MLP)
            targets = tp_targets(model, plan, strict=given)
        except ValueError as exc:  # the model's own plan (a given one passed the same check above)
            return cls(rows={}, meta={"tp_plan_error": f"the model's tp_plan does not fit it: {exc}"})
        try:
            flows = trace_tp_dataflow(
                model, units, targets, sample, device=_pass_device(model, device),
                autocast_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
            )  # fmt: skip
        except Exception as exc:  # a forward that fake tensors cannot run: the timed profile still can
            reason = f"its forward did not run on fake tensors: {type(exc).__name__}: {first_line(exc)}"
            if given:
                raise ValueError(f"tp_plan was given, but {reason}") from exc
            return cls(rows={}, meta={"tp_plan_error": f"the model's tp_plan could not be followed: {reason}"})
        rows = {
            name: {
                "tp_param_bytes": tp_param_bytes(module, name, targets),
                "tp_activation_bytes": flow.sharded_saved_bytes,
                "tp_flop_fraction": flow.sharded_flops / flow.flops if flow.flops else 0.0,
                "tp_forward_bytes": flow.forward_bytes,
                "tp_backward_bytes": flow.backward_bytes,
                "sp_activation_bytes": flow.sharded_saved_bytes + flow.sliced_saved_bytes,
                "tp_duplicated_bytes": flow.duplicated_bytes,
            }
            for (name, module), flow in zip(units, flows)
        }
        divides = sorted(set(tp_divides(model, targets).values()))
        sp = sequence_parallel_plan(model, targets)
        allowed = bool(sp.layers) and not sp.refused
        return cls(rows=rows, meta={"tp_plan": plan, "tp_divides": divides, "sequence_parallel": allowed})

    def added_to(self, profile: Profile) -> Profile:
        """``profile`` with the columns (after the others, by layer name) and the meta keys."""
        df = profile.df.copy()
        if self.rows:
            for column in TP_COLUMNS:
                df[column] = [self.rows[name][column] for name in df["name"]]
        return Profile(df, {**profile.meta, **self.meta})


def _pass_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """Where the fake forward says it runs: ``device``, else the model's (the CPU for a meta model, as a meta model
    is profiled there)."""
    if device is not None:
        return torch.device(device)
    devices = {p.device for p in model.parameters()} - {torch.device("meta")}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")
