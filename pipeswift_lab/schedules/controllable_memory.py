"""V-Half and V-Min: V-shaped pipeline schedules with controllable activation memory.

Qi, Wan, Amar and Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024 (arXiv:2405.15362). A schedule
is a *building block* (the passes of one micro-batch on every rank) repeated every few slots; the block's lifespan
on a rank sets the rank's peak activation memory. The paper's V-shaped blocks put two stages on every rank (rank
``r`` holds stages ``r`` and ``2P-1-r``, as ZB-V and DualPipeV do) and split every backward into an input gradient
``I`` and a weight gradient ``W``. Their two members trade bubble for memory:

* **V-Half** (:func:`v_half`): about half of 1F1B's activations, ``(P+2)//2`` micro-batches per rank against 1F1B's
  ``P``, and about half of 1F1B's bubble ``(P-1)/(m+P-1)`` (unit pass times);
* **V-Min** (:func:`v_min`): about a third, ``(P+4)//3`` micro-batches, and about two thirds of 1F1B's bubble plus a
  small overhead.

(Peaks counted as :attr:`~pipeswift_lab.simulation.timeline.Timeline.peak_inflight` counts them: a chunk's
activations weigh ``1/2``. The bounds are the authors' table in their schedule playground,
huggingface.co/spaces/sail/pipeline-parallelism-with-controllable-memory; the orders below reach them exactly
once ``m`` reaches them, and hold ``m`` before.) Usage::

    schedule = psl.schedules.v_half(4, 8)  # a Schedule: 4 ranks, 8 stages in a V, 8 micro-batches
    timeline = psl.simulate(part, schedule.m, schedule)  # part: a partition placed in a V

[Note: the reference] The orders are those of the authors' implementation, the one their Megatron runtime runs for
``--zero-bubble-v-schedule-mem-setup half`` or ``min``: sail-sg/zero-bubble-pipeline-parallelism,
``megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py`` (``PipelineGraph.create_schedule``). It works
on unit slots, every pass one slot (``T_F = T_I = T_W``, the paper's handcrafted setting; the runtime calls it with
F = B = W = 1000 and a communication of 1, which changes its timings, not its order), in four steps:

1. **block**: the slots of the four passes F, f, B, b of micro-batch 0 on every rank (:func:`_block`);
2. **repeat**: micro-batch ``i`` runs the block ``6 i`` slots later (each rank has six passes per block);
3. **reorder the warm-up and cool-down** with the W passes in place, moving each pass to the earliest free slot its
   dependencies allow that does not raise the rank's peak; then **squeeze** (every pass as early as possible,
   order kept); then reorder the cool-down again without the W passes, which wait for idle slots (:func:`_reorder`);
4. **place the W passes** in the idle slots, oldest first, the second chunk's first (:func:`_with_w`).

Pass codes follow the reference: per rank, ``F`` and ``f`` are the forwards of its first and second chunk, ``B`` and
``b`` the input gradients of its second and first chunk (the backward runs up the V), ``W`` and ``w`` their weight
gradients.
"""

from __future__ import annotations

import copy

from ..core.checks import check_int
from ..core.schedule import Schedule
from ..core.schedule_cells import Action

__all__ = ["v_half", "v_min"]

#: Slots between two micro-batches' blocks on a rank: its six passes F, f, B, b, W, w of one slot each.
_PERIOD = 6
#: Pass codes, in the reference's order ("FfBbWw").
_F0, _F1, _I1, _I0, _W1, _W0 = range(6)
#: Change in held chunks when a pass runs: a forward acquires one, the (single or merged) W releases one.
_HOLD = (1, 1, 0, 0, -1, -1)

#: ``slots[rank][pass][microbatch]``: the slot each pass runs in.
Slots = list[list[list[int]]]


def v_half(P: int, m: int) -> Schedule:
    """V-Half for ``P`` ranks and ``m`` micro-batches (Qi et al., NeurIPS 2024, arXiv:2405.15362).

    Returns a :class:`~pipeswift_lab.core.schedule.Schedule` named ``"V-Half"``, V-shaped (rank ``r`` holds stages
    ``r`` and ``2P-1-r``) with split backwards, holding at most ``(P+2)//2`` micro-batches of activations per rank,
    about half of 1F1B's ``P`` (``min(m, (P+2)//2)`` exactly). Raises ``ValueError`` when ``P < 2`` or ``m < 1``.
    """
    return _schedule(P, m, "half")


def v_min(P: int, m: int) -> Schedule:
    """V-Min for ``P`` ranks and ``m`` micro-batches (Qi et al., NeurIPS 2024, arXiv:2405.15362).

    Returns a :class:`~pipeswift_lab.core.schedule.Schedule` named ``"V-Min"``, V-shaped (rank ``r`` holds stages
    ``r`` and ``2P-1-r``) with split backwards, holding at most ``(P+4)//3`` micro-batches of activations per rank,
    about a third of 1F1B's ``P`` (``min(m, (P+4)//3)`` exactly); its bubble is larger than V-Half's. Raises
    ``ValueError`` when ``P < 2`` or ``m < 1``.
    """
    return _schedule(P, m, "min")


# ---------------------------------------------------------------------------------------------- the four steps
def _schedule(P: int, m: int, memory: str) -> Schedule:
    """Check the arguments, build the slots, read the order off them and return it as a checked Schedule."""
    name = {"half": "V-Half", "min": "V-Min"}[memory]
    P, m = _check(name, P, m)
    slots = _repeat(_block(P, memory), m)
    slots = _reorder(slots, with_w=True)
    slots = _reorder([lanes[:4] for lanes in slots], with_w=False)
    slots = [_with_w(lanes[:4], split=True) for lanes in slots]
    return Schedule.from_lists(_orders(slots), name=name)


def _check(name: str, P: int, m: int) -> tuple[int, int]:
    """``(P, m)`` as ints; ``TypeError`` for a non-integer, ``ValueError`` naming the argument unless ``P >= 2`` and
    ``m >= 1`` (the reference builds a valid order for every ``m >= 1``: with fewer than ``(P+2)//2`` or ``(P+4)//3``
    micro-batches, the peak is ``m``)."""
    P = check_int("P", P)
    m = check_int("m", m)
    if P < 2:
        raise ValueError(f"P={P} is invalid for {name}: its V puts two stages on each of at least 2 ranks; give P >= 2")
    if m < 1:
        raise ValueError(f"m={m} is invalid for {name}: a step runs at least one micro-batch; give m >= 1")
    return P, m


def _block(P: int, memory: str) -> list[list[int]]:
    """Per rank, the slots of its passes F, f, B, b in the building block of micro-batch 0.

    The reference's ``stable_pattern_v_half`` and ``stable_pattern_v_min`` (the paper's V-shaped blocks with uniform
    offsets): V-Half steps two slots from rank to rank on the way down (F, B) and one on the way up (f, b), V-Min one
    slot both ways, which shortens the lifespan, and so the memory, of the first chunk's activations. ``gap`` shifts
    the backward half of the block where the plain offsets would make two passes of different micro-batches collide
    (``P`` even for V-Half, a multiple of 3 for V-Min).
    """
    if memory == "half":
        gap = 3 if P % 2 == 0 else 0
        return [[2 * r, 3 * P - r - 2, 3 * P + gap + 2 * r - 1, 6 * P + gap - r - 2] for r in range(P)]
    gap = 2 if P % 3 == 0 else 0
    return [[r, 2 * P - r - 1, 2 * P + gap + r, 4 * P + gap - r - 1] for r in range(P)]


def _repeat(block: list[list[int]], m: int) -> Slots:
    """The block repeated for ``m`` micro-batches: micro-batch ``i`` ``_PERIOD * i`` slots after micro-batch 0."""
    return [[list(range(first, first + _PERIOD * m, _PERIOD)) for first in lanes] for lanes in block]


def _reorder(slots: Slots, with_w: bool) -> Slots:
    """Move passes of the warm-up (only ``with_w``) and of the cool-down to earlier free slots, then squeeze.

    The reference's ``PipelineGraph.reorder``. Passes are visited in slot order. The steady phase, from rank 0's
    first ``b`` to the first forward of the last micro-batch, stays as it is; any other pass takes the earliest free
    slot after what it needs (:func:`_earliest`) that keeps the rank's peak (:func:`_peak_chunks`) within the
    schedule's, or stays. Without W passes (``with_w=False``) they are placed afterwards (:func:`_with_w`, merged).
    Returns the squeezed slots, five lanes per rank (the W lane merged).
    """
    slots = copy.deepcopy(slots)
    if with_w:
        slots = [_with_w(lanes, split=False) for lanes in slots]
    budget = max(_peak_chunks(lanes) for lanes in slots)
    last = len(slots[0][_F0]) - 1
    taken: list[set[int]] = [set() for _ in slots]
    phase = "warm-up"
    for slot, rank, kind, i in _passes(slots):
        if phase == "warm-up" and kind == _I0 and rank == 0:
            phase = "steady"
        movable = phase == "cool-down" or (phase == "warm-up" and with_w)
        if phase == "steady" and kind == _F0 and i == last:
            phase = "cool-down"  # from the next pass on: this forward stays
        if movable:
            lanes = slots[rank]
            lanes[kind][i] = _earlier_slot(lanes, kind, i, _earliest(slots, rank, kind, i), slot, taken[rank], budget)
        taken[rank].add(slots[rank][kind][i])
    if not with_w:
        slots = [_with_w(lanes, split=False) for lanes in slots]
    return _squeeze(slots)


def _earlier_slot(
    lanes: list[list[int]], kind: int, i: int, start: int, slot: int, taken: set[int], budget: int
) -> int:
    """The first free slot in ``[start, slot)`` where pass ``(kind, i)`` keeps the rank's peak within ``budget``, or
    ``slot`` (where it is) when there is none. Leaves ``lanes[kind][i]`` at the last slot tried, as the reference."""
    for candidate in range(start, slot):
        if candidate not in taken:
            lanes[kind][i] = candidate
            if _peak_chunks(lanes) <= budget:
                return candidate
    return slot


def _earliest(slots: Slots, rank: int, kind: int, i: int) -> int:
    """The first slot pass ``(kind, i)`` of ``rank`` may take: one after the latest pass it needs (the previous rank's
    or the next rank's same pass along the V, its own pass before it in F, f, B, b, and for a W the ``i``-th input
    gradient of the rank), as the slots stand."""
    P, lanes = len(slots), slots[rank]
    needs = [-1]
    if kind in (_F0, _I1) and rank > 0:
        needs.append(slots[rank - 1][kind][i])
    if kind in (_F1, _I0) and rank + 1 < P:
        needs.append(slots[rank + 1][kind][i])
    if 0 < kind < _W1:
        needs.append(lanes[kind - 1][i])
    if kind == _W1:
        needs.append(sorted(lanes[_I1] + lanes[_I0])[i])
    if i > 0:
        needs.append(lanes[kind][i - 1])
    return max(needs) + 1


def _with_w(lanes: list[list[int]], split: bool) -> list[list[int]]:
    """A rank's four lanes F, f, B, b plus its W passes, each in the first idle slot after its input gradient.

    The reference's ``put_w``: walking the slots, an idle slot takes a pending W (the second chunk's first when
    ``split``), and those still pending run after the last pass. Returns five lanes (one merged W lane) or, with
    ``split``, six (W for ``B``, w for ``b``; a lane's ``i``-th entry is micro-batch ``i``'s, as both run in order).
    """
    kind_at = {slot: kind for kind, lane in enumerate(lanes) for slot in lane}
    bound = max(lane[-1] for lane in lanes)
    w_lanes: list[list[int]] = [[], []]
    pending = [0, 0]
    for slot in range(bound + 1):
        kind = kind_at.get(slot)
        if kind is not None:
            if kind in (_I1, _I0):
                pending[kind - _I1 if split else 0] += 1
            continue
        for j in (0, 1):
            if pending[j]:
                w_lanes[j].append(slot)
                pending[j] -= 1
                break
    slot = bound
    for j in (0, 1):
        for _ in range(pending[j]):
            slot += 1
            w_lanes[j].append(slot)
    return [list(lane) for lane in lanes] + (w_lanes if split else w_lanes[:1])


def _peak_chunks(lanes: list[list[int]]) -> int:
    """A rank's peak of held chunk activations: a forward acquires one, a W releases one (the reference's
    ``mem_of_stage``). Without W lanes, each idle slot releases the oldest input gradient's, as :func:`_with_w` would
    place it."""
    kind_at = {slot: kind for kind, lane in enumerate(lanes) for slot in lane}
    has_w = len(lanes) > 4
    level = peak = pending = 0
    for slot in range(max(lane[-1] for lane in lanes) + 1):
        kind = kind_at.get(slot)
        if kind is not None:
            level += _HOLD[kind]
            pending += kind in (_I1, _I0)
        elif not has_w and pending:
            level -= 1
            pending -= 1
        peak = max(peak, level)
    return peak


def _squeeze(slots: Slots) -> Slots:
    """Every pass as early as its dependencies and its rank's order allow, one slot each (the reference's
    ``eager_execution_time`` at unit costs and no communication; the paper's *squeezing*). Returns new slots."""
    P = len(slots)
    end: dict[tuple[int, int, int], int] = {}
    rank_end = [0] * P
    for _, rank, kind, i in _passes(slots):
        ready = rank_end[rank]
        if kind in (_F0, _I1) and rank > 0:
            ready = max(ready, end[rank - 1, kind, i])
        if kind in (_F1, _I0) and rank + 1 < P:
            ready = max(ready, end[rank + 1, kind, i])
        if 0 < kind < _W1:
            ready = max(ready, end[rank, kind - 1, i])
        if i > 0:
            ready = max(ready, end[rank, kind, i - 1])
        end[rank, kind, i] = rank_end[rank] = ready + 1
    return [
        [[end[rank, kind, i] - 1 for i in range(len(lane))] for kind, lane in enumerate(lanes)]
        for rank, lanes in enumerate(slots)
    ]


def _passes(slots: Slots) -> list[tuple[int, int, int, int]]:
    """Every pass as ``(slot, rank, kind, microbatch)``, in the order the reference visits them (slot first)."""
    return sorted(
        (slot, rank, kind, i)
        for rank, lanes in enumerate(slots)
        for kind, lane in enumerate(lanes)
        for i, slot in enumerate(lane)
    )


def _orders(slots: Slots) -> list[list[Action]]:
    """Per rank, its actions in slot order, as torch's ``(kind, stage, microbatch)``: the first chunk is stage
    ``rank``, the second ``2P-1-rank``; B and b are input gradients (``I``), W and w weight gradients."""
    P = len(slots)
    orders = []
    for rank, lanes in enumerate(slots):
        first, second = rank, 2 * P - 1 - rank
        meaning = {_F0: ("F", first), _F1: ("F", second), _I1: ("I", second), _I0: ("I", first)}
        meaning |= {_W1: ("W", second), _W0: ("W", first)}
        timed = sorted((slot, kind, i) for kind, lane in enumerate(lanes) for i, slot in enumerate(lane))
        orders.append([(meaning[kind][0], meaning[kind][1], i) for _, kind, i in timed])
    return orders
