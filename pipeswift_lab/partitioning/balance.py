"""Stage splits of a profiled model: uniform, by parameters, or time-balanced; memory per stage.

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
sharded over ``D`` data-parallel replicas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..core.analytic import inflight_microbatches
from ..core.checks import check_int, check_time
from ..core.display import html_card, text_card
from ..core.link import Link, check_link
from ..core.precision import OPTIMIZER_STATES, check_optimizer, check_precision, state_bytes
from ..core.vocabulary import stage_to_rank as _stage_to_rank
from .bottleneck import Infeasible, MinMaxSplit
from .layers import (  # noqa: F401 - OPTIMIZER_STATES, _MEM_RTOL, _Layers and _split re-exported
    _MEM_RTOL,
    _check_bounds,
    _DoesNotFit,
    _Layers,
    _memory_windows,
    _resolve_m,
    _resolve_placement,
    _split,
    _stage_comm_ms,
    rank_totals,
)

#: Split methods of :func:`partition`.
METHODS = ("uniform", "params", "balanced")


# --------------------------------------------------------------------------- Partition
@dataclass(frozen=True)
class Partition:
    """Contiguous stages of a profiled model and what each costs.

    ``bounds`` are half-open ``(start, end)`` layer ranges, one per stage in stage order
    (``P * v`` stages); ``stage_to_rank`` the rank of each stage. Per-stage tuples:
    ``stage_fwd_ms``, ``stage_bwd_ms`` (whole backward), ``stage_wgrad_ms`` (its
    weight-grad part, None when the profile has no split), ``stage_comm_ms`` (transfers the
    stage sends per micro-batch over ``link``; zeros without one), ``stage_params``,
    ``stage_param_bytes``, ``stage_activation_bytes`` (saved per micro-batch),
    ``stage_output_bytes`` (the activation leaving the stage, 0 for the last),
    ``stage_inflight`` (micro-batches its rank holds, the memory multiplier) and
    ``stage_mem_bytes`` (NaN where the profile lacks memory columns).
    """

    bounds: tuple
    P: int
    v: int
    schedule: str | None
    stage_to_rank: tuple
    layer_names: tuple
    stage_fwd_ms: tuple
    stage_bwd_ms: tuple
    stage_wgrad_ms: tuple | None
    stage_comm_ms: tuple
    stage_params: tuple
    stage_param_bytes: tuple
    stage_activation_bytes: tuple
    stage_output_bytes: tuple
    stage_inflight: tuple
    stage_mem_bytes: tuple
    method: str = "manual"
    m: int | None = None
    optimizer: str = "adam"
    link: Link | None = None
    mem_per_gpu_bytes: float | None = None  # the cap it was split under
    precision: str | None = None
    D: int = 1  # data-parallel replicas the optimizer state is sharded over (ZeRO-1)
    stage_state_bytes: tuple = ()  # weights + gradients + optimizer state of each stage (bytes)

    # ---- construction
    @classmethod
    def from_bounds(
        cls,
        profile,
        bounds,
        *,
        v=1,
        schedule=None,
        link=None,
        m=None,
        optimizer="adam",
        mem_per_gpu_bytes=None,
        method="manual",
        precision=None,
        D=1,
    ) -> Partition:
        """Build a Partition from explicit ``bounds``: ``[(start, end), ...]``, one per stage.

        Bounds must be contiguous half-open ranges covering layers ``0..L-1`` with no empty
        stage, and their number must be a multiple of ``v`` (``P = len(bounds) // v``).
        ``m`` (default ``P``) and ``schedule`` set the in-flight micro-batches of the memory
        estimate; with ``mem_per_gpu_bytes`` every rank must fit or a ``ValueError`` names the
        stage that does not. ``precision`` and ``D`` set the bytes of training state per
        parameter (see :func:`partition`). Returns the Partition.
        """
        layers = profile if isinstance(profile, _Layers) else _Layers(profile)
        bounds = _check_bounds(bounds, layers.n)
        v = check_int("v", v, minimum=1)
        if len(bounds) % v:
            raise ValueError(
                f"bounds has {len(bounds)} stages, not a multiple of v={v}; a pipeline of P ranks with v stages each needs P*v stages"
            )
        P = len(bounds) // v
        schedule, v, mem_schedule = _resolve_placement(P, v, schedule)
        m = _resolve_m(P, m, schedule, v)
        optimizer = check_optimizer(optimizer)
        precision, D = check_precision(precision), check_int("D", D, minimum=1)
        link = check_link(link)
        mem_per_gpu_bytes = memory_cap(mem_per_gpu_bytes)
        placement = _stage_to_rank(P, v, schedule)
        inflight_by_rank = inflight_microbatches(P, m, mem_schedule, v=v)
        inflight = tuple(inflight_by_rank[r] for r in placement)

        def sums(values, as_int=False):
            if values is None:
                return tuple(math.nan for _ in bounds)
            out = tuple(float(values[a:b].sum()) for a, b in bounds)
            return tuple(int(round(x)) for x in out) if as_int else out

        out_bytes = tuple(
            float(layers.output_bytes[b - 1]) if (layers.output_bytes is not None and b < layers.n) else 0.0
            for _, b in bounds
        )
        if link is not None and layers.output_bytes is None and len(bounds) > 1:
            raise ValueError(
                "link is given but the profile has no 'output_bytes' column; the transfer of a stage boundary needs the bytes crossing it"
            )
        comm = _stage_comm_ms(bounds, layers, link)
        stage_param_bytes = sums(layers.param_bytes)
        stage_act = sums(layers.activation_bytes)
        stage_state = sums(state_bytes(layers.params, layers.param_bytes, precision, optimizer, D))
        mem = tuple(sb + ab * f for sb, ab, f in zip(stage_state, stage_act, inflight))
        part = cls(
            bounds=bounds,
            P=P,
            v=v,
            schedule=schedule,
            stage_to_rank=placement,
            layer_names=tuple(layers.names[a:b] for a, b in bounds),
            stage_fwd_ms=sums(layers.fwd),
            stage_bwd_ms=sums(layers.bwd),
            stage_wgrad_ms=sums(layers.wgrad) if layers.wgrad is not None else None,
            stage_comm_ms=comm,
            stage_params=sums(layers.params, as_int=True)
            if layers.params is not None
            else tuple(math.nan for _ in bounds),
            stage_param_bytes=stage_param_bytes,
            stage_activation_bytes=stage_act,
            stage_output_bytes=out_bytes,
            stage_inflight=inflight,
            stage_mem_bytes=mem,
            method=method,
            m=m,
            optimizer=optimizer,
            link=link,
            mem_per_gpu_bytes=mem_per_gpu_bytes,
            precision=precision,
            D=D,
            stage_state_bytes=stage_state,
        )
        if mem_per_gpu_bytes is not None:
            part._check_fits(mem_per_gpu_bytes)
        return part

    def _check_fits(self, limit):
        if any(math.isnan(x) for x in self.stage_mem_bytes):
            raise ValueError(
                "mem_per_gpu_bytes is given but the profile lacks 'param_bytes' or 'activation_bytes'; memory per stage is unknown"
            )
        ranks = self.rank_mem_bytes
        for r, need in enumerate(ranks):
            if need > limit * (1 + _MEM_RTOL):
                stages = [s for s, rr in enumerate(self.stage_to_rank) if rr == r]
                worst = max(stages, key=lambda s: self.stage_mem_bytes[s])
                raise _DoesNotFit(
                    f"mem_per_gpu_bytes={limit:.6g}: rank {r} needs {need:.6g} bytes; {self.describe_stage(worst)}"
                )

    # ---- derived values
    @property
    def n_stages(self) -> int:
        """Number of stages, ``P * v``."""
        return len(self.bounds)

    @property
    def n_layers(self) -> int:
        """Number of layers covered."""
        return self.bounds[-1][1]

    @property
    def stage_ms(self) -> tuple:
        """Forward plus backward compute time of each stage for one micro-batch (ms)."""
        return tuple(f + b for f, b in zip(self.stage_fwd_ms, self.stage_bwd_ms))

    @property
    def stage_cost_ms(self) -> tuple:
        """What ``"balanced"`` minimizes the maximum of: ``stage_ms`` plus ``stage_comm_ms``."""
        return tuple(t + c for t, c in zip(self.stage_ms, self.stage_comm_ms))

    @property
    def bottleneck_ms(self) -> float:
        """The slowest stage's ``stage_cost_ms``."""
        return max(self.stage_cost_ms)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage (``stage_ms``); 1.0 is perfect balance."""
        times = self.stage_ms
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    @property
    def rank_mem_bytes(self) -> tuple:
        """Memory of each rank: the sum of its stages' ``stage_mem_bytes``."""
        return tuple(rank_totals(self.stage_mem_bytes, self.stage_to_rank, self.P))

    def describe_stage(self, s: int) -> str:
        """One sentence on stage ``s``: its layers and its memory, for error messages."""
        a, b = self.bounds[s]
        names = self.layer_names[s]
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        static = self.stage_state_bytes[s]
        act = self.stage_activation_bytes[s]
        state = f"{self.optimizer} state" + (
            ""
            if self.precision is None
            else f" ({self.precision}" + (f", D={self.D})" if self.precision.endswith("zero1") else ")")
        )
        return (
            f"stage {s} (layers {a}..{b - 1}: {span}, rank {self.stage_to_rank[s]}) needs {self.stage_mem_bytes[s]:.6g} bytes = "
            f"{static:.6g} parameters+gradients+{state} + {act:.6g} activation bytes x {self.stage_inflight[s]:g} micro-batches in flight"
        )

    @property
    def df(self) -> pd.DataFrame:
        """One row per stage: bounds, rank, layer names, times, parameters, memory."""
        rows = []
        for s, (a, b) in enumerate(self.bounds):
            rows.append(
                {
                    "stage": s,
                    "rank": self.stage_to_rank[s],
                    "start": a,
                    "end": b,
                    "n_layers": b - a,
                    "first_layer": self.layer_names[s][0],
                    "last_layer": self.layer_names[s][-1],
                    "fwd_ms": self.stage_fwd_ms[s],
                    "bwd_ms": self.stage_bwd_ms[s],
                    "wgrad_ms": self.stage_wgrad_ms[s] if self.stage_wgrad_ms is not None else math.nan,
                    "stage_ms": self.stage_ms[s],
                    "comm_ms": self.stage_comm_ms[s],
                    "params": self.stage_params[s],
                    "param_bytes": self.stage_param_bytes[s],
                    "state_bytes": self.stage_state_bytes[s],
                    "activation_bytes": self.stage_activation_bytes[s],
                    "output_bytes": self.stage_output_bytes[s],
                    "inflight": self.stage_inflight[s],
                    "mem_bytes": self.stage_mem_bytes[s],
                }
            )
        return pd.DataFrame(rows)

    def stage_table(self) -> pd.DataFrame:
        """The per-stage input of :func:`pipeswift_lab.simulation.simulator`: ``fwd_ms``, ``bwd_ms`` (+ ``wgrad_ms``), bytes."""
        cols = ["fwd_ms", "bwd_ms", "output_bytes", "activation_bytes"] + (
            ["wgrad_ms"] if self.stage_wgrad_ms is not None else []
        )
        return self.df[cols]

    # ---- display
    def plot(self, ax=None):
        """Stacked bars of each stage's forward, backward (and transfer) time, with the mean. Returns the Axes."""
        from ..core.plot import KIND_COLORS, get_ax

        ax = get_ax(ax, figsize=(max(4.0, 0.5 * self.n_stages + 2.5), 3.2))
        x = np.arange(self.n_stages)
        fwd, bwd, comm = np.array(self.stage_fwd_ms), np.array(self.stage_bwd_ms), np.array(self.stage_comm_ms)
        ax.bar(x, fwd, color=KIND_COLORS["F"], label="forward")
        ax.bar(x, bwd, bottom=fwd, color=KIND_COLORS["B"], label="backward")
        if comm.any():
            ax.bar(x, comm, bottom=fwd + bwd, color=KIND_COLORS["SEND_F"], label="transfer")
        mean = float(np.mean(fwd + bwd + comm))
        ax.axhline(mean, color="0.3", ls="--", lw=1, label=f"mean {mean:.3g} ms")
        ax.set_xticks(x, [f"s{s}\nr{r}" for s, r in enumerate(self.stage_to_rank)], fontsize="small")
        ax.set_ylabel("time per micro-batch (ms)")
        ax.set_title(
            f"{self.method} split, P={self.P}"
            + (f", v={self.v}" if self.v > 1 else "")
            + f": imbalance {self.imbalance:.2f}"
        )
        ax.legend(fontsize="small", loc="best")
        return ax

    def _summary(self) -> dict:
        out = {
            "method": self.method,
            "P": self.P,
            "v": self.v,
            "schedule": self.schedule or "-",
            "layers": self.n_layers,
            "bottleneck_ms": self.bottleneck_ms,
            "imbalance": self.imbalance,
        }
        if not any(math.isnan(x) for x in self.stage_mem_bytes):
            out["max_rank_mem_bytes"] = max(self.rank_mem_bytes)
        return out

    def _repr_html_(self) -> str:
        df = self.df[
            [
                "stage",
                "rank",
                "start",
                "end",
                "first_layer",
                "last_layer",
                "fwd_ms",
                "bwd_ms",
                "comm_ms",
                "params",
                "mem_bytes",
            ]
        ]
        return html_card(f"Partition: {self.n_stages} stages of {self.n_layers} layers", self._summary(), df)

    def __repr__(self) -> str:
        return text_card(f"Partition {list(self.bounds)}", self._summary())

    __str__ = __repr__


def memory_cap(mem_per_gpu_bytes: float | None) -> float | None:
    """The memory cap per GPU in bytes, checked: a finite number > 0, or ``None`` for no cap."""
    return None if mem_per_gpu_bytes is None else check_time("mem_per_gpu_bytes", mem_per_gpu_bytes, allow_zero=False)


def partition(
    profile,
    P,
    method="balanced",
    *,
    v=1,
    schedule=None,
    link=None,
    mem_per_gpu_bytes=None,
    optimizer="adam",
    m=None,
    precision=None,
    D=1,
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
    fits, and every method raises ``ValueError`` naming the stage that cannot fit and the
    smallest P that would. ``optimizer`` is one of :data:`OPTIMIZER_STATES`.

    ``precision`` sets the bytes of training state per parameter (with Adam):
    ``None`` (default) — the profile's own ``param_bytes * 4`` (16 B/param for an fp32
    profile); ``"fp32"`` — 16 B/param; ``"bf16-mixed"`` — 16 B/param (bf16 weights and
    gradients, fp32 master weights and moments); ``"bf16-mixed-zero1"`` — ``4 + 12 / D``
    B/param, the master weights and moments sharded over ``D`` data-parallel replicas
    (ZeRO-1). Named precisions need a ``params`` column. See :mod:`pipeswift_lab.core.precision`.
    """
    layers = profile if isinstance(profile, _Layers) else _Layers(profile)
    P = check_int("P", P, minimum=1)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not known; valid methods are {list(METHODS)}")
    schedule, v, mem_schedule = _resolve_placement(P, v, schedule)
    if P * v > layers.n:
        what = f"P={P}" if v == 1 else f"P*v={P}*{v}={P * v} stages"
        raise ValueError(f"{what} exceeds the {layers.n} profiled layers; every stage needs at least one layer")
    m = _resolve_m(P, m, schedule, v)
    optimizer = check_optimizer(optimizer)
    precision, D = check_precision(precision), check_int("D", D, minimum=1)
    state_bytes(layers.params, layers.param_bytes, precision, optimizer, D)  # a named precision needs params
    link = check_link(link)
    mem_per_gpu_bytes = memory_cap(mem_per_gpu_bytes)
    try:
        bounds = _split(
            layers, P, v, schedule, mem_schedule, method, link, m, optimizer, mem_per_gpu_bytes, precision, D
        )
        return Partition.from_bounds(
            layers,
            bounds,
            v=v,
            schedule=schedule,
            link=link,
            m=m,
            optimizer=optimizer,
            mem_per_gpu_bytes=mem_per_gpu_bytes,
            method=method,
            precision=precision,
            D=D,
        )
    except (Infeasible, _DoesNotFit):
        pass
    # no balanced split fits: name the worst stage of the unconstrained split and the smallest P that fits
    free = Partition.from_bounds(
        layers,
        _split(layers, P, v, schedule, mem_schedule, method, link, m, optimizer, None),
        v=v,
        schedule=schedule,
        link=link,
        m=m,
        optimizer=optimizer,
        method=method,
        precision=precision,
        D=D,
    )
    raise ValueError(_memory_error(layers, free, mem_per_gpu_bytes, method, link))


def _memory_error(layers, part: Partition, limit, method, link) -> str:
    worst = max(range(part.n_stages), key=lambda s: part.stage_mem_bytes[s] - limit / part.v)
    _, _, mem_schedule = _resolve_placement(part.P, part.v, part.schedule)
    smallest = None
    for P2 in range(part.P + 1, layers.n // part.v + 1):
        try:
            if method == "balanced":
                windows = _memory_windows(
                    layers,
                    P2,
                    part.v,
                    part.schedule,
                    mem_schedule,
                    part.m,
                    part.optimizer,
                    limit,
                    part.precision,
                    part.D,
                )
                zeros = np.zeros(layers.n + 1)
                if MinMaxSplit(zeros, zeros, P2 * part.v, windows).reach(0.0) is None:
                    raise Infeasible
            else:
                bounds = _split(
                    layers, P2, part.v, part.schedule, mem_schedule, method, link, part.m, part.optimizer, None
                )
                Partition.from_bounds(
                    layers,
                    bounds,
                    v=part.v,
                    schedule=part.schedule,
                    m=part.m,
                    optimizer=part.optimizer,
                    mem_per_gpu_bytes=limit,
                    method=method,
                    precision=part.precision,
                    D=part.D,
                )
            smallest = P2
            break
        except (Infeasible, ValueError):
            continue
    where = f"with m={part.m}" + (f", schedule={part.schedule!r}" if part.schedule else "")
    hint = (
        f"the smallest P that fits ({where}) is {smallest}"
        if smallest
        else f"no P up to {layers.n // part.v} fits ({where}); some layer alone exceeds the cap"
    )
    return f"{no_fit_head(limit, method, part.P, part.v)}; in the unconstrained split, {part.describe_stage(worst)}. {hint[0].upper() + hint[1:]}."


def no_fit_head(limit, method, P, v) -> str:
    """The first clause of the error when no ``method`` split into ``P`` ranks fits ``mem_per_gpu_bytes=limit`` (the planner's reason)."""
    share = "" if v == 1 else f" (each of a rank's {v} stages gets mem_per_gpu_bytes / v = {limit / v:.6g})"
    return f"mem_per_gpu_bytes={limit:.6g}: no {method} split into P={P} ranks fits{share}"


__all__ = ["METHODS", "OPTIMIZER_STATES", "Partition", "partition"]
