"""The nearest configuration a framework can run, where it cannot run the plan's: changes that frameworks share.

Each change is made to an :class:`~pipeswift_lab.frameworks.target.ExportTarget` and described in words; the plan
prices the result (:func:`pipeswift_lab.planning.handoff.export`) and says so in an
:class:`~pipeswift_lab.frameworks.ExportWarning`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .target import ExportTarget

__all__ = ["common_nearest", "merged", "merged_recompute", "single_chunk", "uniform_recompute"]


def merged(bounds: Sequence[tuple[int, int]], P: int) -> tuple[tuple[int, int], ...]:
    """``P`` contiguous stages of ``bounds`` merged in order (the nearest single-stage split of a multi-stage one)."""
    per = len(bounds) // P
    return tuple((bounds[r * per][0], bounds[r * per + per - 1][1]) for r in range(P))


def merged_recompute(target: ExportTarget) -> dict[int, str]:
    """Each merged stage recomputes as the most its parts did (``full`` over ``selective``)."""
    out: dict[int, str] = {}
    for stage, mode in target.recompute.items():
        rank = stage // target.v
        out[rank] = "full" if "full" in (mode, out.get(rank)) else mode
    return out


def uniform_recompute(target: ExportTarget, why: str) -> tuple[ExportTarget, list[str]]:
    """``target`` with one recomputation on every stage where its stages differ (``full`` over ``selective``), and
    the change in words, ``why`` the framework needs it (``[]``: none)."""
    modes = set(target.recompute.values())
    if not modes or (len(modes) == 1 and len(target.recompute) == target.P * target.v):
        return target, []
    mode = "full" if "full" in modes else "selective"
    stages = " ".join(f"{s}:{m}" for s, m in sorted(target.recompute.items()))
    change = f"recompute {stages} -> {mode} on every stage ({why})"
    return replace(target, recompute={s: mode for s in range(target.P * target.v)}), [change]


def common_nearest(target: ExportTarget) -> tuple[ExportTarget, list[str]]:
    """Changes every framework without per-stage recomputation or the toolkit's FSDP makes (here: Megatron's)."""
    target, changes = uniform_recompute(target, "one granularity for the whole model")
    if target.fsdp > 1:
        changes.append(
            f"fsdp={target.fsdp} -> data-parallel ranks (D={target.D} -> {target.D * target.fsdp}) with the "
            "optimizer state sharded over them (the framework's FSDP does not pipeline as planned)"
        )
        target = replace(target, D=target.D * target.fsdp, fsdp=1, precision=_zero1(target.precision))
    return target, changes


def _zero1(precision: str | None) -> str | None:
    """The precision with its optimizer state sharded over the data-parallel ranks where it has a sharded form."""
    return "bf16-mixed-zero1" if precision == "bf16-mixed" else precision


def single_chunk(target: ExportTarget, schedule: str, why: str) -> tuple[ExportTarget, str]:
    """``target`` on a single-stage-per-rank ``schedule``: its ``v`` stages of each rank's share merged in order."""
    out = target
    if target.v > 1:
        out = replace(target, v=1, bounds=merged(target.bounds, target.P), recompute=merged_recompute(target))
    out = replace(out, schedule=schedule)
    v = f" v{target.v}" if target.v > 1 else ""
    return out, f"schedule {target.schedule_name}{v} -> {schedule} ({why})"
