"""Every rank's peak memory of the splits the planner's search weighs, cached.

:class:`SplitPeaks` answers what :func:`~pipeswift_lab.partitioning.rank_memory.rank_memory` would
(``predicted_peak_bytes``) for a split at any micro-batch size, from the nearest profile, without replaying its
actions: the replay compiled once per ``(P, m, schedule, v)``
(:func:`~pipeswift_lab.core.peak_forms.peak_form`) is evaluated on the split's stage bytes, taken from sums over the
layers (:class:`~pipeswift_lab.partitioning.rank_memory.SplitBytes`) and shared by every ``m`` and by every ``D``
that holds as much. ``replay=True`` calls ``rank_memory`` itself, the reference both are checked against::

    peaks = SplitPeaks(costs, layers_at, optimizer="adam", precision=None)
    peaks.of(P, m, b, schedule, v, D, bounds, placement)  # one peak per rank
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..core.memory_model import default_optimizer_memory, rank_peak, send_wait
from ..core.peak_forms import StageFields, peak_form
from ..core.precision import PRECISIONS
from ..core.schedule import ScheduleLike
from ..partitioning.layers import Bounds, Layers
from ..partitioning.rank_memory import SplitBytes, rank_memory, stage_bytes, with_sends
from .sharding import fsdp_factors, fsdp_fields, fsdp_stage_bytes, reduce_scatter_moment

__all__ = ["SplitPeaks"]


class SplitPeaks:
    """Each rank's peak of the splits of one profile, by ``(P, m, b, schedule, v, D, bounds)`` and, where the
    optimizer state is sharded ``fsdp > 1`` ways, ``fsdp`` (cached).

    Under FSDP a stage's weights and optimizer state are scaled by
    :func:`~pipeswift_lab.planning.sharding.fsdp_factors` and it keeps no data-parallel gradient buckets (its
    gradients are reduce-scattered once a step), and the reduce-scatter's moment may be the peak
    (:func:`~pipeswift_lab.planning.sharding.reduce_scatter_moment`), for the compiled peaks and the replay alike.

    ``costs`` is the search's :class:`~pipeswift_lab.planning.costs.MicrobatchCosts`; ``layers_at(b)`` its per-layer
    arrays at micro-batch size ``b``; ``optimizer`` and ``precision`` as :func:`rank_memory` takes them.
    """

    def __init__(
        self,
        costs: Any,
        layers_at: Callable[[int], Layers],
        *,
        optimizer: str,
        precision: str | None,
        replay: bool = False,
    ) -> None:
        self.costs, self.layers_at, self.optimizer, self.precision, self.replay = (
            costs,
            layers_at,
            optimizer,
            precision,
            replay,
        )
        self._peaks: dict[tuple, list[float]] = {}
        self._split_bytes: dict[tuple, SplitBytes] = {}
        self._fields: dict[tuple, StageFields] = {}
        self._state_act: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def of(
        self,
        P: int,
        m: int,
        b: int,
        schedule: ScheduleLike,
        v: int,
        D: int,
        bounds: Bounds,
        placement: Sequence[int],
        fsdp: int = 1,
    ) -> list[float]:
        """Each rank's peak of ``bounds`` (stages on ranks ``placement``) at micro-batch size ``b`` with ``fsdp``
        shards: a list, one per rank (cached)."""
        key = (P, m, b, schedule, v, D, bounds) + ((fsdp,) if fsdp > 1 else ())
        if key not in self._peaks:
            if fsdp > 1:
                self._peaks[key] = self._sharded(P, m, b, schedule, v, bounds, placement, fsdp)
            elif self.replay:
                table = rank_memory(
                    self.layers_at(self.costs.nearest(b)),
                    bounds,
                    placement,
                    P=P,
                    m=m,
                    schedule=schedule,
                    v=v,
                    micro_batch_size=b,
                    precision=self.precision,
                    optimizer=self.optimizer,
                    D=D,
                )
                self._peaks[key] = [float(x) for x in table["predicted_peak_bytes"]]
            else:
                split_bytes = self._split_bytes_at(b, D)
                fields_key = (b, bounds, tuple(placement), self._bytes_key(D))
                if fields_key not in self._fields:
                    self._fields[fields_key] = split_bytes.of(bounds, placement)
                peaks = peak_form(P, m, schedule, v).peaks(self._fields[fields_key], split_bytes.optimizer_memory)
                self._peaks[key] = peaks.tolist()
        return self._peaks[key]

    def _sharded(
        self,
        P: int,
        m: int,
        b: int,
        schedule: ScheduleLike,
        v: int,
        bounds: Bounds,
        placement: Sequence[int],
        fsdp: int,
    ) -> list[float]:
        """Each rank's peak under ``fsdp > 1`` shards: the stage bytes without buckets (as at ``D = 1``), scaled by
        :func:`~pipeswift_lab.planning.sharding.fsdp_fields`, compiled or (``replay``) replayed action by action."""
        if not self.replay:
            split_bytes = self._split_bytes_at(b, 1)
            fields_key = (b, bounds, tuple(placement), self._bytes_key(1), fsdp)
            if fields_key not in self._fields:
                self._fields[fields_key] = fsdp_fields(split_bytes.of(bounds, placement), fsdp)
            fields = self._fields[fields_key]
            peaks = peak_form(P, m, schedule, v).peaks(fields, split_bytes.optimizer_memory)
            return np.maximum(peaks, reduce_scatter_moment(fields, placement, P, m)).tolist()
        from ..core.schedule_orders import compute_orders

        layers = self.layers_at(self.costs.nearest(b))
        profiled = layers.meta.get("batch_size")
        optimizer = default_optimizer_memory(self.optimizer, str(layers.meta.get("device", "cpu")).split(":")[0])
        stages = stage_bytes(
            layers, bounds, scale=b / profiled if b and profiled else 1.0, precision=self.precision, optimizer=optimizer
        )
        per_stage = with_sends(fsdp_stage_bytes(stages, fsdp), placement)
        orders = compute_orders(P, m, schedule, v, check=False)
        scattering = reduce_scatter_moment(StageFields.of(per_stage), placement, P, m)
        out: list[float] = []
        for r in range(P):
            mine = {s: per_stage[s] for s, rank in enumerate(placement) if rank == r}
            peak = float(rank_peak(mine, orders[r], m, optimizer, send_wait(schedule))["peak_bytes"])
            out.append(max(peak, float(scattering[r])))
        return out

    def state_and_activations(self, b: int, D: int, fsdp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Per layer at micro-batch size ``b``: ``(state, activations)``, the weights and optimizer state a rank holds
        at every moment (``D`` replicas, ``fsdp`` shards) and the saved activations of one micro-batch, as the peaks
        count them (what :func:`~pipeswift_lab.planning.memory_bound.min_fullest_rank_bytes` reads)."""
        key = (b, self._bytes_key(1 if fsdp > 1 else D), fsdp)
        if key not in self._state_act:
            layer = self._split_bytes_at(b, 1 if fsdp > 1 else D).layer
            factors = fsdp_factors(fsdp)
            state = layer.weights * factors["weights"] + layer.state * factors["optimizer"]
            self._state_act[key] = (state, layer.act * layer.scale)
        return self._state_act[key]

    @property
    def answers(self) -> dict[tuple, list[float]]:
        """Every answer so far, by ``(P, m, b, schedule, v, D, bounds)`` (``fsdp`` appended where it is > 1): a new
        dict."""
        return dict(self._peaks)

    def _bytes_key(self, D: int) -> tuple[bool, int]:
        """What of ``D`` the stage bytes depend on: DDP's buckets (``D > 1`` without a precision) and the optimizer
        state a ZeRO-1 precision shards over ``D``."""
        sharded = self.precision is not None and PRECISIONS[self.precision].sharded
        return (D > 1 and self.precision is None, D if sharded else 1)

    def _split_bytes_at(self, b: int, D: int) -> SplitBytes:
        """The stage bytes of any split at micro-batch size ``b`` with ``D`` replicas, as ``rank_memory`` takes them
        from the nearest profile (cached)."""
        key = (b, self._bytes_key(D))
        if key not in self._split_bytes:
            layers = self.layers_at(self.costs.nearest(b))
            profiled = layers.meta.get("batch_size")
            optimizer = default_optimizer_memory(self.optimizer, str(layers.meta.get("device", "cpu")).split(":")[0])
            self._split_bytes[key] = SplitBytes(
                layers,
                scale=b / profiled if b and profiled else 1.0,
                precision=self.precision,
                optimizer=optimizer,
                D=D,
            )
        return self._split_bytes[key]
