"""Duration-aware simulation of a pipeline schedule: replay torch's action order with real times.

torch's schedule visualizer counts every action as one time unit. Here every rank executes
its order from :mod:`pipeswift_lab.simulation.schedules` one action after the other; an action starts
when its rank is free and its inputs are there:

* ``F`` of stage ``s`` needs the activation of ``F`` of stage ``s-1`` (same micro-batch);
* ``B``/``I`` of stage ``s`` need its own ``F`` and the gradient of the ``B``/``I`` of stage
  ``s+1`` (the last stage needs only its ``F``);
* ``W`` needs the ``I`` of the same stage and micro-batch.

Communication follows each runtime's code (torch ``schedules.py``):

* the multi-chunk runtime (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS, the
  zero-bubble family, DualPipeV) posts receives early and fires sends right after the
  action that produced the data (after both parts of an ``OVERLAP_F_B``) without waiting
  for them, so a transfer overlaps the sender's next actions and only the consumer waits
  for it;
* ``ScheduleGPipe`` waits for its receives before each action, fires sends asynchronously,
  and waits for all forward sends before the first backward;
* ``Schedule1F1B`` waits for the previous forward send after each warm-up forward, and in
  the steady state fuses each send with the next receive in one blocking batch: after a
  forward the rank waits until that activation has arrived downstream *and* the gradient it
  needs next has arrived, and likewise after a backward. Its transfers therefore do not
  overlap its compute.

A transfer of the boundary after stage ``s`` takes ``link.transfer_ms(output_bytes)`` in
either direction (a gradient has its activation's size); stages on the same rank (the V
shape's turn) exchange tensors locally at no cost. Transfers on one link do not contend,
and a send completes when its data arrives (receivers are assumed posted, as torch posts
them ahead). With a link the Timeline has ``SEND_*`` rows on the sender and ``RECV_*`` rows
on the receiver, both spanning the flight of the data.

Each signal is computed once and each rank runs until it waits on a signal not yet
produced, so the simulation is linear in the number of actions; if every rank waits, the
order deadlocks and :class:`ScheduleDeadlock` names what each rank waits for.
"""

from __future__ import annotations

import math
import numbers

import pandas as pd

from ..core.analytic import DEFAULT_WGRAD_FRACTION, backward_parts
from ..core.checks import check_int, check_wgrad_fraction, nonnegative_column
from ..core.link import check_link
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, canonical_schedule, stage_to_rank, validate
from ..partitioning.balance import Partition
from .engine import (  # noqa: F401 - _KIND_NAMES and ScheduleDeadlock re-exported
    _KIND_NAMES,
    ScheduleDeadlock,
    _compute_table,
    _lower,
    _lowered,
    _lowered_table,
    _rows_frame,
    _run,
)
from .timeline import Timeline


class _Stages:
    """Per-stage inputs of the simulator, as plain lists."""

    def __init__(self, fwd, bwd, wgrad, out_bytes, act_bytes, P, v, schedule, placement):
        self.fwd, self.bwd, self.wgrad = fwd, bwd, wgrad
        self.out_bytes, self.act_bytes = out_bytes, act_bytes
        self.P, self.v, self.schedule, self.placement = P, v, schedule, placement
        self.S = len(fwd)


def _from_partition(part: Partition, schedule, v):
    if schedule is None:
        schedule = part.schedule or ("1F1B" if part.v == 1 else "Interleaved1F1B")
    schedule = canonical_schedule(schedule)
    if v is not None and check_int("v", v, minimum=1) != part.v:
        raise ValueError(
            f"v={v} does not match the partition's v={part.v}; the stages per rank are fixed when partitioning: "
            f"re-partition with partition(profile, {part.P}, v={v}, schedule={schedule!r}), or leave v=None"
        )
    if schedule in SINGLE_CHUNK_SCHEDULES and part.v != 1:
        raise ValueError(
            f"schedule={schedule!r} runs one stage per rank but the partition has v={part.v}; re-partition with partition(profile, {part.P}, v=1)"
        )
    if schedule in V_SHAPE_SCHEDULES and part.v != 2:
        raise ValueError(
            f"schedule={schedule!r} places 2 stages per rank in a V but the partition has v={part.v}; "
            f"re-partition with partition(profile, {part.P}, v=2, schedule={schedule!r})"
        )
    expected = stage_to_rank(part.P, part.v, schedule)
    if tuple(part.stage_to_rank) != expected:
        raise ValueError(
            f"schedule={schedule!r} places stages on ranks as {list(expected)} but the partition (schedule={part.schedule!r}) "
            f"places them as {list(part.stage_to_rank)}; partition with schedule={schedule!r}"
        )
    act = None if any(math.isnan(x) for x in part.stage_activation_bytes) else list(part.stage_activation_bytes)
    wgrad = list(part.stage_wgrad_ms) if part.stage_wgrad_ms is not None else None
    return _Stages(
        list(part.stage_fwd_ms),
        list(part.stage_bwd_ms),
        wgrad,
        list(part.stage_output_bytes),
        act,
        part.P,
        part.v,
        schedule,
        tuple(part.stage_to_rank),
    )


def _column(df, col, required=True):
    if col not in df.columns:
        if required:
            raise ValueError(
                f"the stage table has no {col!r} column; it needs fwd_ms and bwd_ms (columns: {list(df.columns)})"
            )
        return None
    values, bad = nonnegative_column(df[col])
    if bad:
        raise ValueError(
            f"stage table column {col!r}: stage {bad[0]} has {bad[1]!r}; values must be finite numbers >= 0 (ms or bytes)"
        )
    return values.tolist()


def _from_table(df: pd.DataFrame, schedule, v):
    schedule = canonical_schedule(schedule or "1F1B")
    if v is None:
        if schedule in SINGLE_CHUNK_SCHEDULES:
            v = 1
        elif schedule in V_SHAPE_SCHEDULES:
            v = 2
        else:
            raise ValueError(
                f"schedule={schedule!r} with a stage table needs v (stages per rank); the table has {len(df)} stages = P*v"
            )
    v = check_int("v", v, minimum=1)
    if len(df) == 0 or len(df) % v:
        raise ValueError(
            f"the stage table has {len(df)} rows; with v={v} it needs P*v rows (a positive multiple of {v})"
        )
    P = len(df) // v
    fwd, bwd = _column(df, "fwd_ms"), _column(df, "bwd_ms")
    wgrad = _column(df, "wgrad_ms", required=False)
    out_bytes = _column(df, "output_bytes", required=False)
    act = _column(df, "activation_bytes", required=False)
    return _Stages(fwd, bwd, wgrad, out_bytes, act, P, v, schedule, None)


def _prepare(partition, m, schedule, v, link, wgrad_fraction, calibration=None):
    """Validate :func:`simulate`'s arguments; return the stage table and per-kind durations.

    With a ``calibration`` (:class:`~pipeswift_lab.fidelity.calibrator.Calibration`) the durations are
    its calibrated ones and, when no ``link`` is given, its fitted transfers are used.
    """
    if isinstance(partition, Partition):
        st = _from_partition(partition, schedule, v)
    elif isinstance(partition, pd.DataFrame):
        st = _from_table(partition, schedule, v)
    else:
        raise TypeError(
            f"partition must be a pipeswift_lab.Partition or a per-stage DataFrame; got {type(partition).__name__}"
        )
    m = check_int("m", m, minimum=1)
    schedule, v = validate(st.P, m, st.schedule, st.v)
    placement = st.placement or stage_to_rank(st.P, v, schedule)
    link = check_link(link)
    if link is not None and st.out_bytes is None and st.S > 1:
        raise ValueError("link is given but the stage table has no 'output_bytes' column (bytes leaving each stage)")
    if wgrad_fraction is not None:
        wgrad_fraction = check_wgrad_fraction(wgrad_fraction)
        wgrad = [wgrad_fraction * b for b in st.bwd]
        split_source = f"wgrad_fraction={wgrad_fraction:g}"
    elif st.wgrad is not None:
        wgrad = st.wgrad
        for s, (w, b) in enumerate(zip(wgrad, st.bwd)):
            if w > b * (1 + 1e-12):
                raise ValueError(f"stage {s}: wgrad_ms={w} exceeds bwd_ms={b}; it is a part of it")
        split_source = "profile wgrad_ms"
    else:
        wgrad = None  # backward_parts' default share
        split_source = f"DEFAULT_WGRAD_FRACTION={DEFAULT_WGRAD_FRACTION:g}"
    transfer = [0.0] * st.S
    if link is not None:
        transfer = [link.transfer_ms(b) for b in st.out_bytes]
    durations = (st.fwd, st.bwd, *backward_parts(st.bwd, wgrad))  # the first stage: I = 0, W = its whole backward
    if calibration is not None:
        from .calibration import check_calibration

        calibration = check_calibration(calibration)
        durations = calibration.action_durations(durations, st.P, schedule or st.schedule)
        if link is None:
            transfer = calibration.transfer_ms(st.out_bytes if st.out_bytes is not None else [0.0] * st.S)
    if tuple(placement) != stage_to_rank(st.P, v, schedule):  # pragma: no cover - guarded in _from_partition
        raise ValueError(f"stage placement {list(placement)} is not the one schedule={schedule!r} runs")
    return st, m, schedule, v, placement, link, durations, transfer, split_source


def simulate_step_ms(partition, m, schedule=None, *, v=None, link=None, wgrad_fraction=None, calibration=None) -> float:
    """The simulated step time (ms) alone: :func:`simulate`'s ``step_ms`` without building the Timeline.

    For searches over many configurations (the planner); takes the same arguments. Like
    ``Timeline.step_ms`` it is the action span: with a ``calibration``, add
    ``calibration.step_overhead_ms(schedule)`` for the whole step.
    """
    st, m, schedule, v, placement, link, durations, transfer, _ = _prepare(
        partition, m, schedule, v, link, wgrad_fraction, calibration
    )
    _, signal, _ = _run(_lowered(st.P, m, schedule, v), st.P, m, st.S, durations, transfer, False)
    return max(_lowered_table(st.P, m, schedule, v)["done"](signal))


def simulate(partition, m, schedule=None, *, v=None, link=None, wgrad_fraction=None, calibration=None) -> Timeline:
    """Simulate one training step of ``m`` micro-batches; return the predicted :class:`Timeline`.

    ``partition`` is a :class:`~pipeswift_lab.partitioning.balance.Partition`, or a DataFrame with one
    row per stage in stage order (``P * v`` rows) and columns ``fwd_ms``, ``bwd_ms`` (whole
    backward), optional ``wgrad_ms`` (its weight-grad part), ``output_bytes`` (activation
    leaving the stage; needed with a ``link``) and ``activation_bytes`` (for memory).
    ``schedule`` defaults to the partition's (else ``"1F1B"``); ``v`` to the partition's
    (a stage table needs it for the interleaved schedules). ``link`` (a
    :class:`~pipeswift_lab.core.link.Link`) adds transfers. Zero-bubble schedules split a
    backward into ``I = bwd - wgrad`` and ``W = wgrad``, with ``wgrad = wgrad_fraction *
    bwd`` when ``wgrad_fraction`` is given, else the profile's ``wgrad_ms``, else
    :data:`~pipeswift_lab.core.analytic.DEFAULT_WGRAD_FRACTION` of ``bwd``; except on the first
    stage, whose input is the data: torch's input-grad pass has nothing to compute there, so
    its ``I`` takes 0 and its ``W`` the whole backward (measured on this machine: ``I`` 0.02
    ms against a ``W`` of the stage's whole backward).

    ``calibration`` (a :class:`~pipeswift_lab.fidelity.calibrator.Calibration` from
    :func:`~pipeswift_lab.fidelity.calibrator.calibrate`) turns profiled times into the times a real
    run takes: each action lasts ``scale(P) * profiled + action_ms + gap_ms``, transfers take
    the fitted latency (and bandwidth) unless a ``link`` is given, and
    ``meta["step_overhead_ms"]`` holds the runtime's per-step time outside the actions, so
    the whole predicted step is ``step_ms + meta["step_overhead_ms"]``
    (:func:`~pipeswift_lab.fidelity.calibrator.whole_step_ms`).
    """
    st, m, schedule, v, placement, link, durations, transfer, split_source = _prepare(
        partition, m, schedule, v, link, wgrad_fraction, calibration
    )
    run = _run(_lowered(st.P, m, schedule, v), st.P, m, st.S, durations, transfer, link is not None or any(transfer))
    df = _rows_frame(_lowered_table(st.P, m, schedule, v), run)
    meta = {
        "schedule": schedule,
        "P": st.P,
        "m": m,
        "v": v,
        "stage_to_rank": list(placement),
        "stage_fwd_ms": list(st.fwd),
        "stage_bwd_ms": list(st.bwd),
        "wgrad_split": split_source,
        "link": link.as_dict() if link is not None else None,
        "step_overhead_ms": calibration.step_overhead_ms(schedule) if calibration is not None else 0.0,
    }
    if any(transfer):
        meta["stage_transfer_ms"] = list(transfer)
    if calibration is not None:
        meta["calibration"] = calibration.label
        meta["gap_ms"] = calibration.gap_ms(schedule, st.P)
    if st.act_bytes is not None:
        meta["stage_activation_bytes"] = list(st.act_bytes)
    return Timeline(df, source="simulated", meta=meta)


def simulate_order(orders, stage_table, m, link=None, placement=None) -> Timeline:
    """Simulate a hand-written order with the multi-chunk runtime's semantics (async sends).

    ``orders`` is ``{rank: [(kind, stage, microbatch), ...]}``; ``stage_table`` a per-stage
    DataFrame as for :func:`simulate`; ``placement`` the rank of each stage (default: the
    rank whose order holds the stage). Useful to test a custom order; raises
    :class:`ScheduleDeadlock` if it cannot run. Returns the Timeline.
    """
    if not isinstance(orders, dict) or not orders:
        raise TypeError("orders must be a non-empty dict {rank: [(kind, stage, microbatch), ...]}")
    m = check_int("m", m, minimum=1)
    P = len(orders)
    if sorted(orders) != list(range(P)):
        raise ValueError(f"orders must have ranks 0..{P - 1} as keys; got {sorted(orders)}")
    S = len(stage_table)
    if placement is None:
        found = {}
        for r, acts in orders.items():
            for kind, s, i in acts:
                found.setdefault(s, r)
        if sorted(found) != list(range(S)):
            raise ValueError(f"orders cover stages {sorted(found)} but the stage table has {S} stages")
        placement = tuple(found[s] for s in range(S))
    seen = {}
    for r, acts in orders.items():
        for kind, s, i in acts:
            if kind not in _KIND_NAMES or not (0 <= s < S) or not isinstance(i, numbers.Integral) or not (0 <= i < m):
                raise ValueError(
                    f"orders[{r}] holds {(kind, s, i)!r}; actions are (kind in {list(_KIND_NAMES)}, stage < {S}, microbatch < {m})"
                )
            family = "B/I" if kind in ("B", "I") else kind  # a backward is a full B, or an I then a W
            if (family, s, i) in seen:
                raise ValueError(
                    f"orders[{r}] holds {(kind, s, i)!r} but orders[{seen[(family, s, i)]}] already runs the "
                    f"{'backward (B or I)' if family == 'B/I' else kind} of stage {s}, micro-batch {i}; each runs once"
                )
            seen[(family, s, i)] = r
    fwd, bwd = _column(stage_table, "fwd_ms"), _column(stage_table, "bwd_ms")
    wgrad = _column(stage_table, "wgrad_ms", required=False)
    out_bytes = _column(stage_table, "output_bytes", required=False)
    link = check_link(link)
    transfer = [link.transfer_ms(b) for b in out_bytes] if (link is not None and out_bytes is not None) else [0.0] * S
    durations = (fwd, bwd, *backward_parts(bwd, wgrad))
    groups = [tuple((a,) for a in orders[r]) for r in range(P)]
    ops = _lower(groups, "custom", P, m, S, placement)
    df = _rows_frame(_compute_table(ops), _run(ops, P, m, S, durations, transfer, link is not None))
    meta = {"schedule": "custom", "P": P, "m": m, "stage_to_rank": list(placement)}
    if S % P == 0:
        meta["v"] = S // P
    return Timeline(df, source="simulated", meta=meta)


__all__ = ["ScheduleDeadlock", "simulate", "simulate_order"]
