"""The :class:`Partition` type: contiguous stages of a profiled model, where each sits and what each costs.

A Partition is made by :func:`~pipeswift_lab.partitioning.balance.partition` or, from hand-written bounds, by
:meth:`Partition.from_bounds`; both sum the profile's per-layer costs over each stage and count its memory as
:mod:`pipeswift_lab.partitioning.memory` describes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.checks import check_int
from ..core.display import html_card, text_card
from ..core.link import Link, check_link
from ..core.precision import state_bytes
from ..core.schedule import ScheduleLike
from .layers import Bounds, Layers, check_bounds, stage_comm_ms
from .memory import MEM_RTOL, DoesNotFit, Layout, memory_cap, rank_totals, resolve_layout

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Partition"]

#: The columns of the card a notebook shows.
_CARD_COLUMNS = [
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


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Contiguous stages of a profiled model and what each costs.

    Per-stage tuples are in stage order (``P * v`` stages). :attr:`df` shows them as a table, one row per stage.
    """

    bounds: Bounds
    """Half-open ``(start, end)`` layer ranges, one per stage."""
    P: int
    """Pipeline ranks."""
    v: int
    """Stages (chunks) per rank."""
    schedule: ScheduleLike | None
    """The schedule the stages were placed for (None: round-robin placement)."""
    stage_to_rank: tuple[int, ...]
    """The rank of each stage."""
    layer_names: tuple[tuple[str, ...], ...]
    """The names of each stage's layers."""
    stage_fwd_ms: tuple[float, ...]
    """Forward time of each stage per micro-batch (ms)."""
    stage_bwd_ms: tuple[float, ...]
    """Whole backward time of each stage per micro-batch (ms)."""
    stage_wgrad_ms: tuple[float, ...] | None
    """The weight-gradient part of each stage's backward (ms); None when the profile has no split."""
    stage_comm_ms: tuple[float, ...]
    """Transfers each stage sends per micro-batch over ``link`` (ms); zeros without a link."""
    stage_params: tuple[float, ...]
    """Parameters of each stage (NaN where the profile has no ``params`` column)."""
    stage_param_bytes: tuple[float, ...]
    """Parameter bytes of each stage, as profiled."""
    stage_activation_bytes: tuple[float, ...]
    """Bytes each stage saves for backward per micro-batch."""
    stage_output_bytes: tuple[float, ...]
    """Bytes of the activation leaving each stage (0 for the last)."""
    stage_inflight: tuple[float, ...]
    """Micro-batches each stage's rank holds in flight: the multiplier of its activation bytes."""
    stage_mem_bytes: tuple[float, ...]
    """Memory of each stage: training state plus activations in flight (NaN where the profile lacks memory
    columns)."""
    method: str = "manual"
    """How the bounds were found: ``"uniform"``, ``"params"``, ``"balanced"``, or ``"manual"``."""
    m: int | None = None
    """Micro-batches per step the memory estimate counts."""
    optimizer: str = "adam"
    """Optimizer whose states count in the training state."""
    link: Link | None = None
    """The link between neighbouring ranks the transfers are timed on."""
    mem_per_gpu_bytes: float | None = None
    """The cap it was split under."""
    precision: str | None = None
    """Bytes of training state per parameter (:mod:`pipeswift_lab.core.precision`); None: the profile's own."""
    D: int = 1
    """Data-parallel replicas the optimizer state is sharded over (ZeRO-1)."""
    stage_state_bytes: tuple[float, ...] = ()
    """Weights + gradients + optimizer state of each stage (bytes)."""
    layers: Layers | None = field(default=None, compare=False, repr=False)
    """The profile's per-layer arrays the stages were summed from (what :meth:`memory` replays)."""
    mem_schedule: ScheduleLike | None = None
    stage_recomputed_ms: tuple[float, ...] | None = None
    stage_input_pass_ms: tuple[float, ...] | None = None
    """Each stage's input-gradient pass as torch's ``stage_backward_input`` took it, layer by layer (ms; NaN where a
    layer's was not measured); None when the profile has no ``input_pass_ms``."""
    stage_weight_pass_ms: tuple[float, ...] | None = None
    """The same of its weight-gradient pass (``stage_backward_weight``)."""
    """The recomputation in each stage's backward (ms, inside ``stage_bwd_ms``), which a zero-bubble schedule runs
    once more: in its input-gradient pass as well as its weight-gradient pass; None without recomputation."""
    """The schedule whose action order :meth:`memory` replays (``schedule``, or 1F1B / Interleaved1F1B)."""

    # ---- construction
    @classmethod
    def from_bounds(
        cls,
        profile: Any,
        bounds: Iterable[Sequence[int]],
        *,
        v: int = 1,
        schedule: ScheduleLike | None = None,
        link: Link | None = None,
        m: int | None = None,
        optimizer: str = "adam",
        mem_per_gpu_bytes: float | None = None,
        method: str = "manual",
        precision: str | None = None,
        D: int = 1,
    ) -> Partition:
        """Build a Partition from explicit ``bounds``: ``[(start, end), ...]``, one per stage.

        Bounds must be contiguous half-open ranges covering layers ``0..L-1`` with no empty
        stage, and their number must be a multiple of ``v`` (``P = len(bounds) // v``).
        ``m`` (default ``P``) and ``schedule`` set the in-flight micro-batches of the memory
        estimate; with ``mem_per_gpu_bytes`` every rank must fit or a ``ValueError`` names the
        stage that does not. ``precision`` and ``D`` set the bytes of training state per
        parameter (see :func:`~pipeswift_lab.partitioning.balance.partition`). Returns the Partition.
        """
        layers = profile if isinstance(profile, Layers) else Layers(profile)
        checked = check_bounds(bounds, layers.n)
        v = check_int("v", v, minimum=1)
        if len(checked) % v:
            raise ValueError(
                f"bounds has {len(checked)} stages, not a multiple of v={v}; "
                "a pipeline of P ranks with v stages each needs P*v stages"
            )
        layout = resolve_layout(len(checked) // v, v, schedule, m, optimizer, precision, D)
        return cls._of_layout(
            layers,
            checked,
            layout,
            link=check_link(link),
            method=method,
            mem_per_gpu_bytes=memory_cap(mem_per_gpu_bytes),
        )

    @classmethod
    def _of_layout(
        cls,
        layers: Layers,
        bounds: Bounds,
        layout: Layout,
        *,
        link: Link | None,
        method: str,
        mem_per_gpu_bytes: float | None,
    ) -> Partition:
        """The Partition of checked ``bounds`` for a checked ``layout``: each stage's sums of the layers' costs and
        its memory; raises ``ValueError`` naming the stage when a rank exceeds ``mem_per_gpu_bytes``."""
        if link is not None and layers.output_bytes is None and len(bounds) > 1:
            raise ValueError(
                "link is given but the profile has no 'output_bytes' column; the transfer of a stage boundary needs "
                "the bytes crossing it"
            )
        sums = _StageSums(bounds)
        inflight = layout.inflight()
        stage_act = sums(layers.activation_bytes)
        stage_state = sums(state_bytes(layers.params, layers.param_bytes, layout.precision, layout.optimizer, layout.D))
        part = cls(
            bounds=bounds,
            P=layout.P,
            v=layout.v,
            schedule=layout.schedule,
            stage_to_rank=layout.placement(),
            layer_names=tuple(layers.names[a:b] for a, b in bounds),
            stage_fwd_ms=sums(layers.fwd),
            stage_bwd_ms=sums(layers.bwd),
            stage_wgrad_ms=sums(layers.wgrad) if layers.wgrad is not None else None,
            stage_recomputed_ms=sums(layers.recomputed) if layers.recomputed is not None else None,
            stage_input_pass_ms=sums(layers.input_pass) if layers.input_pass is not None else None,
            stage_weight_pass_ms=sums(layers.weight_pass) if layers.weight_pass is not None else None,
            stage_comm_ms=stage_comm_ms(bounds, layers, link),
            stage_params=sums(layers.params, as_int=True),
            stage_param_bytes=sums(layers.param_bytes),
            stage_activation_bytes=stage_act,
            stage_output_bytes=_output_bytes(bounds, layers),
            stage_inflight=inflight,
            stage_mem_bytes=tuple(sb + ab * f for sb, ab, f in zip(stage_state, stage_act, inflight)),
            method=method,
            m=layout.m,
            optimizer=layout.optimizer,
            link=link,
            mem_per_gpu_bytes=mem_per_gpu_bytes,
            precision=layout.precision,
            D=layout.D,
            stage_state_bytes=stage_state,
            layers=layers,
            mem_schedule=layout.mem_schedule,
        )
        if mem_per_gpu_bytes is not None:
            part._check_fits(mem_per_gpu_bytes)
        return part

    def _check_fits(self, limit: float) -> None:
        if any(math.isnan(x) for x in self.stage_mem_bytes):
            raise ValueError(
                "mem_per_gpu_bytes is given but the profile lacks 'param_bytes' or 'activation_bytes'; "
                "memory per stage is unknown"
            )
        for r, need in enumerate(self.rank_mem_bytes):
            if need > limit * (1 + MEM_RTOL):
                stages = [s for s, rr in enumerate(self.stage_to_rank) if rr == r]
                worst = max(stages, key=lambda s: self.stage_mem_bytes[s])
                raise DoesNotFit(
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
    def stage_ms(self) -> tuple[float, ...]:
        """Forward plus backward compute time of each stage for one micro-batch (ms)."""
        return tuple(f + b for f, b in zip(self.stage_fwd_ms, self.stage_bwd_ms))

    @property
    def stage_cost_ms(self) -> tuple[float, ...]:
        """What ``"balanced"`` minimizes the maximum of: ``stage_ms`` plus ``stage_comm_ms``."""
        return tuple(t + c for t, c in zip(self.stage_ms, self.stage_comm_ms))

    @property
    def bottleneck_ms(self) -> float:
        """The slowest *stage*'s ``stage_cost_ms`` (ms per micro-batch). With ``v > 1`` a rank holds ``v`` stages and
        works through all of them per micro-batch: :attr:`bottleneck_rank_ms` is the busiest rank's figure."""
        return max(self.stage_cost_ms)

    @property
    def imbalance(self) -> float:
        """Slowest *stage* over the mean stage (``stage_ms``); 1.0 is perfect balance. With ``v > 1``
        :attr:`rank_imbalance` compares the ranks, each the sum of its ``v`` stages."""
        return _max_over_mean(self.stage_ms)

    @property
    def rank_ms(self) -> tuple[float, ...]:
        """Forward plus backward compute of each *rank* for one micro-batch (ms): the sum of ``stage_ms`` over the
        ``v`` stages it holds (``stage_to_rank``); ``stage_ms`` itself when ``v == 1``."""
        return tuple(rank_totals(self.stage_ms, self.stage_to_rank, self.P))

    @property
    def rank_cost_ms(self) -> tuple[float, ...]:
        """Each rank's ``rank_ms`` plus the transfers its stages send (``stage_comm_ms``), per micro-batch (ms)."""
        return tuple(rank_totals(self.stage_cost_ms, self.stage_to_rank, self.P))

    @property
    def bottleneck_rank_ms(self) -> float:
        """The busiest rank's ``rank_cost_ms`` (ms per micro-batch): what paces the pipeline; equal to
        :attr:`bottleneck_ms` when ``v == 1``."""
        return max(self.rank_cost_ms)

    @property
    def rank_imbalance(self) -> float:
        """Busiest rank over the mean rank (``rank_ms``); 1.0 is perfect balance; equal to :attr:`imbalance` when
        ``v == 1``."""
        return _max_over_mean(self.rank_ms)

    @cached_property
    def rank_mem_bytes(self) -> tuple[float, ...]:
        """Predicted peak memory of each rank: :meth:`memory`'s ``predicted_peak_bytes`` (NaN where the profile has
        no memory columns); replayed once per Partition (it is frozen)."""
        if self.layers is None or any(math.isnan(x) for x in self.stage_mem_bytes):
            return tuple(rank_totals(self.stage_mem_bytes, self.stage_to_rank, self.P))
        try:
            return tuple(float(x) for x in self.memory()["predicted_peak_bytes"])
        except ValueError:  # an (m, schedule) torch has no order for: the steady sums of the stages
            return tuple(rank_totals(self.stage_mem_bytes, self.stage_to_rank, self.P))

    def memory(
        self,
        *,
        m: int | None = None,
        schedule: ScheduleLike | None = None,
        micro_batch_size: int | None = None,
        optimizer: Any = None,
    ) -> pd.DataFrame:
        """The predicted peak memory of every rank, term by term, replaying its actions in torch's order
        (:mod:`pipeswift_lab.partitioning.rank_memory`).

        ``m`` and ``schedule`` default to the partition's; ``micro_batch_size`` to the profiled one;
        ``optimizer`` (a name of :data:`~pipeswift_lab.core.precision.OPTIMIZER_STATES` or a measured
        :class:`~pipeswift_lab.core.memory_model.OptimizerMemory`) to the partition's. Returns a DataFrame, one
        row per rank: ``predicted_peak_bytes``, ``weights_bytes``, ``grads_bytes``, ``optimizer_bytes``,
        ``activations_bytes``, ``buffers_bytes``, ``transient_bytes`` (each as it stood at the peak) and
        ``peak_at`` (the action, or the optimizer step).
        """
        from .rank_memory import rank_memory

        if self.layers is None:
            raise ValueError("this Partition has no per-layer profile to replay; build it with partition(profile, ...)")
        return rank_memory(
            self.layers,
            self.bounds,
            self.stage_to_rank,
            P=self.P,
            m=m if m is not None else (self.m or self.P),
            schedule=schedule or self.mem_schedule or self.schedule or ("1F1B" if self.v == 1 else "Interleaved1F1B"),
            v=self.v,
            micro_batch_size=micro_batch_size,
            precision=self.precision,
            optimizer=optimizer if optimizer is not None else self.optimizer,
            D=self.D,
        )

    def describe_stage(self, s: int) -> str:
        """One sentence on stage ``s``: its layers and its memory, for error messages."""
        a, b = self.bounds[s]
        names = self.layer_names[s]
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        state = f"{self.optimizer} state"
        if self.precision is not None:
            state += f" ({self.precision}" + (f", D={self.D})" if self.precision.endswith("zero1") else ")")
        return (
            f"stage {s} (layers {a}..{b - 1}: {span}, rank {self.stage_to_rank[s]}) needs "
            f"{self.stage_mem_bytes[s]:.6g} bytes = {self.stage_state_bytes[s]:.6g} parameters+gradients+{state} + "
            f"{self.stage_activation_bytes[s]:.6g} activation bytes x {self.stage_inflight[s]:g} micro-batches in "
            "flight"
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

    @property
    def split_passes_ms(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(stage_input_pass_ms, stage_weight_pass_ms)`` where the profile timed both, else None."""
        if self.stage_input_pass_ms is None or self.stage_weight_pass_ms is None:
            return None
        return self.stage_input_pass_ms, self.stage_weight_pass_ms

    def stage_table(self) -> pd.DataFrame:
        """The per-stage input of :func:`pipeswift_lab.simulation.simulator`: ``fwd_ms``, ``bwd_ms`` (+ ``wgrad_ms``,
        ``recomputed_ms``), bytes."""
        cols = ["fwd_ms", "bwd_ms", "output_bytes", "activation_bytes"] + (
            ["wgrad_ms"] if self.stage_wgrad_ms is not None else []
        )
        table = self.df[cols]
        passes = self.split_passes_ms
        if passes is not None:
            table = table.assign(input_pass_ms=list(passes[0]), weight_pass_ms=list(passes[1]))
        if self.stage_recomputed_ms is not None:
            table = table.assign(recomputed_ms=list(self.stage_recomputed_ms))
        return table

    # ---- display
    def plot(self, ax: Axes | None = None) -> Axes:
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
        if self.v > 1:
            balance = f", v={self.v}: stage imbalance {self.imbalance:.2f}, rank {self.rank_imbalance:.2f}"
        else:
            balance = f": imbalance {self.imbalance:.2f}"
        ax.set_title(f"{self.method} split, P={self.P}{balance}")
        ax.legend(fontsize="small", loc="best")
        return ax

    def _summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "P": self.P,
            "v": self.v,
            "schedule": self.schedule or "-",
            "layers": self.n_layers,
            "bottleneck_ms": self.bottleneck_ms,
            "imbalance": self.imbalance,
        }
        if self.v > 1:  # a rank holds v stages: its figures differ from a stage's
            out.update(bottleneck_rank_ms=self.bottleneck_rank_ms, rank_imbalance=self.rank_imbalance)
        if self.layers is not None and self.layers.param_bytes is not None and not self.layers.has_bytes:
            out["max_rank_mem_bytes"] = "not predicted: the profile has no byte columns"
        elif not any(math.isnan(x) for x in self.stage_mem_bytes):
            out["max_rank_mem_bytes"] = max(self.rank_mem_bytes)
        return out

    def _repr_html_(self) -> str:
        title = f"Partition: {self.n_stages} stages of {self.n_layers} layers"
        return html_card(title, self._summary(), self.df[_CARD_COLUMNS])

    def __repr__(self) -> str:
        return text_card(f"Partition {list(self.bounds)}", self._summary())

    __str__ = __repr__


def _max_over_mean(times: Sequence[float]) -> float:
    """The largest of ``times`` over their mean (1.0 when the mean is 0)."""
    mean = sum(times) / len(times)
    return max(times) / mean if mean > 0 else 1.0


class _StageSums:
    """Sums of a per-layer array over each stage of ``bounds`` (NaN per stage where the array is unknown)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds

    def __call__(self, values: np.ndarray | None, as_int: bool = False) -> tuple[float, ...]:
        if values is None:
            return tuple(math.nan for _ in self.bounds)
        out = tuple(float(values[a:b].sum()) for a, b in self.bounds)
        return tuple(int(round(x)) for x in out) if as_int else out


def _output_bytes(bounds: Bounds, layers: Layers) -> tuple[float, ...]:
    """Bytes of the activation leaving each stage (0 for the last, and without an ``output_bytes`` column)."""
    out = layers.output_bytes
    return tuple(float(out[b - 1]) if (out is not None and b < layers.n) else 0.0 for _, b in bounds)
