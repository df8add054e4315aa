"""A job of several segments, one per configuration: which segments to run, and one RunResult of them all.

A segment is a stretch of steps on one partition. ``Elastic(resize_at={step: P})`` and
``Elastic(partitions={step: Partition})`` (``run(..., elastic=...)``) plan them before launch;
``Elastic(rebalance_every=N)`` adds one whenever a rebalance pays. Between two segments every rank saves (a
``resize`` or ``rebalance`` checkpoint), the workers stop, and the next segment's workers start and restore by name;
:func:`combine` joins the segments' measurements on one clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..core.checks import check_int
from ..core.schedule import ScheduleLike

if TYPE_CHECKING:
    from torch import nn

    from ..core.jct import JCT
    from ..partitioning.stages import Partition
    from ..simulation.timeline import Timeline
    from .result import RunResult

#: Columns of ``RunResult.segments``.
SEGMENT_COLUMNS = (
    "segment",
    "reason",
    "first_step",
    "last_step",
    "P",
    "v",
    "schedule",
    "bounds",
    "save_s",
    "teardown_s",
    "assembly_s",
    "restore_s",
    "restore_bytes",
)


@dataclass(frozen=True)
class PlannedSegment:
    """A segment known before launch: it starts at ``start_step`` on ``partition`` (the first one, then one per
    resize)."""

    start_step: int
    partition: Partition


def plan_segments(
    model: nn.Module,
    partition: Partition,
    steps: int,
    first_step: int,
    resize_at: dict[int, int] | None,
    partitions: dict[int, Partition] | None,
    profile: Any,
    m: int,
    schedule: ScheduleLike | None,
) -> list[PlannedSegment]:
    """The segments ``resize_at``/``partitions`` ask for, each partition made and checked before launch.

    ``resize_at={step: P}`` partitions ``profile`` for each new P with the first partition's
    schedule, v, memory cap, optimizer and link (``partition(method="balanced")``, so a P the
    model cannot be split into, or one that does not fit memory, raises here);
    ``partitions={step: Partition}`` gives the splits. Steps must lie strictly between the
    job's first step and ``steps``.
    """
    if resize_at is not None and partitions is not None:
        raise ValueError("give resize_at={step: P} or partitions={step: Partition}, not both")
    planned = [PlannedSegment(first_step, partition)]
    changes: dict[int, Any] | None = resize_at if resize_at is not None else partitions
    if changes is None:
        return planned
    name = "resize_at" if resize_at is not None else "partitions"
    if not isinstance(changes, dict) or not changes:
        raise TypeError(
            f"{name} must be a non-empty dict {{step: {'P' if resize_at is not None else 'Partition'}}}; got "
            f"{changes!r}"
        )
    if resize_at is not None and profile is None:
        raise ValueError(
            "resize_at needs profile=... (the Profile the partitions come from) to partition the model for each new P"
        )
    from ..partitioning.balance import partition as make_partition

    for step in sorted(changes):
        step_i = check_int(f"{name} step", step)
        if not first_step < step_i < steps:
            raise ValueError(
                f"{name} step {step_i} is outside the job's steps ({first_step}, {steps}): a change must come after "
                f"step {first_step} and before the last step {steps}"
            )
        value = changes[step]
        if resize_at is not None:
            P = check_int(f"resize_at[{step_i}]", value, minimum=1)
            first = partition
            try:
                new = make_partition(
                    profile,
                    P,
                    method="balanced",
                    v=first.v,
                    schedule=first.schedule,
                    link=first.link,
                    mem_per_gpu_bytes=first.mem_per_gpu_bytes,
                    optimizer=first.optimizer,
                    m=m,
                )
            except ValueError as exc:
                raise ValueError(f"resize_at[{step_i}]={P}: {exc}") from None
        else:
            new = value
            if not hasattr(new, "bounds"):
                raise TypeError(f"partitions[{step_i}] must be a Partition; got {type(new).__name__}")
        planned.append(PlannedSegment(step_i, new))
    return planned


def _boundary_save_s(result: RunResult) -> float:
    table = result.checkpoints
    switch = table[table["kind"].isin(["resize", "rebalance"])] if len(table) else table
    return float(switch["blocking_ms"].iloc[-1] / 1e3) if len(switch) else 0.0


def segments_table(results: Sequence[RunResult], reasons: Sequence[str]) -> pd.DataFrame:
    """One row per segment (see :data:`SEGMENT_COLUMNS`): the measured cost of every change of configuration."""
    rows = []
    for i, (result, reason) in enumerate(zip(results, reasons)):
        save_s = _boundary_save_s(result)
        rows.append(
            {
                "segment": i,
                "reason": reason,
                "first_step": result.first_step,
                "last_step": result.first_step + len(result.step_ms) - 1,
                "P": result.P,
                "v": result.v,
                "schedule": result.schedule,
                "bounds": tuple(result.meta["bounds"]),
                "save_s": save_s,
                "teardown_s": max(0.0, result.jct.cleanup_s - save_s),
                "assembly_s": result.jct.assembly_s,
                "restore_s": result.restore_s,
                "restore_bytes": int(result.meta.get("restore_bytes", 0)),
            }
        )
    return pd.DataFrame(rows, columns=list(SEGMENT_COLUMNS))


def combine(results: Sequence[RunResult], reasons: Sequence[str]) -> RunResult:
    """One :class:`~pipeswift_lab.runner.result.RunResult` of consecutive segments, on the first segment's clock.

    Steps, losses and the timeline (with a ``segment`` column) run across all segments; the
    JCT terms add up segment by segment, so a change's save and teardown count as cleanup and
    its start-up and restore as assembly (restore) or preemption loss, as they happened; the
    final parameters, ranks and P are the last segment's.
    """
    from .rebalance import REBALANCE_COLUMNS

    first, last = results[0], results[-1]
    t0 = first.meta["t0_ns"]
    timeline = _joined_timeline(results)
    jct = _summed_jct(results)
    rebalances = [row for r in results for row in r.meta.get("rebalances", [])]
    meta = {
        **last.meta,
        "step_start_ms": tuple(x + (r.meta["t0_ns"] - t0) / 1e6 for r in results for x in r.meta["step_start_ms"]),
        "t0_ns": t0,
        "launch_ns": first.meta["launch_ns"],
        "probed_steps": sorted({s for r in results for s in r.probed_steps}),
    }
    return dataclasses.replace(
        last,
        timeline=timeline,
        step_ms=tuple(x for r in results for x in r.step_ms),
        losses=tuple(x for r in results for x in r.losses),
        jct=jct,
        first_step=first.first_step,
        meta=meta,
        checkpoints=pd.concat([r.checkpoints.assign(segment=i) for i, r in enumerate(results)], ignore_index=True),
        restarts=sum(r.restarts for r in results),
        steps_redone=sum(r.steps_redone for r in results),
        recovery_s=sum(r.recovery_s for r in results),
        restore_s=first.restore_s,
        skipped_steps=tuple(x for r in results for x in r.skipped_steps),
        segments=segments_table(results, reasons),
        rebalances=pd.DataFrame(rebalances, columns=list(REBALANCE_COLUMNS)),
    )


def _joined_timeline(results: Sequence[RunResult]) -> Timeline | None:
    """The segments' timelines on the first segment's clock, with a ``segment`` column (None unless every segment
    has one)."""
    from ..simulation.timeline import Timeline

    t0, last = results[0].meta["t0_ns"], results[-1]
    frames = []
    for i, result in enumerate(results):
        if result.timeline is not None:
            shift = (result.meta["t0_ns"] - t0) / 1e6
            df = result.timeline.df.copy()
            df["start_ms"] += shift
            df["end_ms"] += shift
            df["segment"] = i
            frames.append(df)
    if not frames or len(frames) != len(results) or last.timeline is None:
        return None
    meta = {
        **last.timeline.meta,
        "segments": len(results),
        "P": max(r.P for r in results),
        "P_by_segment": [r.P for r in results],
    }
    return Timeline(pd.concat(frames, ignore_index=True), source="measured", meta=meta)


def _summed_jct(results: Sequence[RunResult]) -> JCT:
    """The segments' JCT terms added up; a change's restore counts as assembly (its re-assembly), not as
    preemption loss."""
    from ..core.jct import JCT

    switch_restore_s = sum(r.restore_s for r in results[1:])
    last = results[-1]
    return JCT(
        assembly_s=sum(r.jct.assembly_s for r in results) + switch_restore_s,
        training_s=sum(r.jct.training_s for r in results),
        cleanup_s=sum(r.jct.cleanup_s for r in results),
        preemption_loss_s=sum(r.jct.preemption_loss_s for r in results) - switch_restore_s,
        label=last.jct.label
        if len(results) == 1
        else f"measured {len(results)} segments, P " + "→".join(str(r.P) for r in results),
    )


__all__ = ["combine", "plan_segments", "PlannedSegment", "SEGMENT_COLUMNS", "segments_table"]
