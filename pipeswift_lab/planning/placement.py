"""Where a layout's groups sit and what their collectives cost per step: the terms of a step beside the pipeline.

A layout ``(P, D, fsdp, tp)`` is meshed ``(pp, dp, fsdp, tp)`` (:mod:`pipeswift_lab.core.layout`); each group's
link comes from the plan's topology (:meth:`~pipeswift_lab.core.topology.Topology.link_of`):

* the pipeline's sends: ``link`` when given, else the topology's link of the ``pp`` groups when a topology is
  given, else free (the planner's behaviour without one);
* the replicas' gradient all-reduce: ``dp_link`` when given or when no topology is, else the topology's link of the
  ``dp`` groups;
* FSDP's all-gather and reduce-scatter: the ``fsdp`` groups' link (inside a node when ``fsdp · tp`` divides its
  GPUs), on the plan's topology (without one, :func:`~pipeswift_lab.planning.degrees.default_topology`, whose
  inter-node link is ``dp_link``);
* tensor parallelism: inside a node, always.

Per step, beside the simulated pipeline (which holds the tensor-parallel collectives, :mod:`.sharding`):

* ``fsdp == 1``: the replicas all-reduce the busiest rank's gradients once the pipeline drains (the planner's
  ``allreduce_ms`` as it always was);
* ``fsdp > 1``: FSDP all-gathers the busiest rank's parameters (one tensor-parallel rank's share) once before the
  step's first forward and reduce-scatters its gradients once after its last backward (``fsdp_ms``); neither is
  overlapped with the pipeline's first forward or last backward (the planner assumes FSDP2 under
  ``torch.distributed.pipelining``: the all-gather waits for nothing to overlap with, the reduce-scatter runs at
  ``REDUCE_GRAD`` after the schedule); with ``D > 1`` (HSDP) the replicas then all-reduce the ``1 / fsdp`` of the
  gradients each holds;
* the optimizer step streams the busiest rank's state, ``1 / fsdp`` of it under FSDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.costs import allreduce_ms
from ..core.link import Link
from ..core.precision import OPTIMIZER_STATES, PRECISIONS, checkpoint_bytes_per_param, grad_bytes_per_param
from ..core.topology import Topology, all_gather_ms, all_reduce_ms, reduce_scatter_ms

if TYPE_CHECKING:
    from .inputs import PlanInputs

__all__ = [
    "OPTIMIZER_TRAFFIC_FACTOR",
    "Mesh",
    "collective_terms",
    "dp_link_of",
    "layout_name",
    "network_of",
    "pipeline_link",
    "pipeline_link_of",
]

#: Bytes the Adam step reads and writes per byte of parameters: parameter, gradient and two
#: moments read, parameter and two moments written.
OPTIMIZER_TRAFFIC_FACTOR = 7.0

#: A layout's mesh: ``(P, D, fsdp, tp)``.
Mesh = tuple[int, int, int, int]


def layout_name(P: int, D: int, fsdp: int = 1, tp: int = 1) -> str:
    """``P4×D2`` (``P4×D2×fsdp4×tp8`` where FSDP or tensor parallelism is used): a layout's part of a label."""
    return f"P{P}×D{D}" + (f"×fsdp{fsdp}" if fsdp > 1 else "") + (f"×tp{tp}" if tp > 1 else "")


def network_of(inputs: PlanInputs) -> Topology | None:
    """The topology the plan prices tensor-parallel and FSDP collectives on (None in a search of ``tp = fsdp = 1``
    without a topology, which has none)."""
    return inputs.degrees.network if inputs.degrees is not None else None


def pipeline_link(link: Link | None, topology: Topology | None, layout: Mesh) -> Link | None:
    """The link of the pipeline's sends in ``layout``: ``link`` when given, else the ``topology``'s ``pp`` link when
    one is given, else None (free)."""
    if link is not None or topology is None:
        return link
    P, D, fsdp, tp = layout
    return topology.link_of("pp", P=P, D=D, fsdp=fsdp, tp=tp) if P > 1 else None


def pipeline_link_of(inputs: PlanInputs, layout: Mesh) -> Link | None:
    """:func:`pipeline_link` of the plan's ``link`` and topology."""
    return pipeline_link(inputs.link, inputs.topology, layout)


def dp_link_of(inputs: PlanInputs, layout: Mesh) -> Link:
    """The link of the replicas' all-reduce in ``layout``: ``dp_link`` when given or without a topology, else the
    topology's ``dp`` link."""
    topology = inputs.topology
    if inputs.given_dp_link is not None or topology is None:
        return inputs.dp_link
    P, D, fsdp, tp = layout
    return topology.link_of("dp", P=P, D=D, fsdp=fsdp, tp=tp)


def _bytes_per_param(inputs: PlanInputs) -> tuple[float, float]:
    """``(weights, gradients)`` bytes per profiled parameter byte, or per parameter under a named precision."""
    if inputs.precision is None:
        return 1.0, 1.0
    return float(PRECISIONS[inputs.precision].weight_bytes), grad_bytes_per_param(inputs.precision)


def collective_terms(inputs: PlanInputs, layout: Mesh, rank_param_bytes: float, rank_params: float) -> dict[str, Any]:
    """The step's terms beside the pipeline of ``layout`` whose busiest rank holds ``rank_param_bytes`` (in the
    profile's dtype) and ``rank_params`` parameters of one tensor-parallel rank: ``allreduce_ms``, ``fsdp_ms``,
    ``optimizer_ms`` and ``_shard_bytes`` (what that rank writes to a checkpoint), as the module docs say. Returns a
    dict."""
    P, D, fsdp, tp = layout
    per_param = rank_param_bytes if inputs.precision is None else rank_params
    weight_factor, grad_factor = _bytes_per_param(inputs)
    grad_bytes, weight_bytes = per_param * grad_factor, per_param * weight_factor
    if inputs.precision is None:
        shard_bytes = rank_param_bytes * (1.0 + OPTIMIZER_STATES[inputs.optimizer])
    else:
        shard_bytes = rank_params * checkpoint_bytes_per_param(inputs.precision, inputs.optimizer, D)
    dp_link = dp_link_of(inputs, layout)
    if fsdp == 1:
        fsdp_ms = 0.0
        dp_ms = allreduce_ms(grad_bytes, D, dp_link.bandwidth_GBps, dp_link.latency_ms)
    else:
        network = network_of(inputs)
        assert network is not None  # fsdp > 1 is weighed in a search with degrees
        link = network.link_of("fsdp", P=P, D=D, fsdp=fsdp, tp=tp)
        fsdp_ms = all_gather_ms(weight_bytes, fsdp, link) + reduce_scatter_ms(grad_bytes, fsdp, link)
        dp_ms = all_reduce_ms(grad_bytes / fsdp, D, dp_link)
        shard_bytes /= fsdp
    return {
        "allreduce_ms": dp_ms,
        "fsdp_ms": fsdp_ms,
        "optimizer_ms": OPTIMIZER_TRAFFIC_FACTOR * rank_param_bytes / fsdp / (inputs.mem_GBps * 1e6),
        "_shard_bytes": shard_bytes,
    }
