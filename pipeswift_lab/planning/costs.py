"""Per-layer costs at any micro-batch size, from one or more profiles: what the planner's search reads.

Used by :class:`pipeswift_lab.planning.search.Evaluator` and :func:`pipeswift_lab.planning.planner.plan`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pandas as pd

from ..core.checks import check_int
from ..profiling.tp_rank import TIME_COLUMNS

__all__ = ["BYTE_COLUMNS", "TIME_COLUMNS", "MicrobatchCosts"]

#: The per-layer bytes of one micro-batch, which follow its size (the tensor-parallel plan's among them).
BYTE_COLUMNS = ("activation_bytes", "output_bytes", "tp_activation_bytes", "tp_forward_bytes", "tp_backward_bytes")


class MicrobatchCosts:
    """Per-layer costs at any micro-batch size, from one or more profiles.

    With one profile taken at micro-batch size ``b0``, times and bytes scale in proportion
    to ``b / b0``. With profiles at several sizes, each layer's times are interpolated
    piecewise-linearly in ``b`` (and extrapolated along the end segments, never below
    zero), which captures the fixed per-micro-batch cost that makes small micro-batches
    slow; bytes stay proportional to ``b`` from the nearest profile.
    """

    def __init__(self, profile: Any) -> None:
        profiles = list(profile) if isinstance(profile, (list, tuple)) else [profile]
        if not profiles:
            raise ValueError("profile is empty; give a Profile or a list of Profiles at different micro-batch sizes")
        by_size: dict[int, tuple[pd.DataFrame, str]] = {}
        self.metas: dict[int, dict[str, Any]] = {}
        for i, prof in enumerate(profiles):
            size, table, device = _profiled(prof, "profile" if len(profiles) == 1 else f"profile[{i}]")
            if size in by_size:
                raise ValueError(f"two profiles have micro-batch size {size}; give one profile per size")
            by_size[size] = (table, device)
            self.metas[size] = {**(getattr(prof, "meta", None) or {}), "batch_size": size, "device": device}
        self.sizes = sorted(by_size)
        self.tables = {b: by_size[b][0] for b in self.sizes}
        self.device = by_size[self.sizes[0]][1]
        lengths = {len(t) for t in self.tables.values()}
        if len(lengths) != 1:
            raise ValueError(
                f"profiles have different layer counts {sorted(lengths)}; profile the same model at each size"
            )
        self.n_layers = lengths.pop()
        self.proportional = len(self.sizes) == 1
        self._cache: dict[int, pd.DataFrame] = {}

    @property
    def b0(self) -> int:
        """The smallest profiled micro-batch size."""
        return self.sizes[0]

    def nearest(self, b: int) -> int:
        """The profiled micro-batch size closest to ``b`` (the smaller on a tie)."""
        return min(self.sizes, key=lambda size: (abs(size - b), size))

    def table(self, b: int) -> pd.DataFrame:
        """Per-layer DataFrame at micro-batch size ``b``."""
        if b not in self._cache:
            nearest = self.nearest(b)
            df = self.tables[nearest].copy()
            for col in BYTE_COLUMNS:
                if col in df.columns:
                    df[col] = df[col] * (b / nearest)
            for col in TIME_COLUMNS:
                if col in df.columns and all(col in t.columns for t in self.tables.values()):
                    df[col] = self._time(col, b)
            self._cache[b] = df
        return self._cache[b]

    def derived(self, transform: Callable[[pd.DataFrame], pd.DataFrame]) -> MicrobatchCosts:
        """These costs with every profiled table replaced by ``transform(table)`` (same layers, sizes and metas): the
        costs as one tensor-parallel rank sees them, for instance. Returns a new :class:`MicrobatchCosts`."""
        out = copy.copy(self)
        out.tables = {b: transform(table.copy()) for b, table in self.tables.items()}
        out._cache = {}
        return out

    def _time(self, col: str, b: int) -> pd.Series:
        if self.proportional:
            return self.tables[self.b0][col] * (b / self.b0)
        sizes = self.sizes
        hi = next((i for i, size in enumerate(sizes) if size >= b), len(sizes) - 1)
        hi = max(hi, 1)
        b1, b2 = sizes[hi - 1], sizes[hi]
        t1, t2 = self.tables[b1][col], self.tables[b2][col]
        return (t1 + (t2 - t1) * (b - b1) / (b2 - b1)).clip(lower=0.0)


def _profiled(prof: Any, name: str) -> tuple[int, pd.DataFrame, str]:
    """``(micro-batch size, per-layer table, device type)`` of one profile; warns when it has no batch size."""
    df = prof.df if hasattr(prof, "df") else prof
    if not isinstance(df, pd.DataFrame):
        raise TypeError(
            f"profile must be a pipeswift_lab.Profile, a per-layer DataFrame or a list of Profiles; "
            f"got {type(prof).__name__}"
        )
    meta = getattr(prof, "meta", {}) or {}
    if not meta.get("batch_size"):
        warnings.warn(
            f"{name} has no meta['batch_size']: it is planned as if profiled at micro-batch size 1 (layer times and "
            f"activations scale from there); set Profile.meta['batch_size'] "
            f"(Profile.synthetic(..., meta={{'batch_size': b}})) to the size it was taken at",
            UserWarning,
            stacklevel=5,  # _profiled, MicrobatchCosts, check_plan_inputs, plan, the caller
        )
    size = meta.get("batch_size") or 1
    size = int(size) if isinstance(size, float) and size.is_integer() else size
    size = check_int("profile.meta['batch_size']", size, minimum=1)
    return size, df.reset_index(drop=True), str(meta.get("device", "cuda")).split(":")[0]
