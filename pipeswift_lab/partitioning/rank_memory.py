"""Predicted peak memory per rank of a split: the profile's per-layer bytes, replayed over the schedule.

:func:`stage_bytes` turns the layers of each stage into the
:class:`~pipeswift_lab.core.memory_model.StageBytes` of one micro-batch of ``micro_batch_size``
samples; :func:`rank_memory` replays every rank's actions in torch's order
(:func:`~pipeswift_lab.core.memory_model.rank_peak`) and returns one row per rank with every
term. What scales with the micro-batch (saved activations, outputs, the loss's tensors, the
transients beyond a layer's weight gradient) is scaled from the profiled micro-batch
(``profile.meta["batch_size"]``); what does not (weights, gradients, optimizer state) is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.memory_model import (
    MEMORY_TERMS,
    OptimizerMemory,
    StageBytes,
    default_optimizer_memory,
    rank_peak,
    send_wait,
)
from ..core.peak_forms import STAGE_FIELDS, StageFields
from ..core.precision import OPTIMIZER_STATES, PRECISIONS

if TYPE_CHECKING:
    from .layers import Bounds, Layers

__all__ = ["RANK_MEMORY_COLUMNS", "SplitBytes", "rank_memory", "stage_bytes", "with_sends"]

#: The columns of :func:`rank_memory`, one row per rank.
RANK_MEMORY_COLUMNS = (
    "rank",
    "stages",
    "predicted_peak_bytes",
    *(f"{t}_bytes" for t in MEMORY_TERMS),
    "peak_at",
)


def _sum(values: np.ndarray | None, a: int, b: int) -> float:
    return float(np.sum(values[a:b])) if values is not None else 0.0


def _state_per_layer(
    layers: Layers, precision: str | None, optimizer: OptimizerMemory, D: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer: bytes of weights, gradients and optimizer state (master weights included) under ``precision``."""
    param_bytes = layers.param_bytes if layers.param_bytes is not None else np.zeros(layers.n)
    if precision is None:
        return param_bytes, param_bytes, param_bytes * optimizer.states
    if layers.params is None:
        raise ValueError(f"precision={precision!r} counts bytes per parameter, but the profile has no 'params' column")
    spec = PRECISIONS[precision]
    shards = D if spec.sharded else 1
    state = (spec.master_bytes + optimizer.states * spec.state_bytes) / shards
    return layers.params * spec.weight_bytes, layers.params * spec.grad_bytes, layers.params * state


def stage_bytes(
    layers: Layers,
    bounds: Bounds,
    *,
    scale: float = 1.0,
    precision: str | None = None,
    optimizer: OptimizerMemory,
    D: int = 1,
) -> list[StageBytes]:
    """The :class:`~pipeswift_lab.core.memory_model.StageBytes` of each stage of ``bounds``, with what scales with
    the micro-batch multiplied by ``scale`` (the run's micro-batch size over the profiled one). Returns a list in
    stage order."""
    weights, grads, state = _state_per_layer(layers, precision, optimizer, D)
    act = layers.activation_bytes if layers.activation_bytes is not None else np.zeros(layers.n)
    out_b = layers.output_bytes if layers.output_bytes is not None else np.zeros(layers.n)
    transient = layers.transient_bytes if layers.transient_bytes is not None else np.zeros(layers.n)
    largest = layers.largest_param_bytes if layers.largest_param_bytes is not None else weights
    weight_grad = np.minimum(transient, grads)  # a micro-batch's weight gradient does not scale with its size
    activation_transient = (transient - weight_grad) * scale
    layer_transient = weight_grad + activation_transient
    accumulate = (
        layers.df["accumulate_transient_bytes"].to_numpy(float) if "accumulate_transient_bytes" in layers.df else None
    )
    if accumulate is not None and bool(np.all(np.isfinite(accumulate))):
        # measured adding to the gradients there are: one weight's temporary at a time beside the activations' ones
        temporary = np.minimum(accumulate, largest)
        layer_transient = temporary + (accumulate - temporary) * scale
    loss_act = _meta_bytes(layers, "loss_activation_bytes")
    loss_transient = _meta_bytes(layers, "loss_transient_bytes")
    loss_retained = _meta_bytes(layers, "loss_retained_bytes")
    cut = layers.df["cut_bytes"].to_numpy(float) if "cut_bytes" in layers.df else None
    measured_cuts = cut is not None and bool(np.all(np.isfinite(cut)))
    out = []
    for a, b in bounds:
        last = b == layers.n  # the stage that ends the model runs the loss
        output = float(out_b[b - 1])
        if measured_cuts:  # what crosses the cuts, tensor by tensor; the layers hold what they allocated
            recv = _cut_at(layers, "cut_bytes", a)
            grad_recv = _cut_at(layers, "cut_grad_bytes", b)
            activations = (_sum(act, a, b) + _cut_at(layers, "cut_freed_bytes", b)) * scale
            if a > 0 and "received_held_bytes" in layers.df:  # its receive buffers require grad
                activations += float(np.nansum(layers.df["received_held_bytes"].to_numpy(float)[a:b])) * scale
        else:  # the layers' saved tensors and the stage's output, which torch keeps for the backward
            recv = float(out_b[a - 1]) if a > 0 else 0.0
            grad_recv = output if not last else 0.0
            activations = (_sum(act, a, b) + output) * scale
        # a layer's backward runs after the later layers' have freed what they saved for this micro-batch
        freed = np.concatenate([np.cumsum(act[a + 1 : b][::-1])[::-1], [0.0]]) * scale
        peak_transient = max(0.0, float(np.max(layer_transient[a:b] - freed)))
        # the first backward of a step turns its weight gradients into the .grad tensors, layer by layer
        grown = np.cumsum(grads[a:b][::-1])[::-1]
        first_transient = max(0.0, float(np.max(activation_transient[a:b] + grown - freed)))
        if last:
            activations += loss_act * scale
            peak_transient = max(peak_transient + output * scale, loss_transient * scale)
            first_transient = max(first_transient + output * scale, loss_transient * scale)  # no .grad yet
        out.append(
            StageBytes(
                weights=_sum(weights, a, b),
                grads=_sum(grads, a, b),
                buckets=_sum(grads, a, b) if D > 1 and precision is None else 0.0,  # the runner's DDP copy
                optimizer=_sum(state, a, b),
                activations=activations,
                transient=peak_transient,
                first_transient=first_transient,
                recv=recv * scale,
                grad_recv=grad_recv * scale,
                retained=loss_retained * scale if last else 0.0,
                weight_pass_held=_sum(_weight_pass_held(layers), a, b) * scale if a > 0 else 0.0,
                batch=(_meta_bytes(layers, "input_bytes") if a == 0 else 0.0) * scale
                + (_meta_bytes(layers, "target_bytes") if last else 0.0) * scale,
                largest_param=float(np.max(largest[a:b])),
            )
        )
    return out


def _weight_pass_held(layers: Layers) -> np.ndarray:
    """Per layer, what a zero-bubble ``I`` pass of one micro-batch holds until its ``W`` (``weight_pass_bytes``: the
    gradients torch keeps for ``W``, and what a checkpointed layer's ``I`` recomputed that ``W`` reads again); 0
    where the profile has no such column."""
    values = _column(layers, "weight_pass_bytes")
    return np.nan_to_num(values) if values is not None else np.zeros(layers.n)


def _cut_at(layers: Layers, column: str, layer: int) -> float:
    """``column`` of the cut just before ``layer`` (0 before the first layer and after the last)."""
    if layer <= 0 or layer >= layers.n:
        return 0.0
    return float(layers.df[column].iloc[layer])


def with_sends(stages: Sequence[StageBytes], placement: Sequence[int]) -> list[StageBytes]:
    """``stages`` with what each sends to another rank per micro-batch: its output where the next stage is on
    another rank (what that stage receives), its input's gradient where the stage before is (what that one
    receives back)."""
    out = []
    for s, stage in enumerate(stages):
        ahead = s + 1 < len(stages) and placement[s + 1] != placement[s]
        behind = s > 0 and placement[s - 1] != placement[s]
        out.append(
            dataclasses.replace(
                stage,
                sent_output=stages[s + 1].recv if ahead else 0.0,
                sent_grad=stages[s - 1].grad_recv if behind else 0.0,
            )
        )
    return out


def _meta_bytes(layers: Layers, key: str) -> float:
    try:
        value = float(layers.meta.get(key))  # type: ignore[arg-type]  # None and text are caught below
    except (TypeError, ValueError):
        return 0.0
    return value if np.isfinite(value) and value > 0 else 0.0


def rank_memory(
    layers: Layers,
    bounds: Bounds,
    placement: Sequence[int],
    *,
    P: int,
    m: int,
    schedule: str,
    v: int = 1,
    micro_batch_size: int | None = None,
    precision: str | None = None,
    optimizer: OptimizerMemory | str = "adam",
    D: int = 1,
) -> pd.DataFrame:
    """The predicted peak memory of every rank of ``bounds`` placed on ``placement`` under ``schedule`` with ``m``
    micro-batches of ``micro_batch_size`` samples (default: the profiled size).

    ``optimizer`` is an :class:`~pipeswift_lab.core.memory_model.OptimizerMemory` or a name of
    :data:`~pipeswift_lab.core.precision.OPTIMIZER_STATES` (torch's default implementation on the profile's
    device). Returns a DataFrame with :data:`RANK_MEMORY_COLUMNS`, then every term as it stands when the rank's first
    backward starts (``{term}_before_backward_bytes``), one row per rank.
    """
    from ..core.schedule_orders import compute_orders

    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}")
        optimizer = default_optimizer_memory(optimizer, str(layers.meta.get("device", "cpu")).split(":")[0])
    profiled = layers.meta.get("batch_size")
    scale = micro_batch_size / profiled if micro_batch_size and profiled else 1.0
    per_stage = with_sends(
        stage_bytes(layers, bounds, scale=scale, precision=precision, optimizer=optimizer, D=D), placement
    )
    orders = compute_orders(P, m, schedule, v, check=False)
    sends = send_wait(schedule)
    rows: list[dict[str, Any]] = []
    for r in range(P):
        mine = {s: per_stage[s] for s, rank in enumerate(placement) if rank == r}
        peak = rank_peak(mine, orders[r], m, optimizer, sends)
        rows.append(
            {
                "rank": r,
                "stages": tuple(mine),
                "predicted_peak_bytes": peak["peak_bytes"],
                **{f"{t}_bytes": peak[f"{t}_bytes"] for t in MEMORY_TERMS},
                "peak_at": peak["peak_at"],
                **{f"{t}_before_backward_bytes": peak.get(f"{t}_before_backward_bytes", 0.0) for t in MEMORY_TERMS},
            }
        )
    return pd.DataFrame(rows, columns=[*RANK_MEMORY_COLUMNS, *(f"{t}_before_backward_bytes" for t in MEMORY_TERMS)])


class SplitBytes:
    """:func:`stage_bytes` of any split of ``layers``, as :class:`~pipeswift_lab.core.peak_forms.StageFields`, from
    sums over the layers taken once (the planner weighs thousands of splits of the same layers).

    The arguments are :func:`stage_bytes`'s. A stage's largest transient over its layers is a running maximum
    over the layers of a term that does not depend on where the stage starts or ends, shifted by one that depends
    on its end only, so every field of every stage is a sum or a maximum over contiguous layers
    (``np.add.reduceat``, ``np.maximum.reduceat``), or a value at one of its cuts. The fields equal
    :func:`stage_bytes`'s (and, with a placement, :func:`with_sends`') to float rounding.
    """

    def __init__(
        self,
        layers: Layers,
        *,
        scale: float = 1.0,
        precision: str | None = None,
        optimizer: OptimizerMemory,
        D: int = 1,
    ) -> None:
        self.n = layers.n
        self.optimizer_memory = optimizer
        """The optimizer the bytes are for."""
        weights, grads, state = _state_per_layer(layers, precision, optimizer, D)
        act = layers.activation_bytes if layers.activation_bytes is not None else np.zeros(layers.n)
        self.out = layers.output_bytes if layers.output_bytes is not None else np.zeros(layers.n)
        transient = layers.transient_bytes if layers.transient_bytes is not None else np.zeros(layers.n)
        self.largest = layers.largest_param_bytes if layers.largest_param_bytes is not None else weights
        weight_grad = np.minimum(transient, grads)  # as stage_bytes: a weight gradient does not scale
        activation_transient = (transient - weight_grad) * scale
        layer_transient = weight_grad + activation_transient
        accumulate = _column(layers, "accumulate_transient_bytes")
        if accumulate is not None and bool(np.all(np.isfinite(accumulate))):
            temporary = np.minimum(accumulate, self.largest)
            layer_transient = temporary + (accumulate - temporary) * scale
        self.scale, self.weights, self.grads, self.state, self.act = scale, weights, grads, state, act
        self.buckets = D > 1 and precision is None
        # freed[i] = (A[b] - A[i + 1]) * scale and grown[i] = G[b] - G[i] for a stage [a, b), A and G prefix sums
        self.act_prefix = np.concatenate([[0.0], np.cumsum(act)]) * scale
        self.grad_prefix = np.concatenate([[0.0], np.cumsum(grads)])
        self.transient_term = layer_transient + self.act_prefix[1:]
        self.first_term = activation_transient - self.grad_prefix[:-1] + self.act_prefix[1:]
        self.loss_act = _meta_bytes(layers, "loss_activation_bytes")
        self.loss_transient = _meta_bytes(layers, "loss_transient_bytes")
        self.loss_retained = _meta_bytes(layers, "loss_retained_bytes")
        self.input_bytes, self.target_bytes = _meta_bytes(layers, "input_bytes"), _meta_bytes(layers, "target_bytes")
        self.again = _weight_pass_held(layers) * scale
        cut = _column(layers, "cut_bytes")
        self.cuts = None
        if cut is not None and bool(np.all(np.isfinite(cut))):
            received = _column(layers, "received_held_bytes")
            received = np.nan_to_num(received) if received is not None else np.zeros(layers.n)
            grad, freed = _column(layers, "cut_grad_bytes"), _column(layers, "cut_freed_bytes")
            self.cuts = {
                "cut": np.append(cut, 0.0),  # the cut "before" layer n: none
                "grad": np.append(grad if grad is not None else cut, 0.0),
                "freed": np.append(freed if freed is not None else np.zeros(layers.n), 0.0),
                "received": np.concatenate([[0.0], np.cumsum(received)]),
            }

    def of(self, bounds: Bounds, placement: Sequence[int] | None = None) -> StageFields:
        """The fields of every stage of ``bounds`` (contiguous, from layer 0 to the last); with ``placement`` (each
        stage's rank) also what each sends to another rank. Returns a
        :class:`~pipeswift_lab.core.peak_forms.StageFields`."""
        starts = np.fromiter((a for a, _ in bounds), dtype=np.int64, count=len(bounds))
        ends = np.fromiter((b for _, b in bounds), dtype=np.int64, count=len(bounds))
        if len(bounds) == 0 or starts[0] != 0 or ends[-1] != self.n or np.any(starts[1:] != ends[:-1]):
            raise ValueError(f"bounds={bounds!r} must be contiguous stages from layer 0 to {self.n}")
        scale, last, first = self.scale, ends == self.n, starts == 0
        output = self.out[ends - 1]
        grads = np.add.reduceat(self.grads, starts)
        activations = np.add.reduceat(self.act, starts)
        if self.cuts is not None:
            cuts = self.cuts
            recv = np.where(first, 0.0, cuts["cut"][starts])
            grad_recv = np.where(last, 0.0, cuts["grad"][ends])
            activations = activations + np.where(last, 0.0, cuts["freed"][ends])
            received = np.where(first, 0.0, cuts["received"][ends] - cuts["received"][starts])
            activations = activations * scale + received * scale
        else:
            recv = np.where(first, 0.0, self.out[np.maximum(starts - 1, 0)])
            grad_recv = np.where(last, 0.0, output)
            activations = (activations + output) * scale
        activations = activations + np.where(last, self.loss_act * scale, 0.0)
        freed_end = self.act_prefix[ends]
        peak_transient = np.maximum(0.0, np.maximum.reduceat(self.transient_term, starts) - freed_end)
        first_transient = np.maximum(
            0.0, np.maximum.reduceat(self.first_term, starts) + self.grad_prefix[ends] - freed_end
        )
        loss = self.loss_transient * scale
        peak_transient = np.where(last, np.maximum(peak_transient + output * scale, loss), peak_transient)
        first_transient = np.where(last, np.maximum(first_transient + output * scale, loss), first_transient)
        recv, grad_recv = recv * scale, grad_recv * scale
        sent_output, sent_grad = np.zeros(len(bounds)), np.zeros(len(bounds))
        if placement is not None:
            ranks = np.asarray(placement)
            ahead = np.append(ranks[1:] != ranks[:-1], False)
            sent_output[ahead] = recv[1:][ahead[:-1]]
            behind = np.concatenate([[False], ranks[1:] != ranks[:-1]])
            sent_grad[behind] = grad_recv[:-1][behind[1:]]
        fields = {
            "weights": np.add.reduceat(self.weights, starts),
            "grads": grads,
            "optimizer": np.add.reduceat(self.state, starts),
            "activations": activations,
            "transient": peak_transient,
            "first_transient": first_transient,
            "recv": recv,
            "grad_recv": grad_recv,
            "retained": np.where(last, self.loss_retained * scale, 0.0),
            "batch": (np.where(first, self.input_bytes, 0.0) + np.where(last, self.target_bytes, 0.0)) * scale,
            "sent_output": sent_output,
            "sent_grad": sent_grad,
            "weight_pass_held": np.where(first, 0.0, np.add.reduceat(self.again, starts)),
            "buckets": grads if self.buckets else np.zeros(len(bounds)),
            "largest_param": np.maximum.reduceat(self.largest, starts),
        }
        return StageFields(np.stack([fields[name] for name in STAGE_FIELDS]))


def _column(layers: Layers, name: str) -> np.ndarray | None:
    """Column ``name`` of the layers' table as floats, or None where it is absent."""
    return layers.df[name].to_numpy(float) if name in layers.df else None
