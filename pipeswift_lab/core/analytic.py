"""Closed forms of pipeline bubbles and in-flight activation memory.

Two conventions of "bubble" exist and both are quoted in the literature; this module
names them apart so nobody mixes them:

* :func:`bubble_ratio` — the share of a training step that a stage sits idle,
  ``(P-1)/(m+P-1)`` for GPipe (Huang et al., *GPipe*, NeurIPS 2019).
* :func:`bubble_overhead` — bubble time over ideal compute time, ``(P-1)/m`` for 1F1B
  and ``(P-1)/(v*m)`` for the interleaved schedule with ``v`` chunks per rank
  (Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM*, SC 2021).

The two are tied by ``ratio = overhead / (1 + overhead)``.

Zero-bubble schedules split the backward into an input-gradient part ``I`` and a
weight-gradient part ``W`` whose deferral fills the bubble (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024; Qi et al., *Pipeline Parallelism with Controllable
Memory*, NeurIPS 2024; DeepSeek-AI, *DeepSeek-V3 Technical Report*, 2024, for
DualPipe). Their closed forms below are the papers' bubble terms for equal stages;
:func:`pipeswift_lab.simulation.simulator` replays torch's exact action order with real durations
and is the reference for anything else.

How the closed forms compare with torch's orders replayed with equal stages and free
communication (the tests check the exact cases against :func:`~pipeswift_lab.simulation.simulate`):
GPipe and 1F1B match for every ``P``, ``m``, ``F`` and ``B``; Interleaved1F1B and LoopedBFS for
every ``m >= P`` (with ``m < P`` torch's order is slower); InterleavedZeroBubble (ZB-H1) for any
``F``, ``I`` and ``W`` with ``W <= min(F, I)``, where the paper's form assumes the deferred ``W``
fits the bubble (beyond it torch's order is longer); DualPipeV matches DeepSeek-V3's form
exactly when ``F = I = W`` per chunk, as in its Table 2; torch's ZBVZeroBubble order runs up to
about ``(P-1)`` chunk forwards longer than the paper's form.

[Note: zero-bubble conventions] Two conventions differ between the Zero Bubble papers and this
toolkit, and every comparison of a zero-bubble number has to name them:

* **Span.** The papers measure each stage's own span, from its first action to its last;
  ``step_ms`` here (the closed forms and :class:`~pipeswift_lab.simulation.Timeline` alike) is the
  whole step, from the first action of any rank to the last of any rank.
* **Sends.** The papers' sends do not block; torch's ``Schedule1F1B`` does (it fuses each send
  with the next receive in one batch and waits until the tensor has arrived), and the simulator
  follows torch.

Times are per rank and per micro-batch: ``fwd_ms`` is a rank's whole forward of one
micro-batch (all its chunks together), ``bwd_ms`` its whole backward, split as
``igrad_ms + wgrad_ms`` for zero-bubble schedules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .checks import check_fraction, check_int, check_time
from .schedule import Schedule, ScheduleLike, held_chunks
from .vocabulary import SINGLE_CHUNK_SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_schedule_v

#: Share of the backward that is the weight gradient when nothing better is known.
#: For a linear layer ``y = x W`` the input gradient and the weight gradient are one
#: matmul each of the same size, so an even split is the natural default.
DEFAULT_WGRAD_FRACTION = 0.5

#: ``k`` of the zero-bubble bubble ``(P-1)(F + I - k*W)/v``: ZB-H1 (Qi et al. 2024's ``ZB1P``, torch's
#: InterleavedZeroBubble) defers one ``W`` per bubble slot, ZB-V two. DualPipeV has its own form
#: (:func:`_dualpipev_bubble_ms`).
_ZB_WGRAD_MULTIPLIER = {"InterleavedZeroBubble": 1.0, "ZBVZeroBubble": 2.0}


def backward_parts(
    bwd_ms: Sequence[float],
    wgrad_ms: Sequence[float] | None = None,
    recomputed_ms: Sequence[float] | None = None,
    passes_ms: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[list[float], list[float]]:
    """Per stage, the ``(input-grad I, weight-grad W)`` durations of a backward split as a zero-bubble schedule runs
    it.

    ``I = bwd - wgrad`` and ``W = wgrad`` (``wgrad_ms=None``: :data:`DEFAULT_WGRAD_FRACTION` of ``bwd``), except on
    the first stage: its input is the data, which needs no gradient, so torch's input-grad pass has nothing to compute
    there and its weight-grad pass runs the stage's whole backward (``I = 0``, ``W = bwd``; measured on this machine:
    ``I`` 0.02 ms). ``recomputed_ms`` is the recomputation inside each ``bwd`` (checkpointed layers): both passes
    recompute, so it is in ``W`` (its default share is taken of the rest) and ``I`` runs it once more.
    ``passes_ms``, ``(I, W)`` per stage as torch's own split passes took them (the profile's ``input_pass_ms`` and
    ``weight_pass_ms``: split, a backward costs more than whole), replaces the split of ``bwd`` wherever both are
    finite (the recomputation added to each). The one place this rule lives (the simulator and the calibration's fit
    use it).
    """
    again = [0.0] * len(bwd_ms) if recomputed_ms is None else list(recomputed_ms)
    if wgrad_ms is None:
        wgrad = [DEFAULT_WGRAD_FRACTION * (b - r) + r for b, r in zip(bwd_ms, again)]
    else:
        wgrad = list(wgrad_ms)
    igrad = [max(0.0, b - w + r) for b, w, r in zip(bwd_ms, wgrad, again)]
    if passes_ms is not None:
        for s, (i, w) in enumerate(zip(*passes_ms)):
            if math.isfinite(i) and math.isfinite(w):
                igrad[s], wgrad[s] = i + again[s], w + again[s]
    if bwd_ms:
        igrad[0], wgrad[0] = 0.0, bwd_ms[0]
    return igrad, wgrad


def _check_pm(P: int, m: int) -> tuple[int, int]:
    return check_int("P", P, minimum=1), check_int("m", m, minimum=1)


def _bubble_time_over_unit(
    P: int, m: int, schedule: str, v: int, fwd_ms: float, bwd_ms: float, wgrad_fraction: float | None
) -> tuple[float, float]:
    """Return ``(bubble_ms, compute_ms)`` of one step on the busiest rank."""
    P, m = _check_pm(P, m)
    schedule, v = check_schedule_v(schedule, v)
    fwd_ms = check_time("fwd_ms", fwd_ms)
    bwd_ms = check_time("bwd_ms", bwd_ms)
    fraction = (
        DEFAULT_WGRAD_FRACTION
        if wgrad_fraction is None
        else check_fraction("wgrad_fraction", wgrad_fraction, what="a share of the backward")
    )
    wgrad_ms = fraction * bwd_ms
    if fwd_ms + bwd_ms == 0:
        raise ValueError("fwd_ms + bwd_ms must be > 0; a step with no compute has no bubble ratio")
    compute_ms = m * (fwd_ms + bwd_ms)
    if schedule in SINGLE_CHUNK_SCHEDULES:
        bubble_ms = (P - 1) * (fwd_ms + bwd_ms)
    elif schedule in ("Interleaved1F1B", "LoopedBFS"):
        bubble_ms = (P - 1) * (fwd_ms + bwd_ms) / v
    elif schedule == "DualPipeV":
        bubble_ms = _dualpipev_bubble_ms(P, v, fwd_ms, bwd_ms, wgrad_ms)
    else:  # zero-bubble family: W deferred into the bubble
        igrad_ms = bwd_ms - wgrad_ms
        k = _ZB_WGRAD_MULTIPLIER[schedule]
        bubble_ms = (P - 1) * max(0.0, fwd_ms + igrad_ms - k * wgrad_ms) / v
    return bubble_ms, compute_ms


def _dualpipev_bubble_ms(P: int, v: int, fwd_ms: float, bwd_ms: float, wgrad_ms: float) -> float:
    """DualPipeV's bubble on each rank: ``(PP/2 - 1)(F&B + B - 3W)`` of DeepSeek-V3's Table 2 (DeepSeek-AI,
    *DeepSeek-V3 Technical Report*, 2024, and the DualPipe README), with ``PP = 2P`` chunks and the overlapped
    ``F&B`` drawn as ``F + B``, as the official DualPipeV figure draws it. ``F``, ``B`` and ``W`` are one chunk's:
    a rank's times over ``v``. With ``F = I = W = 1`` per chunk, ``P = 4`` and ``m = 10`` it is 6 of a 66-unit step.
    """
    f, b, w = fwd_ms / v, bwd_ms / v, wgrad_ms / v
    return (P - 1) * max(0.0, f + b + b - 3 * w)


def bubble_overhead(
    P: int,
    m: int,
    schedule: str = "1F1B",
    *,
    v: int = 1,
    fwd_ms: float = 1.0,
    bwd_ms: float = 2.0,
    wgrad_fraction: float | None = None,
) -> float:
    """Bubble time over ideal compute time of one step (Megatron-LM's convention).

    Returns ``(P-1)/m`` for GPipe and 1F1B, ``(P-1)/(v*m)`` for Interleaved1F1B and
    LoopedBFS, for the zero-bubble schedules ``(P-1)*max(0, F+I-k*W)/(v*m*(F+I+W))``
    with ``k=1`` for InterleavedZeroBubble (ZB-H1, the papers' ZB1P) and ``k=2`` for
    ZBVZeroBubble (ZB-V), and for DualPipeV ``(P-1)*max(0, F+2B-3W)/(v*m*(F+B))``
    (DeepSeek-V3's ``(PP/2-1)(F&B+B-3W)``), where ``B = bwd_ms``, ``W = wgrad_fraction * bwd_ms``
    and ``I = B - W``. ``fwd_ms``, ``bwd_ms`` and ``wgrad_fraction`` only matter for the
    zero-bubble family; ``wgrad_fraction`` defaults to :data:`DEFAULT_WGRAD_FRACTION`.
    The bubble is the whole step's, not each stage's own span as the Zero Bubble papers
    measure it, and torch's sends block where the papers' do not: see
    [Note: zero-bubble conventions] in this module's docstring.

    >>> bubble_overhead(4, 10, "DualPipeV", v=2, fwd_ms=2, bwd_ms=4, wgrad_fraction=0.5)
    0.1
    """
    bubble_ms, compute_ms = _bubble_time_over_unit(P, m, schedule, v, fwd_ms, bwd_ms, wgrad_fraction)
    return bubble_ms / compute_ms


def bubble_ratio(
    P: int,
    m: int,
    schedule: str = "1F1B",
    *,
    v: int = 1,
    fwd_ms: float = 1.0,
    bwd_ms: float = 2.0,
    wgrad_fraction: float | None = None,
) -> float:
    """Share of one step that a stage sits idle (GPipe's convention).

    Returns ``(P-1)/(m+P-1)`` for GPipe and 1F1B, ``(P-1)/(v*m+P-1)`` for the
    interleaved schedules, and ``overhead/(1+overhead)`` in general, where
    ``overhead`` is :func:`bubble_overhead` of the same arguments (the same default
    schedule, 1F1B, whose bubble equals GPipe's).

    >>> round(bubble_ratio(8, 16), 3), round(bubble_ratio(4, 16), 3)
    (0.304, 0.158)
    """
    bubble_ms, compute_ms = _bubble_time_over_unit(P, m, schedule, v, fwd_ms, bwd_ms, wgrad_fraction)
    return bubble_ms / (bubble_ms + compute_ms)


def bubble_summary(P: int, m: int, schedule: str = "1F1B", *, v: int = 1) -> dict[str, Any]:
    """Both bubble conventions and rank 0's in-flight micro-batches for one setting, as a flat dict.

    Keys: ``P``, ``m``, ``schedule``, ``v``, ``bubble_ratio``, ``bubble_overhead``, ``inflight_rank0``.
    """
    return {
        "P": P,
        "m": m,
        "schedule": schedule,
        "v": v,
        "bubble_ratio": bubble_ratio(P, m, schedule, v=v),
        "bubble_overhead": bubble_overhead(P, m, schedule, v=v),
        "inflight_rank0": inflight_microbatches(P, m, schedule, v=v)[0],
    }


def step_ms(
    P: int,
    m: int,
    schedule: str = "1F1B",
    *,
    v: int = 1,
    fwd_ms: float = 1.0,
    bwd_ms: float = 2.0,
    wgrad_fraction: float | None = None,
) -> float:
    """Closed-form step time with equal stages and free communication: compute plus bubble.

    ``fwd_ms`` and ``bwd_ms`` are one rank's forward and backward of one micro-batch;
    ``wgrad_fraction`` as in :func:`bubble_overhead`.
    """
    bubble_ms, compute_ms = _bubble_time_over_unit(P, m, schedule, v, fwd_ms, bwd_ms, wgrad_fraction)
    return bubble_ms + compute_ms


def inflight_microbatches(P: int, m: int, schedule: ScheduleLike = "1F1B", *, v: int = 1) -> list[float]:
    """Peak number of micro-batches whose activations a rank holds, one entry per rank.

    Counted in whole-rank micro-batches: with ``v`` chunks per rank a chunk's activations
    count ``1/v``. A micro-batch is held from its forward until its backward ends (until
    its weight-grad ``W`` for the zero-bubble schedules, whose input-grad keeps the graph
    alive). The counts are those of the orders torch executes (checked against
    :func:`pipeswift_lab.simulation.simulator` in the tests), with ``m_round = m / max(1, m // P)``
    micro-batches per round as in torch's interleaved schedules:

    * GPipe and LoopedBFS: all ``m`` on every rank;
    * 1F1B: ``min(m, P - r)`` on rank ``r`` (PipeDream-Flush);
    * Interleaved1F1B: ``min(v*m, (v-1)*m_round + 2*(P-1-r) + 1)`` chunks — its warm-up plus one;
    * InterleavedZeroBubble: ``min(v*m, (v-1)*m_round + P)`` chunks on every rank;
    * ZBVZeroBubble: ``min(2P, 2m, m+1+r)`` chunks — ``P`` micro-batches once warm (Qi et al. 2024);
    * DualPipeV: ``min(2m, 2P+1)`` chunks, ``P + 1/2`` micro-batches once warm, on every rank (DeepSeek-V3 report);
    * a :class:`~pipeswift_lab.core.schedule.Schedule`: counted along its own order.
    """
    P, m = _check_pm(P, m)
    schedule, v = check_schedule_v(schedule, v)
    if isinstance(schedule, Schedule):
        schedule.check_fits(P, P * v, m)
        return [c / v for c in held_chunks(schedule)]
    per_round = m // max(1, m // P)
    if schedule in ("GPipe", "LoopedBFS"):
        chunks = [m * v] * P
    elif schedule == "1F1B":
        chunks = [min(m, P - r) for r in range(P)]
    elif schedule == "Interleaved1F1B":
        chunks = [min(m * v, (v - 1) * per_round + 2 * (P - 1 - r) + 1) for r in range(P)]
    elif schedule == "InterleavedZeroBubble":
        chunks = [min(m * v, (v - 1) * per_round + P)] * P
    elif schedule == "ZBVZeroBubble":
        chunks = [min(2 * P, 2 * m, m + 1 + r) for r in range(P)]
    else:  # DualPipeV
        chunks = [min(2 * m, 2 * P + 1)] * P
    return [c / v for c in chunks]


def activation_memory_bytes(
    P: int, m: int, activation_bytes: float | Sequence[float], schedule: str = "1F1B", *, v: int = 1
) -> list[float]:
    """Peak activation memory of each rank: in-flight micro-batches times bytes per micro-batch.

    ``activation_bytes`` is what one rank saves for backward per micro-batch (a
    number for equal stages, or one number per rank). Returns one value per rank.
    """
    counts = inflight_microbatches(P, m, schedule, v=v)
    if isinstance(activation_bytes, (list, tuple)):
        if len(activation_bytes) != len(counts):
            raise ValueError(
                f"activation_bytes has {len(activation_bytes)} entries; it needs one per rank, P={len(counts)}"
            )
        per_rank = [check_time(f"activation_bytes[{r}]", a) for r, a in enumerate(activation_bytes)]
    else:
        per_rank = [check_time("activation_bytes", activation_bytes)] * len(counts)
    return [c * a for c, a in zip(counts, per_rank)]


__all__ = [
    "DEFAULT_WGRAD_FRACTION",
    "backward_parts",
    "ZERO_BUBBLE_SCHEDULES",
    "bubble_ratio",
    "bubble_overhead",
    "bubble_summary",
    "step_ms",
    "inflight_microbatches",
    "activation_memory_bytes",
]
