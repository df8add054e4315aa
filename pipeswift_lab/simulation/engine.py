"""The simulator's engine: lowering torch's action order to wait / compute / fire operations, and running them.

:func:`lowered` turns ``(P, m, schedule, v)`` into one operation list per rank (cached: it
depends on no duration); :func:`execute` runs them with durations and transfer times, each
rank running until it waits on a signal not yet produced, so the run is linear in the number
of actions; :func:`rows_frame` turns the result into a Timeline table. The communication
semantics of each torch runtime are described in :mod:`pipeswift_lab.simulation.simulator`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd

from ..core.schedule import ScheduleDeadlock
from ..core.schedule_orders import Groups, action_groups
from ..core.vocabulary import COMPUTE_KINDS, stage_to_rank

#: One operation of a rank (see the table below): a tuple whose first item is _WAIT, _COMPUTE or _FIRE.
Op = tuple[Any, ...]
#: One operation list per rank.
Ops = tuple[tuple[Op, ...], ...]
#: :func:`execute`'s result: ``(started, signal, comm_rows)``.
Run = tuple[list[float], list[Any], list[tuple[Any, ...]]]

_WAIT, _COMPUTE, _FIRE = 0, 1, 2
# signal families: 0 forward done, 1 input-grad done (B or I), 2 weight-grad done,
# 3 activation arrived at stage s+1, 4 gradient arrived at stage s-1
_F_DONE, _G_DONE, _W_DONE, _ACT_ARRIVED, _GRAD_ARRIVED = range(5)
_DONE_FAMILY = {"F": _F_DONE, "B": _G_DONE, "I": _G_DONE, "W": _W_DONE}  # B and I both deliver the input gradient
_KIND_CODE = {k: i for i, k in enumerate(COMPUTE_KINDS)}


# --------------------------------------------------------------------------- ops
# Operations hold structure only (signals, stage indices); the engine looks durations up, so
# the lowered order of (P, m, schedule, v) is built once and reused across partitions.
#   (_WAIT, signal)
#   (_COMPUTE, done_signal, duration_index = kind_code * S + stage, stage, microbatch, kind, waits)
# (``waits``: the signals it needs first, folded in by :func:`_fuse_waits`)
#   (_FIRE, arrival_signal, boundary, stage, dst_stage, dst_rank, direction, microbatch)
# ``boundary`` indexes the transfer time (the cut after stage ``boundary``); direction 0 is an
# activation going forward, 1 a gradient going back.


def duration_index(kind: str, stage: int, S: int) -> int:
    """Where the engine looks an action's duration up: ``kind_code * S + stage`` (kind codes in
    :data:`~pipeswift_lab.core.vocabulary.COMPUTE_KINDS` order)."""
    return _KIND_CODE[kind] * S + stage


class _Lowering:
    """Signals, waits and sends of actions for one ``(P, m, placement)``."""

    def __init__(self, P: int, m: int, S: int, placement: Sequence[int]) -> None:
        self.P, self.m, self.S, self.placement = P, m, S, placement
        self.SM = S * m
        self.cross_prev = [s > 0 and placement[s - 1] != placement[s] for s in range(S)]
        self.cross_next = [s < S - 1 and placement[s + 1] != placement[s] for s in range(S)]

    def compute(self, kind: str, s: int, i: int) -> Op:
        """The compute operation of ``kind`` on stage ``s``, micro-batch ``i`` (without its waits)."""
        done = _DONE_FAMILY[kind] * self.SM + s * self.m + i
        return (_COMPUTE, done, duration_index(kind, s, self.S), s, i, kind)

    def action(self, kind: str, s: int, i: int) -> tuple[Op, ...]:
        """An action's waits, then its compute."""
        return (*self.waits(kind, s, i), self.compute(kind, s, i))

    def waits(self, kind: str, s: int, i: int) -> tuple[Op, ...]:
        """The signals an action needs before it may start."""
        SM, base, m = self.SM, s * self.m + i, self.m
        if kind == "F":
            if s == 0:
                return ()
            return ((_WAIT, (_ACT_ARRIVED if self.cross_prev[s] else _F_DONE) * SM + base - m),)
        if kind == "W":
            return ((_WAIT, _G_DONE * SM + base),)
        if s == self.S - 1:
            return ((_WAIT, _F_DONE * SM + base),)
        return (
            (_WAIT, _F_DONE * SM + base),
            (_WAIT, (_GRAD_ARRIVED if self.cross_next[s] else _G_DONE) * SM + base + m),
        )

    def sends(self, kind: str, s: int, i: int) -> tuple[Op, ...]:
        """The transfers an action starts, as fire operations (none within a rank)."""
        if kind == "F":
            if self.cross_next[s]:
                return ((_FIRE, _ACT_ARRIVED * self.SM + s * self.m + i, s, s, s + 1, self.placement[s + 1], 0, i),)
        elif kind in ("B", "I") and self.cross_prev[s]:
            return ((_FIRE, _GRAD_ARRIVED * self.SM + s * self.m + i, s - 1, s, s - 1, self.placement[s - 1], 1, i),)
        return ()


def lower(groups: Groups, schedule: str, P: int, m: int, S: int, placement: Sequence[int]) -> Ops:
    """Lower every rank's order (``groups``, as :func:`~pipeswift_lab.core.schedule_orders.action_groups` gives it)
    to a tuple of wait / compute / fire operations; returns one tuple per rank."""
    low = _Lowering(P, m, S, placement)
    ops = []
    for rank in range(P):
        if schedule == "1F1B":
            out = _one_f_one_b_ops(rank, P, m, low)
        elif schedule == "GPipe":
            out = _gpipe_ops(rank, m, low)
        else:  # torch's _PipelineScheduleRuntime
            out = []
            extend = out.extend
            for group in groups[rank]:
                for kind, s, i in group:
                    extend(low.action(kind, s, i))
                for kind, s, i in group:
                    extend(low.sends(kind, s, i))
        ops.append(_fuse_waits(out))
    return tuple(ops)


def _fuse_waits(out: list[Op]) -> tuple[Op, ...]:
    """Fold the waits just before a compute into it (``op[6]``): one engine step per action instead of one per
    signal."""
    fused: list[Op] = []
    pending: list[int] = []
    for op in out:
        if op[0] == _WAIT:
            pending.append(op[1])
        elif op[0] == _COMPUTE:
            fused.append(op + (tuple(pending),))
            pending = []
        else:
            fused += [(_WAIT, sid) for sid in pending]
            fused.append(op)
            pending = []
    fused += [(_WAIT, sid) for sid in pending]
    return tuple(fused)


@lru_cache(maxsize=64)
def lowered(P: int, m: int, schedule: str, v: int) -> Ops:
    """The lowered operations of ``(P, m, schedule, v)`` with torch's placement (cached: they hold no duration)."""
    placement = stage_to_rank(P, v, schedule)
    return lower(action_groups(P, m, schedule, v), schedule, P, m, P * v, placement)


def _gpipe_ops(rank: int, m: int, low: _Lowering) -> list[Op]:
    """``ScheduleGPipe._step_microbatches``: receive, compute, send; all forward sends done before the backward."""
    out: list[Op] = []
    sent: list[Op] = []
    for i in range(m):
        out += low.action("F", rank, i)
        for send in low.sends("F", rank, i):
            out.append(send)
            sent.append((_WAIT, send[1]))
    out += sent
    for i in range(m):
        out += low.action("B", rank, i)
        out += low.sends("B", rank, i)
    return out


def _blocking(sends: tuple[Op, ...]) -> tuple[Op, ...]:
    """Sends fused with the next receive in one blocking batch: each fired, then waited for until it has arrived."""
    return tuple(op for send in sends for op in (send, (_WAIT, send[1])))


def _one_f_one_b_ops(rank: int, P: int, m: int, low: _Lowering) -> list[Op]:
    """``Schedule1F1B._step_microbatches`` with its blocking waits on sends."""
    out: list[Op] = []
    s = rank
    warmup = min(m, P - s)
    prev_send: Op | None = None
    deferred: tuple[Op, ...] = ()
    for k in range(warmup):
        out += low.action("F", s, k)
        if prev_send is not None:  # _wait_batch_p2p(send_work): the previous forward's send
            out.append(prev_send)
            prev_send = None
        sends = low.sends("F", s, k)
        if k != warmup - 1:
            for send in sends:
                out.append(send)
                prev_send = (_WAIT, send[1])
        else:
            deferred = sends  # fused with the first backward's receive
    fwd, bwd = warmup, 0
    bwd_sends: tuple[Op, ...] = ()
    while True:
        out += _blocking(deferred) + low.action("B", s, bwd)  # fwd_sends + bwd_recvs in one blocking batch
        bwd_sends = low.sends("B", s, bwd)
        bwd += 1
        if fwd == m:
            break
        out += _blocking(bwd_sends) + low.action("F", s, fwd)  # bwd_sends + fwd_recvs in one blocking batch
        deferred = low.sends("F", s, fwd)
        fwd += 1
    prev_send = None
    for send in bwd_sends:  # fired without waiting
        out.append(send)
        prev_send = (_WAIT, send[1])
    while bwd < m:  # cool-down
        out += low.action("B", s, bwd)
        if prev_send is not None:
            out.append(prev_send)
            prev_send = None
        for send in low.sends("B", s, bwd):
            out.append(send)
            prev_send = (_WAIT, send[1])
        bwd += 1
    return out


# --------------------------------------------------------------------------- engine
def execute(
    ops: Ops,
    P: int,
    m: int,
    S: int,
    durations: Sequence[Sequence[float]],
    transfer: Sequence[float],
    with_comm_rows: bool,
    per_action: dict[tuple[int, int], float] | None = None,
) -> Run:
    """Execute the per-rank operation lists; return ``(started, signal, comm_rows)``.

    A compute action's start is ``started[done]`` and its end ``signal[done]`` (``done`` its
    completion signal, see :func:`compute_table`); ``comm_rows`` are the transfer rows
    ``(rank, stage, mb, kind, start, end)`` when ``with_comm_rows``. ``durations`` is ``(fwd,
    bwd, igrad, wgrad)``, one list per kind with one entry per stage; ``per_action``
    optionally overrides single actions: ``{(kind_code * S + stage, microbatch): ms}``.
    """
    dur = [d for per_kind in durations for d in per_kind]  # flat, indexed kind_code * S + stage
    signal: list[Any] = [None] * (5 * S * m)
    started = [0.0] * (5 * S * m)
    waiting: dict[int, list[int]] = {}
    pc = [0] * P
    clock = [0.0] * P
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    work = list(range(P - 1, -1, -1))
    while work:
        r = work.pop()
        rank_ops = ops[r]
        i, t, n = pc[r], clock[r], len(rank_ops)
        while i < n:
            op = rank_ops[i]
            code = op[0]
            if code == 1:  # _COMPUTE, after its waits
                for sid in op[6]:
                    value = signal[sid]
                    if value is None:
                        break
                    if value > t:
                        t = value
                else:
                    end = t + (dur[op[2]] if per_action is None else per_action.get((op[2], op[4]), dur[op[2]]))
                    done = op[1]
                    started[done] = t
                    signal[done] = end
                    t = end
                    if done in waiting:
                        work.extend(waiting.pop(done))
                    i += 1
                    continue
                waiting.setdefault(sid, []).append(r)
                break
            if code == 0:  # _WAIT
                value = signal[op[1]]
                if value is None:
                    waiting.setdefault(op[1], []).append(r)
                    break
                if value > t:
                    t = value
            else:  # _FIRE
                arrive = t + transfer[op[2]]
                signal[op[1]] = arrive
                if with_comm_rows:
                    if op[6] == 0:
                        append((r, op[3], op[7], "SEND_F", t, arrive))
                        append((op[5], op[4], op[7], "RECV_F", t, arrive))
                    else:
                        append((r, op[3], op[7], "SEND_B", t, arrive))
                        append((op[5], op[4], op[7], "RECV_B", t, arrive))
                if op[1] in waiting:
                    work.extend(waiting.pop(op[1]))
            i += 1
        pc[r], clock[r] = i, t
    stuck = [r for r in range(P) if pc[r] < len(ops[r])]
    if stuck:
        raise ScheduleDeadlock(_deadlock_message(ops, pc, stuck, S, m, signal))
    return started, signal, rows


def compute_table(ops: Ops) -> dict[str, Any]:
    """The compute actions of lowered ``ops``, rank by rank in execution order, as numpy arrays.

    ``rank``, ``stage``, ``mb``, ``kind`` (object array of names) and ``done`` (completion
    signals, a ``tuple`` for :func:`operator.itemgetter`). Static for an order: the engine only
    adds times.
    """
    rows = [(r, op[3], op[4], op[5], op[1]) for r, rank_ops in enumerate(ops) for op in rank_ops if op[0] == _COMPUTE]
    rank, stage, mb, kind, done = zip(*rows)
    return {
        "rank": np.array(rank, np.int64),
        "stage": np.array(stage, np.int64),
        "mb": np.array(mb, np.int64),
        "kind": np.array(kind, dtype=object),
        "done": operator.itemgetter(*done) if len(done) > 1 else (lambda xs, d=done[0]: (xs[d],)),
    }


@lru_cache(maxsize=64)
def lowered_table(P: int, m: int, schedule: str, v: int) -> dict[str, Any]:
    """:func:`compute_table` of :func:`lowered` (cached with it)."""
    return compute_table(lowered(P, m, schedule, v))


def rows_frame(table: dict[str, Any], run: Run) -> pd.DataFrame:
    """The Timeline table of one simulated step: the compute actions of ``table``, timed by ``run`` (:func:`execute`'s
    output)."""
    started, signal, comm = run
    pick = table["done"]
    # copies: the table is cached with the order, and a Timeline's columns may be edited by its user
    cols = {
        "step": np.zeros(len(table["rank"]), dtype=np.int64),
        "rank": table["rank"].copy(),
        "stage": table["stage"].copy(),
        "microbatch": table["mb"].copy(),
        "kind": table["kind"].copy(),
        "start_ms": np.array(pick(started), dtype=float),
        "end_ms": np.array(pick(signal), dtype=float),
    }
    if comm:
        rank, stage, mb, kind, start, end = zip(*comm)
        extra = (np.zeros(len(comm), np.int64), rank, stage, mb, np.array(kind, dtype=object), start, end)
        cols = {c: np.concatenate([v, np.asarray(e, dtype=v.dtype)]) for (c, v), e in zip(cols.items(), extra)}
    return pd.DataFrame(cols)


def _describe_signal(sid: int, S: int, m: int) -> str:
    family, rest = divmod(sid, S * m)
    s, i = divmod(rest, m)
    return {
        _F_DONE: f"F of stage {s}, micro-batch {i}",
        _G_DONE: f"the input-grad (B/I) of stage {s}, micro-batch {i}",
        _W_DONE: f"W of stage {s}, micro-batch {i}",
        _ACT_ARRIVED: f"the activation of stage {s}, micro-batch {i} to arrive",
        _GRAD_ARRIVED: f"the gradient from stage {s}, micro-batch {i} to arrive",
    }[family]


def _deadlock_message(ops: Ops, pc: list[int], stuck: list[int], S: int, m: int, signal: list[Any]) -> str:
    parts = []
    for r in stuck[:6]:
        op = ops[r][pc[r]]
        sid = next(w for w in op[6] if signal[w] is None) if op[0] == _COMPUTE else op[1]
        nxt = next((o for o in ops[r][pc[r] :] if o[0] == _COMPUTE), None)
        action = f"{nxt[5]} of stage {nxt[3]}, micro-batch {nxt[4]}" if nxt else "its last sends"
        parts.append(f"rank {r} waits for {_describe_signal(sid, S, m)} before {action}")
    more = f" (and {len(stuck) - 6} more ranks)" if len(stuck) > 6 else ""
    return "the pipeline order deadlocks: " + "; ".join(parts) + more


__all__ = [
    "Op",
    "Ops",
    "Run",
    "ScheduleDeadlock",
    "compute_table",
    "duration_index",
    "execute",
    "lower",
    "lowered",
    "lowered_table",
    "rows_frame",
]
