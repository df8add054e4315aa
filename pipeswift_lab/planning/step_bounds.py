"""Lower bounds on a simulated pipeline step, from the schedule's dependencies alone: the planner's searches prune
with them, so each must hold for every order torch runs (transfers, calibration's fixed costs and the runtime's
overhead only lengthen a step).

For a split whose stage ``s`` takes ``f_s`` forward and ``b_s`` backward per micro-batch, rank ``k`` (lowest stage
``s_k``, busy ``T_k`` per micro-batch) can start nothing before micro-batch 0's forward has crossed the stages
before ``s_k``, is busy ``m · T_k``, and, under a schedule that does not split its backward, ends with the backward
of stage ``s_k`` after which the stages before it run that micro-batch's backward. So (:func:`split_step_lower_ms`)

    step >= max_k ( Σ_{s < s_k} f_s + m · T_k + Σ_{s < s_k} b_s )      (the last sum 0 under zero-bubble schedules)

which is ``max_k (Σ_{s<k} t_s + m t_k)`` under GPipe and 1F1B. Before any split (:func:`closed_form_step_lower_ms`),
every rank's share is at least ``T / P`` of the whole ``T``, no rank runs less than the slowest layer, and
micro-batch 0 alone crosses every forward (and, without split backwards, every backward). Under GPipe and 1F1B the
bound above is, over every split of ``T`` (its stages as fine as wanted), at least the ``c`` at which
``t_k = (c − Σ_{s<k} t_s) / m`` makes the stages sum to ``T``: ``c = T / (1 − (1 − 1/m)^P)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.schedule import ScheduleLike
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, splits_backward

__all__ = ["closed_form_step_lower_ms", "split_step_lower_ms"]


def split_step_lower_ms(
    stage_fwd: Sequence[float] | np.ndarray,
    stage_bwd: Sequence[float] | np.ndarray,
    placement: Sequence[int],
    P: int,
    m: int,
    schedule: ScheduleLike,
) -> float:
    """The module docs' bound on the step of a split whose stages take ``stage_fwd`` and ``stage_bwd`` per
    micro-batch and sit on ranks ``placement``, with ``m`` micro-batches under ``schedule``. Returns ms."""
    fwd, bwd = np.asarray(stage_fwd, dtype=float), np.asarray(stage_bwd, dtype=float)
    ranks = np.asarray(placement)
    head = np.concatenate([[0.0], np.cumsum(fwd)])
    tail = np.concatenate([[0.0], np.cumsum(bwd)]) if not splits_backward(schedule) else np.zeros(len(fwd) + 1)
    busy = np.bincount(ranks, weights=fwd + bwd, minlength=P)
    first = np.full(P, len(fwd))
    np.minimum.at(first, ranks, np.arange(len(fwd)))
    held = first < len(fwd)
    return float(np.max(np.where(held, head[first] + m * busy + tail[first], m * busy)))


def closed_form_step_lower_ms(
    total_ms: float, forward_ms: float, slowest_ms: float, P: int, m: int, schedule: ScheduleLike
) -> float:
    """A bound on the step of any split of layers whose forward and backward take ``total_ms`` per micro-batch
    (``forward_ms`` of it forward; the slowest layer ``slowest_ms``) over ``P`` ranks with ``m`` micro-batches under
    ``schedule`` (the module docs derive it). Returns ms."""
    crossing = forward_ms if splits_backward(schedule) else total_ms
    bound = max(m * total_ms / P, m * slowest_ms, crossing)
    if schedule in SINGLE_CHUNK_SCHEDULES:
        bound = max(bound, total_ms / (1.0 - (1.0 - 1.0 / m) ** P))
    return bound
