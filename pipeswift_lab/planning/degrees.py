"""Which tensor-parallel and FSDP degrees a plan weighs, and the network it prices their collectives on: the
``topology``, ``tp`` and ``fsdp`` arguments of :func:`~pipeswift_lab.planning.planner.plan`, checked once.

* Without any of the three, the plan weighs ``tp = fsdp = 1`` alone: the search of pipelines × replicas it always
  made (a plan without a topology does not know where its nodes end, and a layout's price depends on it).
* With a ``topology`` (or ``tp=`` or ``fsdp=``), ``None`` means every degree that fits: ``tp`` every divisor of the
  node's GPUs that the profile allows (its ``meta["tp_divides"]``: attention heads, key/value heads and every
  sharded dimension must divide by ``tp``; ``tp = 1`` alone without a ``tp_param_bytes`` column); ``fsdp`` every
  power of two that divides the global batch, within the GPUs (1 alone under a ZeRO-1 ``precision``, whose
  replicas shard the optimizer state already).
* Without a ``topology``, the collectives of a layout run on :data:`DEFAULT_TOPOLOGY`'s nodes of 8 GPUs, its
  inter-node link the ``dp_link`` (the network the replicas' all-reduce has always been priced on).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.checks import check_flag, check_int
from ..core.link import Link
from ..core.precision import PRECISIONS
from ..core.topology import DEFAULT_INTRA_NODE_LINK, Topology, check_topology
from .costs import MicrobatchCosts
from .sharding import has_tp_columns

__all__ = ["DEFAULT_GPUS_PER_NODE", "Degrees", "allowed_tp", "check_degrees", "default_topology"]

#: GPUs per node of the topology a plan without one prices tensor-parallel and FSDP collectives on (an 8-GPU node,
#: the HGX/DGX form).
DEFAULT_GPUS_PER_NODE = 8


def default_topology(dp_link: Link) -> Topology:
    """The topology of a plan given none: nodes of :data:`DEFAULT_GPUS_PER_NODE` GPUs linked inside by
    :data:`~pipeswift_lab.core.topology.DEFAULT_INTRA_NODE_LINK` and between them by ``dp_link``."""
    return Topology(DEFAULT_GPUS_PER_NODE, intra_node=DEFAULT_INTRA_NODE_LINK, inter_node=dp_link)


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """The layouts a plan weighs beside ``P`` and ``D``, checked by :func:`check_degrees`."""

    tp: tuple[int, ...]
    """Tensor-parallel degrees, ascending."""
    fsdp: tuple[int, ...]
    """FSDP shard degrees, ascending."""
    topology: Topology | None
    """The topology given (None: none)."""
    network: Topology
    """The topology the collectives are priced on: ``topology``, or :func:`default_topology`."""
    sequence_parallel: bool = False
    """Whether ``tp > 1`` layouts run with sequence parallelism (:mod:`~pipeswift_lab.core.sequence_parallel`)."""

    @property
    def three_d(self) -> bool:
        """Whether the plan weighs more than pipelines × replicas (a topology, or a degree other than 1)."""
        return self.topology is not None or self.tp != (1,) or self.fsdp != (1,)


def allowed_tp(costs: MicrobatchCosts) -> tuple[set[int] | None, str]:
    """``(degrees, why)``: the tensor-parallel degrees the profile allows (None: any) and what limits them."""
    if not all(has_tp_columns(t) for t in costs.tables.values()):
        return {1}, "the profile has no tp_param_bytes column (profile a model with a tensor-parallel plan)"
    sizes: list[int] = []
    for meta in costs.metas.values():
        value: Any = meta.get("tp_divides")
        if value is None:
            continue
        items = list(value.values()) if isinstance(value, dict) else list(value)
        sizes += [check_int(f"profile.meta['tp_divides'][{i}]", x, minimum=1) for i, x in enumerate(items)]
    common = math.gcd(*sizes) if sizes else 0
    if common == 0:
        return None, ""
    return {d for d in range(1, common + 1) if common % d == 0}, f"profile.meta['tp_divides']={sorted(set(sizes))}"


def _given(name: str, values: Any) -> tuple[int, ...] | None:
    """``values`` (an int or ints) checked, deduplicated and ascending; None when None."""
    if values is None:
        return None
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an int, a sequence of ints or None; got {type(values).__name__} {values!r}")
    out = sorted({check_int(f"{name}[{i}]", x, minimum=1) for i, x in enumerate(values)})
    if not out:
        raise ValueError(f"{name} is empty; give at least one degree, or None for every degree that fits")
    return tuple(out)


def check_degrees(
    *,
    tp: Any,
    fsdp: Any,
    topology: Any,
    costs: MicrobatchCosts,
    gpus: int,
    global_batch: int,
    precision: str | None,
    dp_link: Link,
    sequence_parallel: bool = False,
) -> Degrees:
    """The checked ``tp`` and ``fsdp`` degrees and topology of a plan (the module docs give the defaults). Raises
    ``TypeError``/``ValueError`` naming the argument: a ``tp`` that spans nodes or that the profile does not allow,
    a degree beyond the GPUs, FSDP under a ZeRO-1 precision."""
    topology = check_topology(topology)
    tp_given, fsdp_given = _given("tp", tp), _given("fsdp", fsdp)
    network = topology if topology is not None else default_topology(dp_link)
    three_d = topology is not None or tp_given is not None or fsdp_given is not None
    allowed, why = allowed_tp(costs)
    if tp_given is None:
        node = network.gpus_per_node
        tp_given = tuple(
            d
            for d in range(1, node + 1)
            if three_d and node % d == 0 and d <= gpus and (allowed is None or d in allowed)
        ) or (1,)
    for value in tp_given:
        network.check_tp(value, "tp")
        if allowed is not None and value not in allowed:
            raise ValueError(f"tp={value} is not allowed: {why}; tp can be one of {sorted(allowed)}")
        if value > gpus:
            raise ValueError(f"tp={value} exceeds gpus={gpus}; a tensor-parallel group needs tp GPUs")
    sharded = precision is not None and PRECISIONS[precision].sharded
    if fsdp_given is None:
        fsdp_given = (
            tuple(2**k for k in range(40) if 2**k <= min(gpus, global_batch) and global_batch % 2**k == 0)
            if three_d and not sharded
            else (1,)
        )
    for value in fsdp_given:
        if value > gpus:
            raise ValueError(f"fsdp={value} exceeds gpus={gpus}; an FSDP group needs fsdp GPUs")
        if global_batch % value:
            raise ValueError(
                f"fsdp={value} does not divide global_batch={global_batch}: every FSDP shard reads its own slice "
                f"of the batch"
            )
        if value > 1 and sharded:
            raise ValueError(
                f"fsdp={value} with precision={precision!r}: FSDP shards the optimizer state itself; give "
                f"precision='bf16-mixed' with fsdp > 1, or fsdp=1 with the ZeRO-1 precision"
            )
    check_flag("sequence_parallel", sequence_parallel)
    if sequence_parallel:
        refusing = [meta for meta in costs.metas.values() if meta.get("sequence_parallel") is not True]
        if refusing or not costs.metas:
            raise ValueError(
                "sequence_parallel=True needs a profile whose tensor-parallel plan allows it (profile.meta"
                "['sequence_parallel'] is True: every parameter of a layer inside the plan's regions or in a norm, "
                "each region in a submodule); this profile's does not"
            )
    return Degrees(
        tp=tp_given, fsdp=fsdp_given, topology=topology, network=network, sequence_parallel=sequence_parallel
    )
