"""Zero Bubble schedules: the handcrafted ZB-H2 and the automatic heuristic behind ZB-1p and ZB-2p.

Qi, Wan, Huang & Lin, *Zero Bubble Pipeline Parallelism*, ICLR 2024 (arXiv:2401.10241). Both split every backward
into the input gradient ``I`` (the paper's ``B``), which the previous stage waits for, and the weight gradient ``W``,
which may run any time after its ``I`` and so fills the bubbles. Both return a
:class:`~pipeswift_lab.core.schedule.Schedule` with one stage per rank (loop placement)::

    sch = zero_bubble(part, m=24, link=link, max_inflight=2 * part.P)  # ZB-2p
    tl = psl.simulate(part, sch.m, sch, link=link)
    tl.rank_span_bubble_rate  # the paper's bubble rate (Section 5.3)

* :func:`zb_h2` (Section 2.2, Figure 3 bottom) is the order drawn for ``T_F = T_B = T_W``: ``2P - 1`` warm-up
  forwards on the first stage, the tail's ``W`` moved up so the trapezoid becomes a parallelogram.
* :func:`zero_bubble` (Section 3.1) plans with the stages' own times and the transfer time: a greedy pass per
  combination of three binary choices, keeping the order whose longest stage span is the shortest. It is a port of
  sail-sg's ``Graph.manual_order`` and ``initial_solution`` (github.com/sail-sg/zero-bubble-pipeline-parallelism,
  ``megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py``), without the optional ILP refinement (Appendix G).

[Note: zero-bubble memory] The heuristic counts activation memory in micro-batches of one stage: a forward adds 1
(the paper's ``M_B``), its ``I`` frees all but ``w_memory_share`` of it (``M_W / M_B``) and its ``W`` the rest.
``max_inflight`` caps the count per stage: ``P`` is the paper's ZB-1p (``M_limit = p M_B``), ``2P`` its ZB-2p. With
the default ``w_memory_share=1`` a micro-batch is held from its ``F`` until its ``W`` (the convention of
:attr:`~pipeswift_lab.simulation.timeline.Timeline.peak_inflight`), so every rank's forwards done minus weight
gradients done never exceed ``max_inflight``. The paper's experiments use Table 1's share for a GPT layer,
``32h / (34h + 5as)`` (sail-sg's ``get_zero_bubble_forward_backward_func``), which admits more forwards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..core.analytic import backward_parts
from ..core.checks import check_fraction, check_int, check_time
from ..core.link import Link, check_link
from ..core.schedule import Schedule
from ..core.schedule_cells import Action
from ..partitioning.stages import Partition

__all__ = ["StageTimes", "stage_times", "zb_h2", "zero_bubble"]

#: Slack of the memory comparisons: counts are sums of shares, compared with the limit as the reference compares its
#: integer byte counts.
_EPS = 1e-9


# ---------------------------------------------------------------------------------------------------------- ZB-H2
def zb_h2(P: int, m: int) -> Schedule:
    """The ZB-H2 schedule of ``P`` stages, one per rank, and ``m`` micro-batches (Qi et al., ICLR 2024, Section 2.2,
    Figure 3 bottom). Returns the :class:`~pipeswift_lab.core.schedule.Schedule`, named ``"ZB-H2"``.

    Rank ``r`` (0-based) runs ``2(P - r) - 1`` warm-up forwards, then ``2r`` pairs of one ``I`` and one ``F`` while
    the later stages fill, then ``I, W, F`` triples until the forwards run out, ``I, W`` pairs until the input
    gradients run out, and the remaining ``W``. Every rank reaches ``2P - 1`` micro-batches in flight (forwards done
    minus weight gradients done); as a ``W`` keeps less than a ``B`` (Section 2.3: rank ``r`` holds
    ``(2P - 2r - 1) M_B + 2r M_W``), the first stage's memory peaks highest. With ``T_F = T_B = T_W`` and no transfer
    time each rank computes without a gap from its first action to its last. Raises ``ValueError`` when
    ``m < 2P - 1``: the warm-up needs that many micro-batches.
    """
    P = check_int("P", P, minimum=1)
    m = check_int("m", m, minimum=1)
    if m < 2 * P - 1:
        raise ValueError(
            f"zb_h2 needs m >= 2P - 1 = {2 * P - 1} micro-batches for P={P} (its first stage runs 2P - 1 warm-up "
            f"forwards); got m={m}. Use more micro-batches, or zero_bubble() for a schedule of any m"
        )
    return Schedule.from_lists([_zb_h2_rank(P, m, r) for r in range(P)], name="ZB-H2")


def _zb_h2_rank(P: int, m: int, r: int) -> list[Action]:
    """Rank ``r``'s order in ZB-H2 (see :func:`zb_h2`); its stage is ``r``."""
    warm_up = 2 * (P - r) - 1
    order: list[Action] = [("F", r, i) for i in range(warm_up)]
    forwards, backwards, weights = warm_up, 0, 0
    for _ in range(2 * r):  # one I, one F while the later stages are still filling
        order += [("I", r, backwards), ("F", r, forwards)]
        backwards, forwards = backwards + 1, forwards + 1
    while backwards < m:  # steady I, W, F; I, W once the forwards are done
        order += [("I", r, backwards), ("W", r, weights)]
        backwards, weights = backwards + 1, weights + 1
        if forwards < m:
            order.append(("F", r, forwards))
            forwards += 1
    return order + [("W", r, i) for i in range(weights, m)]


# ---------------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """What the heuristic plans with, per stage in stage order (ms)."""

    f: tuple[float, ...]
    """Forward."""
    i: tuple[float, ...]
    """Input gradient (the paper's ``T_B``)."""
    w: tuple[float, ...]
    """Weight gradient (``T_W``)."""
    transfer: tuple[float, ...]
    """A transfer across the boundary after each stage, either direction (``T_comm``); the last is unused."""

    @property
    def S(self) -> int:
        """Stages."""
        return len(self.f)


def stage_times(partition: Partition, link: Link | None = None) -> StageTimes:
    """The :class:`StageTimes` of a one-stage-per-rank ``partition``, split as the simulator splits them.

    ``I`` and ``W`` come from :func:`~pipeswift_lab.core.analytic.backward_parts` of the stages' backward, weight
    gradient, recomputation and measured passes (so the first stage's ``I`` is 0 and its ``W`` the whole backward);
    a transfer takes ``link.transfer_ms`` of the stage's output bytes, 0 without a link. Raises ``TypeError`` for
    anything but a Partition and ``ValueError`` for one with several stages per rank.
    """
    if not isinstance(partition, Partition):
        raise TypeError(f"partition must be a pipeswift_lab.Partition; got {type(partition).__name__}")
    if partition.v != 1:
        raise ValueError(
            f"the zero-bubble heuristic places one stage per rank; the partition has v={partition.v} stages per rank "
            "(partition it with v=1)"
        )
    link = check_link(link)
    passes = partition.split_passes_ms
    igrad, wgrad = backward_parts(
        partition.stage_bwd_ms,
        partition.stage_wgrad_ms,
        partition.stage_recomputed_ms,
        (list(passes[0]), list(passes[1])) if passes else None,
    )
    out_bytes = partition.stage_output_bytes
    transfer = [link.transfer_ms(b) for b in out_bytes] if link is not None else [0.0] * len(out_bytes)
    return StageTimes(f=tuple(partition.stage_fwd_ms), i=tuple(igrad), w=tuple(wgrad), transfer=tuple(transfer))


# ---------------------------------------------------------------------------------------------------------- heuristic
def zero_bubble(
    partition: Partition,
    m: int,
    *,
    link: Link | None = None,
    max_inflight: float | None = None,
    w_memory_share: float = 1.0,
) -> Schedule:
    """The schedule of Zero Bubble's automatic heuristic (Qi et al., ICLR 2024, Section 3.1) for ``partition`` (one
    stage per rank) and ``m`` micro-batches. Returns the :class:`~pipeswift_lab.core.schedule.Schedule`, named
    ``"ZB-1p"`` / ``"ZB-2p"`` when ``max_inflight`` is ``P`` / ``2P``, else ``"ZB(max_inflight=...)"``.

    The stage times ``T_F``, ``T_B`` (the ``I`` here), ``T_W`` and ``T_comm`` come from :func:`stage_times`.
    ``max_inflight`` (default ``P``, at least 1) caps the activations each stage holds, in micro-batches, and
    ``w_memory_share`` is the part of them a micro-batch keeps between its ``I`` and its ``W``: see [Note:
    zero-bubble memory] in the module docstring. The heuristic, as the paper and sail-sg's ``manual_order`` run it:

    * warm-up: the first micro-batch's forward on every stage, then as many more forwards per stage as fit the
      memory before its first ``I`` could start (one that would delay that ``I`` only with the first binary choice),
      each stage at least one fewer than the stage before;
    * then one ``F`` and one ``I`` per round, stage by stage; before each, the ``W`` that fit in the wait for its
      input, one more when the wait is smaller than ``T_W`` (with the third choice, only while the stage's bubble stays
      under the largest stage's), and as many as the memory needs; the second choice lets a stage already two
      forwards ahead of the next one skip a forward that would not shorten the pipeline;
    * the remaining ``W`` at the end.

    Of the eight combinations the order with the shortest longest stage span (first action's start to last action's
    end, the paper's ``cost``) is kept.
    """
    times = stage_times(partition, link)
    m = check_int("m", m, minimum=1)
    limit = _check_inflight(max_inflight, times.S)
    share = check_fraction("w_memory_share", w_memory_share, what="a share of a micro-batch's activations")
    runs = [_Greedy(times, m, limit, share) for _ in range(8)]
    for run, flags in zip(runs, itertools.product((True, False), repeat=3)):
        run.schedule(*flags)
    best = min(runs, key=_Greedy.cost)  # the first of equal costs, as sail-sg's initial_solution keeps it
    return Schedule.from_lists(best.orders, name=_name(limit, times.S))


def _check_inflight(max_inflight: float | None, P: int) -> float:
    """``max_inflight`` as a float, ``P`` when None; a number >= 1 (the first forward of every stage must fit)."""
    if max_inflight is None:
        return float(P)
    value = check_time("max_inflight", max_inflight)
    if value < 1:
        raise ValueError(
            f"max_inflight={max_inflight!r} is invalid: it counts micro-batches a stage holds and must be >= 1 "
            f"(P={P} is ZB-1p, {2 * P} is ZB-2p)"
        )
    return value


def _name(limit: float, P: int) -> str:
    """``"ZB-1p"``, ``"ZB-2p"``, ... for a limit of whole multiples of ``P``, else the limit itself."""
    times = limit / P
    return f"ZB-{times:g}p" if times == int(times) else f"ZB(max_inflight={limit:g})"


@dataclass(eq=False)
class _Greedy:
    """One greedy pass of the heuristic: the state of sail-sg's ``manual_order``, stage ``j`` being rank ``j``."""

    times: StageTimes
    m: int
    limit: float
    share: float
    done: dict[str, list[int]] = field(init=False)
    """Per kind, actions put per stage (the next micro-batch)."""
    end: dict[str, list[list[float]]] = field(init=False)
    """Per kind, stage and micro-batch, when the action ends (ms)."""
    free: list[float] = field(init=False)
    """When each stage is next free (ms)."""
    held: list[float] = field(init=False)
    """Activations each stage holds (micro-batches)."""
    bubble: list[float] = field(init=False)
    """Each stage's idle time since its second forward (ms)."""
    orders: list[list[Action]] = field(init=False)
    """Each rank's order so far."""
    durations: dict[str, tuple[float, ...]] = field(init=False)
    """Per kind, each stage's duration (ms)."""
    deltas: dict[str, float] = field(init=False)
    """Activations an action adds (micro-batches): see [Note: zero-bubble memory]."""

    def __post_init__(self) -> None:
        S, m = self.times.S, self.m
        self.done = {k: [0] * S for k in "FIW"}
        self.end = {k: [[0.0] * m for _ in range(S)] for k in "FIW"}
        self.free, self.held, self.bubble = [0.0] * S, [0.0] * S, [0.0] * S
        self.orders = [[] for _ in range(S)]
        self.durations = {"F": self.times.f, "I": self.times.i, "W": self.times.w}
        self.deltas = {"F": 1.0, "I": self.share - 1.0, "W": -self.share}

    # ------------------------------------------------------------------ primitives

    def put(self, j: int, kind: str) -> None:
        """Append stage ``j``'s next ``kind`` and time it: it starts when the stage is free and its input has come."""
        done, ends, transfer = self.done[kind], self.end[kind], self.times.transfer
        mb = done[j]
        duration = self.durations[kind][j]
        end = no_wait = self.free[j] + duration
        if kind == "F" and j > 0:
            end = max(end, ends[j - 1][mb] + transfer[j - 1] + duration)
        elif kind == "I" and j < len(transfer) - 1:
            end = max(end, ends[j + 1][mb] + transfer[j] + duration)
        if self.done["F"][j] > 0:
            self.bubble[j] += end - no_wait
        self.free[j] = ends[j][mb] = end
        self.held[j] += self.deltas[kind]
        done[j] += 1
        self.orders[j].append((kind, j, mb))

    def weights_left(self, j: int) -> bool:
        return self.done["W"][j] < self.done["I"][j]

    def make_room(self, j: int, kind: str) -> None:
        """Run ``W`` until stage ``j`` can hold what ``kind`` adds. sail-sg's guard stays: with none left it raises,
        which the warm-up's count (at most ``max_inflight - 1`` forwards ahead) keeps from happening."""
        while self.held[j] + self.deltas[kind] > self.limit + _EPS:
            if not self.weights_left(j):
                raise ValueError(f"stage {j} cannot fit max_inflight={self.limit:g} micro-batches")
            self.put(j, "W")

    def fill(self, j: int, arrival: float, greedy: bool) -> None:
        """Run the ``W`` that end before stage ``j``'s input arrives at ``arrival``, and one more that overruns it
        when the stage would wait otherwise (with ``greedy`` off, only if its bubble would pass the largest one)."""
        while self.weights_left(j) and self.free[j] + self.times.w[j] <= arrival:
            self.put(j, "W")
        if self.weights_left(j) and self.free[j] < arrival:
            if greedy or arrival - self.free[j] > max(self.bubble) - self.bubble[j]:
                self.put(j, "W")

    # ------------------------------------------------------------------ phases
    def schedule(self, allow_bubble_before_first_b: bool, prioritize_b: bool, greedy: bool) -> None:
        """The whole order with the three binary choices of Section 3.1."""
        self.warm_up(allow_bubble_before_first_b)
        for i in range(1, self.m):
            self.forward_round(prioritize_b, greedy)
            self.backward_round(i, greedy)
        for j in range(self.times.S):
            while self.done["W"][j] < self.m:
                self.put(j, "W")

    def warm_up(self, allow_bubble: bool) -> None:
        """Micro-batch 0's forwards, each stage's extra warm-up forwards, then micro-batch 0's ``I`` back up."""
        S, t = self.times.S, self.times
        for j in range(S):
            self.put(j, "F")
        extra = [0] * S
        first_i = self.end["F"][S - 1][0] + t.i[S - 1]  # when the first I can end on the stage below
        for j in range(S - 2, -1, -1):
            held, busy, arrival = self.held[j], self.free[j], first_i + t.transfer[j]
            while self.done["F"][j] + extra[j] < self.m and held + 1.0 <= self.limit + _EPS:
                if (busy + t.f[j] > arrival) if allow_bubble else (busy >= arrival):
                    break
                held, busy, extra[j] = held + 1.0, busy + t.f[j], extra[j] + 1
            first_i = max(busy, arrival) + t.i[j]
        for j in range(1, S):  # at least one forward fewer than the stage before
            while 0 < extra[j] and extra[j - 1] <= extra[j] and self.done["F"][j] + extra[j] < self.m:
                extra[j] -= 1
        for j in range(S):
            for _ in range(extra[j]):
                self.put(j, "F")
        for j in range(S - 1, -1, -1):
            self.put(j, "I")

    def forward_round(self, prioritize_b: bool, greedy: bool) -> None:
        """One more forward on every stage that takes one (a stage only when the next one does too)."""
        S = self.times.S
        wants = [self.wants_forward(j, prioritize_b) for j in range(S)]
        for j in range(S - 2, -1, -1):
            wants[j] = wants[j] and wants[j + 1]
        for j in range(S):
            if wants[j]:
                self.make_room(j, "F")
                if j > 0:
                    self.fill(j, self.end["F"][j - 1][self.done["F"][j]] + self.times.transfer[j - 1], greedy)
                self.put(j, "F")

    def wants_forward(self, j: int, prioritize_b: bool) -> bool:
        """Whether stage ``j`` runs a forward this round: any left, unless ``prioritize_b`` lets a stage two ahead of
        the next skip one that would end after the next stage's input gradient comes back."""
        f = self.done["F"]
        if f[j] >= self.m:
            return False
        if not (prioritize_b and j + 1 < self.times.S and f[j] >= f[j + 1] + 2):
            return True
        t, nxt = self.times, j + 1
        back = self.free[nxt] + t.f[nxt] + t.i[nxt] + t.transfer[j]
        if self.free[j] >= back:
            return False
        w_cost, count, held = 0.0, 0, self.held[j] + 1.0
        while held > self.limit + _EPS and self.done["W"][j] + count < self.done["I"][j]:
            w_cost, held, count = w_cost + t.w[j], held - self.share, count + 1
        if self.free[j] + t.f[j] + w_cost <= back:
            return True
        return not back - self.free[j] <= max(self.bubble) - self.bubble[j]

    def backward_round(self, i: int, greedy: bool) -> None:
        """Micro-batch ``i``'s input gradient on every stage, last to first, each after the ``W`` that fit before."""
        for j in range(self.times.S - 1, -1, -1):
            self.make_room(j, "I")
            if j + 1 < self.times.S:
                self.fill(j, self.end["I"][j + 1][i] + self.times.transfer[j], greedy)
            if j == 0 and self.done["F"][0] == self.m:
                while self.weights_left(0):
                    self.put(0, "W")
            self.put(j, "I")

    def cost(self) -> float:
        """The longest stage span (ms): first forward's start to last weight gradient's end (the paper's cost)."""
        last = self.m - 1
        return max(self.end["W"][j][last] - self.end["F"][j][0] + self.times.f[j] for j in range(self.times.S))
