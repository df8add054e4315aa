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

from ..core.memory_model import default_optimizer_memory
from ..core.peak_forms import StageFields, peak_form
from ..core.precision import PRECISIONS
from ..partitioning.layers import Bounds, Layers
from ..partitioning.rank_memory import SplitBytes, rank_memory

__all__ = ["SplitPeaks"]


class SplitPeaks:
    """Each rank's peak of the splits of one profile, by ``(P, m, b, schedule, v, D, bounds)`` (cached).

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

    def of(
        self, P: int, m: int, b: int, schedule: str, v: int, D: int, bounds: Bounds, placement: Sequence[int]
    ) -> list[float]:
        """Each rank's peak of ``bounds`` (stages on ranks ``placement``) at micro-batch size ``b``: a list, one per
        rank (cached)."""
        key = (P, m, b, schedule, v, D, bounds)
        if key not in self._peaks:
            if self.replay:
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

    @property
    def answers(self) -> dict[tuple, list[float]]:
        """Every answer so far, by ``(P, m, b, schedule, v, D, bounds)``: a new dict."""
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
