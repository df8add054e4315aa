"""The planner's strategies for a job whose GPUs come and go: grow when more free up, shrink when some are taken.

The plan's ``strategy`` column names what a row does (:data:`STRATEGIES`): ``"now"`` starts at once on GPUs free
now and keeps one configuration to the end; ``"wait"`` waits for its GPUs (``queue_s > 0``), then keeps one
configuration; ``"grow"`` starts on what is free now and moves to more GPUs when they free up; ``"shrink"`` moves to
fewer when availability drops mid-run. Both moves are built from the simulated, feasible ``now`` and ``wait`` rows of
:func:`pipeswift_lab.planning.planner.plan` (one configuration held from start to end): a row of a job that changes
configuration once, paying the change as :func:`pipeswift_lab.runner.run` measures it (``resize_at``): a
checkpoint save on the old configuration (a whole one, ``CheckpointModel.save_s``: the job waits for
its write), a new assembly and a restore on the new one
(``costs.CheckpointModel`` and ``costs.AssemblyModel``, both calibratable from
``RunResult.segments``). The steps done before the change are kept; the partial step it cuts
short is lost. Neither is weighed with ``mtbf_s`` (the preemption term of a job that changes
shape mid-way is not modelled).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..core.costs import AssemblyModel, Availability, CheckpointModel
from ..core.display import hours
from ..core.jct import TERMS
from .placement import layout_name

if TYPE_CHECKING:
    from .inputs import PlanInputs

__all__ = ["HOLDING", "STRATEGIES", "check_strategy", "first_drop", "grow_rows", "shrink_rows", "split_by_drops"]

#: The planner's strategies, the values of the plan table's ``strategy`` column: ``"now"`` (start now on GPUs free
#: now, one configuration to the end), ``"wait"`` (wait for the GPUs, then one configuration), ``"grow"`` (start on
#: what is free now, move to more GPUs when they free up), ``"shrink"`` (move to fewer GPUs when availability drops
#: mid-run). A move's ``change`` column says when and from which configuration.
STRATEGIES = ("now", "wait", "grow", "shrink")
#: The strategies that hold one configuration from start to end.
HOLDING = ("now", "wait")


def check_strategy(name: str) -> str:
    """Return ``name`` if it is one of :data:`STRATEGIES`; raise ``ValueError`` naming them otherwise (and what the
    old ``"start"`` became)."""
    if name in STRATEGIES:
        return name
    hint = (
        ': "start" was split into "now" (start on the GPUs free now) and "wait" (wait for GPUs, queue_s > 0), '
        'both holding one configuration to the end; filter on strategy.isin(["now", "wait"]) for both'
        if name == "start"
        else ""
    )
    raise ValueError(f"unknown strategy {name!r}; the planner's strategies are {', '.join(STRATEGIES)}{hint}")


def _label(row: pd.Series) -> str:
    layout = layout_name(int(row["P"]), int(row["D"]), _degree(row, "fsdp"), _degree(row, "tp"))
    return f"{layout} m{int(row['m'])} b{int(row['microbatch_size'])} {row['schedule']}"


def _degree(row: pd.Series, name: str) -> int:
    """``row[name]`` (``"tp"`` or ``"fsdp"``) as an int, 1 where absent."""
    value = row.get(name, 1)
    return 1 if pd.isna(value) else int(value)


def _move_s(old: pd.Series, new: pd.Series, assembly: AssemblyModel, checkpoint: CheckpointModel) -> float:
    return (
        checkpoint.save_s(old["_shard_bytes"])
        + assembly.seconds(int(new["P"]), int(new["gpus"]) // int(new["P"]))
        + checkpoint.restore_s(new["_shard_bytes"])
    )


def _switch(
    old: pd.Series, new: pd.Series, t_switch: float, inputs: PlanInputs, strategy: str, change: str, queue_s: float
) -> dict[str, Any] | None:
    """A row: ``old`` from its start until ``t_switch`` (seconds from now), then ``new`` to the end, moving at the
    cost ``inputs`` models; None if it never trains on ``old``."""
    steps = inputs.steps
    trained_s = t_switch - queue_s - old["assembly_s"]
    first_steps = trained_s / (old["step_ms"] / 1000.0)
    if first_steps >= steps:
        return None
    done = max(0, math.floor(first_steps))
    lost = max(0.0, trained_s - done * old["step_ms"] / 1000.0)
    row = new.to_dict()
    row.update(
        strategy=strategy,
        change=change,
        queue_s=queue_s,
        assembly_s=old["assembly_s"] + _move_s(old, new, inputs.assembly, inputs.checkpoint) + lost,
        training_s=done * old["step_ms"] / 1000.0 + (steps - done) * new["step_ms"] / 1000.0,
        preemption_loss_s=0.0,
    )
    row["total_s"] = sum(row[term] for term in TERMS)
    return row


def grow_rows(feasible: pd.DataFrame, inputs: PlanInputs) -> pd.DataFrame:
    """Start on the best configuration free now; when more GPUs free up (``inputs.availability``), move to the best
    one there.

    One row per later availability level with more GPUs than the start.
    """
    availability = inputs.availability
    now = feasible[feasible["strategy"] == "now"]
    if now.empty or len(availability.points) < 2 or inputs.mtbf_s is not None:
        return feasible.iloc[0:0]
    small = now.loc[now["total_s"].idxmin()]
    rows = []
    for t, _free in availability.points[1:]:
        later = feasible[
            (feasible["gpus"] <= min(n for tt, n in availability.points if tt >= t))
            & (feasible["gpus"] > small["gpus"])
        ]
        if later.empty:
            continue
        big = later.loc[later["training_s"].idxmin()]
        row = _switch(small, big, t, inputs, "grow", f"at {hours(t)} from {_label(small)}", 0.0)
        if row is not None and t > small["assembly_s"]:
            rows.append(row)
    return pd.DataFrame(rows, columns=feasible.columns)


def first_drop(availability: Availability, gpus: int, start_s: float, end_s: float) -> tuple[float, int] | None:
    """``(time_s, free)`` of the first availability point in ``(start_s, end_s)`` with fewer than ``gpus`` free, or
    None."""
    for t, free in availability.points:
        if start_s < t < end_s and free < gpus:
            return t, free
    return None


def split_by_drops(feasible: pd.DataFrame, availability: Availability) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(kept, lost)``: ``now`` and ``wait`` rows that keep their GPUs to the end, and those whose GPUs are taken
    mid-run.

    A lost row's ``reason`` says when and to how many GPUs availability drops; it is no longer
    feasible as planned (the shrink strategy may rescue it).
    """
    lost_index, reasons = [], {}
    for index, row in feasible.iterrows():
        if row["strategy"] not in HOLDING:
            continue
        end = row["queue_s"] + row["assembly_s"] + row["training_s"] + row["cleanup_s"] + row["preemption_loss_s"]
        drop = first_drop(availability, int(row["gpus"]), row["queue_s"], end)
        if drop is not None:
            lost_index.append(index)
            reasons[index] = (
                f"its {int(row['gpus'])} GPUs are not all free until it ends: availability drops to "
                f"{drop[1]} at {hours(drop[0])} (see the shrink strategy)"
            )
    lost = feasible.loc[lost_index].assign(feasible=False, total_s=math.nan)
    if len(lost):
        lost["reason"] = [reasons[i] for i in lost.index]
    return feasible.drop(index=lost_index), lost


def shrink_rows(lost: pd.DataFrame, feasible: pd.DataFrame, inputs: PlanInputs) -> pd.DataFrame:
    """For each configuration whose GPUs are taken mid-run: run until the drop, then continue on the best that fits.

    "Best" is the fewest remaining training seconds among the feasible configurations on at
    most the GPUs that stay free from the drop on. One row per rescued configuration (the
    best few of them, by JCT): strategy ``shrink``, ``change`` ``at <time> from <configuration>``.
    """
    if lost.empty or inputs.mtbf_s is not None:
        return feasible.iloc[0:0]
    availability = inputs.availability
    candidates = feasible[feasible["strategy"].isin(HOLDING)]
    rows = []
    for _, old in lost.iterrows():
        end = old["queue_s"] + old["assembly_s"] + old["training_s"] + old["cleanup_s"]
        drop = first_drop(availability, int(old["gpus"]), old["queue_s"], end)
        if drop is None:  # every lost row has a drop (split_by_drops found it)
            continue
        t_drop = drop[0]
        stays = min(n for t, n in availability.points if t >= t_drop)
        fits = candidates[candidates["gpus"] <= stays]
        if fits.empty:
            continue
        new = fits.loc[fits["training_s"].idxmin()]
        row = _switch(old, new, t_drop, inputs, "shrink", f"at {hours(t_drop)} from {_label(old)}", old["queue_s"])
        if row is not None:
            rows.append(row)
    out = pd.DataFrame(rows, columns=feasible.columns)
    return out.sort_values("total_s", kind="stable").head(8)
