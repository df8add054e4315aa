"""Every rank's compute order as numpy arrays, from the formulas of torch's per-rank schedule loops.

:func:`~pipeswift_lab.core.schedule_orders.compute_orders` instantiates torch's schedule classes and reads their
``pipeline_order``: the truth, but a few milliseconds per ``(P, m, schedule, v)`` and a Python tuple per action. A
search that weighs hundreds of such combinations needs the same orders faster. :func:`order_arrays` computes them
as arrays (kind, stage and micro-batch of every action of every rank) from the loops torch runs in
``_calculate_single_rank_operations`` (and ``_get_1f1b_rank_ops``), and from this package's GPipe and 1F1B loops::

    orders = order_arrays(P=4, m=8, schedule="Interleaved1F1B", v=2)
    orders.kind[rank, :orders.length[rank]]  # codes into COMPUTE_KINDS: F, B, I, W

torch places idle steps (``None``) between the actions and ``ScheduleInterleavedZeroBubble`` adds more where a
dependency is not met; neither changes a rank's order of compute actions, which is all this module gives. The
first time a schedule is used in a process its formulas are compared with torch's own orders on a few small
pipelines (:func:`formulas_agree`); where they differ (another torch release) the orders are read from torch.
``tests/core/test_order_arrays.py`` compares them action by action over a grid of ``(P, m, v)``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from .schedule import ScheduleLike
from .schedule_orders import compute_orders
from .vocabulary import COMPUTE_KINDS, SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, accepts, check_schedule_v, validate

__all__ = ["OrderArrays", "formulas_agree", "from_orders", "order_arrays"]

#: The kind codes, named as torch names them (``_ComputationType``): ``F``, ``B``, ``I``, ``W``.
FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = range(len(COMPUTE_KINDS))
#: The kind code of the padding after a rank's last action.
PAD = -1


@dataclass(frozen=True, eq=False)
class OrderArrays:
    """Every rank's compute actions in order, padded to the longest rank with :data:`PAD`."""

    kind: np.ndarray
    """``(P, n)`` int8: the index of each action's kind in :data:`~pipeswift_lab.core.vocabulary.COMPUTE_KINDS`."""
    stage: np.ndarray
    """``(P, n)`` int64: each action's (global) stage."""
    mb: np.ndarray
    """``(P, n)`` int64: each action's micro-batch."""
    length: np.ndarray
    """``(P,)``: each rank's number of actions."""

    def actions(self, rank: int) -> list[tuple[str, int, int]]:
        """Rank ``rank``'s actions as :func:`~pipeswift_lab.core.schedule_orders.compute_orders` gives them: a list
        of ``(kind, stage, microbatch)``."""
        n = int(self.length[rank])
        return [
            (COMPUTE_KINDS[k], s, b)
            for k, s, b in zip(self.kind[rank, :n].tolist(), self.stage[rank, :n].tolist(), self.mb[rank, :n].tolist())
        ]


def order_arrays(P: int, m: int, schedule: ScheduleLike = "1F1B", v: int = 1, *, check: bool = True) -> OrderArrays:
    """The compute actions of every rank as arrays, in the order torch's runtime executes them. Returns an
    :class:`OrderArrays` equal to :func:`~pipeswift_lab.core.schedule_orders.compute_orders`'s lists.

    Raises ``ValueError`` for combinations torch refuses (:func:`~pipeswift_lab.core.vocabulary.validate`);
    ``check=False`` lets GPipe and 1F1B run with fewer micro-batches than ranks, as ``compute_orders`` does (the
    other schedules are checked all the same: torch's classes refuse what ``validate`` refuses).
    """
    if check or check_schedule_v(schedule, v)[0] not in SINGLE_CHUNK_SCHEDULES:
        schedule, v = validate(P, m, schedule, v)
    else:
        schedule, v = check_schedule_v(schedule, v)
    P, m = int(P), int(m)
    if isinstance(schedule, str) and formulas_agree(schedule):
        return _FORMULAS[schedule](P, m, v)
    return from_orders(compute_orders(P, m, schedule, v, check=check))


def from_orders(orders: dict[int, list[tuple[str, int, int]]]) -> OrderArrays:
    """The :class:`OrderArrays` of ``{rank: [(kind, stage, microbatch), ...]}`` (ranks ``0..P-1``)."""
    P = len(orders)
    n = max((len(orders[r]) for r in range(P)), default=0)
    kind = np.full((P, n), PAD, dtype=np.int8)
    stage = np.zeros((P, n), dtype=np.int64)
    mb = np.zeros((P, n), dtype=np.int64)
    length = np.array([len(orders[r]) for r in range(P)], dtype=np.int64)
    for r in range(P):
        if orders[r]:
            kinds, stages, mbs = zip(*orders[r])
            kind[r, : len(kinds)] = [COMPUTE_KINDS.index(k) for k in kinds]
            stage[r, : len(kinds)] = stages
            mb[r, : len(kinds)] = mbs
    return OrderArrays(kind=kind, stage=stage, mb=mb, length=length)


#: The small pipelines on which :func:`formulas_agree` compares the formulas with torch: ``(P, m, v)``.
_PROBES = ((1, 3, 1), (2, 4, 2), (3, 5, 1), (3, 7, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4), (5, 10, 2), (4, 12, 2))


@cache
def formulas_agree(schedule: str) -> bool:
    """Whether this module's formulas give torch's orders for ``schedule`` on a few small pipelines (checked once
    per process; warns when they do not, and :func:`order_arrays` then reads torch's orders)."""
    for P, m, v in _PROBES:
        v = 1 if schedule in SINGLE_CHUNK_SCHEDULES else 2 if schedule in V_SHAPE_SCHEDULES else v
        if not accepts(P, m, schedule, v):
            continue
        got = _FORMULAS[schedule](P, m, v)
        if any(got.actions(r) != want for r, want in compute_orders(P, m, schedule, v).items()):
            warnings.warn(
                f"pipeswift_lab.core.order_arrays: the {schedule} formulas do not give torch's order for P={P}, "
                f"m={m}, v={v} (another torch release?); orders are read from torch's schedule classes instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
    return True


# -- the formulas, one per schedule ----------------------------------------------------------------------------------


def _sorted(P: int, kind: np.ndarray, stage: np.ndarray, mb: np.ndarray, key: np.ndarray) -> OrderArrays:
    """Ranks of equally many actions, each put in the order of its ``key`` (``(P, n)`` arrays)."""
    order = np.argsort(key, axis=1, kind="stable")
    take = np.take_along_axis
    n = kind.shape[1]
    return OrderArrays(
        kind=take(kind, order, 1).astype(np.int8),
        stage=take(stage, order, 1),
        mb=take(mb, order, 1),
        length=np.full(P, n, dtype=np.int64),
    )


def _gpipe(P: int, m: int, v: int) -> OrderArrays:
    """``ScheduleGPipe``: every forward, then every backward, in micro-batch order."""
    kind = np.repeat(np.array([FORWARD, FULL_BACKWARD], dtype=np.int8), m)
    mb = np.tile(np.arange(m), 2)
    ranks = np.arange(P)[:, None]
    return OrderArrays(
        kind=np.broadcast_to(kind, (P, 2 * m)).copy(),
        stage=np.broadcast_to(ranks, (P, 2 * m)).copy(),
        mb=np.broadcast_to(mb, (P, 2 * m)).copy(),
        length=np.full(P, 2 * m, dtype=np.int64),
    )


def _one_f_one_b(P: int, m: int, v: int) -> OrderArrays:
    """``Schedule1F1B``: ``w = min(m, P - r)`` forwards, then a backward before every later forward, then the
    backwards left: forward ``o`` at step ``2o``, backward ``q`` at ``2(q + w) - 1``."""
    w = np.minimum(m, P - np.arange(P))[:, None]
    o = np.broadcast_to(np.arange(m), (P, m))
    key = np.concatenate([2 * o, 2 * (o + w) - 1], axis=1)
    kind = np.concatenate([np.full((P, m), FORWARD), np.full((P, m), FULL_BACKWARD)], axis=1)
    stage = np.broadcast_to(np.arange(P)[:, None], (P, 2 * m))
    return _sorted(P, kind, stage, np.concatenate([o, o], axis=1), key)


def _looped_bfs(P: int, m: int, v: int) -> OrderArrays:
    """``ScheduleLoopedBFS``: every forward of each local stage in turn, then every backward, last stage and last
    micro-batch first."""
    local = np.concatenate([np.repeat(np.arange(v), m), np.repeat(np.arange(v)[::-1], m)])
    mb = np.concatenate([np.tile(np.arange(m), v), np.tile(np.arange(m)[::-1], v)])
    kind = np.repeat(np.array([FORWARD, FULL_BACKWARD], dtype=np.int8), v * m)
    n = 2 * v * m
    return OrderArrays(
        kind=np.broadcast_to(kind, (P, n)).copy(),
        stage=local[None, :] * P + np.arange(P)[:, None],
        mb=np.broadcast_to(mb, (P, n)).copy(),
        length=np.full(P, n, dtype=np.int64),
    )


def _interleaved(P: int, m: int, v: int, *, zero_bubble: bool) -> OrderArrays:
    """``_get_1f1b_rank_ops`` as ``ScheduleInterleaved1F1B`` (``zero_bubble=False``) and
    ``ScheduleInterleavedZeroBubble`` call it.

    Op ``o`` of ``v * m + w`` runs the forward ``o`` (``o < v * m``), then the backward ``q = o - w`` (``o >= w``),
    then (zero bubble, ``q >= r``) the weight gradient ``q - r``; the weight gradients left run after the last op.
    A forward's local stage is ``(o // per_round) % v``, a backward's ``v - 1 - (q // per_round) % v``, and the
    micro-batch of either is how many of that stage ran before it.
    """
    ops = v * m
    per_round = m // max(1, m // P)
    r = np.arange(P)[:, None]
    warmup = np.minimum((v - 1) * per_round + (1 if zero_bubble else 2) * (P - 1 - r), ops)
    o = np.broadcast_to(np.arange(ops), (P, ops))
    mb = (o // (per_round * v)) * per_round + o % per_round
    fwd_stage = ((o // per_round) % v) * P + r
    bwd_stage = (v - 1 - (o // per_round) % v) * P + r
    slots = 3 if zero_bubble else 2
    parts = [
        (FORWARD, fwd_stage, slots * o),
        (BACKWARD_INPUT if zero_bubble else FULL_BACKWARD, bwd_stage, slots * (o + warmup) + 1),
    ]
    if zero_bubble:  # the weight gradient k runs in op k + r + w, or after the last op
        weight_key = np.where(o + r < ops, slots * (o + r + warmup) + 2, slots * (ops + warmup) + o)
        parts.append((BACKWARD_WEIGHT, bwd_stage, weight_key))
    kind = np.concatenate([np.full((P, ops), k) for k, _, _ in parts], axis=1)
    stage = np.concatenate([s for _, s, _ in parts], axis=1)
    key = np.concatenate([k for _, _, k in parts], axis=1)
    return _sorted(P, kind, stage, np.concatenate([mb] * len(parts), axis=1), key)


class _Phases:
    """Every rank's actions, appended a phase at a time for all ranks at once."""

    def __init__(self, P: int) -> None:
        self.P = P
        self.actions: list[np.ndarray] = []  # (P, width, 3): kind, stage, micro-batch
        self.valid: list[np.ndarray] = []  # (P, width): whether the rank runs it

    def repeat(self, n: Any, *pattern: tuple[int, Any, Any]) -> None:
        """A pattern of ``(kind, stage, first micro-batch)`` repeated ``n`` times on each rank, each repetition one
        micro-batch further; ``n``, stages and first micro-batches are numbers or one per rank."""
        n = np.broadcast_to(np.asarray(n), (self.P,))
        width = int(n.max(initial=0))
        if width <= 0:
            return
        i = np.arange(width)
        block = np.empty((self.P, width, len(pattern), 3), dtype=np.int64)
        for j, (kind, stage, first) in enumerate(pattern):
            block[:, :, j, 0] = kind
            block[:, :, j, 1] = np.reshape(stage, (-1, 1))
            block[:, :, j, 2] = np.reshape(first, (-1, 1)) + i
        valid = np.broadcast_to((i < n[:, None])[:, :, None], block.shape[:3])
        self.add(block.reshape(self.P, -1, 3), valid.reshape(self.P, -1))

    def add(self, actions: np.ndarray, valid: np.ndarray) -> None:
        """``(P, width, 3)`` actions, each run where ``valid`` (``(P, width)``)."""
        self.actions.append(actions)
        self.valid.append(valid)

    def orders(self, keep: Any = None) -> OrderArrays:
        """The :class:`OrderArrays`, each rank's actions in order (those where ``keep(actions)`` is False dropped)."""
        actions, valid = np.concatenate(self.actions, axis=1), np.concatenate(self.valid, axis=1)
        if keep is not None:
            valid = valid & keep(actions)
        length = valid.sum(axis=1)
        pick = np.argsort(~valid, axis=1, kind="stable")[:, : int(length.max(initial=0))]
        picked = np.take_along_axis(actions, pick[:, :, None], 1)
        pad = np.arange(pick.shape[1]) >= length[:, None]
        return OrderArrays(
            kind=np.where(pad, PAD, picked[:, :, 0]).astype(np.int8),
            stage=np.where(pad, 0, picked[:, :, 1]),
            mb=np.where(pad, 0, picked[:, :, 2]),
            length=length.astype(np.int64),
        )


def _zbv(P: int, m: int, v: int) -> OrderArrays:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations``: planned for ``max(2P - 1, m)`` micro-batches,
    those beyond ``m`` dropped."""
    n_micro = max(2 * P - 1, m)
    r = np.arange(P)
    c0, c1 = r, 2 * P - 1 - r
    out = _Phases(P)
    f0 = 2 * (P - r) - 1
    out.repeat(f0, (FORWARD, c0, 0))
    out.repeat(r, (FORWARD, c1, 0), (FORWARD, c0, f0))
    f0 = f0 + r
    out.repeat(P - r, (FORWARD, c1, r), (BACKWARD_INPUT, c1, 0), (BACKWARD_WEIGHT, c1, 0))
    stable, with_f0 = n_micro - P, n_micro - f0  # iterations; the first with_f0 start with a forward of c0
    b1 = P - r
    out.repeat(
        with_f0,
        (FORWARD, c0, f0),
        (BACKWARD_INPUT, c0, 0),
        (BACKWARD_WEIGHT, c0, 0),
        (FORWARD, c1, P),
        (BACKWARD_INPUT, c1, b1),
        (BACKWARD_WEIGHT, c1, b1),
    )
    out.repeat(
        stable - with_f0,
        (BACKWARD_INPUT, c0, with_f0),
        (BACKWARD_WEIGHT, c0, with_f0),
        (FORWARD, c1, P + with_f0),
        (BACKWARD_INPUT, c1, b1 + with_f0),
        (BACKWARD_WEIGHT, c1, b1 + with_f0),
    )
    b0, b1 = np.full(P, stable), b1 + stable
    w0, w1 = b0, b1
    out.repeat(r, (BACKWARD_INPUT, c0, b0), (BACKWARD_INPUT, c1, b1))
    b0, b1 = b0 + r, b1 + r
    out.repeat(P - r, (BACKWARD_INPUT, c0, b0), (BACKWARD_WEIGHT, c0, w0))
    b0, w0 = b0 + P - r, w0 + P - r
    out.repeat(b1 - w1, (BACKWARD_WEIGHT, c1, w1))
    out.repeat(b0 - w0, (BACKWARD_WEIGHT, c0, w0))
    return out.orders(keep=lambda actions: actions[:, :, 2] < m)


def _dualpipe_v(P: int, m: int, v: int) -> OrderArrays:
    """``ScheduleDualPipeV._calculate_single_rank_operations``, an overlapped forward-backward as its forward then
    its backward; a weight gradient runs the oldest input gradient still waiting for one (a queue)."""
    r = np.arange(P)
    R = r[:, None]
    c0, c1 = r, 2 * P - 1 - r
    out = _Phases(P)
    n1, n2, n3 = 2 * (P - r - 1), r + 1, P - r - 1
    out.repeat(n1, (FORWARD, c0, 0))
    out.repeat(n2, (FORWARD, c0, n1), (FORWARD, c1, 0))
    out.repeat(
        n3, (BACKWARD_INPUT, c1, 0), (BACKWARD_WEIGHT, c1, 0), (FORWARD, c1, n2)
    )  # each input gradient's weight gradient runs at once
    f0, f1, b1 = n1 + n2, n2 + n3, n3
    n4 = m - 2 * P + r + 1
    out.repeat(n4, (FORWARD, c0, f0), (FULL_BACKWARD, c1, b1), (FORWARD, c1, f1), (FULL_BACKWARD, c0, 0))
    f1, b1, b0 = f1 + n4, b1 + n4, n4
    n5 = P - r - 1
    out.repeat(n5, (FULL_BACKWARD, c1, b1), (FORWARD, c1, f1), (FULL_BACKWARD, c0, b0))
    b1, b0 = b1 + n5, b0 + n5
    # the sixth step: r + 1 pairs (c1, then c0); from pair (r + 1) // 2 on (at its c0 on an even rank) input
    # gradients, whose weight gradients wait in the queue, instead of full backwards
    u = np.arange(2 * P)[None, :]
    on_c1 = u % 2 == 0
    stage6 = np.where(on_c1, c1[:, None], c0[:, None])
    mb6 = np.where(on_c1, b1[:, None], b0[:, None]) + u // 2
    split_from = 2 * ((R + 1) // 2) + (R % 2 == 0)
    out.add(np.stack([np.where(u < split_from, FULL_BACKWARD, BACKWARD_INPUT), stage6, mb6], axis=2), u < 2 * (R + 1))
    # the queue: the sixth step's r + 1 input gradients, then the seventh's (stage c0, one each)
    q = np.arange(P)[None, :]
    from_six = np.clip(split_from + q, 0, 2 * P - 1)
    b0_7 = b0[:, None] + R + 1
    queue_stage = np.where(q < R + 1, np.take_along_axis(stage6, from_six, 1), c0[:, None])
    queue_mb = np.where(q < R + 1, np.take_along_axis(mb6, from_six, 1), b0_7 + q - (R + 1))
    weights = np.stack(
        [np.full((P, P), BACKWARD_WEIGHT), queue_stage, queue_mb], axis=2
    )  # the queue's weight gradients
    t = np.arange(P)[None, :]  # the seventh step: a weight gradient, then an input gradient of c0
    seventh = np.stack(
        [weights, np.stack([np.full((P, P), BACKWARD_INPUT), np.broadcast_to(c0[:, None], (P, P)), b0_7 + t], 2)]
    )
    out.add(seventh.transpose(1, 2, 0, 3).reshape(P, 2 * P, 3), np.repeat(t < P - R - 1, 2, axis=1))
    shift = np.clip(P - R - 1 + t, 0, P - 1)  # the eighth step: the queue's last r + 1 weight gradients
    out.add(np.take_along_axis(weights, shift[:, :, None], 1), t < R + 1)
    return out.orders()


_FORMULAS = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "LoopedBFS": _looped_bfs,
    "Interleaved1F1B": lambda P, m, v: _interleaved(P, m, v, zero_bubble=False),
    "InterleavedZeroBubble": lambda P, m, v: _interleaved(P, m, v, zero_bubble=True),
    "ZBVZeroBubble": _zbv,
    "DualPipeV": _dualpipe_v,
}
