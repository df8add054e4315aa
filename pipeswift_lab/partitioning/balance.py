"""Stage splits of a profiled model: uniform, by parameters, or time-balanced, within each GPU's memory.

A pipeline cuts a model's ``L`` layers into ``K = P * v`` contiguous stages, ``v`` per rank.
:func:`partition` offers three methods:

* ``"uniform"`` — equal layer counts, the remainder spread over the first stages;
* ``"params"`` — the contiguous split minimizing the largest stage's parameter count;
* ``"balanced"`` — the contiguous split minimizing the slowest stage's forward+backward time,
  plus, with a :class:`~pipeswift_lab.core.link.Link`, the transfers the stage sends (its output
  activation forward, the gradient of its input backward). This is the linear-partition
  (bottleneck) problem (Bokhari, *Partitioning problems in parallel, pipelined and
  distributed computing*, IEEE Trans. Computers 1988); torchgpipe's ``balance_by_time``
  (Kim et al., *torchgpipe*, 2020) solves it for additive costs. Here it is solved
  **exactly** also with boundary transfers and memory caps: a bisection over the
  bottleneck ``T`` whose feasibility test is a reachability DP over prefixes (stage ``k``
  can end at layer ``b`` if some valid start ``a`` is reachable with ``k - 1`` stages and
  ``cost(a, b) <= T``); a stage cost is ``U[b] - D[a]`` so the test is a prefix maximum,
  ``O(K * L)`` numpy work. The bisection stops when the float just below the best
  bottleneck found is infeasible, which certifies optimality. Among optimal splits, the
  one returned keeps every stage close to the average of what precedes it.

With ``v > 1`` the stages go to ranks round-robin (``s % P``), or in a V for
``ZBVZeroBubble``/``DualPipeV`` (rank ``r`` holds stages ``r`` and ``2P-1-r``).

Memory of a stage (bytes): its training state plus ``activation_bytes`` times the
micro-batches its rank holds in flight under the schedule
(:func:`pipeswift_lab.core.analytic.inflight_microbatches`, which needs ``m``). The training state
is set by ``precision`` (:mod:`pipeswift_lab.core.precision`): ``None`` counts the profile's own
bytes, ``param_bytes * (2 + k)`` — weights, gradients and ``k`` copies of optimizer state
(:data:`OPTIMIZER_STATES`: Adam/AdamW keep two moments, ``k = 2``; plain SGD ``k = 0``;
SGD with momentum ``k = 1``); ``"fp32"`` and ``"bf16-mixed"`` count ``params`` times 16 bytes
with Adam, ``"bf16-mixed-zero1"`` ``4 + 12 / D`` bytes (the master weights and moments
sharded over ``D`` data-parallel replicas). See :mod:`pipeswift_lab.partitioning.memory`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.checks import check_choice, check_int
from ..core.link import Link, check_link
from ..core.precision import state_bytes
from ..core.schedule import ScheduleLike
from .bottleneck import Infeasible, MinMaxSplit
from .layers import Bounds, Layers, capped_split, split
from .memory import (
    DoesNotFit,
    Layout,
    memory_cap,
    memory_windows,
    no_fit_head,
    resolve_layout,
    resolve_m,
)
from .stages import Partition

__all__ = ["METHODS", "partition"]

#: Split methods of :func:`partition`.
METHODS: tuple[str, ...] = ("uniform", "params", "balanced")


def partition(
    profile: Any,
    P: int,
    method: str = "balanced",
    *,
    v: int = 1,
    schedule: ScheduleLike | None = None,
    link: Link | None = None,
    mem_per_gpu_bytes: float | None = None,
    optimizer: str = "adam",
    m: int | None = None,
    precision: str | None = None,
    D: int = 1,
) -> Partition:
    """Split a profiled model into ``P * v`` contiguous stages; return a :class:`Partition`.

    ``profile`` is a :class:`pipeswift_lab.Profile` or a DataFrame with one row per layer
    (``fwd_ms``, ``bwd_ms``; optional ``wgrad_ms``, ``params``, ``param_bytes``,
    ``activation_bytes``, ``output_bytes``, ``name``, ``layer``). ``method`` is
    ``"uniform"``, ``"params"`` or ``"balanced"`` (exact bottleneck minimization, see the
    module docstring). ``schedule`` fixes the rank placement (V shape for ZBV/DualPipeV)
    and, with ``m`` (default ``P``), the in-flight micro-batches of the memory estimate
    (``None``: 1F1B for ``v == 1``, Interleaved1F1B otherwise). ``link`` adds boundary
    transfers to the balanced objective. With ``mem_per_gpu_bytes`` (per rank; with ``v > 1``
    each stage gets ``mem_per_gpu_bytes / v``), ``"balanced"`` returns the best split that
    fits, and every method raises ``ValueError`` naming the worst stage of the rank whose replayed
    peak is the highest and the smallest P that would fit. ``optimizer`` is one of :data:`OPTIMIZER_STATES`.

    ``precision`` sets the bytes of training state per parameter (with Adam):
    ``None`` (default) — the profile's own ``param_bytes * 4`` (16 B/param for an fp32
    profile); ``"fp32"`` — 16 B/param; ``"bf16-mixed"`` — 16 B/param (bf16 weights and
    gradients, fp32 master weights and moments); ``"bf16-mixed-zero1"`` — ``4 + 12 / D``
    B/param, the master weights and moments sharded over ``D`` data-parallel replicas
    (ZeRO-1). Named precisions need a ``params`` column. See :mod:`pipeswift_lab.core.precision`.
    """
    layers = profile if isinstance(profile, Layers) else Layers(profile)
    P = check_int("P", P, minimum=1)
    method = check_choice("method", method, METHODS, noun="methods")
    layout = resolve_layout(P, v, schedule, m, optimizer, precision, D, n_layers=layers.n)
    state_bytes(layers.params, layers.param_bytes, layout.precision, layout.optimizer, layout.D)  # needs params?
    link = check_link(link)
    limit = memory_cap(mem_per_gpu_bytes)
    if limit is None:
        return _split_partition(layers, layout, method, link, None)
    try:
        return _split_partition(layers, layout, method, link, limit)
    except (Infeasible, DoesNotFit):
        pass
    # no split fits: name the worst stage of the unconstrained split and the smallest P that fits
    free = _split_partition(layers, layout, method, link, None)
    raise ValueError(_memory_error(layers, free, layout, limit, method, link))


def _split_partition(layers: Layers, layout: Layout, method: str, link: Link | None, limit: float | None) -> Partition:
    """The Partition of the ``method`` split of ``layout`` within ``limit`` bytes per GPU (None: no cap).

    The exact solver bounds each stage's steady memory (training state and activations in flight); the rank's
    replayed peak (:meth:`Partition.memory`) adds buffers and transients. When that peak exceeds the cap, the
    solver runs again with the cap lowered by the excess and below what the windows allowed that split, a few times,
    before giving up (:func:`capped_split`)."""
    if limit is None:
        return Partition._of_layout(
            layers, split(layers, layout, method, link, None), layout, link=link, method=method, mem_per_gpu_bytes=None
        )

    def peaks(bounds: Bounds) -> tuple[float, ...]:
        return Partition._of_layout(
            layers, bounds, layout, link=link, method=method, mem_per_gpu_bytes=None
        ).rank_mem_bytes

    bounds = capped_split(layers, layout, method, link, limit, peaks)
    if bounds is None:
        raise DoesNotFit(no_fit_head(limit, method, layout.P, layout.v))
    return Partition._of_layout(layers, bounds, layout, link=link, method=method, mem_per_gpu_bytes=limit)


def _memory_error(layers: Layers, part: Partition, layout: Layout, limit: float, method: str, link: Link | None) -> str:
    """Why no ``method`` split fits ``limit``: the worst stage of the unconstrained split ``part``, and the smallest
    ``P`` that would fit."""
    peaks = part.rank_mem_bytes
    fullest = int(np.argmax(peaks))
    replayed_ok = bool(np.isfinite(peaks[fullest]))
    # the worst stage: on the rank whose replayed peak is the highest (the steady estimate of one stage leaves out
    # buffers and transients, so it can point at a rank that is not the fullest)
    candidates = [s for s in range(part.n_stages) if part.stage_to_rank[s] == fullest] if replayed_ok else []
    worst = max(candidates or range(part.n_stages), key=lambda s: part.stage_mem_bytes[s] - limit / part.v)
    larger = range(part.P + 1, layers.n // part.v + 1)
    smallest = next((P2 for P2 in larger if _fits(layers, layout.with_P(P2), limit, method, link)), None)
    where = f"with m={part.m}" + (f", schedule={part.schedule!r}" if part.schedule else "")
    hint = (
        f"the smallest P that fits ({where}) is {smallest}"
        if smallest
        else f"no P up to {layers.n // part.v} fits ({where}); {_heaviest_layer(layers, layout, limit)}"
    )
    head = no_fit_head(limit, method, part.P, part.v)
    replayed = (
        f"; its rank, {fullest}, the fullest, peaks at {peaks[fullest]:.6g} bytes (Partition.memory() has the terms)"
        if replayed_ok
        else ""
    )
    return f"{head}; in the unconstrained split, {part.describe_stage(worst)}{replayed}. {hint[0].upper() + hint[1:]}."


def _heaviest_layer(layers: Layers, layout: Layout, limit: float) -> str:
    """The layer that needs the most memory alone (a rank holding only it, with as few micro-batches in flight as any
    rank of the layout holds: :func:`~pipeswift_lab.partitioning.rank_memory.rank_memory`; when the step has two
    micro-batches or more, also after a first backward, with the gradients allocated), and how much at least, for
    an error message."""
    from .rank_memory import rank_memory

    if layers.param_bytes is None or layers.activation_bytes is None:
        return "some layer alone exceeds the cap"
    held = max(1, int(np.ceil(min(layout.inflight()))))
    # (schedule, micro-batches): all `held` in flight at the first backward, and one in flight at a later backward
    replays = [("GPipe", held)] + ([("1F1B", 2)] if layout.m >= 2 else [])

    def alone_peak(j: int) -> Any:
        rows = [
            rank_memory(
                layers,
                ((j, j + 1),),
                (0,),
                P=1,
                m=n,
                schedule=schedule,
                precision=layout.precision,
                optimizer=layout.optimizer,
                D=layout.D,
            ).iloc[0]
            for schedule, n in replays
        ]
        return max(rows, key=lambda row: row["predicted_peak_bytes"])

    alone = [alone_peak(j) for j in range(layers.n)]
    j = int(np.argmax([row["predicted_peak_bytes"] for row in alone]))
    row = alone[j]
    verdict = "more than" if row["predicted_peak_bytes"] > limit else "close to"
    terms = ", ".join(
        f"{name} {row[f'{name}_bytes']:.4g}" for name in ("weights", "grads", "optimizer", "activations", "transient")
    )
    return (
        f"layer {j} ({layers.names[j]!r}) alone needs at least {row['predicted_peak_bytes']:.6g} bytes ({held} "
        f"micro-batch{'es' if held > 1 else ''} in flight), {verdict} the cap ({terms}; peak at {row['peak_at']})"
    )


def _fits(layers: Layers, layout: Layout, limit: float, method: str, link: Link | None) -> bool:
    """Whether a ``method`` split of ``layout`` fits ``limit``: for ``"balanced"`` a split the memory windows allow
    whose replayed peaks fit too, for the others their one split, at an ``m`` the schedule takes with ``layout.P``
    ranks."""
    try:
        if method == "balanced":
            zeros = np.zeros(layers.n + 1)
            windows = memory_windows(layers, layout, limit)
            if MinMaxSplit(zeros, zeros, layout.n_stages, windows).reach(0.0) is None:
                return False
            _split_partition(layers, layout, method, link, limit)
            return True
        resolve_m(layout.P, layout.m, layout.schedule, layout.v)
        bounds = split(layers, layout, method, link, None)
        Partition._of_layout(layers, bounds, layout, link=None, method=method, mem_per_gpu_bytes=limit)
        return True
    except (Infeasible, ValueError):
        return False
