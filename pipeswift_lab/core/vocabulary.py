"""The vocabulary of ``torch.distributed.pipelining`` that every room speaks: schedule names, action kinds, how
many chunks a schedule places per rank by default, and on which rank each stage sits.
"""

from __future__ import annotations

from typing import overload

from .checks import check_int
from .schedule import Schedule, ScheduleLike

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KINDS",
    "MULTI_CHUNK_SCHEDULES",
    "REDUCE_KINDS",
    "SHARD_KINDS",
    "SCHEDULES",
    "SINGLE_CHUNK_SCHEDULES",
    "TORCH_CLASS",
    "TP_COLLECTIVE",
    "TP_KINDS",
    "V_SHAPE_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "accepts",
    "canonical_schedule",
    "check_schedule_v",
    "default_v",
    "splits_backward",
    "stage_to_rank",
    "validate",
]

#: Schedule names, spelled as ``torch.distributed.pipelining`` spells them.
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules that place one stage on every rank (``v == 1``), run by torch's single-chunk runtime.
SINGLE_CHUNK_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")
#: Schedules that place several stages ("chunks", ``v``) on every rank.
MULTI_CHUNK_SCHEDULES: tuple[str, ...] = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules whose chunks go to ranks in a V shape and need exactly two per rank.
V_SHAPE_SCHEDULES: tuple[str, ...] = ("ZBVZeroBubble", "DualPipeV")


def default_v(schedule: ScheduleLike) -> int:
    """Chunks per rank when none is given: 1 for the single-chunk schedules, 2 for the others, a
    :class:`~pipeswift_lab.core.schedule.Schedule`'s own."""
    if isinstance(schedule, Schedule):
        return schedule.v
    return 1 if schedule not in MULTI_CHUNK_SCHEDULES else 2


def splits_backward(schedule: ScheduleLike) -> bool:
    """Whether ``schedule`` runs backwards as input-grad (I) and weight-grad (W) passes: the zero-bubble family, or a
    :class:`~pipeswift_lab.core.schedule.Schedule` holding an I."""
    if isinstance(schedule, Schedule):
        return schedule.splits_backward
    return canonical_schedule(schedule) in ZERO_BUBBLE_SCHEDULES


#: Schedules that split the backward into input-grad (I) and weight-grad (W).
ZERO_BUBBLE_SCHEDULES: tuple[str, ...] = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

#: Action kinds, as ``torch.distributed.pipelining`` names them: forward, full backward, input-grad, weight-grad ...
COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
#: ... and the transfers between ranks.
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: ... and the gradient reduction across data-parallel processes (torch's ``REDUCE_GRAD``: DDP's all-reduce over the
#: replicas, FSDP2's reduce-scatter), measured when D > 1 or fsdp > 1.
REDUCE_KINDS: tuple[str, ...] = ("REDUCE_GRAD",)
#: ... and FSDP2's all-gather of a stage's sharded parameters at the start of a step (torch's ``UNSHARD``).
SHARD_KINDS: tuple[str, ...] = ("UNSHARD",)
#: ... and tensor parallelism's collectives, measured inside the ``F``, ``B``, ``I`` or ``W`` that ran them (the
#: collectives of DTensor's redistributions, forward and backward; :mod:`pipeswift_lab.runner.rank.tp_comm`).
TP_KINDS: tuple[str, ...] = ("TP_ALL_REDUCE", "TP_ALL_GATHER", "TP_REDUCE_SCATTER", "TP_ALL_TO_ALL")
#: The collective each of :data:`TP_KINDS` runs over the tensor-parallel ranks (the names of
#: :mod:`pipeswift_lab.core.topology`'s cost formulas).
TP_COLLECTIVE: dict[str, str] = {
    "TP_ALL_REDUCE": "all_reduce",
    "TP_ALL_GATHER": "all_gather",
    "TP_REDUCE_SCATTER": "reduce_scatter",
    "TP_ALL_TO_ALL": "all_to_all",
}
#: Every action kind a Timeline row may hold.
KINDS: tuple[str, ...] = COMPUTE_KINDS + COMM_KINDS + REDUCE_KINDS + SHARD_KINDS + TP_KINDS

_BY_LOWER: dict[str, str] = {name.lower(): name for name in SCHEDULES}


@overload
def canonical_schedule(schedule: str) -> str: ...
@overload
def canonical_schedule(schedule: Schedule) -> Schedule: ...
@overload
def canonical_schedule(schedule: ScheduleLike) -> ScheduleLike: ...
def canonical_schedule(schedule: ScheduleLike) -> ScheduleLike:
    """Return the canonical spelling of ``schedule``: case, ``_`` and ``-`` are ignored, and torch's class name
    (``"ScheduleInterleaved1F1B"``) is accepted for its schedule. A :class:`~pipeswift_lab.core.schedule.Schedule` is
    returned as it is."""
    if isinstance(schedule, Schedule):
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(
            f"schedule must be a name, one of {list(SCHEDULES)}, or a pipeswift_lab.Schedule; got "
            f"{type(schedule).__name__} {schedule!r}"
        )
    key = schedule.lower().replace("_", "").replace("-", "")
    if key.removeprefix("schedule") in _BY_LOWER:
        key = key.removeprefix("schedule")
    if key not in _BY_LOWER:
        raise ValueError(
            f"schedule={schedule!r} is not known; valid schedules are {list(SCHEDULES)} (case-insensitive)"
        )
    return _BY_LOWER[key]


@overload
def check_schedule_v(schedule: str, v: int) -> tuple[str, int]: ...
@overload
def check_schedule_v(schedule: Schedule, v: int) -> tuple[Schedule, int]: ...
@overload
def check_schedule_v(schedule: ScheduleLike, v: int) -> tuple[ScheduleLike, int]: ...
def check_schedule_v(schedule: ScheduleLike, v: int) -> tuple[ScheduleLike, int]:
    """Validate the chunks-per-rank ``v`` a schedule allows; return ``(schedule, v)``.

    Single-stage schedules need ``v=1``, V-shape schedules exactly ``v=2``, the
    other multi-chunk schedules any ``v >= 1`` (torch accepts one chunk per rank too), and a
    :class:`~pipeswift_lab.core.schedule.Schedule` its own.
    """
    schedule = canonical_schedule(schedule)
    v = check_int("v", v, minimum=1)
    if isinstance(schedule, Schedule):
        if v != schedule.v:
            raise ValueError(f"v={v} does not match schedule {schedule.name!r}, which places {schedule.v} per rank")
        return schedule, v
    if schedule in SINGLE_CHUNK_SCHEDULES and v != 1:
        raise ValueError(f"v={v} is not allowed for schedule={schedule!r}, which runs one stage per rank; use v=1")
    if schedule in V_SHAPE_SCHEDULES and v != 2:
        raise ValueError(
            f"v={v} is not allowed for schedule={schedule!r}, which places exactly 2 stages per rank in a V; use v=2"
        )
    return schedule, v


#: torch's class of every multi-chunk schedule.
TORCH_CLASS: dict[str, str] = {
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def accepts(P: int, m: int, schedule: ScheduleLike = "1F1B", v: int = 1) -> bool:
    """Whether torch's ``schedule`` takes ``P`` ranks, ``m`` micro-batches and ``v`` chunks per rank (:func:`validate`
    without the error)."""
    try:
        validate(P, m, schedule, v)
    except ValueError:
        return False
    return True


@overload
def validate(P: int, m: int, schedule: str = ..., v: int = ...) -> tuple[str, int]: ...
@overload
def validate(P: int, m: int, schedule: Schedule, v: int = ...) -> tuple[Schedule, int]: ...
@overload
def validate(P: int, m: int, schedule: ScheduleLike, v: int = ...) -> tuple[ScheduleLike, int]: ...
def validate(P: int, m: int, schedule: ScheduleLike = "1F1B", v: int = 1) -> tuple[ScheduleLike, int]:
    """Check ``(P, m, schedule, v)`` against torch's own rules; return ``(schedule, v)`` canonical.

    The rules are those the torch schedule constructors enforce:

    * ``1F1B``: ``m >= P`` (``Schedule1F1B`` needs as many micro-batches as stages);
    * ``Interleaved1F1B`` and ``InterleavedZeroBubble``: ``m`` must be a multiple of the number
      of rounds ``max(1, m // P)``;
    * ``DualPipeV``: ``m >= 2 * P`` (as many micro-batches as its ``2P`` stages);
    * ``ZBVZeroBubble`` and ``DualPipeV`` need ``v == 2``; ``GPipe`` and ``1F1B`` ``v == 1``;
    * a :class:`~pipeswift_lab.core.schedule.Schedule` its own ``P``, ``m`` and ``v``.

    Raises ``ValueError`` naming ``P``, ``m``, ``v`` and the rule.
    """
    P = check_int("P", P, minimum=1)
    m = check_int("m", m, minimum=1)
    schedule, v = check_schedule_v(schedule, v)
    if isinstance(schedule, Schedule):
        schedule.check_fits(P, P * v, m)
        return schedule, v
    where = f"schedule={schedule!r} with P={P}, m={m}, v={v}"
    if schedule == "1F1B" and m < P:
        raise ValueError(
            f"{where}: torch's Schedule1F1B needs m >= P (at least as many micro-batches as stages); use m >= {P}"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // P)
        if m % rounds:
            lower = next(k for k in range(m - 1, 0, -1) if k % max(1, k // P) == 0)
            upper = next(k for k in range(m + 1, 2 * m + P + 1) if k % max(1, k // P) == 0)
            raise ValueError(
                f"{where}: torch's {TORCH_CLASS[schedule]} needs m to be a multiple of its number of rounds "
                f"max(1, m // P) = {rounds}; m={m} is not (the nearest valid m are {lower} and {upper})"
            )
    if schedule == "DualPipeV" and m < 2 * P:
        raise ValueError(
            f"{where}: torch's ScheduleDualPipeV needs m >= 2*P = {2 * P} "
            f"(at least as many micro-batches as its {2 * P} stages)"
        )
    return schedule, v


def stage_to_rank(P: int, v: int = 1, schedule: ScheduleLike | None = None) -> tuple[int, ...]:
    """Rank of every stage, in stage order: round-robin ``s % P``, or a V for ZBV/DualPipeV, or where a
    :class:`~pipeswift_lab.core.schedule.Schedule` runs them.

    In the V shape (``v == 2``), rank ``r`` holds stages ``r`` and ``2P - 1 - r``
    (torch's ``generate_stage_to_rank_mapping(style="v")``).
    """
    P = check_int("P", P, minimum=1)
    v = check_int("v", v, minimum=1)
    if schedule is not None:
        schedule, v = check_schedule_v(schedule, v)
    if isinstance(schedule, Schedule):
        schedule.check_fits(P, P * v)
        return schedule.placement
    if schedule in V_SHAPE_SCHEDULES:
        return tuple(s if s < P else 2 * P - 1 - s for s in range(2 * P))
    return tuple(s % P for s in range(P * v))
