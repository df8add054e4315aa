"""Replay: re-simulate a measured step with its own measured action durations.

The simulator places each action by the schedule's order and dependencies
(:mod:`pipeswift_lab.simulation.simulator`); fed the durations a run measured, what is left between the
replayed and the measured step is what the schedule and communication model misses, and what
is left between a prediction and the replay is what the predicted durations miss
(:attr:`pipeswift_lab.fidelity.Comparison.decomposition`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.schedule import schedule_from_meta
from ..core.vocabulary import COMPUTE_KINDS, canonical_schedule
from ..simulation.engine import duration_index, execute, lowered, lowered_table, rows_frame
from ..simulation.timeline import Timeline


def replay(
    measured: Timeline,
    step: int,
    *,
    transfer_ms: Sequence[float] | None = None,
    step_overhead_ms: float = 0.0,
    gap_ms: float = 0.0,
) -> Timeline:
    """Re-simulate one measured step with its own measured action durations; return the replayed Timeline.

    ``measured`` is a measured :class:`~pipeswift_lab.simulation.timeline.Timeline` whose ``meta`` names
    ``schedule``, ``P``, ``m`` and ``v`` (a ``RunResult.timeline``); every ``F``/``B``/``I``/``W``
    of ``step`` keeps its measured duration and the simulator places it by the schedule's
    order and dependencies, with ``transfer_ms`` (one value per stage boundary, default 0)
    for the transfers and ``gap_ms`` added to every action (a calibrated prediction's time
    between actions, which belongs to the runtime model, not to the durations). The gap
    between the replayed and the measured step is what the
    schedule and communication model misses; the gap between a prediction and the replay is
    what its action durations miss. ``meta["step_overhead_ms"]`` is set to ``step_overhead_ms``.
    A timeline of several data-parallel replicas is replayed from replica 0 (as ``compare`` lines it up).
    """
    meta = getattr(measured, "meta", None) or {}
    missing = [k for k in ("schedule", "P", "m", "v") if k not in meta]
    if missing:
        raise ValueError(
            f"measured timeline meta lacks {missing}; replay needs the schedule, P, m and v a RunResult's timeline "
            "records"
        )
    schedule = canonical_schedule(schedule_from_meta(meta))
    P, m, v = int(meta["P"]), int(meta["m"]), int(meta["v"])
    S = P * v
    df = measured.df
    df = df[(df["step"] == step) & df["kind"].isin(COMPUTE_KINDS) & (df["replica"] == 0)]
    if df.empty:
        raise ValueError(f"step={step} has no compute actions in the measured timeline")
    dur = (df["end_ms"] - df["start_ms"]).to_numpy(float)
    per_action = {
        (duration_index(k, int(s), S), int(i)): float(d) + gap_ms
        for k, s, i, d in zip(df["kind"], df["stage"], df["microbatch"], dur)
    }
    zeros = [0.0] * S
    transfer = list(transfer_ms) if transfer_ms is not None else zeros
    if len(transfer) != S:
        raise ValueError(f"transfer_ms has {len(transfer)} values; give one per stage ({S})")
    run = execute(lowered(P, m, schedule, v), P, m, S, (zeros,) * 4, transfer, any(transfer), per_action)
    out = dict(meta)
    out.update({"replayed_step": int(step), "step_overhead_ms": float(step_overhead_ms)})
    return Timeline(rows_frame(lowered_table(P, m, schedule, v), run), source="simulated", meta=out)


__all__ = ["replay"]
