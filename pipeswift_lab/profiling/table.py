"""The :class:`Profile` type: measured (or synthetic) per-layer costs of one micro-batch, one row per layer.

Every plan in the lab starts from these per-layer costs: the practitioners' recipe (GPipe, Huang et al., NeurIPS 2019;
PipeDream, Narayanan et al., SOSP 2019; torchgpipe's ``balance_by_time``, Kim et al., 2020) fixes the micro-batch
size, measures each layer's forward and backward time and memory on a representative batch, and cuts stages by
cumulative cost. A Profile holds that table, checked, with its ``meta``; it is measured by
:func:`pipeswift_lab.profiling.measure.profile`, made up by :meth:`Profile.synthetic`, and kept with
:meth:`Profile.to_csv` / :meth:`Profile.read_csv`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pandas as pd

from ..core.checks import check_time, nonnegative_column
from ..core.display import html_card, noise_note, noise_warning, text_card

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["COLUMNS", "MEMORY_COLUMNS", "REQUIRED_COLUMNS", "TP_COLUMNS", "Profile"]

#: Per-layer columns of :attr:`Profile.df`, in order.
COLUMNS: tuple[str, ...] = (
    "layer",
    "name",
    "type",
    "calls",
    "fwd_ms",
    "bwd_ms",
    "total_ms",
    "fwd_ms_iqr",
    "bwd_ms_iqr",
    "params",
    "param_bytes",
    "activation_bytes",
    "output_bytes",
    "peak_bytes",
)
#: Optional per-layer memory columns a measured profile adds: ``transient_bytes`` (the most a layer's forward or
#: backward allocates beyond what it keeps, its weight gradients included, in a backward from no gradients),
#: ``accumulate_transient_bytes`` (the same in a backward that adds to existing gradients), ``largest_param_bytes``
#: (its largest parameter tensor, what a per-tensor optimizer allocates temporaries of), and what a pipeline cut just
#: before the layer sends per micro-batch: ``cut_bytes`` (the previous layer's output and every other tensor a later
#: layer reads: masks, rotary tables, the encoder's output), ``cut_grad_bytes`` (its floating-point part, whose
#: gradients come back) and ``cut_freed_bytes`` (the part the forward frees before it ends, which the sending stage
#: holds anyway). The cut columns are 0 for the first layer. ``received_held_bytes`` (a traced model's): what the layer
#: holds besides in a stage after the first, whose receive buffers require grad, so the operators reading a mask or
#: rotary tables the stage received save for their backward.
MEMORY_COLUMNS: tuple[str, ...] = (
    "transient_bytes",
    "accumulate_transient_bytes",
    "largest_param_bytes",
    "cut_bytes",
    "cut_grad_bytes",
    "cut_freed_bytes",
    "received_held_bytes",
)
#: Per-layer columns a profile of a model with a tensor-parallel plan adds, at the full (``tp = 1``) size
#: (:mod:`pipeswift_lab.profiling.tp_columns`): the bytes of the parameters the plan cuts, the part of
#: ``activation_bytes`` that is a local shard under TP, the share of the forward FLOPs on shards, and the bytes the
#: forward and the backward all-reduce or all-gather per micro-batch.
TP_COLUMNS: tuple[str, ...] = (
    "tp_param_bytes",
    "tp_activation_bytes",
    "tp_flop_fraction",
    "tp_forward_bytes",
    "tp_backward_bytes",
    "sp_activation_bytes",
    "tp_duplicated_bytes",
)
#: Columns every Profile table has (``calls`` and ``wgrad_ms`` are optional).
REQUIRED_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c != "calls")
_LAYER_TIMES = ("fwd_ms", "bwd_ms", "total_ms")
_TIME_COLUMNS = ("fwd_ms", "bwd_ms", "fwd_ms_iqr", "bwd_ms_iqr", "wgrad_ms")
_COUNT_COLUMNS = ("calls", "params", "param_bytes", "activation_bytes", "output_bytes", "largest_param_bytes")
#: Byte columns that may be fractional (scaled, or medians) or NaN where unknown.
_BYTE_COLUMNS = (
    "peak_bytes",
    "transient_bytes",
    "accumulate_transient_bytes",
    "cut_bytes",
    "cut_grad_bytes",
    "cut_freed_bytes",
    "received_held_bytes",
    *(c for c in TP_COLUMNS if c.endswith("_bytes")),
)
_CSV_HEADER = "# pipeswift_lab.Profile "


@dataclass(frozen=True, eq=False)
class Profile:
    """Measured (or synthetic) per-layer costs of one micro-batch.

    ``df`` has one row per layer in execution order: ``layer`` (0..L-1), ``name``, ``type``,
    ``calls`` (forward calls per step), ``fwd_ms``, ``bwd_ms`` (medians over the repeats),
    ``total_ms`` (their sum), ``fwd_ms_iqr``, ``bwd_ms_iqr`` (interquartile ranges),
    ``params``, ``param_bytes``, ``activation_bytes`` (what a stage holds per in-flight
    micro-batch until its backward: the storages the layer's forward allocates that are still
    alive when the model's forward ends, each storage once, measured in the memory step; the
    storages autograd saved where memory is not measured), ``output_bytes`` (the bytes the
    layer returns), ``peak_bytes`` (the highest allocation above the start of its forward or
    backward, measured in one extra untimed step: CUDA's allocator statistics, or on CPU every
    storage the operators allocate; NaN in a synthetic profile) and, from :func:`profile`, the
    :data:`MEMORY_COLUMNS`; ``meta`` also holds the loss's ``loss_activation_bytes``,
    ``loss_transient_bytes`` and ``loss_retained_bytes``, the memory step's ``live_peak_bytes`` (every tensor
    byte the process held at its peak), and the sample's ``input_bytes`` and
    ``target_bytes``. ``meta`` holds the device,
    dtype, batch shape, torch version, repeats, warmup and the measured whole-step times
    (``step_ms_samples``). Profiles compare equal when their tables and meta do; they are not hashable.
    """

    df: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.df, pd.DataFrame):
            raise TypeError(f"df must be a pandas DataFrame; got {type(self.df).__name__}")
        missing = [c for c in REQUIRED_COLUMNS if c not in self.df.columns]
        if missing:
            raise ValueError(f"df is missing the Profile columns {missing}; it has {list(self.df.columns)}")
        if len(self.df) == 0:
            raise ValueError("df has no rows; a Profile needs at least one layer")
        if self.df["layer"].tolist() != list(range(len(self.df))):
            raise ValueError(f"df['layer'] must be 0..{len(self.df) - 1} in order; got {self.df['layer'].tolist()}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict; got {type(self.meta).__name__}")
        _check_columns(self.df)
        object.__setattr__(self, "meta", dict(self.meta))

    # -- sizes and totals -------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """Number of layers (rows of ``df``)."""
        return len(self.df)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Layer names in order."""
        return tuple(self.df["name"])

    @property
    def total_ms(self) -> float:
        """Sum of the layers' forward plus backward medians, in ms per micro-batch."""
        return float(self.df["total_ms"].sum())

    @property
    def step_samples_ms(self) -> list[float]:
        """The measured whole-step times, one per repeat (empty for a synthetic profile)."""
        return [float(x) for x in self.meta.get("step_ms_samples", [])]

    @property
    def step_ms(self) -> float:
        """Median measured whole step in ms (NaN when nothing was measured)."""
        samples = self.step_samples_ms
        return float(np.median(samples)) if samples else float("nan")

    @property
    def coverage(self) -> float:
        """``total_ms`` over the median measured step: the share of the step the layers explain.

        Below 1, the step spends time outside the layers (loss, glue code between them,
        optimizer in a custom step, framework overhead). NaN for a synthetic profile.
        """
        step = self.step_ms
        return self.total_ms / step if step > 0 else float("nan")

    @property
    def cv(self) -> float:
        """Run-to-run coefficient of variation of the whole step (sample std over mean); NaN below 2 repeats."""
        samples = self.step_samples_ms
        if len(samples) < 2:
            return float("nan")
        mean = float(np.mean(samples))
        return float(np.std(samples, ddof=1) / mean) if mean > 0 else float("nan")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def synthetic(
        cls,
        fwd_ms: Sequence[float],
        bwd_ms: Sequence[float],
        meta: Mapping[str, Any] | None = None,
        **columns: Any,
    ) -> Profile:
        """A Profile from given per-layer times, for what-if studies without a model.

        ``fwd_ms`` and ``bwd_ms`` are sequences of non-negative finite ms, one per layer.
        ``columns`` sets any other per-layer column (a sequence of the same length, or one
        value for every layer), e.g. ``param_bytes``, ``activation_bytes``, ``output_bytes``,
        ``wgrad_ms`` (the weight-gradient part of ``bwd_ms``), ``name`` or ``type``.
        Defaults: names ``layer_0``…, type ``"synthetic"``, one call, zero spreads, zero
        parameters and bytes, NaN peak. Returns the Profile; its ``coverage`` and ``cv`` are NaN.
        """
        fwd = _time_list("fwd_ms", fwd_ms)
        bwd = _time_list("bwd_ms", bwd_ms)
        if len(fwd) != len(bwd):
            raise ValueError(
                f"fwd_ms has {len(fwd)} layers but bwd_ms has {len(bwd)}; give one value per layer in both"
            )
        for forbidden in ("layer", "total_ms"):
            if forbidden in columns:
                raise ValueError(f"{forbidden} is derived (layer = 0..L-1, total_ms = fwd_ms + bwd_ms); do not pass it")
        data = _default_columns(fwd, bwd)
        data.update({name: _given_column(name, values, len(fwd)) for name, values in columns.items()})
        _check_synthetic(data, bwd)
        df = pd.DataFrame(data)
        df = df[list(COLUMNS) + [c for c in df.columns if c not in COLUMNS]]
        return cls(df, {"source": "synthetic", **(meta or {})})

    # -- persistence --------------------------------------------------------------------
    def with_recompute(self, recompute: str | dict[str, str] | None) -> Profile:
        """This profile as its layers cost recomputed (``"full"``, ``"selective"`` or ``{layer or glob: mode}``), from
        the columns ``profile(..., recompute=True)`` measures; a new Profile to partition, simulate and plan with
        (:func:`pipeswift_lab.profiling.recompute_costs.recomputed`)."""
        from .recompute_costs import recomputed

        return cast(Profile, recomputed(self, recompute))

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write ``df`` as CSV, preceded by one ``# pipeswift_lab.Profile {meta as JSON}`` line."""
        try:
            header = json.dumps({"meta": self.meta}, sort_keys=True)
        except TypeError as exc:
            raise ValueError(f"meta must be JSON-serializable to save a Profile: {exc}") from exc
        with open(path, "w", newline="", encoding="utf-8") as f:
            f.write(_CSV_HEADER + header + "\n")
            self.df.to_csv(f, index=False)

    @classmethod
    def read_csv(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a Profile written by :meth:`to_csv`; returns it with its ``meta``."""
        with open(path, encoding="utf-8", newline="") as f:
            first = f.readline()
            if not first.startswith(_CSV_HEADER):
                raise ValueError(
                    f"path={str(path)!r} is not a Profile CSV: its first line must start with "
                    f"{_CSV_HEADER.strip()!r} (written by Profile.to_csv)"
                )
            meta = json.loads(first[len(_CSV_HEADER) :])["meta"]
            df = pd.read_csv(
                f, dtype={"name": str, "type": str}, keep_default_na=False, na_values=[""], float_precision="round_trip"
            )
        return cls(df, meta)

    def __eq__(self, other: object) -> bool:
        # defining __eq__ without __hash__ leaves the class unhashable, as a DataFrame is
        if not isinstance(other, Profile):
            return NotImplemented
        return self.meta == other.meta and list(self.df.columns) == list(other.df.columns) and self.df.equals(other.df)

    # -- display ------------------------------------------------------------------------
    def _summary(self) -> dict[str, Any]:
        heaviest = self.df.loc[self.df["total_ms"].idxmax(), "name"] if self.total_ms > 0 else "-"
        unmeasured = "not measured" + (": a synthetic profile" if self.meta.get("source") == "synthetic" else "")
        return {
            "layers": self.n_layers,
            "device": self.meta.get("device", "-"),
            "batch_shape": self.meta.get("batch_shape", "-"),
            "total_ms": self.total_ms,
            "step_ms": self.step_ms if math.isfinite(self.step_ms) else unmeasured,
            "coverage": self.coverage if math.isfinite(self.coverage) else unmeasured,
            "cv": self.cv if math.isfinite(self.cv) else unmeasured,
            "heaviest": heaviest,
            "repeats": self.meta.get("repeats", "-"),
            **({} if self.has_bytes else {"memory": "not measured: the profile has no byte columns"}),
        }

    @property
    def has_bytes(self) -> bool:
        """Whether the profile carries memory: some layer's ``param_bytes`` or ``activation_bytes`` is not 0 (a
        :meth:`synthetic` profile given only times has none)."""
        return bool(any(c in self.df and self.df[c].fillna(0).ne(0).any() for c in ("param_bytes", "activation_bytes")))

    def _title(self) -> str:
        return f"Profile of {self.meta.get('model', 'a model')} ({self.meta.get('source', 'measured')})"

    def _repr_html_(self) -> str:
        return html_card(self._title(), self._summary(), self.df) + noise_warning(self.cv, "the profiled step")

    def __repr__(self) -> str:
        note = noise_note(self.cv, "the profiled step")
        return text_card(self._title(), self._summary()) + (f"\n  {note}" if note else "")

    def plot(self, ax: Axes | None = None) -> Axes:
        """Stacked forward/backward bars per layer, activation and parameter memory on a twin axis.

        Returns the matplotlib Axes with the bars.
        """
        from ..core.plot import KIND_COLORS, get_ax

        n = self.n_layers
        ax = get_ax(ax, figsize=(max(6.0, 0.45 * n + 2.5), 3.5))
        x = np.arange(n)
        fwd, bwd = self.df["fwd_ms"].to_numpy(float), self.df["bwd_ms"].to_numpy(float)
        ax.bar(x, fwd, color=KIND_COLORS["F"], label="forward")
        ax.bar(x, bwd, bottom=fwd, color=KIND_COLORS["B"], label="backward")
        ax.set_xticks(x, list(self.layer_names), rotation=45 if n > 4 else 0, ha="right" if n > 4 else "center")
        ax.set_ylabel("ms per micro-batch")
        ax.set_xlabel("layer")
        mem = ax.twinx()
        mem.plot(
            x, self.df["activation_bytes"].to_numpy(float) / 2**20, "o-", color="0.25", label="activations saved (MiB)"
        )
        mem.plot(x, self.df["param_bytes"].to_numpy(float) / 2**20, "s--", color="0.6", label="parameters (MiB)")
        mem.set_ylabel("MiB")
        mem.set_ylim(bottom=0)
        mem.grid(False)
        handles = ax.get_legend_handles_labels()[0] + mem.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + mem.get_legend_handles_labels()[1]
        ax.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.32 if n > 4 else -0.2),
            ncols=2,
            fontsize="small",
            frameon=False,
        )
        title = f"{self.meta.get('model', 'profile')}: {self.total_ms:.3g} ms in layers"
        if not math.isnan(self.coverage):
            title += f", coverage {self.coverage:.0%}"
        ax.set_title(title)
        return ax


def _check_columns(df: pd.DataFrame) -> None:
    """Refuse per-layer values a Profile cannot hold: the layer times must be finite numbers >= 0;
    spreads, ``wgrad_ms`` and byte/parameter counts numbers >= 0 (NaN where unknown); ``tp_flop_fraction`` a share
    between 0 and 1."""
    for col in _LAYER_TIMES + _TIME_COLUMNS[2:] + _COUNT_COLUMNS + _BYTE_COLUMNS:
        if col not in df.columns:
            continue
        required = col in _LAYER_TIMES
        _, bad = nonnegative_column(df[col], allow_missing=not required)
        if bad:
            i, value = bad
            name = df["name"].iloc[i] if "name" in df.columns else i
            what = "a finite number >= 0 (ms)" if required else "a number >= 0, or empty/NaN where unknown"
            raise ValueError(f"df[{col!r}] of layer {i} ({name!r}) is {value!r}; each value must be {what}")
    for i, fraction in enumerate(df["tp_flop_fraction"] if "tp_flop_fraction" in df.columns else ()):
        if not isinstance(fraction, numbers.Real) or not (fraction != fraction or 0.0 <= float(fraction) <= 1.0):
            raise ValueError(
                f"df['tp_flop_fraction'] of layer {i} is {fraction!r}; each value must be a share between 0 and 1 "
                "(NaN where unknown)"
            )


def _time_list(name: str, values: Any) -> list[float]:
    """``values`` (a sequence of ms per layer, at least one) as checked floats."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of ms per layer; got {type(values).__name__} {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"{name}=[] is invalid; give at least one layer")
    return [check_time(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _default_columns(fwd: list[float], bwd: list[float]) -> dict[str, list[Any]]:
    """The columns of a synthetic profile before the caller's: see :meth:`Profile.synthetic` for the defaults."""
    n = len(fwd)
    return {
        "layer": list(range(n)),
        "name": [f"layer_{i}" for i in range(n)],
        "type": ["synthetic"] * n,
        "calls": [1] * n,
        "fwd_ms": fwd,
        "bwd_ms": bwd,
        "total_ms": [f + b for f, b in zip(fwd, bwd)],
        "fwd_ms_iqr": [0.0] * n,
        "bwd_ms_iqr": [0.0] * n,
        "params": [0] * n,
        "param_bytes": [0] * n,
        "activation_bytes": [0] * n,
        "output_bytes": [0] * n,
        "peak_bytes": [float("nan")] * n,
    }


def _given_column(name: str, values: Any, n: int) -> list[Any]:
    """A column given to :meth:`Profile.synthetic` (one value for every layer, or one per layer), checked."""
    if isinstance(values, (str, numbers.Number)):
        values = [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(
            f"{name} has {len(values)} values but the profile has {n} layers (len(fwd_ms)); give one per layer"
        )
    if name in _TIME_COLUMNS:
        return [check_time(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if name in _COUNT_COLUMNS:
        return [_count(f"{name}[{i}]", v, name) for i, v in enumerate(values)]
    if name in _BYTE_COLUMNS:
        return [
            float("nan") if isinstance(v, float) and math.isnan(v) else check_time(f"{name}[{i}]", v)
            for i, v in enumerate(values)
        ]
    return values


def _count(label: str, value: Any, column: str) -> int:
    """``value`` as a whole count >= 0 (a float such as ``64.0`` is accepted; ``1.5`` is not)."""
    number = check_time(label, value)
    if number != int(number):
        raise ValueError(f"{label}={number} is invalid; {column} counts whole units and must be an integer")
    return int(number)


def _check_synthetic(data: dict[str, list[Any]], bwd: list[float]) -> None:
    """Refuse a weight-gradient part larger than its backward, and names that are not distinct non-empty strings."""
    for i, (w, b) in enumerate(zip(data.get("wgrad_ms", []), bwd)):
        if w > b:
            raise ValueError(
                f"wgrad_ms[{i}]={w} exceeds bwd_ms[{i}]={b}; the weight-gradient part is inside the backward"
            )
    names = data["name"]
    if len(set(names)) != len(bwd) or any(not isinstance(s, str) or not s for s in names):
        raise ValueError(f"name must be distinct non-empty strings; got {names}")
