"""What calibration reads from measured runs: the runs checked (one model, instrumented), the partition each ran with
the profile's times, and the durations, spans, overheads and hand-offs of their steady steps
(:func:`measure_runs`). The fits of :mod:`pipeswift_lab.fidelity.fitting` read these values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..core.analytic import backward_parts
from ..core.vocabulary import COMPUTE_KINDS
from ..partitioning.stages import Partition
from ..simulation.calibration import RUNTIMES, runtime_of
from ..simulation.steady import first_step

#: A measured run: a :class:`~pipeswift_lab.runner.RunResult`, read as a value (this room never imports the runner).
Run = Any
#: One (run, stage, kind) sample of the compute fit: ``(P, profiled_ms, measured_ms, last_stage_F, last_stage_B_or_I)``.
Sample = tuple[int, float, float, bool, bool]


# --------------------------------------------------------------------------- inputs


def run_key(run: Run) -> tuple:
    """A run's identity: configuration and its measured step times."""
    return (run.schedule, int(run.P), int(run.v), int(run.m), tuple(round(float(t), 6) for t in run.step_ms))


def model_of(run: Run) -> tuple:
    """A run's model fingerprint: ``(n_layers, state_keys)`` from its meta."""
    meta = getattr(run, "meta", {}) or {}
    return (meta.get("n_layers"), tuple(meta.get("state_keys", ())))


def check_runs(runs: Run | Sequence[Run], model: tuple | None = None) -> list[Run]:
    """Validate ``runs``: RunResults of one model (``model``'s, when given), each with a measured Timeline; return
    them as a list."""
    if not isinstance(runs, (list, tuple)):
        runs = [runs]
    runs = list(runs)
    if not runs:
        raise ValueError("runs is empty; give one or more RunResults (psl.run(...)) of the same model")
    for i, run in enumerate(runs):
        needed = ("timeline", "step_ms", "schedule", "P", "v", "m", "meta")
        if not all(hasattr(run, a) for a in needed):
            raise TypeError(f"runs[{i}] must be a pipeswift_lab.RunResult (from psl.run); got {type(run).__name__}")
        if run.timeline is None or not getattr(run, "instrumented", True):
            raise ValueError(
                f"runs[{i}] ({run.schedule} P={run.P} m={run.m}) has no Timeline: it ran with instrument=False; "
                f"calibration needs the measured actions, rerun it with instrument=True (the default)"
            )
        if "bounds" not in run.meta:
            raise ValueError(
                f"runs[{i}] has no stage bounds in its meta; calibrate needs RunResults from psl.run or load_result"
            )
        if getattr(run, "D", 1) > 1:
            raise ValueError(
                f"runs[{i}] ({run.schedule} P={run.P} m={run.m}) ran D={run.D} replicas; calibrate fits one pipeline "
                "(its compute scale is per P ranks sharing the machine, and the model has no all-reduce term), so give "
                f"it D=1 runs; the all-reduce of a replicated run is measured in RunResult.allreduce_ms"
            )
    first = model_of(runs[0]) if model is None else (model[0], tuple(model[1]))
    for i, run in enumerate(runs):
        other = model_of(run)
        if other != first:
            if other[0] != first[0]:
                detail = f"{other[0]} layers against {first[0]}"
            else:
                diff = sorted(set(other[1]) ^ set(first[1]))
                detail = f"parameters differ, e.g. {diff[:3]}"
            whose = "runs[0]" if model is None else "the runs this calibration was fitted on"
            raise ValueError(
                f"runs[{i}] ({run.schedule} P={run.P} m={run.m}) is a run of a different model than {whose} "
                f"({detail}); "
                f"calibrate each model on its own runs"
            )
    return runs


def profile_table(profile: Any) -> tuple[pd.DataFrame, int | None]:
    """``(per-layer DataFrame, micro-batch size or None)`` of a Profile or a per-layer DataFrame."""
    df = getattr(profile, "df", profile)
    if not isinstance(df, pd.DataFrame) or not {"fwd_ms", "bwd_ms"} <= set(df.columns):
        raise TypeError(
            "profile must be a pipeswift_lab.Profile or a per-layer DataFrame with fwd_ms and bwd_ms; "
            f"got {type(profile).__name__}"
        )
    meta = getattr(profile, "meta", {}) or {}
    size = meta.get("batch_size")
    return df.reset_index(drop=True), (int(size) if size else None)


def partition_of(run: Run, table: pd.DataFrame, batch_size: int | None, index: int) -> Partition:
    """The Partition a run executed, with the profile's times (scaled to the run's micro-batch size when both are
    known)."""
    n_run = run.meta.get("n_layers")
    bounds = [tuple(int(x) for x in b) for b in run.meta["bounds"]]
    if (n_run is not None and n_run != len(table)) or bounds[-1][1] != len(table):
        raise ValueError(
            f"the profile has {len(table)} layers but runs[{index}] ({run.schedule} P={run.P} m={run.m}) partitioned a "
            f"model of {n_run if n_run is not None else bounds[-1][1]} layers (stage bounds {bounds}); profile the "
            "model the runs trained"
        )
    keys = run.meta.get("state_keys") or ()
    if keys and {"name", "params"} <= set(table.columns):
        unknown = [
            str(n)
            for n, p in zip(table["name"], table["params"])
            if p > 0 and not any(k.startswith(f"{n}.") for k in keys)
        ]
        if unknown:
            raise ValueError(
                f"the profile's layers {unknown[:3]} hold parameters but the model of runs[{index}] has no such layer "
                f"(its parameters: {list(keys)[:3]}...); profile the model the runs trained"
            )
    mb = run.meta.get("microbatch_size")
    if batch_size and mb and int(mb) != batch_size:
        table = table.copy()
        scaled = ("fwd_ms", "bwd_ms", "wgrad_ms", "recompute_ms", "selective_recompute_ms", "activation_bytes")
        for col in (*scaled, "output_bytes"):
            if col in table.columns:
                table[col] = table[col] * (int(mb) / batch_size)
    layer_modes = run.meta.get("recompute_layers")
    if layer_modes:  # the run's backwards recomputed these layers: time them as they ran
        from ..profiling.recompute_costs import RECOMPUTE_COLUMNS, recomputed
        from ..profiling.table import Profile

        if not all(c in table.columns for c in RECOMPUTE_COLUMNS):
            raise ValueError(
                f"runs[{index}] ({run.schedule} P={run.P} m={run.m}) recomputed {len(layer_modes)} layers but the "
                "profile has no recompute columns; profile the model with profile(..., recompute=True)"
            )
        table = recomputed(Profile(table, {}), layer_modes).df
    return Partition.from_bounds(table, bounds, v=run.v, schedule=run.schedule, m=run.m)


def steady_steps(run: Run) -> list[int]:
    """Step numbers after the warm-up (the first measured) step; the only one if there is one."""
    n, first = len(run.step_ms), first_step(run)
    return list(range(first + 1, first + n)) if n > 1 else [first]


def profiled_durations(part: Partition) -> dict[tuple[int, str], float]:
    """``{(stage, kind): profiled ms}`` as the simulator splits a backward
    (:func:`~pipeswift_lab.core.analytic.backward_parts`)."""
    bwd = list(part.stage_bwd_ms)
    igrad, wgrad = backward_parts(bwd, part.stage_wgrad_ms, part.stage_recomputed_ms, part.split_passes_ms)
    out = {}
    for s, f in enumerate(part.stage_fwd_ms):
        out.update({(s, "F"): f, (s, "B"): bwd[s], (s, "I"): igrad[s], (s, "W"): wgrad[s]})
    return out


def transfer_gaps(df: pd.DataFrame, part: Partition) -> list[tuple[float, float]]:
    """``(bytes, gap_ms)`` for every cross-rank hand-off whose receiver sat idle before the data was sent."""
    placement = list(part.stage_to_rank)
    S = len(placement)
    out = []
    for _, step in df.groupby("step"):
        step = step.sort_values(["rank", "start_ms"], kind="stable")
        prev_end = step.groupby("rank")["end_ms"].shift(1).fillna(-math.inf).to_numpy()
        by_key = {
            (int(s), int(i), k): (st, en)
            for s, i, k, st, en in zip(
                step["stage"], step["microbatch"], step["kind"], step["start_ms"], step["end_ms"]
            )
        }
        for s, i, k, start, ready in zip(step["stage"], step["microbatch"], step["kind"], step["start_ms"], prev_end):
            s, i = int(s), int(i)
            if k == "F" and s > 0 and placement[s - 1] != placement[s]:
                sender, boundary = by_key.get((s - 1, i, "F")), s - 1
            elif k in ("B", "I") and s < S - 1 and placement[s + 1] != placement[s]:
                sender = by_key.get((s + 1, i, "B")) or by_key.get((s + 1, i, "I"))
                boundary = s
            else:
                continue
            if sender is None or ready > sender[1]:
                continue  # the receiver was still busy when the data was sent: the gap is a queue, not a transfer
            out.append((float(part.stage_output_bytes[boundary]), float(start - sender[1])))
    return out


# --------------------------------------------------------------------------- measuring
@dataclass(frozen=True, kw_only=True)
class Measurements:
    """What the fits read from the runs' steady steps (:func:`measure_runs`)."""

    samples: list[Sample]
    """One per (run, stage, kind): the median measured duration against the profiled one."""
    spans: list[float]
    """Per run, the median first-to-last action span of its steady steps (ms)."""
    overheads: dict[str, list[float]]
    """Per runtime kind, every steady step's time minus its action span (ms)."""
    gaps: list[tuple[float, float]]
    """``(bytes, gap_ms)`` of every hand-off to an idle receiver (:func:`transfer_gaps`)."""
    cvs: list[float]
    """Per run with enough steps, the coefficient of variation of its steps after the first."""


def measure_runs(runs: Sequence[Run], parts: Sequence[Partition]) -> Measurements:
    """Read every run's steady steps: the samples, spans, per-step overheads, hand-offs and step dispersion."""
    out = Measurements(samples=[], spans=[], overheads={k: [] for k in RUNTIMES}, gaps=[], cvs=[])
    for run, part in zip(runs, parts):
        steady = steady_steps(run)
        df = run.timeline.df
        df = df[df["step"].isin(steady) & df["kind"].isin(COMPUTE_KINDS)]
        if df.empty:
            raise ValueError(f"the run {run.schedule} P={run.P} m={run.m} has no measured actions in steps {steady}")
        out.samples.extend(_samples(run, part, df))
        span = df.groupby("step")["end_ms"].max() - df.groupby("step")["start_ms"].min()
        out.spans.append(float(span.median()))
        first = first_step(run)
        out.overheads[runtime_of(run.schedule)] += [run.step_ms[k - first] - span[k] for k in steady if k in span]
        out.gaps.extend(transfer_gaps(df, part))
        cv = float(run.step_stats().iloc[-1]["cv"])  # the dispersion the noise rule reads too
        if math.isfinite(cv):
            out.cvs.append(cv)
    return out


def _samples(run: Run, part: Partition, df: pd.DataFrame) -> list[Sample]:
    """The median measured duration of every (stage, kind) of ``df`` against its profiled one."""
    profiled = profiled_durations(part)
    med = (df["end_ms"] - df["start_ms"]).groupby([df["stage"], df["kind"]]).median()
    last = len(part.stage_fwd_ms) - 1
    return [
        (run.P, profiled[(int(s), k)], float(d), int(s) == last and k == "F", int(s) == last and k in ("B", "I"))
        for (s, k), d in med.items()
    ]


__all__ = [
    "Measurements",
    "Run",
    "Sample",
    "check_runs",
    "measure_runs",
    "model_of",
    "partition_of",
    "profile_table",
    "profiled_durations",
    "run_key",
    "steady_steps",
    "transfer_gaps",
]
