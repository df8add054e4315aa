"""Duration-aware simulation of a pipeline schedule: replay torch's action order with real times.

torch's schedule visualizer counts every action as one time unit. Here every rank executes
its order from :mod:`pipeswift_lab.core.schedule_orders` one action after the other; an action starts
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..core.analytic import DEFAULT_WGRAD_FRACTION, backward_parts
from ..core.checks import check_fraction, check_int, nonnegative_column
from ..core.link import Link, check_link
from ..core.schedule import ScheduleLike, schedule_meta
from ..partitioning.stages import Partition
from .calibration import SimulatorCalibration, check_calibration
from .engine import ScheduleDeadlock, execute, lowered, lowered_table, rows_frame
from .reconciliation import Reconciled, reconcile
from .timeline import Timeline


@dataclass(frozen=True, kw_only=True)
class _Stages:
    """Per-stage inputs of the simulator, as plain lists in stage order."""

    fwd: list[float]
    """Forward ms."""
    bwd: list[float]
    """Whole backward ms."""
    wgrad: list[float] | None
    """Weight-grad part of the backward (ms); None when the profile has no split."""
    out_bytes: list[float] | None
    """Bytes of the activation leaving each stage; None when unknown (then no link can be given)."""
    act_bytes: list[float] | None
    """Activation bytes saved per micro-batch; None when unknown."""
    recomputed: list[float] | None = None
    """The recomputation inside each backward (ms), run once more by a zero-bubble input-gradient pass; None
    without."""
    passes: tuple[list[float], list[float]] | None = None
    """``(I, W)`` per stage as torch's split passes took them (NaN where unmeasured); None when not profiled."""

    @property
    def S(self) -> int:
        """Number of stages."""
        return len(self.fwd)


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """What one simulation runs: the reconciled shape, the stages and every duration, checked."""

    shape: Reconciled
    """Schedule, P, v and the placement (:func:`~pipeswift_lab.simulation.reconciliation.reconcile`)."""
    m: int
    """Micro-batches, checked against torch's rules."""
    stages: _Stages
    """The per-stage inputs."""
    link: Link | None
    """The link transfers take (None: the calibration's fitted transfers, or none)."""
    durations: tuple[Sequence[float], ...]
    """Per-kind per-stage durations ``(fwd, bwd, igrad, wgrad)`` the engine runs, calibrated when asked."""
    transfer: list[float]
    """ms of a transfer across each stage boundary (0 without a link or calibration)."""
    split_source: str
    """Where the weight-grad share of the backward came from (``meta["wgrad_split"]``)."""
    calibration: SimulatorCalibration | None
    """The calibration applied, or None."""


def _setup(
    partition: Partition | pd.DataFrame,
    m: int,
    schedule: ScheduleLike | None,
    v: int | None,
    link: Link | None,
    wgrad_fraction: float | None,
    calibration: SimulatorCalibration | None,
) -> _Setup:
    """Validate :func:`simulate`'s arguments and resolve what the engine runs (durations, transfers).

    With a ``calibration`` (:class:`~pipeswift_lab.fidelity.calibrator.Calibration`) the durations are
    its calibrated ones and, when no ``link`` is given, its fitted transfers are used.
    """
    if not isinstance(partition, (Partition, pd.DataFrame)):
        raise TypeError(
            f"partition must be a pipeswift_lab.Partition or a per-stage DataFrame; got {type(partition).__name__}"
        )
    shape = reconcile(partition, schedule, v=v, m=m)
    stages = _from_partition(partition) if isinstance(partition, Partition) else _from_table(partition)
    link = check_link(link)
    if link is not None and stages.out_bytes is None and stages.S > 1:
        raise ValueError("link is given but the stage table has no 'output_bytes' column (bytes leaving each stage)")
    wgrad, split_source = _weight_grad(stages, wgrad_fraction)
    durations: tuple[Sequence[float], ...] = (
        stages.fwd,
        stages.bwd,
        *backward_parts(stages.bwd, wgrad, stages.recomputed, stages.passes if wgrad_fraction is None else None),
    )
    out_bytes = stages.out_bytes if stages.out_bytes is not None else [0.0] * stages.S
    transfer = [link.transfer_ms(b) for b in out_bytes] if link is not None else [0.0] * stages.S
    calibration = check_calibration(calibration)
    if calibration is not None:
        durations = calibration.action_durations(durations, shape.P, shape.schedule)
        if link is None:
            transfer = calibration.transfer_ms(out_bytes)
    return _Setup(
        shape=shape,
        m=check_int("m", m, minimum=1),
        stages=stages,
        link=link,
        durations=durations,
        transfer=transfer,
        split_source=split_source,
        calibration=calibration,
    )


def _from_partition(part: Partition) -> _Stages:
    act = None if any(math.isnan(x) for x in part.stage_activation_bytes) else list(part.stage_activation_bytes)
    return _Stages(
        fwd=list(part.stage_fwd_ms),
        bwd=list(part.stage_bwd_ms),
        wgrad=list(part.stage_wgrad_ms) if part.stage_wgrad_ms is not None else None,
        out_bytes=list(part.stage_output_bytes),
        act_bytes=act,
        recomputed=list(part.stage_recomputed_ms) if part.stage_recomputed_ms is not None else None,
        passes=(list(part.split_passes_ms[0]), list(part.split_passes_ms[1])) if part.split_passes_ms else None,
    )


def _from_table(df: pd.DataFrame) -> _Stages:
    return _Stages(
        fwd=_column(df, "fwd_ms"),
        bwd=_column(df, "bwd_ms"),
        wgrad=_column(df, "wgrad_ms", required=False),
        out_bytes=_column(df, "output_bytes", required=False),
        act_bytes=_column(df, "activation_bytes", required=False),
        recomputed=_column(df, "recomputed_ms", required=False),
        passes=_passes(df),
    )


def _passes(df: pd.DataFrame) -> tuple[list[float], list[float]] | None:
    """A stage table's ``(input_pass_ms, weight_pass_ms)`` (NaN where unmeasured), or None without both."""
    if "input_pass_ms" not in df.columns or "weight_pass_ms" not in df.columns:
        return None
    measured = [
        pd.to_numeric(df[col], errors="coerce").astype(float).tolist() for col in ("input_pass_ms", "weight_pass_ms")
    ]
    return measured[0], measured[1]


def _column(df: pd.DataFrame, col: str, required: bool = True) -> Any:
    """A per-stage column as a list of floats (None when absent and not ``required``)."""
    if col not in df.columns:
        if required:
            raise ValueError(
                f"the stage table has no {col!r} column; it needs fwd_ms and bwd_ms (columns: {list(df.columns)})"
            )
        return None
    values, bad = nonnegative_column(df[col])
    if bad:
        raise ValueError(
            f"stage table column {col!r}: stage {bad[0]} has {bad[1]!r}; values must be finite numbers >= 0 "
            "(ms or bytes)"
        )
    return values.tolist()


def _weight_grad(stages: _Stages, wgrad_fraction: float | None) -> tuple[list[float] | None, str]:
    """The weight-grad ms of every stage (None: :func:`~pipeswift_lab.core.analytic.backward_parts`' default share)
    and where it came from."""
    if wgrad_fraction is not None:
        wgrad_fraction = check_fraction("wgrad_fraction", wgrad_fraction, what="a share of the backward")
        return [wgrad_fraction * b for b in stages.bwd], f"wgrad_fraction={wgrad_fraction:g}"
    if stages.wgrad is not None:
        for s, (w, b) in enumerate(zip(stages.wgrad, stages.bwd)):
            if w > b * (1 + 1e-12):
                raise ValueError(f"stage {s}: wgrad_ms={w} exceeds bwd_ms={b}; it is a part of it")
        return stages.wgrad, "profile wgrad_ms"
    return None, f"DEFAULT_WGRAD_FRACTION={DEFAULT_WGRAD_FRACTION:g}"


def simulate_step_ms(
    partition: Partition | pd.DataFrame,
    m: int,
    schedule: ScheduleLike | None = None,
    *,
    v: int | None = None,
    link: Link | None = None,
    wgrad_fraction: float | None = None,
    calibration: SimulatorCalibration | None = None,
) -> float:
    """The simulated step time (ms) alone: :func:`simulate`'s ``step_ms`` without building the Timeline.

    For searches over many configurations (the planner); takes the same arguments. Like
    ``Timeline.step_ms`` it is the action span: with a ``calibration``, add
    ``calibration.step_overhead_ms(schedule)`` for the whole step.
    """
    setup = _setup(partition, m, schedule, v, link, wgrad_fraction, calibration)
    sh, m = setup.shape, setup.m
    _, signal, _ = execute(lowered(sh.P, m, sh.schedule, sh.v), sh.P, m, sh.S, setup.durations, setup.transfer, False)
    return max(lowered_table(sh.P, m, sh.schedule, sh.v)["done"](signal))


def simulate(
    partition: Partition | pd.DataFrame,
    m: int,
    schedule: ScheduleLike | None = None,
    *,
    v: int | None = None,
    link: Link | None = None,
    wgrad_fraction: float | None = None,
    calibration: SimulatorCalibration | None = None,
) -> Timeline:
    """Simulate one training step of ``m`` micro-batches; return the predicted :class:`Timeline`.

    ``partition`` is a :class:`~pipeswift_lab.partitioning.balance.Partition`, or a DataFrame with one
    row per stage in stage order (``P * v`` rows) and columns ``fwd_ms``, ``bwd_ms`` (whole
    backward), optional ``wgrad_ms`` (its weight-grad part), ``output_bytes`` (activation
    leaving the stage; needed with a ``link``) and ``activation_bytes`` (for memory).
    ``schedule`` (a name, or a :class:`~pipeswift_lab.Schedule` replayed with the multi-chunk runtime's rules)
    defaults to the partition's (else ``"1F1B"``); ``v`` to the partition's
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

    Two conventions differ from the Zero Bubble papers (see [Note: zero-bubble conventions] in
    :mod:`pipeswift_lab.core.analytic`): ``step_ms`` is the whole step, from any rank's first
    action to any rank's last, where the papers measure each stage's own span; and a 1F1B send
    is waited for until it has arrived, as torch's ``Schedule1F1B`` fuses it with the next
    receive in one blocking batch, where the papers' sends do not block.
    """
    setup = _setup(partition, m, schedule, v, link, wgrad_fraction, calibration)
    sh, m = setup.shape, setup.m
    comm_rows = setup.link is not None or any(setup.transfer)
    run = execute(lowered(sh.P, m, sh.schedule, sh.v), sh.P, m, sh.S, setup.durations, setup.transfer, comm_rows)
    return Timeline(rows_frame(lowered_table(sh.P, m, sh.schedule, sh.v), run), meta=_meta(setup))


def _meta(setup: _Setup) -> dict[str, Any]:
    """The simulated Timeline's ``meta``: the configuration, the stage inputs and the calibration's terms."""
    sh, st, cal = setup.shape, setup.stages, setup.calibration
    meta: dict[str, Any] = {
        **schedule_meta(sh.schedule),
        "P": sh.P,
        "m": setup.m,
        "v": sh.v,
        "stage_to_rank": list(sh.placement),
        "stage_fwd_ms": list(st.fwd),
        "stage_bwd_ms": list(st.bwd),
        "wgrad_split": setup.split_source,
        "link": setup.link.as_dict() if setup.link is not None else None,
        "step_overhead_ms": cal.step_overhead_ms(sh.schedule) if cal is not None else 0.0,
    }
    if any(setup.transfer):
        meta["stage_transfer_ms"] = list(setup.transfer)
    if cal is not None:
        meta["calibration"] = cal.label
        meta["gap_ms"] = cal.gap_ms(sh.schedule, sh.P)
    if st.act_bytes is not None:
        meta["stage_activation_bytes"] = list(st.act_bytes)
    return meta


__all__ = ["ScheduleDeadlock", "simulate", "simulate_step_ms"]
