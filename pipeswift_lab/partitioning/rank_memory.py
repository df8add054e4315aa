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
from dataclasses import dataclass
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
from ..core.schedule import ScheduleLike
from .input_pass import InputPassBytes, weight_pass_held

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
    per_layer = _LayerBytes.of(layers, scale=scale, precision=precision, optimizer=optimizer, D=D)
    measured_cuts = _measured_column(layers, "cut_bytes") is not None
    return [_stage(per_layer, layers, a, b, measured_cuts) for a, b in bounds]


@dataclass(frozen=True, kw_only=True)
class _LayerBytes:
    """Per layer, the bytes a stage's are sums and maxima of, and the loss's and the batch's from the profile's meta
    (what :func:`stage_bytes` and :class:`SplitBytes` read alike)."""

    scale: float
    """The run's micro-batch size over the profiled one."""
    weights: np.ndarray
    grads: np.ndarray
    state: np.ndarray
    """Optimizer state, master weights included."""
    act: np.ndarray
    """Saved activations of a profiled micro-batch (not scaled)."""
    out: np.ndarray
    """Output of a profiled micro-batch (not scaled)."""
    largest: np.ndarray
    """The largest parameter tensor."""
    activation_transient: np.ndarray
    """What a backward of one micro-batch allocates beyond its weight gradient (scaled)."""
    layer_transient: np.ndarray
    """All a backward of one micro-batch allocates (what scales with the micro-batch scaled)."""
    weight_pass: np.ndarray
    """What an ``I`` pass holds until its ``W`` (:func:`~.input_pass.weight_pass_held`, not scaled)."""
    input_pass: InputPassBytes
    """What an ``I`` pass holds while it runs (scaled)."""
    buckets: bool
    """Whether a stage keeps a copy of its gradients: the runner's DDP (``D > 1``, no ``precision``)."""
    loss_act: float
    loss_transient: float
    loss_retained: float
    input_bytes: float
    target_bytes: float

    @classmethod
    def of(
        cls, layers: Layers, *, scale: float, precision: str | None, optimizer: OptimizerMemory, D: int
    ) -> _LayerBytes:
        """The per-layer bytes of ``layers`` (:func:`stage_bytes`' arguments). Returns a :class:`_LayerBytes`."""
        weights, grads, state = _state_per_layer(layers, precision, optimizer, D)
        largest = layers.largest_param_bytes if layers.largest_param_bytes is not None else weights
        activation_transient, layer_transient = _layer_transients(layers, grads, largest, scale)
        return cls(
            scale=scale,
            weights=weights,
            grads=grads,
            state=state,
            act=layers.activation_bytes if layers.activation_bytes is not None else np.zeros(layers.n),
            out=layers.output_bytes if layers.output_bytes is not None else np.zeros(layers.n),
            largest=largest,
            activation_transient=activation_transient,
            layer_transient=layer_transient,
            weight_pass=weight_pass_held(layers),
            input_pass=InputPassBytes.of(layers, scale, _meta_bytes(layers, "loss_transient_bytes")),
            buckets=D > 1 and precision is None,
            loss_act=_meta_bytes(layers, "loss_activation_bytes"),
            loss_transient=_meta_bytes(layers, "loss_transient_bytes"),
            loss_retained=_meta_bytes(layers, "loss_retained_bytes"),
            input_bytes=_meta_bytes(layers, "input_bytes"),
            target_bytes=_meta_bytes(layers, "target_bytes"),
        )


def _layer_transients(
    layers: Layers, grads: np.ndarray, largest: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, what a backward of one micro-batch allocates: ``(beyond its weight gradient, all of it)``, with
    what scales with the micro-batch multiplied by ``scale``."""
    transient = layers.transient_bytes if layers.transient_bytes is not None else np.zeros(layers.n)
    weight_grad = np.minimum(transient, grads)  # a micro-batch's weight gradient does not scale with its size
    activation_transient = (transient - weight_grad) * scale
    layer_transient = weight_grad + activation_transient
    accumulate = _measured_column(layers, "accumulate_transient_bytes")
    if accumulate is not None:
        # measured adding to the gradients there are: one weight's temporary at a time beside the activations' ones
        temporary = np.minimum(accumulate, largest)
        layer_transient = temporary + (accumulate - temporary) * scale
    return activation_transient, layer_transient


def _stage(per_layer: _LayerBytes, layers: Layers, a: int, b: int, measured_cuts: bool) -> StageBytes:
    """The bytes of the stage of layers ``a`` to ``b`` (excluded), from what crosses its cuts where the profile
    measured it. Returns a :class:`~pipeswift_lab.core.memory_model.StageBytes`."""
    p, scale = per_layer, per_layer.scale
    last = b == layers.n  # the stage that ends the model runs the loss
    output = float(p.out[b - 1])
    if measured_cuts:
        recv, grad_recv, activations = _measured_crossings(p, layers, a, b)
    else:
        recv, grad_recv, activations = _output_crossings(p, a, b, output, last)
    transient, first_transient = _stage_transients(p, a, b, output, last)
    input_transient = (
        transient if a == 0 else p.input_pass.stage(a, b, last=last, grad_recv=grad_recv, transient=transient)
    )
    return StageBytes(
        weights=_sum(p.weights, a, b),
        grads=_sum(p.grads, a, b),
        buckets=_sum(p.grads, a, b) if p.buckets else 0.0,
        optimizer=_sum(p.state, a, b),
        activations=activations + p.loss_act * scale if last else activations,
        transient=transient,
        first_transient=first_transient,
        recv=recv,
        grad_recv=grad_recv,
        retained=p.loss_retained * scale if last else 0.0,
        weight_pass_held=_sum(p.weight_pass, a, b) * scale if a > 0 else 0.0,
        input_transient=input_transient,
        batch=(p.input_bytes if a == 0 else 0.0) * scale + (p.target_bytes if last else 0.0) * scale,
        largest_param=float(np.max(p.largest[a:b])),
    )


def _measured_crossings(p: _LayerBytes, layers: Layers, a: int, b: int) -> tuple[float, float, float]:
    """What the stage of layers ``a`` to ``b`` receives, receives back and keeps per micro-batch where the profile
    measured what crosses each cut, tensor by tensor: the layers hold what they allocated. Returns ``(recv,
    grad_recv, activations)``, scaled."""
    recv = _cut_at(layers, "cut_bytes", a)
    grad_recv = _cut_at(layers, "cut_grad_bytes", b)
    activations = (_sum(p.act, a, b) + _cut_at(layers, "cut_freed_bytes", b)) * p.scale
    if a > 0 and "received_held_bytes" in layers.df:  # its receive buffers require grad
        activations += float(np.nansum(layers.df["received_held_bytes"].to_numpy(float)[a:b])) * p.scale
    return recv * p.scale, grad_recv * p.scale, activations


def _output_crossings(p: _LayerBytes, a: int, b: int, output: float, last: bool) -> tuple[float, float, float]:
    """The same as :func:`_measured_crossings` from the layers' outputs: the stage receives the output of the layer
    before it and keeps its layers' saved tensors and its ``output``, which torch keeps for the backward. Returns
    ``(recv, grad_recv, activations)``, scaled."""
    recv = float(p.out[a - 1]) if a > 0 else 0.0
    grad_recv = output if not last else 0.0
    return recv * p.scale, grad_recv * p.scale, (_sum(p.act, a, b) + output) * p.scale


def _stage_transients(p: _LayerBytes, a: int, b: int, output: float, last: bool) -> tuple[float, float]:
    """The most a backward of one micro-batch on the stage of layers ``a`` to ``b`` allocates beyond what it frees,
    and the same for its first backward of a step, whose weight gradients become the ``.grad`` tensors (on the last
    stage the loss's backward and the output's gradient too). Returns ``(transient, first_transient)``."""
    # a layer's backward runs after the later layers' have freed what they saved for this micro-batch
    freed = np.concatenate([np.cumsum(p.act[a + 1 : b][::-1])[::-1], [0.0]]) * p.scale
    transient = max(0.0, float(np.max(p.layer_transient[a:b] - freed)))
    # the first backward of a step turns its weight gradients into the .grad tensors, layer by layer
    grown = np.cumsum(p.grads[a:b][::-1])[::-1]
    first_transient = max(0.0, float(np.max(p.activation_transient[a:b] + grown - freed)))
    if last:
        loss = p.loss_transient * p.scale
        transient = max(transient + output * p.scale, loss)
        first_transient = max(first_transient + output * p.scale, loss)  # no .grad yet
    return transient, first_transient


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
    schedule: ScheduleLike,
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

    optimizer = _optimizer_memory(optimizer, layers)
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
        rows.append(_rank_row(r, mine, rank_peak(mine, orders[r], m, optimizer, sends)))
    return pd.DataFrame(rows, columns=[*RANK_MEMORY_COLUMNS, *(f"{t}_before_backward_bytes" for t in MEMORY_TERMS)])


def _optimizer_memory(optimizer: OptimizerMemory | str, layers: Layers) -> OptimizerMemory:
    """``optimizer``, or for a name torch's default implementation of it on the profile's device. Returns an
    :class:`~pipeswift_lab.core.memory_model.OptimizerMemory`."""
    if not isinstance(optimizer, str):
        return optimizer
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}")
    return default_optimizer_memory(optimizer, str(layers.meta.get("device", "cpu")).split(":")[0])


def _rank_row(r: int, mine: dict[int, StageBytes], peak: dict[str, float | str]) -> dict[str, Any]:
    """The row of :func:`rank_memory` of rank ``r``, holding the stages ``mine``, from its :func:`rank_peak`."""
    return {
        "rank": r,
        "stages": tuple(mine),
        "predicted_peak_bytes": peak["peak_bytes"],
        **{f"{t}_bytes": peak[f"{t}_bytes"] for t in MEMORY_TERMS},
        "peak_at": peak["peak_at"],
        **{f"{t}_before_backward_bytes": peak.get(f"{t}_before_backward_bytes", 0.0) for t in MEMORY_TERMS},
    }


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
        self.layer = _LayerBytes.of(layers, scale=scale, precision=precision, optimizer=optimizer, D=D)
        """The bytes per layer, as :func:`stage_bytes` takes them."""
        p = self.layer
        # freed[i] = (A[b] - A[i + 1]) * scale and grown[i] = G[b] - G[i] for a stage [a, b), A and G prefix sums
        self.act_prefix = np.concatenate([[0.0], np.cumsum(p.act)]) * scale
        self.grad_prefix = np.concatenate([[0.0], np.cumsum(p.grads)])
        self.transient_term = p.layer_transient + self.act_prefix[1:]
        self.first_term = p.activation_transient - self.grad_prefix[:-1] + self.act_prefix[1:]
        self.again = p.weight_pass * scale
        self.cuts = _cut_values(layers)

    def of(self, bounds: Bounds, placement: Sequence[int] | None = None) -> StageFields:
        """The fields of every stage of ``bounds`` (contiguous, from layer 0 to the last); with ``placement`` (each
        stage's rank) also what each sends to another rank. Returns a
        :class:`~pipeswift_lab.core.peak_forms.StageFields`."""
        starts, ends = self._starts_ends(bounds)
        p, scale, last, first = self.layer, self.layer.scale, ends == self.n, starts == 0
        output = p.out[ends - 1]
        recv, grad_recv, activations = self._crossings(starts, ends, output)
        transient, first_transient = self._transients(starts, ends, output)
        by_input_pass = p.input_pass.stages(starts, ends, grad_recv=grad_recv, transient=transient)
        input_transient = np.where(first, transient, by_input_pass)
        sent_output, sent_grad = _sends(recv, grad_recv, placement)
        grads = np.add.reduceat(p.grads, starts)
        fields = {
            "weights": np.add.reduceat(p.weights, starts),
            "grads": grads,
            "optimizer": np.add.reduceat(p.state, starts),
            "activations": activations,
            "transient": transient,
            "first_transient": first_transient,
            "recv": recv,
            "grad_recv": grad_recv,
            "retained": np.where(last, p.loss_retained * scale, 0.0),
            "batch": (np.where(first, p.input_bytes, 0.0) + np.where(last, p.target_bytes, 0.0)) * scale,
            "sent_output": sent_output,
            "sent_grad": sent_grad,
            "weight_pass_held": np.where(first, 0.0, np.add.reduceat(self.again, starts)),
            "input_transient": input_transient,
            "buckets": grads if p.buckets else np.zeros(len(bounds)),
            "largest_param": np.maximum.reduceat(p.largest, starts),
        }
        return StageFields(np.stack([fields[name] for name in STAGE_FIELDS]))

    def _starts_ends(self, bounds: Bounds) -> tuple[np.ndarray, np.ndarray]:
        """The first layer of each stage of ``bounds`` and the one after its last, checked contiguous from layer 0 to
        the last. Returns ``(starts, ends)``."""
        starts = np.fromiter((a for a, _ in bounds), dtype=np.int64, count=len(bounds))
        ends = np.fromiter((b for _, b in bounds), dtype=np.int64, count=len(bounds))
        if len(bounds) == 0 or starts[0] != 0 or ends[-1] != self.n or np.any(starts[1:] != ends[:-1]):
            raise ValueError(f"bounds={bounds!r} must be contiguous stages from layer 0 to {self.n}")
        return starts, ends

    def _crossings(
        self, starts: np.ndarray, ends: np.ndarray, output: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage, what it receives, receives back and keeps per micro-batch (the loss's on the last), as
        :func:`_measured_crossings` or :func:`_output_crossings` take them. Returns ``(recv, grad_recv,
        activations)``, scaled."""
        p, scale, last, first = self.layer, self.layer.scale, ends == self.n, starts == 0
        activations = np.add.reduceat(p.act, starts)
        if self.cuts is not None:
            cuts = self.cuts
            recv = np.where(first, 0.0, cuts["cut"][starts])
            grad_recv = np.where(last, 0.0, cuts["grad"][ends])
            activations = activations + np.where(last, 0.0, cuts["freed"][ends])
            received = np.where(first, 0.0, cuts["received"][ends] - cuts["received"][starts])
            activations = activations * scale + received * scale
        else:
            recv = np.where(first, 0.0, p.out[np.maximum(starts - 1, 0)])
            grad_recv = np.where(last, 0.0, output)
            activations = (activations + output) * scale
        activations = activations + np.where(last, p.loss_act * scale, 0.0)
        return recv * scale, grad_recv * scale, activations

    def _transients(self, starts: np.ndarray, ends: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per stage, :func:`_stage_transients` from the running maxima of the terms taken once. Returns
        ``(transient, first_transient)``."""
        scale, last = self.layer.scale, ends == self.n
        freed_end = self.act_prefix[ends]
        transient = np.maximum(0.0, np.maximum.reduceat(self.transient_term, starts) - freed_end)
        first_transient = np.maximum(
            0.0, np.maximum.reduceat(self.first_term, starts) + self.grad_prefix[ends] - freed_end
        )
        loss = self.layer.loss_transient * scale
        transient = np.where(last, np.maximum(transient + output * scale, loss), transient)
        first_transient = np.where(last, np.maximum(first_transient + output * scale, loss), first_transient)
        return transient, first_transient


def _cut_values(layers: Layers) -> dict[str, np.ndarray] | None:
    """What the profile measured crossing each cut, for :class:`SplitBytes`: ``"cut"``, ``"grad"`` and ``"freed"`` at
    the cut before each layer (and none after the last), ``"received"`` the prefix sums of what the layers' receive
    buffers keep. Returns a dict of arrays, or None where the profile did not measure every cut."""
    cut = _measured_column(layers, "cut_bytes")
    if cut is None:
        return None
    received = _column(layers, "received_held_bytes")
    received = np.nan_to_num(received) if received is not None else np.zeros(layers.n)
    grad, freed = _column(layers, "cut_grad_bytes"), _column(layers, "cut_freed_bytes")
    return {
        "cut": np.append(cut, 0.0),  # the cut "before" layer n: none
        "grad": np.append(grad if grad is not None else cut, 0.0),
        "freed": np.append(freed if freed is not None else np.zeros(layers.n), 0.0),
        "received": np.concatenate([[0.0], np.cumsum(received)]),
    }


def _sends(recv: np.ndarray, grad_recv: np.ndarray, placement: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, what it sends to a stage on another rank per micro-batch, as :func:`with_sends` takes it (none
    without a ``placement``). Returns ``(sent_output, sent_grad)``."""
    sent_output, sent_grad = np.zeros(len(recv)), np.zeros(len(recv))
    if placement is not None:
        ranks = np.asarray(placement)
        ahead = np.append(ranks[1:] != ranks[:-1], False)
        sent_output[ahead] = recv[1:][ahead[:-1]]
        behind = np.concatenate([[False], ranks[1:] != ranks[:-1]])
        sent_grad[behind] = grad_recv[:-1][behind[1:]]
    return sent_output, sent_grad


def _column(layers: Layers, name: str) -> np.ndarray | None:
    """Column ``name`` of the layers' table as floats, or None where it is absent."""
    return layers.df[name].to_numpy(float) if name in layers.df else None


def _measured_column(layers: Layers, name: str) -> np.ndarray | None:
    """Column ``name`` of the layers' table as floats where the profile measured it for every layer (all finite), or
    None."""
    values = _column(layers, name)
    return values if values is not None and bool(np.all(np.isfinite(values))) else None
