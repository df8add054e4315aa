"""The checks a :class:`~pipeswift_lab.core.schedule.Schedule` passes when it is made, before anything runs: every
action once, an ``I`` with its ``W``, one backward form per stage and micro-batch, one rank per stage, as many stages
on every rank, and an order that can finish (its dependencies replayed, cross-rank sends included)."""

from __future__ import annotations

from typing import Any

from .schedule_cells import Action, cell, group_cell

__all__ = ["ScheduleDeadlock", "check_actions", "check_finishes", "check_placement", "needs"]


class ScheduleDeadlock(RuntimeError):
    """Raised when no rank of a pipeline order can make progress."""


def check_actions(schedule: Any) -> None:
    """Every stage of every micro-batch: one F, and one B or one I and one W (torch's DualPipeV mixes the two forms
    on one stage, micro-batch by micro-batch)."""
    P, S, m = schedule.P, schedule.S, schedule.m
    if S == 0:
        raise ValueError("the schedule holds no action")
    seen: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        for j, action in enumerate(row):
            if action in seen:
                first = seen[action]
                raise ValueError(
                    f"action {cell(action)} appears twice: rank {first[0]} position {first[1]} and rank {rank} "
                    f"position {j}"
                )
            seen[action] = (rank, j)
    for s in range(S):
        for i in range(m):
            if ("F", s, i) not in seen:
                raise ValueError(f"action {s}F{i} is missing (the forward of stage {s}, micro-batch {i})")
            full, split_input, split_weight = (("B", s, i) in seen), (("I", s, i) in seen), (("W", s, i) in seen)
            if full and (split_input or split_weight):
                raise ValueError(
                    f"stage {s}, micro-batch {i} has both a full backward {s}B{i} and a split one "
                    f"({s}I{i}/{s}W{i}): run one form (B, or I then W)"
                )
            if split_input and not split_weight:
                raise ValueError(f"the I {s}I{i} has no W: add {s}W{i} (the weight gradient it leaves)")
            if split_weight and not split_input:
                raise ValueError(f"the W {s}W{i} has no I: add {s}I{i} before it, or run a full backward {s}B{i}")
            if not (full or split_input):
                raise ValueError(f"action {s}B{i} is missing (the backward of stage {s}, micro-batch {i}; or I and W)")
    if S % P:
        raise ValueError(f"{S} stages on {P} ranks: every rank must hold the same number of stages")


def check_placement(schedule: Any) -> None:
    """Each stage on one rank, the same number on every rank."""
    where: dict[int, int] = {}
    for rank, row in enumerate(schedule.actions):
        for kind, s, i in row:
            other = where.setdefault(s, rank)
            if other != rank:
                raise ValueError(
                    f"stage {s} runs on rank {other} and on rank {rank} (action {s}{kind}{i}): a stage sits on one rank"
                )
    counts = [sum(1 for r in where.values() if r == rank) for rank in range(schedule.P)]
    if len(set(counts)) != 1:
        raise ValueError(f"ranks hold different numbers of stages {counts}: every rank must hold {schedule.v}")


def needs(action: Action, S: int) -> tuple[Action, ...]:
    """The actions ``action`` waits for: a forward the previous stage's forward, a backward (B or I) its own forward and
    the next stage's backward (whichever form), a W its I."""
    kind, s, i = action
    if kind == "F":
        return (("F", s - 1, i),) if s > 0 else ()
    if kind == "W":
        return (("I", s, i),)
    own = ("F", s, i)
    return (own,) if s == S - 1 else (own, ("G", s + 1, i))


def check_finishes(schedule: Any) -> None:
    """Replay the order, each rank in turn running its next group of actions when what they need has run (sends never
    block, as torch's runtime posts them and waits at the receive); raise :class:`ScheduleDeadlock` when every rank
    waits."""
    done: set[Action] = set()
    heads = [0] * schedule.P
    left = sum(len(row) for row in schedule.groups)
    while left:
        progressed = False
        for rank, row in enumerate(schedule.groups):
            while heads[rank] < len(row) and _unready(row[heads[rank]], done, schedule.S) is None:
                for kind, s, i in row[heads[rank]]:
                    done.add((kind, s, i))
                    if kind in "BI":
                        done.add(("G", s, i))
                heads[rank] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlock(_deadlock_message(schedule, heads, done))


def _unready(group: tuple[Action, ...], done: set[Action], S: int) -> tuple[Action, Action] | None:
    """The first action of ``group`` and what it waits for, or None when the group can run (a part may use what an
    earlier part of the group made)."""
    made: set[Action] = set()
    for action in group:
        for need in needs(action, S):
            if need not in done and need not in made:
                return action, need
        made.add(action)
        if action[0] in "BI":
            made.add(("G", action[1], action[2]))
    return None


def _deadlock_message(schedule: Any, heads: list[int], done: set[Action]) -> str:
    """Name the first rank that waits forever, its action, what it waits for and where that stands."""
    rank = next(r for r, row in enumerate(schedule.groups) if heads[r] < len(row))
    unready = _unready(schedule.groups[rank][heads[rank]], done, schedule.S)
    assert unready is not None
    action, missing = unready
    other = schedule.placement[missing[1]]
    if missing[0] == "G":
        waits_for = f"the backward of stage {missing[1]}, micro-batch {missing[2]}"
    else:
        waits_for = cell(missing)
    if other == rank:
        where = "which comes later in its own order"
    else:
        where = f"on rank {other}, which itself waits at {_head(schedule, heads, other)}"
    return (
        f"schedule {schedule.name!r} cannot finish: rank {rank} waits forever at position {heads[rank]}, action "
        f"{cell(action)}, for {waits_for} ({where})"
    )


def _head(schedule: Any, heads: list[int], rank: int) -> str:
    row = schedule.groups[rank]
    return f"position {heads[rank]}, action {group_cell(row[heads[rank]])}" if heads[rank] < len(row) else "its end"
