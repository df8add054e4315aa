"""Rebalancing a running pipeline from its measured stage times, only when it pays.

Every ``rebalance_every`` steps the ranks report each stage's measured compute per step; each
stage's profiled layers are rescaled by that stage's measured-over-profiled ratio, the exact
balanced partition of the rescaled profile is computed (``partition(method="balanced")``) and
both partitions are simulated on it. The predicted saving over the remaining steps is weighed
against the measured cost of a reconfiguration (save, teardown, assembly, restore): rebalance
only when it is larger. This is the measurement-driven re-partitioning of adaptive pipeline
systems (e.g. the re-profiling loop of PipeDream, Narayanan et al., SOSP 2019), restricted to
moving stage boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

#: Columns of ``RunResult.rebalances``: one row per decision, taken or not.
REBALANCE_COLUMNS = (
    "step",
    "taken",
    "old_bounds",
    "new_bounds",
    "measured_stage_ms",
    "profiled_stage_ms",
    "predicted_step_ms_old",
    "predicted_step_ms_new",
    "remaining_steps",
    "predicted_gain_s",
    "cost_s",
    "reason",
)


@dataclass(frozen=True, kw_only=True)
class RebalancePlan:
    """What a worker needs to decide: the profile, how the partition was made, and how often to look."""

    every: int
    """Steps between decisions."""
    profile: pd.DataFrame
    """The per-layer profile (``fwd_ms``, ``bwd_ms``, ... as ``Profile.df``) the partitions come from."""
    partition_kwargs: dict[str, Any]
    """How to re-partition: ``schedule``, ``v``, ``m``, ``mem_per_gpu_bytes``, ``optimizer``, ``link``."""
    job_steps: int
    """The job's total steps, for the remaining steps."""
    cost_s: float | None = None
    """A measured reconfiguration cost from an earlier segment; ``None``: estimated in the run."""


def rescaled_profile(profile: pd.DataFrame, bounds: Sequence[tuple[int, int]], ratios: Sequence[float]) -> pd.DataFrame:
    """``profile`` with every layer of stage ``s`` (``bounds[s]``) scaled by ``ratios[s]`` (fwd, bwd and wgrad
    times)."""
    df = profile.copy()
    scale = np.ones(len(df))
    for (a, b), r in zip(bounds, ratios):
        scale[a:b] = r
    for col in ("fwd_ms", "bwd_ms", "wgrad_ms"):
        if col in df.columns:
            df[col] = df[col].to_numpy(dtype=float) * scale
    return df


def decide(
    plan: RebalancePlan,
    bounds: Sequence[Sequence[int]],
    measured_stage_ms: Sequence[float],
    step: int,
    cost_s: float,
) -> dict[str, Any]:
    """One decision at ``step`` (steps done): a row of :data:`REBALANCE_COLUMNS`.

    ``measured_stage_ms`` is each stage's measured compute (sum of its actions) per step;
    the profiled counterpart is ``m × (fwd + bwd)`` of its layers. ``taken`` is True when the
    balanced partition of the rescaled profile differs and its predicted saving over the
    remaining steps exceeds ``cost_s``.
    """
    from ..partitioning.balance import partition
    from ..partitioning.stages import Partition
    from ..simulation.simulator import simulate_step_ms

    kw = dict(plan.partition_kwargs)
    m = kw.pop("m")
    old = tuple((int(a), int(b)) for a, b in bounds)
    fwd = plan.profile["fwd_ms"].to_numpy(dtype=float)
    bwd = plan.profile["bwd_ms"].to_numpy(dtype=float)
    profiled = [m * float(fwd[a:b].sum() + bwd[a:b].sum()) for a, b in old]
    ratios = [meas / prof if prof > 0 else 1.0 for meas, prof in zip(measured_stage_ms, profiled)]
    scaled = rescaled_profile(plan.profile, old, ratios)
    current = Partition.from_bounds(scaled, list(old), m=m, **kw)
    remaining = plan.job_steps - step
    row = {
        "step": step,
        "old_bounds": old,
        "measured_stage_ms": tuple(float(x) for x in measured_stage_ms),
        "profiled_stage_ms": tuple(profiled),
        "remaining_steps": remaining,
        "cost_s": float(cost_s),
    }
    try:
        balanced = partition(scaled, current.P, method="balanced", m=m, **kw)
    except ValueError as exc:  # e.g. no split of the rescaled profile fits memory
        return {
            **row,
            "taken": False,
            "new_bounds": old,
            "predicted_step_ms_old": float("nan"),
            "predicted_step_ms_new": float("nan"),
            "predicted_gain_s": 0.0,
            "reason": f"no balanced partition: {exc}",
        }
    old_ms = simulate_step_ms(current, m)
    new_ms = simulate_step_ms(balanced, m)
    gain_s = max(0.0, (old_ms - new_ms) / 1e3 * remaining)
    new_bounds = tuple((int(a), int(b)) for a, b in balanced.bounds)
    if new_bounds == old:
        taken, reason = False, "the balanced partition of the measured times is the current one"
    elif gain_s <= cost_s:
        taken, reason = (
            False,
            f"predicted saving {gain_s:.3g} s over {remaining} steps does not pay the {cost_s:.3g} s reconfiguration",
        )
    else:
        taken, reason = (
            True,
            f"predicted saving {gain_s:.3g} s over {remaining} steps exceeds the {cost_s:.3g} s reconfiguration",
        )
    return {
        **row,
        "taken": taken,
        "new_bounds": new_bounds,
        "predicted_step_ms_old": old_ms,
        "predicted_step_ms_new": new_ms,
        "predicted_gain_s": gain_s,
        "reason": reason,
    }


def measured_stage_ms(
    records: torch.Tensor, stages: Iterable[int], first_step: int, last_step: int
) -> dict[int, float]:
    """Each of ``stages``' measured compute per step over steps ``first_step .. last_step - 1``, from an
    ActionRecorder's rows."""
    from .rank.instrument import COMPUTE_CODES

    rows = torch.as_tensor(records).to("cpu")
    out = {s: 0.0 for s in stages}
    n = max(1, last_step - first_step)
    if len(rows):  # the window's compute rows only: a decision costs its window, not the whole run so far
        keep = (
            (rows[:, 0] >= first_step) & (rows[:, 0] < last_step) & torch.isin(rows[:, 1], torch.tensor(COMPUTE_CODES))
        )
        rows = rows[keep]
    for _step, _kind, stage, _mb, start, end in rows.tolist():
        if stage in out:
            out[stage] += (end - start) / 1e6
    return {s: total / n for s, total in out.items()}


__all__ = ["decide", "measured_stage_ms", "REBALANCE_COLUMNS", "RebalancePlan", "rescaled_profile"]
