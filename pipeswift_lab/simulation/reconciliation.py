"""Which schedule a partition runs under, with how many chunks per rank, on which ranks: one answer for the simulator,
the sweep and the runner.

A :class:`~pipeswift_lab.partitioning.Partition` fixes the number of stages per rank ``v`` and their placement on
ranks (round-robin, or a V for ZBV/DualPipeV) when it is made. :func:`reconcile` takes a partition, an optional
schedule, ``v`` and ``m``, and either returns the one consistent :class:`Reconciled` or raises an error naming what
disagrees and how to re-partition::

    shape = reconcile(part, "Interleaved1F1B", m=8)
    shape.schedule, shape.v, shape.P, shape.placement

The rules: ``schedule=None`` takes the partition's own, else ``"1F1B"`` for one stage per rank and
``"Interleaved1F1B"`` for more (the defaults of ``partition()``); a given ``v`` must be the partition's; the schedule
must allow the partition's ``v`` (GPipe and 1F1B one stage per rank, ZBV and DualPipeV exactly two); the schedule's
placement (:func:`~pipeswift_lab.core.vocabulary.stage_to_rank`) must be the partition's; with ``m``, torch's rules for
``(P, m, schedule, v)`` (:func:`~pipeswift_lab.core.vocabulary.validate`). A schedule other than the partition's own
passes when its placement is the same (a 1F1B partition runs GPipe); ``same_schedule=True`` refuses it, as the runner
does, whose run records the partition it ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..core.checks import check_int
from ..core.schedule import Schedule, ScheduleLike
from ..core.vocabulary import (
    SINGLE_CHUNK_SCHEDULES,
    V_SHAPE_SCHEDULES,
    canonical_schedule,
    stage_to_rank,
    validate,
)

#: What :func:`reconcile` needs of a partition (a Partition, or any object with these attributes; ``schedule``, the
#: partition's own, is read when present).
PARTITION_FIELDS = ("P", "v", "stage_to_rank")


@dataclass(frozen=True, kw_only=True)
class Reconciled:
    """A partition, a schedule, ``v`` and ``m`` that agree with each other and with torch (:func:`reconcile`)."""

    schedule: ScheduleLike
    """The schedule, spelled as torch spells it, or a :class:`~pipeswift_lab.core.schedule.Schedule`."""
    v: int
    """Stages (chunks) per rank."""
    P: int
    """Pipeline ranks."""
    m: int | None
    """Micro-batches per step, checked against torch's rules; None when none was given."""
    placement: tuple[int, ...]
    """The rank of every stage, in stage order (torch's mapping for the schedule)."""

    @property
    def S(self) -> int:
        """Stages: ``P * v``."""
        return self.P * self.v


def reconcile(
    partition: Any,
    schedule: ScheduleLike | None = None,
    *,
    v: int | None = None,
    m: int | None = None,
    same_schedule: bool = False,
) -> Reconciled:
    """Reconcile ``partition`` with ``schedule``, ``v`` and ``m``; return the :class:`Reconciled` shape.

    ``partition`` is a :class:`~pipeswift_lab.partitioning.Partition` (or any object with ``P``, ``v``,
    ``stage_to_rank`` and optionally ``schedule``), or a per-stage DataFrame (``P * v`` rows in stage order; its ``v``
    defaults to what the schedule allows, and an interleaved schedule needs it given). The rules are the module
    docstring's. Raises ``TypeError`` for a partition of another type, ``ValueError`` naming what disagrees and how to
    re-partition.
    """
    if isinstance(partition, pd.DataFrame):
        return _of_table(partition, schedule, v, m)
    P, own_v, own, placement = _read(partition)
    schedule = _resolve_schedule(schedule, own, own_v)
    if v is not None and check_int("v", v, minimum=1) != own_v:
        raise ValueError(
            f"v={v} does not match the partition's v={own_v}; the stages per rank are fixed when partitioning: "
            f"re-partition with partition(profile, {P}, v={v}, schedule={schedule!r}), or leave v=None"
        )
    _check_chunks(schedule, own_v, P)
    if isinstance(schedule, Schedule):
        return _of_schedule(schedule, P, own_v, placement, m)
    if same_schedule and own is not None and canonical_schedule(own) != schedule:
        raise ValueError(
            f"schedule={schedule!r} differs from the partition's schedule {own!r}; the partition's stage placement was "
            f"made for {own!r}: pass schedule={own!r} or re-partition for {schedule!r}"
        )
    expected = stage_to_rank(P, own_v, schedule)
    if placement != expected:
        raise ValueError(
            f"schedule={schedule!r} places stages on ranks as {list(expected)} but the partition (schedule={own!r}) "
            f"places them as {list(placement)}; re-partition with partition(profile, {P}, v={own_v}, "
            f"schedule={schedule!r})"
        )
    return Reconciled(schedule=schedule, v=own_v, P=P, m=_check_m(P, m, schedule, own_v), placement=placement)


def _read(partition: Any) -> tuple[int, int, str | None, tuple[int, ...]]:
    """``(P, v, own schedule or None, placement)`` of a partition, each checked."""
    for attr in PARTITION_FIELDS:
        if not hasattr(partition, attr):
            raise TypeError(
                f"partition must be a pipeswift_lab.Partition (with {', '.join(PARTITION_FIELDS)}) or a per-stage "
                f"DataFrame; {type(partition).__name__} has no {attr!r}"
            )
    P = check_int("partition.P", partition.P, minimum=1)
    v = check_int("partition.v", partition.v, minimum=1)
    placement = tuple(int(r) for r in partition.stage_to_rank)
    if len(placement) != P * v:
        raise ValueError(
            f"partition.stage_to_rank has {len(placement)} stages; P={P} ranks with v={v} stages each need {P * v}"
        )
    return P, v, getattr(partition, "schedule", None), placement


def _resolve_schedule(schedule: ScheduleLike | None, own: ScheduleLike | None, v: int) -> ScheduleLike:
    """The schedule given, else the partition's own, else ``partition()``'s default for ``v``; canonical."""
    if schedule is None:
        schedule = own if own is not None else ("1F1B" if v == 1 else "Interleaved1F1B")
    return canonical_schedule(schedule)


def _check_chunks(schedule: ScheduleLike, v: int, P: int) -> None:
    """Refuse a partition's ``v`` the schedule does not run."""
    if isinstance(schedule, Schedule):
        if (schedule.P, schedule.v) != (P, v):
            raise ValueError(
                f"schedule {schedule.name!r} has P={schedule.P} ranks with {schedule.v} stage(s) each ({schedule.S} "
                f"stages) but the partition has P={P} with v={v} ({P * v} stages); re-partition with "
                f"partition(profile, {schedule.P}, v={schedule.v}, schedule=<the Schedule>)"
            )
        return
    if schedule in SINGLE_CHUNK_SCHEDULES and v != 1:
        raise ValueError(
            f"v={v} is not allowed for schedule={schedule!r}, which runs one stage per rank, but the partition has "
            f"v={v}; re-partition with partition(profile, {P}, v=1, schedule={schedule!r}), or pick a multi-chunk "
            "schedule"
        )
    if schedule in V_SHAPE_SCHEDULES and v != 2:
        raise ValueError(
            f"v={v} is not allowed for schedule={schedule!r}, which places exactly 2 stages per rank in a V, but the "
            f"partition has v={v}; re-partition with partition(profile, {P}, v=2, schedule={schedule!r})"
        )


def _of_schedule(schedule: Schedule, P: int, v: int, placement: tuple[int, ...], m: int | None) -> Reconciled:
    """A partition under a :class:`~pipeswift_lab.core.schedule.Schedule`: the order must place stages as the
    partition does (a V-shaped order needs a V-shaped partition)."""
    if placement != schedule.placement:
        raise ValueError(
            f"schedule {schedule.name!r} runs its stages on ranks {list(schedule.placement)} ({schedule.shape} shape) "
            f"but the partition places them on {list(placement)}; re-partition with partition(profile, {P}, v={v}, "
            "schedule=<the Schedule>), which places the stages as the order runs them"
        )
    return Reconciled(schedule=schedule, v=v, P=P, m=_check_m(P, m, schedule, v), placement=placement)


def _check_m(P: int, m: int | None, schedule: ScheduleLike, v: int) -> int | None:
    """``m`` checked against torch's rules for ``(P, m, schedule, v)``; None stays None."""
    if m is None:
        return None
    m = check_int("m", m, minimum=1)
    validate(P, m, schedule, v)
    return m


def _of_table(df: pd.DataFrame, schedule: ScheduleLike | None, v: int | None, m: int | None) -> Reconciled:
    """A per-stage table's shape: ``P = rows / v``, torch's placement for the schedule (a Schedule's own)."""
    schedule = canonical_schedule(schedule if schedule is not None else "1F1B")
    if isinstance(schedule, Schedule):
        v = schedule.v if v is None else v
    if v is None:
        if schedule in SINGLE_CHUNK_SCHEDULES:
            v = 1
        elif schedule in V_SHAPE_SCHEDULES:
            v = 2
        else:
            raise ValueError(
                f"schedule={schedule!r} with a stage table needs v (stages per rank); the table has {len(df)} "
                "stages = P*v"
            )
    v = check_int("v", v, minimum=1)
    if len(df) == 0 or len(df) % v:
        raise ValueError(
            f"the stage table has {len(df)} rows; with v={v} it needs P*v rows (a positive multiple of {v})"
        )
    P = len(df) // v
    placement = stage_to_rank(P, v, schedule)
    return Reconciled(schedule=schedule, v=v, P=P, m=_check_m(P, m, schedule, v), placement=placement)


__all__ = ["PARTITION_FIELDS", "Reconciled", "reconcile"]
