"""Where a job's processes sit: nodes of ``gpus_per_node`` GPUs, a fast link inside a node and a slower one between
nodes; and what the collectives of a group of ranks cost on a link.

A job of ``P · D · fsdp · tp`` processes is meshed ``(pp, dp, fsdp, tp)``, ``tp`` fastest
(:mod:`pipeswift_lab.core.layout`), and its global ranks fill the nodes in order. A group of one mesh dimension
(the ``n`` ranks that differ only in that coordinate) is ``n`` ranks ``stride`` apart: ``tp`` adjacent ranks, an
``fsdp`` group ``tp`` apart, a ``dp`` group ``fsdp · tp`` apart, a ``pp`` group ``D · fsdp · tp`` apart. Every group
of a dimension lies inside one node exactly when the job fits one node or ``n · stride`` divides ``gpus_per_node``
(a node boundary inside a block of ``n · stride`` ranks cuts a group); its collectives then run on ``intra_node``,
else on ``inter_node``::

    topo = psl.Topology(8, intra_node=psl.Link(0.002, 450.0), inter_node=psl.Link(0.01, 50.0))
    topo.within_node("fsdp", D=2, fsdp=4, tp=2)  # True: 4 ranks 2 apart, in blocks of 8 ranks, one node each
    topo.link_of("dp", D=2, fsdp=4, tp=2)         # inter_node: the 2 replicas are 8 ranks apart, a node each

Collectives are NCCL's ring algorithms priced on a :class:`~pipeswift_lab.core.link.Link` whose bandwidth is the
bus bandwidth each GPU sustains (Thakur, Rabenseifner and Gropp, *Optimization of Collective Communication
Operations in MPICH*, IJHPCA 2005, §4; NCCL's ``nccl-tests/doc/PERFORMANCE.md``, which converts a collective's
time to this "bus bandwidth" by the same factors): over ``n`` ranks, on ``B`` bytes (the whole buffer, not one
rank's shard)

* all-reduce: ``2 (n-1)/n · B / bandwidth + 2 (n-1) · latency`` (a reduce-scatter then an all-gather);
* all-gather and reduce-scatter: ``(n-1)/n · B / bandwidth + (n-1) · latency``;

each ring step paying the link's latency once. None of them costs anything on one rank.

Those are NCCL's algorithms. A CPU run's collectives ride gloo, whose algorithms differ
(:func:`collective_shape`): gloo's reduce-scatter reduces the whole buffer on every rank and keeps its shard (it
costs an all-reduce), and an all-to-all over DTensor on CPU is an all-gather of every rank's whole input. Its
timings do not carry over to NCCL: :func:`collective_ms` prices a collective in the shape of the backend that runs
it, on a link fitted for that backend (``Calibration.links``) or on the Topology's links for NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import check_choice, check_int, check_time
from .link import Link

__all__ = [
    "BACKEND_SHAPES",
    "COLLECTIVES",
    "DEFAULT_INTER_NODE_LINK",
    "DEFAULT_INTRA_NODE_LINK",
    "MESH_STRIDES",
    "Topology",
    "all_gather_ms",
    "all_reduce_ms",
    "check_topology",
    "collective_ms",
    "collective_shape",
    "reduce_scatter_ms",
]

#: Inside a node when none is given: NVLink 4 of an H100 SXM node, 450 GB/s each way per GPU (NVIDIA's H100
#: datasheet: 900 GB/s of NVLink bandwidth per GPU, both directions) with 2 µs per ring step (an assumption of the
#: order of NCCL's per-hop latency inside a node; calibrate it on your own machines).
DEFAULT_INTRA_NODE_LINK = Link(latency_ms=0.002, bandwidth_GBps=450.0)
#: Between nodes when none is given: a 200 Gb/s network per GPU (25 GB/s) with 10 µs per step, the planner's
#: data-parallel link (:data:`pipeswift_lab.planning.inputs.DEFAULT_DP_LINK`).
DEFAULT_INTER_NODE_LINK = Link(latency_ms=0.01, bandwidth_GBps=25.0)
#: The mesh dimensions whose groups a topology places, outermost first.
MESH_STRIDES = ("pp", "dp", "fsdp", "tp")


@dataclass(frozen=True)
class Topology:
    """Nodes of ``gpus_per_node`` GPUs: ``intra_node`` links the GPUs of one node, ``inter_node`` the nodes;
    bandwidths are per GPU (what one GPU sustains in a collective, NCCL's bus bandwidth).

    * ``gpus_per_node`` — GPUs in one node (``>= 1``); a tensor-parallel group never spans nodes, so ``tp`` must
      divide it;
    * ``intra_node`` — the :class:`~pipeswift_lab.Link` inside a node (default :data:`DEFAULT_INTRA_NODE_LINK`);
    * ``inter_node`` — the :class:`~pipeswift_lab.Link` between nodes (default :data:`DEFAULT_INTER_NODE_LINK`).
    """

    gpus_per_node: int
    intra_node: Link = DEFAULT_INTRA_NODE_LINK
    inter_node: Link = DEFAULT_INTER_NODE_LINK

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus_per_node", check_int("gpus_per_node", self.gpus_per_node, minimum=1))
        for name in ("intra_node", "inter_node"):
            value = getattr(self, name)
            if not isinstance(value, Link):
                raise TypeError(f"{name} must be a pipeswift_lab.Link; got {type(value).__name__} {value!r}")

    @staticmethod
    def group(dim: str, *, P: int = 1, D: int = 1, fsdp: int = 1, tp: int = 1) -> tuple[int, int]:
        """``(ranks, stride)`` of a group of mesh dimension ``dim`` (``"pp"``, ``"dp"``, ``"fsdp"`` or ``"tp"``) in
        a ``P · D · fsdp · tp`` job meshed ``(pp, dp, fsdp, tp)``: its size and the distance between its ranks."""
        dim = check_choice("dim", dim, MESH_STRIDES, noun="mesh dimensions")
        P, D, fsdp, tp = (check_int(n, v, minimum=1) for n, v in (("P", P), ("D", D), ("fsdp", fsdp), ("tp", tp)))
        sizes = {"pp": (P, D * fsdp * tp), "dp": (D, fsdp * tp), "fsdp": (fsdp, tp), "tp": (tp, 1)}
        return sizes[dim]

    def within_node(self, dim: str, *, P: int = 1, D: int = 1, fsdp: int = 1, tp: int = 1) -> bool:
        """Whether every group of mesh dimension ``dim`` lies inside one node: it has one rank, or the job fits one
        node, or its block of ``ranks · stride`` consecutive ranks divides ``gpus_per_node`` (else some node
        boundary cuts a group)."""
        n, stride = self.group(dim, P=P, D=D, fsdp=fsdp, tp=tp)
        return n == 1 or P * D * fsdp * tp <= self.gpus_per_node or self.gpus_per_node % (n * stride) == 0

    def link_of(self, dim: str, *, P: int = 1, D: int = 1, fsdp: int = 1, tp: int = 1) -> Link:
        """The :class:`~pipeswift_lab.Link` the collectives (or, for ``"pp"``, the sends) of mesh dimension ``dim``
        run on: ``intra_node`` where :meth:`within_node`, else ``inter_node``."""
        inside = self.within_node(dim, P=P, D=D, fsdp=fsdp, tp=tp)
        return self.intra_node if inside else self.inter_node

    def check_tp(self, tp: int, name: str = "tp") -> int:
        """``tp`` checked against the node: a tensor-parallel group is ``tp`` adjacent ranks and never spans nodes,
        so ``tp`` must divide ``gpus_per_node``. Returns it; raises ``ValueError`` naming ``name`` otherwise."""
        tp = check_int(name, tp, minimum=1)
        if self.gpus_per_node % tp:
            fits = [d for d in range(1, self.gpus_per_node + 1) if self.gpus_per_node % d == 0]
            raise ValueError(
                f"{name}={tp} does not divide gpus_per_node={self.gpus_per_node}: a tensor-parallel group never spans "
                f"nodes; {name} can be one of {fits}"
            )
        return tp

    def as_dict(self) -> dict[str, Any]:
        """``{"gpus_per_node", "intra_node", "inter_node"}``, the links as :meth:`Link.as_dict` (JSON-friendly)."""
        return {
            "gpus_per_node": self.gpus_per_node,
            "intra_node": self.intra_node.as_dict(),
            "inter_node": self.inter_node.as_dict(),
        }

    def _summary(self) -> Mapping[str, Any]:
        return {
            "gpus_per_node": self.gpus_per_node,
            "intra_node": str(self.intra_node),
            "inter_node": str(self.inter_node),
        }

    def _repr_html_(self) -> str:
        from .display import html_card

        return html_card("Topology", self._summary())

    def __str__(self) -> str:
        from .display import text_card

        return text_card("Topology", self._summary())


def check_topology(topology: Any, name: str = "topology") -> Topology | None:
    """Return ``topology`` if it is a :class:`Topology` or None; raise ``TypeError`` naming ``name`` otherwise."""
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"{name} must be a pipeswift_lab.Topology (e.g. Topology(gpus_per_node=8)) or None; got "
            f"{type(topology).__name__} {topology!r}"
        )
    return topology


def _ring(nbytes: float, n: int, link: Link, rounds: int) -> float:
    """``rounds`` passes of a ring over ``n`` ranks: ``rounds (n-1)/n · nbytes / bandwidth + rounds (n-1) ·
    latency``, in ms."""
    nbytes = check_time("nbytes", nbytes)
    n = check_int("n", n, minimum=1)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a pipeswift_lab.Link; got {type(link).__name__} {link!r}")
    if n == 1:
        return 0.0
    steps = rounds * (n - 1)
    return steps / n * nbytes / (link.bandwidth_GBps * 1e6) + steps * link.latency_ms


def all_reduce_ms(nbytes: float, n: int, link: Link) -> float:
    """Milliseconds of a ring all-reduce of ``nbytes`` over ``n`` ranks on ``link``:
    ``2 (n-1)/n · nbytes / bandwidth + 2 (n-1) · latency`` (0 on one rank; the module docs cite the model)."""
    return _ring(nbytes, n, link, 2)


def all_gather_ms(nbytes: float, n: int, link: Link) -> float:
    """Milliseconds of a ring all-gather that leaves ``nbytes`` (the whole, ``nbytes / n`` from each rank) on each
    of ``n`` ranks: ``(n-1)/n · nbytes / bandwidth + (n-1) · latency`` (0 on one rank)."""
    return _ring(nbytes, n, link, 1)


def reduce_scatter_ms(nbytes: float, n: int, link: Link) -> float:
    """Milliseconds of a ring reduce-scatter of ``nbytes`` on each of ``n`` ranks into one ``nbytes / n`` shard
    each: ``(n-1)/n · nbytes / bandwidth + (n-1) · latency`` (0 on one rank)."""
    return _ring(nbytes, n, link, 1)


#: The collectives :func:`collective_ms` prices.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: How each backend runs each collective over ``n`` ranks: ``(passes, volume)``, a ring of ``passes · (n-1)`` steps
#: that moves ``passes · volume · (n-1)/n`` of the whole buffer through each rank's link. NCCL: the rings of the
#: module docs (an all-to-all sends each peer its ``1/n``, ``n-1`` steps). gloo: the same all-reduce and all-gather;
#: its reduce-scatter is an all-reduce of the whole buffer (2 passes), and DTensor's all-to-all on CPU an all-gather of
#: every rank's whole input (``n`` times the buffer).
BACKEND_SHAPES: dict[str, dict[str, tuple[int, int | None]]] = {
    "nccl": {"all_reduce": (2, 1), "all_gather": (1, 1), "reduce_scatter": (1, 1), "all_to_all": (1, 1)},
    "gloo": {"all_reduce": (2, 1), "all_gather": (1, 1), "reduce_scatter": (2, 1), "all_to_all": (1, None)},
}


def collective_shape(collective: str, n: int, backend: str = "nccl") -> tuple[float, float]:
    """``(steps, factor)`` of ``collective`` over ``n`` ranks as ``backend`` runs it (:data:`BACKEND_SHAPES`): on a
    link it takes ``steps · latency + factor · nbytes / bandwidth`` for a whole buffer of ``nbytes``; ``(0, 0)`` on
    one rank."""
    backend = check_choice("backend", backend, tuple(BACKEND_SHAPES), noun="backends")
    collective = check_choice("collective", collective, COLLECTIVES, noun="collectives")
    n = check_int("n", n, minimum=1)
    passes, volume = BACKEND_SHAPES[backend][collective]
    if n == 1:
        return 0.0, 0.0
    return float(passes * (n - 1)), passes * (n if volume is None else volume) * (n - 1) / n


def collective_ms(collective: str, nbytes: float, n: int, link: Link, backend: str = "nccl") -> float:
    """Milliseconds of ``collective`` (one of :data:`COLLECTIVES`) on a whole buffer of ``nbytes`` over ``n`` ranks
    on ``link``, in ``backend``'s shape (:func:`collective_shape`; ``"nccl"``: :func:`all_reduce_ms`,
    :func:`all_gather_ms`, :func:`reduce_scatter_ms`)."""
    nbytes = check_time("nbytes", nbytes)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a pipeswift_lab.Link; got {type(link).__name__} {link!r}")
    steps, factor = collective_shape(collective, n, backend)
    return steps * link.latency_ms + factor * nbytes / (link.bandwidth_GBps * 1e6)
