"""What one process of a ``tp``-way tensor-parallel, ``fsdp``-way sharded layout holds and computes, per layer: the
per-layer costs the planner's search weighs a 3-D layout with.

Tensor parallelism (the profile's TP columns, measured where the model has a TP plan; every one per layer and per
micro-batch at the profiled size):

* compute: a layer's time ``t`` becomes ``t (1 - f) + t f / tp``, ``f`` its ``tp_flop_fraction`` (the share of its
  compute inside the sharded modules), for every time the planner reads (forward, backward, weight gradient,
  recomputation);
* collectives: the forward all-reduces ``tp_forward_bytes`` over the ``tp`` ranks and the backward
  ``tp_backward_bytes`` (the input gradients of the plan's entry points), on the tensor-parallel group's link (inside
  a node), priced as one ring all-reduce each (:func:`~pipeswift_lab.core.topology.all_reduce_ms`) and added to the
  layer's forward and backward (and to a full recomputation's forward): they are on the critical path, nothing
  overlaps them. With one profile every time scales with the micro-batch size, their latency too;
* memory: the parameters the plan shards divide by ``tp`` (:func:`~pipeswift_lab.core.layout.state_bytes_per_rank`),
  the rest stay whole on every rank; of the saved activations, ``tp_activation_bytes`` divide by ``tp`` and the rest
  stay whole, ``tp_duplicated_bytes`` (a whole input a row-parallel module slices into a new tensor while another
  operator saves it) held beside them; the parameter count, the largest parameter and a layer's backward transients
  (mostly its weight gradients) shrink as the parameter bytes do, what a recomputing backward allocates again as the
  activations do, and the input full recomputation keeps stays whole (sliced ``tp`` ways with sequence
  parallelism), while the loss's backward and the output's gradient on the last stage (the profile's meta, the
  layers' outputs) stay whole, as the runner's prediction takes them (:mod:`pipeswift_lab.runner.layout_memory`),
  except a vocabulary-parallel loss's (an analytic profile's), which divides as its time does. The outputs that
  cross a pipeline cut stay whole;
* with sequence parallelism (``plan(..., sequence_parallel=True)``, Korthikanti et al. 2022) the saved activations
  that divide are ``sp_activation_bytes`` (the norms' and the residual stream's too), and each all-reduce becomes an
  all-gather and a reduce-scatter of the same bytes: forward, the entries' inputs are gathered and the exits'
  outputs reduce-scattered; backward, the other way round. In the ring model that is the all-reduce's time.

A profile without a ``tp_param_bytes`` column admits ``tp = 1`` only; a missing ``tp_flop_fraction``,
``tp_activation_bytes``, ``tp_forward_bytes`` or ``tp_backward_bytes`` counts as 0.

FSDP (``fsdp`` shards inside a replica) under a pipeline keeps each stage's parameters and gradients unsharded for
the whole step, with the sharded parameters beside them and the optimizer state sharded ``fsdp`` ways
(:func:`~pipeswift_lab.core.layout.state_bytes_per_rank`): :func:`fsdp_factors` scales a stage's weights and
optimizer state, and FSDP keeps no data-parallel gradient buckets. Its one reduce-scatter, after the last backward,
copies the unsharded gradients into the collective's input while they are still held, beside the weights, the
optimizer state and the boundary buffers, the activations gone (:func:`reduce_scatter_moment`): that moment may be a
rank's peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..core.layout import state_bytes_per_rank
from ..core.link import Link
from ..core.memory_model import StageBytes
from ..core.peak_forms import STAGE_FIELDS, StageFields
from ..core.precision import OPTIMIZER_STATES, PRECISIONS
from ..profiling.tp_rank import tp_table
from .costs import MicrobatchCosts

__all__ = [
    "TP_COLUMNS",
    "fsdp_factors",
    "fsdp_fields",
    "fsdp_stage_bytes",
    "fsdp_state_ratio",
    "has_tp_columns",
    "reduce_scatter_moment",
    "tp_costs",
    "tp_table",
]

#: The profile's tensor-parallel columns (per layer, per micro-batch at the profiled size).
TP_COLUMNS = ("tp_param_bytes", "tp_activation_bytes", "tp_flop_fraction", "tp_forward_bytes", "tp_backward_bytes")


def has_tp_columns(table: pd.DataFrame) -> bool:
    """Whether a per-layer table says what tensor parallelism shards (its ``tp_param_bytes`` column)."""
    return "tp_param_bytes" in table.columns


def tp_costs(costs: MicrobatchCosts, tp: int, link: Link, sequence_parallel: bool = False) -> MicrobatchCosts:
    """``costs`` as one of ``tp`` tensor-parallel ranks sees them (:func:`tp_table` of every profiled table), its
    collectives on ``link``, with ``sequence_parallel`` or without. Returns ``costs`` itself when ``tp == 1``."""
    if tp == 1:
        return costs
    out = costs.derived(lambda df: tp_table(df, tp, link, sequence_parallel))
    out.metas = {b: _tp_meta(meta, tp) for b, meta in costs.metas.items()}
    return out


def _tp_meta(meta: dict, tp: int) -> dict:
    """A profile's ``meta`` on one of ``tp`` ranks: the loss's bytes divided where its cross-entropy is
    vocabulary-parallel (``meta["loss_vocab_parallel"]``, an analytic profile's: Megatron-LM's), whole otherwise
    (the runner's loss, which the last stage computes on the gathered logits)."""
    if not meta.get("loss_vocab_parallel"):
        return meta
    out = dict(meta)
    for key in ("loss_activation_bytes", "loss_transient_bytes"):
        if isinstance(out.get(key), (int, float)):
            out[key] = out[key] / tp
    return out


def fsdp_factors(fsdp: int) -> dict[str, float]:
    """``{"weights", "grads", "optimizer"}``: what one process of ``fsdp`` shards holds of a stage's weights,
    gradients and optimizer state, per byte of each unsharded (:func:`~pipeswift_lab.core.layout.state_bytes_per_rank`
    of one byte): ``1 + 1/fsdp``, 1 and ``1/fsdp`` (1, 1, 1 without FSDP)."""
    if fsdp == 1:
        return {"weights": 1.0, "grads": 1.0, "optimizer": 1.0}
    return state_bytes_per_rank(1.0, 0.0, fsdp=fsdp, weight_factor=1.0, grad_factor=1.0, optimizer_factor=1.0)


def fsdp_fields(fields: StageFields, fsdp: int) -> StageFields:
    """The stage fields ``fields`` (computed without FSDP and without gradient buckets) as one of ``fsdp`` shards
    holds them: weights and optimizer state scaled by :func:`fsdp_factors`. Returns ``fields`` itself at ``fsdp ==
    1``."""
    if fsdp == 1:
        return fields
    factors = fsdp_factors(fsdp)
    values = fields.values.copy()
    for name in ("weights", "optimizer"):
        values[STAGE_FIELDS.index(name)] *= factors[name]
    return StageFields(values)


def reduce_scatter_moment(fields: StageFields, placement: Sequence[int], P: int, m: int) -> np.ndarray:
    """Per rank, the bytes it holds as FSDP reduce-scatters its gradients (``fields`` already as one of the shards
    holds them, :func:`fsdp_fields`): weights, optimizer state, the ``m`` micro-batches' boundary buffers and twice
    the unsharded gradients. Returns a ``(P,)`` array."""

    def field(name: str) -> np.ndarray:
        return fields.values[STAGE_FIELDS.index(name)]

    held = field("weights") + field("optimizer") + 2 * field("grads")
    held = held + m * (field("recv") + field("grad_recv") + field("batch"))
    return np.bincount(np.asarray(placement), weights=held, minlength=P)


def fsdp_stage_bytes(stages: Sequence[StageBytes], fsdp: int) -> list[StageBytes]:
    """:func:`fsdp_fields` for a list of :class:`~pipeswift_lab.core.memory_model.StageBytes` (the replay's form).
    Returns a new list."""
    factors = fsdp_factors(fsdp)
    return [
        dataclasses.replace(s, weights=s.weights * factors["weights"], optimizer=s.optimizer * factors["optimizer"])
        for s in stages
    ]


def fsdp_state_ratio(precision: str | None, optimizer: str, fsdp: int) -> float:
    """A stage's training state (weights, gradients, optimizer state and master weights) under ``fsdp`` shards over
    the same without FSDP, for ``precision`` and ``optimizer`` (the same for every layer). Returns a float (1 at
    ``fsdp == 1``)."""
    if fsdp == 1:
        return 1.0
    k = OPTIMIZER_STATES[optimizer]
    if precision is None:
        weights, grads, state = 1.0, 1.0, float(k)
    else:
        spec = PRECISIONS[precision]
        weights, grads, state = spec.weight_bytes, spec.grad_bytes, spec.master_bytes + k * spec.state_bytes
    factors = fsdp_factors(fsdp)
    sharded = weights * factors["weights"] + grads * factors["grads"] + state * factors["optimizer"]
    return float(sharded / (weights + grads + state))
