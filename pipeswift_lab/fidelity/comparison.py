"""Predicted against measured: one simulated step next to one measured step, rank by rank.

Both sides are Timelines in the same schema, so the comparison is plain arithmetic on their
actions. For one step of each (the simulated step 0; by default the measured step with the
median step time, leaving out the first, warm-up step) it reports per rank the busy time (sum
of the compute actions), the idle time (step minus busy), the mean duration of each action
kind, and for the pipeline:

* ``step_ms`` — the measured step as :data:`MEASURED_STEP` defines it (for a RunResult its
  :attr:`~pipeswift_lab.runner.RunResult.steady_step_ms`: the whole step, optimizer
  included; for a bare Timeline, which has no whole step, the action span of that step)
  against the predicted span plus the predicted ``meta["step_overhead_ms"]`` (the
  calibrated runtime overhead; 0 for an uncalibrated simulation);
* ``span_ms`` — first action start to last action end on both sides;
* ``replayed_step_ms`` — the simulator fed the measured step's own action durations
  (:func:`~pipeswift_lab.fidelity.replays.replay`) with the prediction's transfers, time between
  actions and step overhead: ``predicted - replayed`` is the error of the durations, ``replayed - measured``
  that of the schedule and communication model (:attr:`Comparison.decomposition`);
* ``bubble_ratio`` as the idle share of ``P x span`` (GPipe's convention, ``(P-1)/(m+P-1)``
  for uniform stages);
* ``peak_memory_bytes`` per rank, when the measured side is a RunResult that measured memory:
  the memory model's prediction for that run against the tensor-level measured peak
  (:attr:`~pipeswift_lab.runner.RunResult.memory`, replica 0).

``rel_error`` is ``(predicted - measured) / measured``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.display import html_card, text_card
from ..core.vocabulary import COMPUTE_KINDS
from ..simulation.steady import MEASURED_STEP, first_step, pick_step, timeline_of
from ..simulation.timeline import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: A metric's key: ``(metric, rank)``, rank None for a whole-pipeline metric.
MetricKey = tuple[str, "int | None"]


def _one_step(df: pd.DataFrame, step: int) -> pd.DataFrame:
    """The compute actions of ``step``, shifted to start at 0; of replica 0 only when the Timeline has several
    (D > 1)."""
    out = df[(df["step"] == step) & df["kind"].isin(COMPUTE_KINDS) & (df["replica"] == 0)].copy()
    if out.empty:
        raise ValueError(f"step {step} has no compute actions")
    t0 = out["start_ms"].min()
    out["start_ms"] -= t0
    out["end_ms"] -= t0
    return out


def _metrics(df: pd.DataFrame, ranks: list[int]) -> dict[MetricKey, float]:
    """Step time, bubble, per-rank busy/idle (the Timeline's own definitions) and mean action durations."""
    timeline = Timeline(df, meta={"P": len(ranks)} if ranks == list(range(len(ranks))) else {})
    out: dict[MetricKey, float] = {
        ("span_ms", None): timeline.step_ms,
        ("bubble_ratio", None): timeline.bubble_ratio,
    }
    by_rank = timeline.idle_by_rank.set_index("rank")
    for r in ranks:
        out[("busy_ms", r)] = float(by_rank.loc[r, "busy_ms"])
        out[("idle_ms", r)] = float(by_rank.loc[r, "idle_ms"])
    dur = df["end_ms"] - df["start_ms"]
    for (kind, r), value in dur.groupby([df["kind"], df["rank"]]).mean().items():
        out[(f"mean_{kind}_ms", int(r))] = float(value)
    return out


@dataclass(frozen=True, repr=False, kw_only=True)
class Comparison:
    """A predicted and a measured step side by side (see the module docstring for the metrics).

    ``df`` columns: ``metric``, ``rank`` (``<NA>`` for whole-pipeline metrics), ``predicted``,
    ``measured``, ``rel_error``.
    """

    predicted: Timeline
    """The predicted Timeline."""
    measured: Timeline
    """The measured Timeline."""
    predicted_step: int
    """The predicted step compared (its first)."""
    measured_step: int
    """The measured step compared (:func:`~pipeswift_lab.simulation.steady.pick_step`)."""
    df: pd.DataFrame
    """Every metric, predicted against measured."""
    replayed: Timeline | None = None
    """The replayed Timeline (None when the measured timeline does not name its schedule)."""
    statistic: str = MEASURED_STEP
    """What the measured ``step_ms`` is."""

    def _value(self, metric: str, column: str) -> float:
        row = self.df[(self.df["metric"] == metric) & self.df["rank"].isna()]
        return float(row[column].iloc[0])

    @property
    def step_ms(self) -> tuple[float, float]:
        """``(predicted, measured)`` step time in ms."""
        return self._value("step_ms", "predicted"), self._value("step_ms", "measured")

    @property
    def step_rel_error(self) -> float:
        """``(predicted - measured) / measured`` of the step time."""
        return self._value("step_ms", "rel_error")

    @property
    def replayed_step_ms(self) -> float:
        """The step the simulator gives with the measured step's own action durations (NaN when it cannot replay)."""
        return self._value("replayed_step_ms", "predicted")

    @property
    def decomposition(self) -> pd.DataFrame:
        """The step error split in two: ``component``, ``ms``, ``share_of_measured``.

        ``durations`` is predicted minus replayed (the action times the prediction assumed
        against those measured), ``schedule and communication model`` replayed minus
        measured (what the simulator's order, transfers and step overhead miss with the
        right durations), ``total`` their sum, predicted minus measured.
        """
        p, m = self.step_ms
        r = self.replayed_step_ms
        rows = [("durations", p - r), ("schedule and communication model", r - m), ("total", p - m)]
        return pd.DataFrame([{"component": c, "ms": v, "share_of_measured": v / m} for c, v in rows])

    @property
    def memory(self) -> pd.DataFrame:
        """Peak memory per rank: ``rank``, ``predicted``, ``measured`` (bytes), ``rel_error``; empty when the measured
        side measured none."""
        rows = self.df[self.df["metric"] == "peak_memory_bytes"]
        return rows[["rank", "predicted", "measured", "rel_error"]].reset_index(drop=True)

    @property
    def bubble_ratio(self) -> tuple[float, float]:
        """``(predicted, measured)`` idle share of ``P x step`` (GPipe's convention)."""
        return self._value("bubble_ratio", "predicted"), self._value("bubble_ratio", "measured")

    def plot(self, ax: Axes | None = None) -> Axes:
        """Both Gantt charts on one Axes: one row per rank, predicted bars outlined above, measured bars filled
        below. Returns the Axes."""
        from matplotlib.patches import Patch

        from ..core.plot import KIND_COLORS, get_ax

        pred = _one_step(timeline_of(self.predicted, "predicted").df, self.predicted_step)
        meas = _one_step(timeline_of(self.measured, "measured").df, self.measured_step)
        ranks = sorted(set(pred["rank"]) | set(meas["rank"]))
        ax = get_ax(ax, figsize=(9.0, 0.9 + 0.8 * len(ranks)))
        label_ms = 0.04 * max(pred["end_ms"].max(), meas["end_ms"].max())  # bars wider than this get their number
        _draw_step(ax, pred, offset=-0.21, filled=False, label_ms=label_ms)
        _draw_step(ax, meas, offset=0.21, filled=True, label_ms=label_ms)
        ax.set_yticks(ranks)
        ax.set_yticklabels([f"rank {r}" for r in ranks])
        ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
        ax.set_xlabel("ms since the step started")
        p, m = self.step_ms
        ax.set_title(
            f"predicted (outline, above) {p:.1f} ms vs measured (filled, below) {m:.1f} ms: "
            f"error {self.step_rel_error:+.1%}"
        )
        kinds = [k for k in COMPUTE_KINDS if k in set(pred["kind"]) | set(meas["kind"])]
        ax.legend(
            handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds],
            loc="upper right",
            fontsize="small",
            ncols=len(kinds),
        )
        return ax

    def _summary(self) -> dict[str, Any]:
        p, m = self.step_ms
        bp, bm = self.bubble_ratio
        return {
            "predicted_step_ms": p,
            "measured_step_ms": m,
            "step_rel_error": self.step_rel_error,
            "replayed_step_ms": self.replayed_step_ms,
            "predicted_bubble": bp,
            "measured_bubble": bm,
            "measured_step": self.measured_step,
            "measured step is": self.statistic,
            **({"memory_rel_error_max": float(self.memory["rel_error"].abs().max())} if len(self.memory) else {}),
        }

    def _repr_html_(self) -> str:
        return html_card("Predicted vs measured", self._summary(), self.df)

    def __str__(self) -> str:
        return text_card("Predicted vs measured", self._summary())

    __repr__ = __str__


def _draw_step(ax: Axes, df: pd.DataFrame, *, offset: float, filled: bool, label_ms: float) -> None:
    """One side's bars on its half of each rank's row: outlined (predicted) or filled (measured), numbered when wider
    than ``label_ms``."""
    from ..core.plot import KIND_COLORS

    for row in df.itertuples(index=False):
        color = KIND_COLORS.get(row.kind, "#999999")
        ax.broken_barh(
            [(row.start_ms, row.end_ms - row.start_ms)],
            (row.rank + offset - 0.19, 0.38),
            facecolors=color if filled else "none",
            edgecolors=color if not filled else "white",
            linewidth=1.2 if not filled else 0.4,
            alpha=0.9,
        )
        if row.end_ms - row.start_ms > label_ms:
            center = (row.start_ms + row.end_ms) / 2
            text_color = "white" if filled else color
            ax.text(
                center, row.rank + offset, f"{row.microbatch}", ha="center", va="center", fontsize=7, color=text_color
            )


def compare(predicted: Any, measured: Any, *, step: int | None = None) -> Comparison:
    """Compare a predicted Timeline (its step 0) with a measured one (``step``, default the median step after the
    first).

    ``predicted``: a Timeline or anything with ``.timeline`` (a simulation result);
    ``measured``: a :class:`~pipeswift_lab.runner.RunResult` or a Timeline. The two must have
    the same ranks. The measured ``step_ms`` is :data:`MEASURED_STEP` (``Comparison.statistic``
    says which); the replayed step is given when the measured timeline names its schedule,
    P, m and v (a RunResult's does). Returns a :class:`Comparison`.
    """
    pred_tl, meas_tl = timeline_of(predicted, "predicted"), timeline_of(measured, "measured")
    pred_step = int(pred_tl.df["step"].min()) if len(pred_tl.df) else 0
    meas_step = pick_step(measured, step)
    pred, meas = _one_step(pred_tl.df, pred_step), _one_step(meas_tl.df, meas_step)
    pred_ranks, meas_ranks = sorted(set(pred["rank"])), sorted(set(meas["rank"]))
    if pred_ranks != meas_ranks:
        raise ValueError(f"predicted has ranks {pred_ranks} but measured {meas_ranks}; compare runs of the same P")
    pm, mm = _metrics(pred, pred_ranks), _metrics(meas, meas_ranks)
    _add_memory(measured, pm, mm)
    overhead = float(pred_tl.meta.get("step_overhead_ms", 0.0) or 0.0)
    measured_step_ms, statistic = _measured_step(measured, meas_tl, meas_step, mm[("span_ms", None)], step)
    replayed = _replay(pred_tl, meas_tl, meas_step, overhead)
    replayed_ms = replayed.step_ms + overhead if replayed is not None else np.nan
    return Comparison(
        predicted=pred_tl,
        measured=meas_tl,
        predicted_step=pred_step,
        measured_step=meas_step,
        df=_table(pm, mm, pm[("span_ms", None)] + overhead, measured_step_ms, replayed_ms),
        replayed=replayed,
        statistic=statistic,
    )


def _add_memory(measured: Any, pm: dict[MetricKey, float], mm: dict[MetricKey, float]) -> None:
    """Add each rank's ``peak_memory_bytes`` (predicted for the run, measured) when ``measured`` has them."""
    memory = getattr(measured, "memory", None)
    if not isinstance(memory, pd.DataFrame) or memory.empty:
        return
    for row in memory[memory["replica"] == 0].itertuples(index=False):
        pm[("peak_memory_bytes", int(row.rank))] = float(row.predicted_peak_bytes)
        mm[("peak_memory_bytes", int(row.rank))] = float(row.measured_peak_bytes)


def _measured_step(
    measured: Any, meas_tl: Timeline, meas_step: int, span_ms: float, step: int | None
) -> tuple[float, str]:
    """The measured step (ms) and what it is: a RunResult's whole step, else the Timeline's action span."""
    whole = getattr(measured, "step_ms", None) if measured is not meas_tl else None
    if whole:
        return float(whole[meas_step - first_step(measured)]), MEASURED_STEP
    which = "median step after the first" if step is None else f"step {meas_step}"
    return (
        span_ms,
        f"action span (first action start to last action end) of the {which}; a bare Timeline has no whole step",
    )


def _replay(pred_tl: Timeline, meas_tl: Timeline, meas_step: int, overhead: float) -> Timeline | None:
    """The measured step replayed with the prediction's transfers, gap and overhead (None when the measured timeline
    does not name its schedule, P, m and v)."""
    if not all(k in meas_tl.meta for k in ("schedule", "P", "m", "v")):
        return None
    from .replays import replay

    transfer = pred_tl.meta.get("stage_transfer_ms")
    stages = int(meas_tl.meta["P"]) * int(meas_tl.meta["v"])
    return replay(
        meas_tl,
        meas_step,
        transfer_ms=transfer if transfer is not None and len(transfer) == stages else None,
        step_overhead_ms=overhead,
        gap_ms=float(pred_tl.meta.get("gap_ms", 0.0) or 0.0),
    )


def _table(
    pm: dict[MetricKey, float],
    mm: dict[MetricKey, float],
    predicted_step_ms: float,
    measured_step_ms: float,
    replayed_ms: float,
) -> pd.DataFrame:
    """:attr:`Comparison.df`: the step, the replayed step, then every metric of either side, with relative errors."""
    rows = [
        {"metric": "step_ms", "rank": None, "predicted": predicted_step_ms, "measured": measured_step_ms},
        {"metric": "replayed_step_ms", "rank": None, "predicted": replayed_ms, "measured": measured_step_ms},
    ]
    for key in list(pm) + [k for k in mm if k not in pm]:
        rows.append(
            {"metric": key[0], "rank": key[1], "predicted": pm.get(key, np.nan), "measured": mm.get(key, np.nan)}
        )
    df = pd.DataFrame(rows)
    df["rel_error"] = [
        (p - m) / m if np.isfinite(m) and m != 0 else np.nan for p, m in zip(df["predicted"], df["measured"])
    ]
    df["rank"] = df["rank"].astype("Int64")
    return df


__all__ = ["MEASURED_STEP", "Comparison", "compare"]
