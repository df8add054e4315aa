"""Duration-aware simulation of a pipeline schedule: replay torch's action order with real times.

torch's schedule visualizer counts every action as one time unit. Here every rank executes
its order from :mod:`pipeswift_lab.schedules` one action after the other; an action starts
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
import operator
from functools import lru_cache

import numpy as np
import pandas as pd

from ._checks import (
    COMPUTE_KINDS,
    SINGLE_CHUNK_SCHEDULES,
    V_SHAPE_SCHEDULES,
    canonical_schedule,
    check_int,
    check_time,
)
from .analytic import DEFAULT_WGRAD_FRACTION
from .link import check_link
from .partition import Partition
from .schedules import action_groups, stage_to_rank, validate
from .timeline import Timeline

_WAIT, _COMPUTE, _FIRE = 0, 1, 2
_KIND_NAMES = COMPUTE_KINDS
# signal families: 0 forward done, 1 input-grad done (B or I), 2 weight-grad done,
# 3 activation arrived at stage s+1, 4 gradient arrived at stage s-1
_F_DONE, _G_DONE, _W_DONE, _ACT_ARRIVED, _GRAD_ARRIVED = range(5)


class ScheduleDeadlock(RuntimeError):
    """Raised when no rank of a pipeline order can make progress."""


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
        raise ValueError(f"schedule={schedule!r} runs one stage per rank but the partition has v={part.v}; re-partition with partition(profile, {part.P}, v=1)")
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
    return _Stages(list(part.stage_fwd_ms), list(part.stage_bwd_ms), wgrad, list(part.stage_output_bytes), act, part.P, part.v, schedule, tuple(part.stage_to_rank))


def _column(df, col, required=True):
    if col not in df.columns:
        if required:
            raise ValueError(f"the stage table has no {col!r} column; it needs fwd_ms and bwd_ms (columns: {list(df.columns)})")
        return None
    values = pd.to_numeric(df[col], errors="coerce").to_numpy(float)
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if len(bad):
        given = df[col].iloc[int(bad[0])]
        given = given.item() if hasattr(given, "item") else given
        raise ValueError(f"stage table column {col!r}: stage {int(bad[0])} has {given!r}; values must be finite numbers >= 0 (ms or bytes)")
    return values.tolist()


def _from_table(df: pd.DataFrame, schedule, v):
    schedule = canonical_schedule(schedule or "1F1B")
    if v is None:
        if schedule in SINGLE_CHUNK_SCHEDULES:
            v = 1
        elif schedule in V_SHAPE_SCHEDULES:
            v = 2
        else:
            raise ValueError(f"schedule={schedule!r} with a stage table needs v (stages per rank); the table has {len(df)} stages = P*v")
    v = check_int("v", v, minimum=1)
    if len(df) == 0 or len(df) % v:
        raise ValueError(f"the stage table has {len(df)} rows; with v={v} it needs P*v rows (a positive multiple of {v})")
    P = len(df) // v
    fwd, bwd = _column(df, "fwd_ms"), _column(df, "bwd_ms")
    wgrad = _column(df, "wgrad_ms", required=False)
    out_bytes = _column(df, "output_bytes", required=False)
    act = _column(df, "activation_bytes", required=False)
    return _Stages(fwd, bwd, wgrad, out_bytes, act, P, v, schedule, None)


def _prepare(partition, m, schedule, v, link, wgrad_fraction, calibration=None):
    """Validate :func:`simulate`'s arguments; return the stage table and per-kind durations.

    With a ``calibration`` (:class:`~pipeswift_lab.calibrate.Calibration`) the durations are
    its calibrated ones and, when no ``link`` is given, its fitted transfers are used.
    """
    if isinstance(partition, Partition):
        st = _from_partition(partition, schedule, v)
    elif isinstance(partition, pd.DataFrame):
        st = _from_table(partition, schedule, v)
    else:
        raise TypeError(f"partition must be a pipeswift_lab.Partition or a per-stage DataFrame; got {type(partition).__name__}")
    m = check_int("m", m, minimum=1)
    schedule, v = validate(st.P, m, st.schedule, st.v)
    placement = st.placement or stage_to_rank(st.P, v, schedule)
    link = check_link(link)
    if link is not None and st.out_bytes is None and st.S > 1:
        raise ValueError("link is given but the stage table has no 'output_bytes' column (bytes leaving each stage)")
    if wgrad_fraction is not None:
        wgrad_fraction = check_time("wgrad_fraction", wgrad_fraction)
        if wgrad_fraction > 1:
            raise ValueError(f"wgrad_fraction={wgrad_fraction} is invalid; it is a share of the backward, in [0, 1]")
        wgrad = [wgrad_fraction * b for b in st.bwd]
        split_source = f"wgrad_fraction={wgrad_fraction:g}"
    elif st.wgrad is not None:
        wgrad = st.wgrad
        for s, (w, b) in enumerate(zip(wgrad, st.bwd)):
            if w > b * (1 + 1e-12):
                raise ValueError(f"stage {s}: wgrad_ms={w} exceeds bwd_ms={b}; it is a part of it")
        split_source = "profile wgrad_ms"
    else:
        wgrad = [DEFAULT_WGRAD_FRACTION * b for b in st.bwd]
        split_source = f"DEFAULT_WGRAD_FRACTION={DEFAULT_WGRAD_FRACTION:g}"
    transfer = [0.0] * st.S
    if link is not None:
        transfer = [link.transfer_ms(b) for b in st.out_bytes]
    durations = (st.fwd, st.bwd, [max(0.0, b - w) for b, w in zip(st.bwd, wgrad)], wgrad)
    if calibration is not None:
        from .calibrate import check_calibration

        calibration = check_calibration(calibration)
        durations = calibration.action_durations(durations, st.P, schedule or st.schedule)
        if link is None:
            transfer = calibration.transfer_ms(st.out_bytes if st.out_bytes is not None else [0.0] * st.S)
    if tuple(placement) != stage_to_rank(st.P, v, schedule):  # pragma: no cover - guarded in _from_partition
        raise ValueError(f"stage placement {list(placement)} is not the one schedule={schedule!r} runs")
    return st, m, schedule, v, placement, link, durations, transfer, split_source


def simulate_step_ms(partition, m, schedule=None, v=None, link=None, wgrad_fraction=None, calibration=None) -> float:
    """The simulated step time (ms) alone: :func:`simulate`'s ``step_ms`` without building the Timeline.

    For searches over many configurations (the planner); takes the same arguments. Like
    ``Timeline.step_ms`` it is the action span: with a ``calibration``, add
    ``calibration.step_overhead_ms(schedule)`` for the whole step.
    """
    st, m, schedule, v, placement, link, durations, transfer, _ = _prepare(partition, m, schedule, v, link, wgrad_fraction, calibration)
    _, signal, _ = _run(_lowered(st.P, m, schedule, v), st.P, m, st.S, durations, transfer, False)
    return max(_lowered_table(st.P, m, schedule, v)["done"](signal))


def simulate(partition, m, schedule=None, v=None, link=None, wgrad_fraction=None, calibration=None) -> Timeline:
    """Simulate one training step of ``m`` micro-batches; return the predicted :class:`Timeline`.

    ``partition`` is a :class:`~pipeswift_lab.partition.Partition`, or a DataFrame with one
    row per stage in stage order (``P * v`` rows) and columns ``fwd_ms``, ``bwd_ms`` (whole
    backward), optional ``wgrad_ms`` (its weight-grad part), ``output_bytes`` (activation
    leaving the stage; needed with a ``link``) and ``activation_bytes`` (for memory).
    ``schedule`` defaults to the partition's (else ``"1F1B"``); ``v`` to the partition's
    (a stage table needs it for the interleaved schedules). ``link`` (a
    :class:`~pipeswift_lab.link.Link`) adds transfers. Zero-bubble schedules split a
    backward into ``I = bwd - wgrad`` and ``W = wgrad``, with ``wgrad = wgrad_fraction *
    bwd`` when ``wgrad_fraction`` is given, else the profile's ``wgrad_ms``, else
    :data:`~pipeswift_lab.analytic.DEFAULT_WGRAD_FRACTION` of ``bwd``.

    ``calibration`` (a :class:`~pipeswift_lab.calibrate.Calibration` from
    :func:`~pipeswift_lab.calibrate.calibrate`) turns profiled times into the times a real
    run takes: each action lasts ``scale(P) * profiled + action_ms + gap_ms``, transfers take
    the fitted latency (and bandwidth) unless a ``link`` is given, and
    ``meta["step_overhead_ms"]`` holds the runtime's per-step time outside the actions, so
    the whole predicted step is ``step_ms + meta["step_overhead_ms"]``
    (:func:`~pipeswift_lab.calibrate.whole_step_ms`).
    """
    st, m, schedule, v, placement, link, durations, transfer, split_source = _prepare(partition, m, schedule, v, link, wgrad_fraction, calibration)
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


# --------------------------------------------------------------------------- ops
# Operations hold structure only (signals, stage indices); the engine looks durations up, so
# the lowered order of (P, m, schedule, v) is built once and reused across partitions.
#   (_WAIT, signal)
#   (_COMPUTE, done_signal, duration_index = kind_code * S + stage, stage, microbatch, kind, waits)
# (``waits``: the signals it needs first, folded in by :func:`_fuse_waits`)
#   (_FIRE, arrival_signal, boundary, stage, dst_stage, dst_rank, direction, microbatch)
# ``boundary`` indexes the transfer time (the cut after stage ``boundary``); direction 0 is an
# activation going forward, 1 a gradient going back.


class _Lowering:
    """Signals, waits and sends of actions for one ``(P, m, placement)``."""

    def __init__(self, P, m, S, placement):
        self.P, self.m, self.S, self.placement = P, m, S, placement
        self.SM = S * m
        self.cross_prev = [s > 0 and placement[s - 1] != placement[s] for s in range(S)]
        self.cross_next = [s < S - 1 and placement[s + 1] != placement[s] for s in range(S)]

    def compute(self, kind, s, i):
        base, S = s * self.m + i, self.S
        if kind == "F":
            return (_COMPUTE, _F_DONE * self.SM + base, s, s, i, "F")
        if kind == "W":
            return (_COMPUTE, _W_DONE * self.SM + base, 3 * S + s, s, i, "W")
        return (_COMPUTE, _G_DONE * self.SM + base, (1 if kind == "B" else 2) * S + s, s, i, kind)

    def waits(self, kind, s, i):
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
        return ((_WAIT, _F_DONE * SM + base), (_WAIT, (_GRAD_ARRIVED if self.cross_next[s] else _G_DONE) * SM + base + m))

    def sends(self, kind, s, i):
        """The transfers an action starts, as fire operations (none within a rank)."""
        if kind == "F":
            if self.cross_next[s]:
                return ((_FIRE, _ACT_ARRIVED * self.SM + s * self.m + i, s, s, s + 1, self.placement[s + 1], 0, i),)
        elif kind in ("B", "I") and self.cross_prev[s]:
            return ((_FIRE, _GRAD_ARRIVED * self.SM + s * self.m + i, s - 1, s, s - 1, self.placement[s - 1], 1, i),)
        return ()


def _lower(groups, schedule, P, m, S, placement):
    """Lower every rank's order to a list of wait / compute / fire operations."""
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
                    extend(low.waits(kind, s, i))
                    out.append(low.compute(kind, s, i))
                for kind, s, i in group:
                    extend(low.sends(kind, s, i))
        ops.append(_fuse_waits(out))
    return tuple(ops)


def _fuse_waits(out):
    """Fold the waits just before a compute into it (``op[6]``): one engine step per action instead of one per signal."""
    fused, pending = [], []
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
def _lowered(P, m, schedule, v):
    placement = stage_to_rank(P, v, schedule)
    return _lower(action_groups(P, m, schedule, v), schedule, P, m, P * v, placement)


def _gpipe_ops(rank, m, low):
    """``ScheduleGPipe._step_microbatches``: receive, compute, send; all forward sends done before the backward."""
    out, sent = [], []
    for i in range(m):
        out += low.waits("F", rank, i)
        out.append(low.compute("F", rank, i))
        for send in low.sends("F", rank, i):
            out.append(send)
            sent.append((_WAIT, send[1]))
    out += sent
    for i in range(m):
        out += low.waits("B", rank, i)
        out.append(low.compute("B", rank, i))
        out += low.sends("B", rank, i)
    return out


def _one_f_one_b_ops(rank, P, m, low):
    """``Schedule1F1B._step_microbatches`` with its blocking waits on sends."""
    out = []
    s = rank
    warmup = min(m, P - s)
    prev_send = None
    deferred = ()
    for k in range(warmup):
        out += low.waits("F", s, k)
        out.append(low.compute("F", s, k))
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
    bwd_sends = ()
    while True:
        for send in deferred:  # fwd_sends + bwd_recvs in one blocking batch
            out += (send, (_WAIT, send[1]))
        out += low.waits("B", s, bwd)
        out.append(low.compute("B", s, bwd))
        bwd_sends = low.sends("B", s, bwd)
        bwd += 1
        if fwd == m:
            break
        for send in bwd_sends:  # bwd_sends + fwd_recvs in one blocking batch
            out += (send, (_WAIT, send[1]))
        out += low.waits("F", s, fwd)
        out.append(low.compute("F", s, fwd))
        deferred = low.sends("F", s, fwd)
        fwd += 1
    prev_send = None
    for send in bwd_sends:  # fired without waiting
        out.append(send)
        prev_send = (_WAIT, send[1])
    while bwd < m:  # cool-down
        out += low.waits("B", s, bwd)
        out.append(low.compute("B", s, bwd))
        if prev_send is not None:
            out.append(prev_send)
            prev_send = None
        for send in low.sends("B", s, bwd):
            out.append(send)
            prev_send = (_WAIT, send[1])
        bwd += 1
    return out


# --------------------------------------------------------------------------- engine
def _run(ops, P, m, S, durations, transfer, with_comm_rows, per_action=None):
    """Execute the per-rank operation lists; return ``(started, signal, comm_rows)``.

    A compute action's start is ``started[done]`` and its end ``signal[done]`` (``done`` its
    completion signal, see :func:`_compute_table`); ``comm_rows`` are the transfer rows
    ``(rank, stage, mb, kind, start, end)`` when ``with_comm_rows``. ``durations`` is ``(fwd,
    bwd, igrad, wgrad)``, one list per kind with one entry per stage; ``per_action``
    optionally overrides single actions: ``{(kind_code * S + stage, microbatch): ms}``.
    """
    dur = [d for per_kind in durations for d in per_kind]  # flat, indexed kind_code * S + stage
    plain = per_action is None
    signal = [None] * (5 * S * m)
    started = [0.0] * (5 * S * m)
    waiting: dict[int, list[int]] = {}
    pc = [0] * P
    clock = [0.0] * P
    rows = []
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
                    end = t + (dur[op[2]] if plain else per_action.get((op[2], op[4]), dur[op[2]]))
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


def _compute_table(ops) -> dict:
    """The compute actions of lowered ``ops``, rank by rank in execution order, as numpy arrays.

    ``rank``, ``stage``, ``mb``, ``kind`` (object array of names) and ``done`` (completion
    signals, a ``tuple`` for :func:`operator.itemgetter`). Static for an order: the engine only
    adds times.
    """
    rows = [(r, op[3], op[4], op[5], op[1]) for r, rank_ops in enumerate(ops) for op in rank_ops if op[0] == _COMPUTE]
    rank, stage, mb, kind, done = zip(*rows)
    return {"rank": np.array(rank, np.int64), "stage": np.array(stage, np.int64), "mb": np.array(mb, np.int64),
            "kind": np.array(kind, dtype=object), "done": operator.itemgetter(*done) if len(done) > 1 else (lambda xs, d=done[0]: (xs[d],))}


@lru_cache(maxsize=64)
def _lowered_table(P, m, schedule, v) -> dict:
    return _compute_table(_lowered(P, m, schedule, v))


def _rows_frame(table, run) -> pd.DataFrame:
    """The Timeline table of one simulated step: the compute actions of ``table``, timed by ``run`` (:func:`_run`'s output)."""
    started, signal, comm = run
    pick = table["done"]
    cols = {"step": np.zeros(len(table["rank"]), dtype=np.int64), "rank": table["rank"], "stage": table["stage"],
            "microbatch": table["mb"], "kind": table["kind"], "start_ms": np.array(pick(started), dtype=float),
            "end_ms": np.array(pick(signal), dtype=float)}
    if comm:
        rank, stage, mb, kind, start, end = zip(*comm)
        extra = (np.zeros(len(comm), np.int64), rank, stage, mb, np.array(kind, dtype=object), start, end)
        cols = {c: np.concatenate([v, np.asarray(e, dtype=v.dtype)]) for (c, v), e in zip(cols.items(), extra)}
    return pd.DataFrame(cols)


def _describe_signal(sid, S, m):
    family, rest = divmod(sid, S * m)
    s, i = divmod(rest, m)
    return {
        _F_DONE: f"F of stage {s}, micro-batch {i}",
        _G_DONE: f"the input-grad (B/I) of stage {s}, micro-batch {i}",
        _W_DONE: f"W of stage {s}, micro-batch {i}",
        _ACT_ARRIVED: f"the activation of stage {s}, micro-batch {i} to arrive",
        _GRAD_ARRIVED: f"the gradient from stage {s}, micro-batch {i} to arrive",
    }[family]


def _deadlock_message(ops, pc, stuck, S, m, signal):
    parts = []
    for r in stuck[:6]:
        op = ops[r][pc[r]]
        sid = next(w for w in op[6] if signal[w] is None) if op[0] == _COMPUTE else op[1]
        nxt = next((o for o in ops[r][pc[r]:] if o[0] == _COMPUTE), None)
        action = f"{nxt[5]} of stage {nxt[3]}, micro-batch {nxt[4]}" if nxt else "its last sends"
        parts.append(f"rank {r} waits for {_describe_signal(sid, S, m)} before {action}")
    more = f" (and {len(stuck) - 6} more ranks)" if len(stuck) > 6 else ""
    return "the pipeline order deadlocks: " + "; ".join(parts) + more


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
    for r, acts in orders.items():
        for kind, s, i in acts:
            if kind not in _KIND_NAMES or not (0 <= s < S) or not isinstance(i, numbers.Integral) or not (0 <= i < m):
                raise ValueError(f"orders[{r}] holds {(kind, s, i)!r}; actions are (kind in {list(_KIND_NAMES)}, stage < {S}, microbatch < {m})")
    fwd, bwd = _column(stage_table, "fwd_ms"), _column(stage_table, "bwd_ms")
    wgrad = _column(stage_table, "wgrad_ms", required=False) or [DEFAULT_WGRAD_FRACTION * b for b in bwd]
    out_bytes = _column(stage_table, "output_bytes", required=False)
    link = check_link(link)
    transfer = [link.transfer_ms(b) for b in out_bytes] if (link is not None and out_bytes is not None) else [0.0] * S
    durations = (fwd, bwd, [max(0.0, b - w) for b, w in zip(bwd, wgrad)], wgrad)
    groups = [tuple((a,) for a in orders[r]) for r in range(P)]
    ops = _lower(groups, "custom", P, m, S, placement)
    df = _rows_frame(_compute_table(ops), _run(ops, P, m, S, durations, transfer, link is not None))
    meta = {"schedule": "custom", "P": P, "m": m, "stage_to_rank": list(placement)}
    if S % P == 0:
        meta["v"] = S // P
    return Timeline(df, source="simulated", meta=meta)


__all__ = ["ScheduleDeadlock", "simulate", "simulate_order"]
