"""Argument validation shared by every module, and the schedule vocabulary of
``torch.distributed.pipelining``.

Every check raises ``ValueError``/``TypeError`` whose message names the argument,
the bad value and what is valid (the project convention). Nothing is clamped.
"""
from __future__ import annotations

import math
import numbers

#: Schedule names, spelled as ``torch.distributed.pipelining`` spells them.
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules that place one stage on every rank (``v == 1``), run by torch's single-chunk runtime.
SINGLE_CHUNK_SCHEDULES = ("GPipe", "1F1B")
#: Schedules that place several stages ("chunks", ``v``) on every rank.
MULTI_CHUNK_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: Schedules whose chunks go to ranks in a V shape and need exactly two per rank.
V_SHAPE_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
def default_v(schedule: str) -> int:
    """Chunks per rank when none is given: 1 for the single-chunk schedules, 2 for the others."""
    return 1 if schedule not in MULTI_CHUNK_SCHEDULES else 2


#: Schedules that split the backward into input-grad (I) and weight-grad (W).
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

#: Action kinds, as ``torch.distributed.pipelining`` names them: forward, full backward, input-grad, weight-grad ...
COMPUTE_KINDS = ("F", "B", "I", "W")
#: ... and the transfers between ranks.
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: ... and the gradient all-reduce across data-parallel replicas (torch's ``REDUCE_GRAD``), measured when D > 1.
REDUCE_KINDS = ("REDUCE_GRAD",)
#: Every action kind a Timeline row may hold.
KINDS = COMPUTE_KINDS + COMM_KINDS + REDUCE_KINDS

_BY_LOWER = {name.lower(): name for name in SCHEDULES}


def canonical_schedule(schedule: str) -> str:
    """Return the canonical spelling of ``schedule`` (case-insensitive match)."""
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a str, one of {list(SCHEDULES)}; got {type(schedule).__name__} {schedule!r}")
    key = schedule.lower().replace("_", "").replace("-", "")
    if key == "schedule1f1b":
        key = "1f1b"
    for prefix in ("schedule",):
        if key.startswith(prefix) and key[len(prefix):] in _BY_LOWER:
            key = key[len(prefix):]
    if key not in _BY_LOWER:
        raise ValueError(f"schedule={schedule!r} is not known; valid schedules are {list(SCHEDULES)} (case-insensitive)")
    return _BY_LOWER[key]


def check_schedule_v(schedule: str, v: int) -> tuple[str, int]:
    """Validate the chunks-per-rank ``v`` a schedule allows; return ``(schedule, v)``.

    Single-stage schedules need ``v=1``, V-shape schedules exactly ``v=2``, and the
    other multi-chunk schedules any ``v >= 1`` (torch accepts one chunk per rank too).
    """
    schedule = canonical_schedule(schedule)
    v = check_int("v", v, minimum=1)
    if schedule in SINGLE_CHUNK_SCHEDULES and v != 1:
        raise ValueError(f"v={v} is not allowed for schedule={schedule!r}, which runs one stage per rank; use v=1")
    if schedule in V_SHAPE_SCHEDULES and v != 2:
        raise ValueError(f"v={v} is not allowed for schedule={schedule!r}, which places exactly 2 stages per rank in a V; use v=2")
    return schedule, v


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int, refusing bools, floats and values out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is invalid; it must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} is invalid; it must be <= {maximum}")
    return value


def check_wgrad_fraction(value) -> float:
    """Return ``wgrad_fraction`` (the weight-gradient share of a backward) as a float in ``[0, 1]``."""
    value = check_time("wgrad_fraction", value)
    if value > 1:
        raise ValueError(f"wgrad_fraction={value} is invalid; it is a share of the backward, in [0, 1]")
    return value


def nonnegative_column(column, allow_missing: bool = False):
    """``(values, first_bad)`` of a pandas Series of per-layer or per-stage numbers: ``values`` as a float array, and
    ``first_bad = (position, given value)`` of the first entry that is not a finite number >= 0 (with ``allow_missing``,
    an empty entry, NaN or None, is allowed), else None. The caller names the table in its message."""
    import numpy as np
    import pandas as pd

    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=float)
    missing_ok = column.isna().to_numpy() if allow_missing else np.zeros(len(values), bool)
    bad = np.flatnonzero((np.isnan(values) & ~missing_ok) | np.isinf(values) | (values < 0))
    if not len(bad):
        return values, None
    given = column.iloc[int(bad[0])]
    return values, (int(bad[0]), given.item() if hasattr(given, "item") else given)


def check_time(name: str, value, allow_zero: bool = True) -> float:
    """Return ``value`` as a finite float that is ``>= 0`` (``> 0`` if not ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name}={value} is invalid; it must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value} is invalid; it must be {bound}")
    return value
