"""The Gantt chart of a Timeline (:meth:`Timeline.plot`): one row per device, compute bars colored by kind.

Idle time is left empty. Micro-batch numbers label the bars wide enough to hold them; with several stages per rank,
later chunks are drawn lighter. Transfers (``SEND_*``), the gradient reduction (``REDUCE_GRAD``) and FSDP's
all-gather (``UNSHARD``) show as thin bars under the rank's row; tensor parallelism's collectives (``TP_*``), which
run inside the compute actions, as thin dark bars along the bottom of the action that ran them. With several
replicas every (replica, rank) gets a row. The bottleneck, the busiest rank (:meth:`Timeline.bottleneck_rank`), gets
a shaded lane and a bold "bottleneck" tick label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.vocabulary import COMPUTE_KINDS, TP_KINDS
from .schema import device_index
from .timeline_view import TimelineView

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Most compute bars that get a micro-batch label (beyond it the labels are unreadable and slow).
MAX_LABELS = 800

#: Color of the bottleneck's shaded lane and tick label.
BOTTLENECK_COLOR = "#B8860B"
#: Color of tensor parallelism's collectives, drawn inside the compute bars.
TP_COLOR = "#222222"


@dataclass(frozen=True, kw_only=True)
class _Bars:
    """The rows of the drawn step, as arrays ready for ``barh``."""

    row: np.ndarray
    """Device row of each action (:func:`~pipeswift_lab.simulation.schema.device_index`)."""
    start: np.ndarray
    """Start (ms), shifted to the step's start when one step is drawn."""
    end: np.ndarray
    """End (ms), shifted likewise."""
    kind: np.ndarray
    """Action kind of each row (object array)."""
    stage: np.ndarray
    """Stage of each row."""
    mb: np.ndarray
    """Micro-batch of each row."""


def plot_timeline(
    timeline: TimelineView,
    ax: Axes | None = None,
    step: int | None = None,
    labels: bool = True,
    comms: bool = True,
    bottleneck: bool = True,
) -> Axes:
    """Draw ``timeline`` as a Gantt chart on ``ax`` (a new figure when None); return the Axes.

    ``step`` picks one step of a multi-step timeline (times then start at that step's start); None draws all steps.
    ``labels`` writes micro-batch numbers on wide bars; ``comms`` draws the transfers and the all-reduce;
    ``bottleneck`` shades the busiest rank's lane (every replica's) and labels it (none when all are equally busy).
    """
    from ..core.plot import get_ax

    bars = _bars(timeline, step)
    names = _row_names(timeline)
    ax = get_ax(ax, figsize=(9.0, 0.45 * len(names) + 1.4))
    chunk = _chunk_index(timeline)
    _draw_compute(ax, bars, chunk)
    if comms:
        _draw_comms(ax, bars)
    lo, hi = (float(bars.start.min()), float(bars.end.max())) if len(bars.row) else (0.0, 1.0)
    span = hi - lo if hi > lo else 1.0
    if labels:
        _draw_labels(ax, bars, span)
    marked = _bottleneck_rows(timeline, step) if bottleneck else []
    for i in marked:
        names[i] = f"{names[i]} · bottleneck"
    ax.set_yticks(range(len(names)), names)
    for i in marked:
        ax.get_yticklabels()[i].set(color=BOTTLENECK_COLOR, fontweight="bold")
        ax.fill_between(  # x in Axes fractions: the band spans the chart whatever its limits become
            [0.0, 1.0],
            i - 0.5,
            i + 0.5,
            transform=ax.get_yaxis_transform(),
            color=BOTTLENECK_COLOR,
            alpha=0.18,
            linewidth=0,
            zorder=0,
            label="bottleneck (busiest rank)" if i == marked[0] else None,
        )
    ax.set_ylim(len(names) - 0.2 if names else 1, -0.6)
    ax.set_xlim(lo, lo + span * 1.01)
    ax.set_xlabel("time since step start (ms)" if step is not None else "time (ms)")
    ax.set_title(_title(timeline))
    _legend(ax, later_chunks=any(chunk.get(int(s), 0) > 0 for s in bars.stage))
    ax.grid(axis="y", visible=False)
    return ax


def _bars(timeline: TimelineView, step: int | None) -> _Bars:
    """The rows to draw: all steps, or ``step`` alone shifted to start at 0."""
    df = timeline.df
    offset = 0.0
    if step is not None:
        if step not in timeline.steps:
            raise ValueError(f"step={step!r} is not in this timeline; steps are {timeline.steps}")
        df = df[df["step"] == step]
        offset = float(df["start_ms"].min())
    row = device_index(
        timeline.replicas, timeline.ranks, df["replica"].to_numpy(np.int64), df["rank"].to_numpy(np.int64)
    )
    return _Bars(
        row=row,
        start=df["start_ms"].to_numpy(float) - offset,
        end=df["end_ms"].to_numpy(float) - offset,
        kind=df["kind"].to_numpy(object),
        stage=df["stage"].to_numpy(np.int64),
        mb=df["microbatch"].to_numpy(np.int64),
    )


def _bottleneck_rows(timeline: TimelineView, step: int | None) -> list[int]:
    """The device rows of the busiest rank (one per replica), or none when every rank is equally busy."""
    rank = timeline.bottleneck_rank(step)
    if rank is None:
        return []
    replicas = np.asarray(timeline.replicas, dtype=np.int64)
    rows = device_index(timeline.replicas, timeline.ranks, replicas, np.full(len(replicas), rank))
    return [int(i) for i in rows]


def _row_names(timeline: TimelineView) -> list[str]:
    """One name per device row: replica d's rank r at row ``d * P + r``."""
    ranks, replicas = timeline.ranks, timeline.replicas
    if len(replicas) > 1:
        return [f"replica {d} rank {r}" for d in replicas for r in ranks]
    return [f"rank {r}" for r in ranks]


def _chunk_index(timeline: TimelineView) -> dict[int, int]:
    """Position of each stage among its rank's stages (0 for the first chunk)."""
    df = timeline.df
    pairs = sorted(set(zip(df["rank"].tolist(), df["stage"].tolist())))
    out: dict[int, int] = {}
    seen: dict[int, int] = {}
    for r, s in pairs:
        out[s] = seen.get(r, 0)
        seen[r] = seen.get(r, 0) + 1
    return out


def _draw_compute(ax: Axes, bars: _Bars, chunk: dict[int, int]) -> None:
    """The compute bars, one color per kind, a rank's later chunks lighter."""
    from ..core.plot import KIND_COLORS

    for k in COMPUTE_KINDS:
        sel = bars.kind == k
        if not sel.any():
            continue
        alpha = np.where([chunk.get(int(s), 0) == 0 for s in bars.stage[sel]], 1.0, 0.6)
        drawn = ax.barh(
            bars.row[sel],
            bars.end[sel] - bars.start[sel],
            left=bars.start[sel],
            height=0.8,
            color=KIND_COLORS[k],
            edgecolor="white",
            linewidth=0.4,
            label=k,
        )
        for bar, al in zip(drawn, alpha):
            bar.set_alpha(al)


def _draw_comms(ax: Axes, bars: _Bars) -> None:
    """Transfers, the gradient reduction and FSDP's all-gather as thin bars under each row; tensor parallelism's
    collectives as thin dark bars along the bottom of the compute bars they ran inside (one legend entry)."""
    from ..core.plot import KIND_COLORS

    for k in ("SEND_F", "SEND_B", "REDUCE_GRAD", "UNSHARD"):
        sel = bars.kind == k
        if sel.any():
            width = bars.end[sel] - bars.start[sel]
            ax.barh(bars.row[sel] + 0.47, width, left=bars.start[sel], height=0.12, color=KIND_COLORS[k], label=k)
    sel = np.isin(bars.kind, TP_KINDS)
    if sel.any():
        width = bars.end[sel] - bars.start[sel]
        ax.barh(bars.row[sel] + 0.3, width, left=bars.start[sel], height=0.12, color=TP_COLOR, label="TP collective")


def _draw_labels(ax: Axes, bars: _Bars, span: float) -> None:
    """Micro-batch numbers on the compute bars wide enough to hold them (none beyond :data:`MAX_LABELS` bars)."""
    compute = np.flatnonzero(np.isin(bars.kind, COMPUTE_KINDS))
    if not 0 < len(compute) <= MAX_LABELS:
        return
    figure: Any = ax.get_figure()
    fig_width_px = figure.get_size_inches()[0] * figure.dpi * 0.8
    for i in compute:
        text = str(bars.mb[i])
        width_px = (bars.end[i] - bars.start[i]) / span * fig_width_px
        if width_px >= 7 * len(text) + 4:
            center = (bars.start[i] + bars.end[i]) / 2
            ax.text(center, bars.row[i], text, ha="center", va="center", fontsize=7, color="white")


def _title(timeline: TimelineView) -> str:
    """``<source> <schedule> (P=.., m=.., v=..): step .. ms, bubble ..%``."""
    meta = timeline.meta
    details = ", ".join(f"{k}={meta[k]}" for k in ("P", "D", "m", "v") if k in meta and (k != "D" or meta[k] != 1))
    step_ms = timeline.step_ms
    step_text = f"{step_ms:,.0f}" if step_ms >= 100 else f"{step_ms:.3g}"
    title = f"{timeline.source} {meta.get('schedule', '')} ({details}): step {step_text} ms"
    return f"{title}, bubble {timeline.bubble_ratio:.1%}".replace("  ", " ")


def _legend(ax: Axes, later_chunks: bool) -> None:
    """The kinds' legend outside the Axes, with a note on the lighter bars when a rank holds several chunks."""
    where: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.0, 1.0), "fontsize": "small", "frameon": False}
    if not later_chunks:
        ax.legend(**where)
        return
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles.append(Patch(facecolor="grey", alpha=0.6, edgecolor="white", label="lighter: the rank's later chunk"))
    ax.legend(handles=handles, **where)


__all__ = ["BOTTLENECK_COLOR", "MAX_LABELS", "TP_COLOR", "plot_timeline"]
