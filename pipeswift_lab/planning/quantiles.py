"""The planner's tail: the JCT a job finishes within with probability ``q`` (the p95 job), by Monte Carlo.

Two random processes lengthen a job beyond its expected JCT:

* **step-time dispersion.** The training term is ``steps * step``; the step varies with a
  coefficient of variation ``step_cv`` (fitted by :func:`~pipeswift_lab.fidelity.calibrator.calibrate`
  or given). It is taken as *persistent* over the job: each sample draws one job-long
  speed ``1 + step_cv * Z`` (``Z`` standard normal, clipped at zero), the conservative
  reading of run-to-run and machine-to-machine spread. Steps that varied independently
  would shrink it by ``sqrt(steps)``, to nothing for long jobs.
* **failures.** Preemptions arrive as a Poisson process with rate ``gpus / mtbf_s`` in
  wall-clock time (MTBF per GPU, as :func:`~pipeswift_lab.core.costs.preemption_loss_s`). The job
  checkpoints every ``tau`` seconds of work (:meth:`CheckpointModel.interval_s
  <pipeswift_lab.core.costs.CheckpointModel.interval_s>`: Young/Daly's ``sqrt(2 C MTBF)``, never shorter than
  an asynchronous save's write), paying the stall ``C`` (:meth:`~pipeswift_lab.core.costs.CheckpointModel.stall_s`)
  each time; a failure loses the work since the last completed checkpoint and costs the
  restart ``R`` (re-assembly plus restore). Each sample replays this until the work is
  done. Its mean matches the closed form the planner's expected ``preemption_loss_s`` uses
  (half an interval redone per failure) up to the closed form's fixed-point approximation.

The queue, assembly and cleanup terms are deterministic. Every configuration uses the same
random numbers (a fixed ``seed``), so rankings do not move by sampling noise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_choice, check_int, check_time
from ..core.costs import CheckpointModel, young_daly_interval_s

#: Monte Carlo samples per configuration.
DEFAULT_SAMPLES = 2000
#: Seed of the common random numbers.
DEFAULT_SEED = 0


def quantile_column(quantile: float) -> str:
    """The Plan.table column of a quantile: ``total_s_p95`` for 0.95."""
    return f"total_s_p{100 * quantile:g}"


#: The objectives an error message names; any other ``"pNN"`` with ``0 < NN < 100`` (the JCT at that quantile) is
#: accepted too.
OBJECTIVES = ("mean", "p50", "p90", "p95", "p99")


def check_quantile(objective: Any) -> tuple[float | None, str]:
    """Validate ``objective``; return ``(its quantile or None, the Plan.table column ranked by)``.

    ``objective`` is ``"mean"`` (the expected JCT) or ``"pNN"`` (the JCT at quantile ``NN / 100``, added to the
    table as column ``total_s_pNN``).
    """
    quantile = objective_quantile(objective)
    return (None, "total_s") if quantile is None else (quantile, quantile_column(quantile))


def objective_quantile(objective: Any) -> float | None:
    """The quantile ``objective`` ranks by: None for ``"mean"``, 0.95 for ``"p95"``.

    Raises ``TypeError`` for a non-string and ``ValueError`` for an unknown name (:func:`check_choice`).
    """
    if isinstance(objective, str) and objective.startswith("p"):
        try:
            implied = float(objective[1:]) / 100
        except ValueError:
            implied = math.nan
        if 0 < implied < 1:
            return implied
    try:
        check_choice("objective", objective, OBJECTIVES)
    except ValueError as error:
        raise ValueError(f"{error}, or another 'pNN' (the JCT at that quantile, 0 < NN < 100)") from None
    return None


def training_samples(training_s: float, steps_cv: float, z: np.ndarray) -> np.ndarray:
    """Training seconds per sample: ``training_s * max(0, 1 + step_cv * z)``."""
    return training_s * np.clip(1.0 + steps_cv * z, 0.0, None)


def failure_wall_s(
    work_s: np.ndarray,
    checkpoint_s: float,
    restart_s: float,
    job_mtbf_s: float,
    rng: np.random.Generator,
    max_failures: int = 100_000,
    interval_s: float | None = None,
) -> np.ndarray:
    """Wall seconds to finish ``work_s`` of training (one value per sample) under Poisson failures.

    Checkpoints every ``interval_s`` of work (the Young/Daly interval of ``checkpoint_s`` when None), each
    stalling training ``checkpoint_s``; a failure (mean time between them ``job_mtbf_s``) loses the work since the
    last checkpoint and costs ``restart_s``. Returns the wall seconds per sample, ``inf`` for samples still
    unfinished after ``max_failures``.
    """
    checkpoint_s = check_time("checkpoint_s", checkpoint_s)
    tau = (
        young_daly_interval_s(checkpoint_s, job_mtbf_s)
        if interval_s is None
        else check_time("interval_s", interval_s, allow_zero=checkpoint_s == 0)
    )
    remaining = np.asarray(work_s, float).copy()
    wall = np.zeros_like(remaining)
    active = remaining > 0
    for _ in range(max_failures):
        if not active.any():
            return wall
        idx = np.flatnonzero(active)
        rem = remaining[idx]
        failure = rng.exponential(job_mtbf_s, len(idx))
        if tau > 0:
            saves = np.maximum(np.ceil(rem / tau) - 1.0, 0.0)  # no checkpoint after the last piece of work
            finish = rem + saves * checkpoint_s
            kept = np.minimum(np.floor(failure / (tau + checkpoint_s)) * tau, rem)
        else:  # free checkpoints: every second of work is kept
            finish = rem
            kept = np.minimum(failure, rem)
        done = failure >= finish
        wall[idx[done]] += finish[done]
        lost = idx[~done]
        wall[lost] += failure[~done] + restart_s
        remaining[lost] -= kept[~done]
        active[idx[done]] = False
    wall[active] = math.inf
    return wall


def jct_quantile(
    rows: pd.DataFrame,
    quantile: float,
    step_cv: float = 0.0,
    mtbf_s: float | None = None,
    checkpoint: CheckpointModel | None = None,
    samples: int = DEFAULT_SAMPLES,
    seed: int = DEFAULT_SEED,
) -> pd.Series:
    """The JCT at ``quantile`` of each planner row (seconds), by Monte Carlo (see the module docstring).

    ``rows`` needs ``queue_s``, ``assembly_s``, ``cleanup_s``, ``training_s``, ``gpus`` and,
    with ``mtbf_s``, ``_shard_bytes`` (what a checkpoint writes per rank); ``checkpoint`` is
    the :class:`~pipeswift_lab.core.costs.CheckpointModel` the plan used (None: the default one).
    """
    step_cv = check_time("step_cv", step_cv)
    samples = check_int("samples", samples, minimum=10)
    checkpoint = checkpoint or CheckpointModel()
    out = []
    for _, row in rows.iterrows():
        rng = np.random.default_rng(seed)  # common random numbers across configurations
        z = rng.standard_normal(samples)
        work = training_samples(float(row["training_s"]), step_cv, z)
        if mtbf_s is not None:
            shard = float(row["_shard_bytes"])
            restart = float(row["assembly_s"]) + checkpoint.restore_s(shard)
            job_mtbf_s = mtbf_s / float(row["gpus"])
            interval = checkpoint.interval_s(shard, job_mtbf_s)
            work = failure_wall_s(work, checkpoint.stall_s(shard), restart, job_mtbf_s, rng, interval_s=interval)
        fixed = float(row["queue_s"]) + float(row["assembly_s"]) + float(row["cleanup_s"])
        out.append(fixed + float(np.quantile(work, quantile)))
    return pd.Series(out, index=rows.index, dtype=float)


__all__ = [
    "OBJECTIVES",
    "check_quantile",
    "failure_wall_s",
    "jct_quantile",
    "objective_quantile",
    "quantile_column",
    "training_samples",
]
