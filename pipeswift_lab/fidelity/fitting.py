"""The fitting machinery of :func:`pipeswift_lab.fidelity.calibrator.calibrate`: checking the runs, the partition each ran,
and the least-squares and median fits of the model's parameters (the model is stated in :mod:`pipeswift_lab.fidelity.calibrator`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..core.analytic import backward_parts
from ..core.link import fit_latency_bandwidth

# --------------------------------------------------------------------------- inputs


def _run_key(run) -> tuple:
    """A run's identity: configuration and its measured step times."""
    return (run.schedule, int(run.P), int(run.v), int(run.m), tuple(round(float(t), 6) for t in run.step_ms))


def _model_of(run) -> tuple:
    meta = getattr(run, "meta", {}) or {}
    return (meta.get("n_layers"), tuple(meta.get("state_keys", ())))


def _check_runs(runs, model=None) -> list:
    """Validate ``runs``: RunResults of one model, each with a measured Timeline."""
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
                f"(its compute scale is per P ranks sharing the machine, and the model has no all-reduce term), so give "
                f"it D=1 runs; the all-reduce of a replicated run is measured in RunResult.allreduce_ms"
            )
    first = _model_of(runs[0]) if model is None else (model[0], tuple(model[1]))
    for i, run in enumerate(runs):
        other = _model_of(run)
        if other != first:
            if other[0] != first[0]:
                detail = f"{other[0]} layers against {first[0]}"
            else:
                diff = sorted(set(other[1]) ^ set(first[1]))
                detail = f"parameters differ, e.g. {diff[:3]}"
            whose = "runs[0]" if model is None else "the runs this calibration was fitted on"
            raise ValueError(
                f"runs[{i}] ({run.schedule} P={run.P} m={run.m}) is a run of a different model than {whose} ({detail}); "
                f"calibrate each model on its own runs"
            )
    return runs


def _profile_table(profile):
    """``(per-layer DataFrame, micro-batch size or None)`` of a Profile or a per-layer DataFrame."""
    df = getattr(profile, "df", profile)
    if not isinstance(df, pd.DataFrame) or not {"fwd_ms", "bwd_ms"} <= set(df.columns):
        raise TypeError(
            f"profile must be a pipeswift_lab.Profile or a per-layer DataFrame with fwd_ms and bwd_ms; got {type(profile).__name__}"
        )
    meta = getattr(profile, "meta", {}) or {}
    size = meta.get("batch_size")
    return df.reset_index(drop=True), (int(size) if size else None)


def _partition_of(run, table: pd.DataFrame, batch_size, index: int):
    """The Partition a run executed, with the profile's times (scaled to the run's micro-batch size when both are known)."""
    from ..partitioning.balance import Partition

    n_run = run.meta.get("n_layers")
    bounds = [tuple(int(x) for x in b) for b in run.meta["bounds"]]
    if (n_run is not None and n_run != len(table)) or bounds[-1][1] != len(table):
        raise ValueError(
            f"the profile has {len(table)} layers but runs[{index}] ({run.schedule} P={run.P} m={run.m}) partitioned a model of "
            f"{n_run if n_run is not None else bounds[-1][1]} layers (stage bounds {bounds}); profile the model the runs trained"
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
        for col in ("fwd_ms", "bwd_ms", "wgrad_ms", "activation_bytes", "output_bytes"):
            if col in table.columns:
                table[col] = table[col] * (int(mb) / batch_size)
    return Partition.from_bounds(table, bounds, v=run.v, schedule=run.schedule, m=run.m)


def _first(run) -> int:
    """Step number of ``run.step_ms[0]`` (a resumed run's measured steps start later)."""
    return int(getattr(run, "first_step", 0) or 0)


def _steady(run) -> list[int]:
    """Step numbers after the warm-up (the first measured) step; the only one if there is one."""
    n, first = len(run.step_ms), _first(run)
    return list(range(first + 1, first + n)) if n > 1 else [first]


def _profiled_durations(part) -> dict:
    """``{(stage, kind): profiled ms}`` as the simulator splits a backward (:func:`~pipeswift_lab.core.analytic.backward_parts`)."""
    bwd = list(part.stage_bwd_ms)
    igrad, wgrad = backward_parts(bwd, part.stage_wgrad_ms)
    out = {}
    for s, f in enumerate(part.stage_fwd_ms):
        out.update({(s, "F"): f, (s, "B"): bwd[s], (s, "I"): igrad[s], (s, "W"): wgrad[s]})
    return out


def _transfer_gaps(df: pd.DataFrame, part) -> list[tuple[float, float]]:
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


def _fit_compute(samples, how, missing):
    """``({P: scale}, action_ms, (loss_fwd_ms, loss_bwd_ms))`` by least squares, the additive costs kept >= 0.

    ``measured = scale[P] * profiled + action_ms + loss_fwd_ms [last-stage F] + loss_bwd_ms [last-stage B/I]``;
    an additive cost the unconstrained fit makes negative is set to 0 and the rest refitted, and a scale it makes
    ``<= 0`` drops the additive costs (``action_ms`` first) until it is positive: at the end the proportional model
    through the origin, whose slope is positive because every measured time is; so every parameter is physical.
    """
    Ps = sorted({row[0] for row in samples})
    P_arr = np.array([row[0] for row in samples])
    x = np.array([row[1] for row in samples], float)
    y = np.array([row[2] for row in samples], float)
    for P in Ps:
        if not np.any(x[P_arr == P] > 0):
            raise ValueError(
                f"the profile gives 0 ms to every action of the runs at P={P}; a scale cannot be fitted from it"
            )
    n = len(samples)
    scale_cols = [np.where(P_arr == P, x, 0.0) for P in Ps]
    extra = {
        "action_ms": np.ones(n),
        "loss_fwd_ms": np.array([row[3] for row in samples], float),
        "loss_bwd_ms": np.array([row[4] for row in samples], float),
    }
    active = list(extra)
    if np.ptp(x) <= 0.05 * np.max(x):
        active.remove("action_ms")
        how["action_ms"] = (
            "not fitted: every profiled action has the same duration, so a fixed cost and a scale cannot be told apart; 0"
        )
        missing.append("action_ms")
    values = {}
    while True:
        design = np.column_stack(scale_cols + [extra[k] for k in active])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        values = dict(zip(active, coef[len(Ps) :]))
        if np.any(coef[: len(Ps)] <= 0) and active:
            # measured times do not grow with profiled ones here (noise, or actions too alike): a slope <= 0 is no
            # scale; drop the additive costs one by one (the fixed cost first) down to the proportional model,
            # measured = scale * profiled, whose slope is positive (every measured and some profiled time is)
            dropped = active.pop(0)
            how[dropped] = (
                f"not fitted: with it the least-squares scale came out {min(coef[: len(Ps)]):.3g} (measured times do not "
                "grow with profiled ones), so 0 and the scale fitted closer to the origin"
            )
            missing.append(dropped)
            continue
        negative = [k for k in active if values[k] < 0]
        if not negative:
            break
        worst = min(negative, key=lambda k: values[k])
        how[worst] = f"least squares gave {values[worst]:.3g} ms; a cost cannot be negative, so 0 and the rest refitted"
        active.remove(worst)
    for k in active:
        what = {
            "action_ms": "intercept",
            "loss_fwd_ms": "offset of the last stage's F",
            "loss_bwd_ms": "offset of the last stage's B/I",
        }[k]
        how[k] = f"least squares {what} over {n} (run, stage, kind) median action times"
    out = {}
    for P, s in zip(Ps, coef[: len(Ps)]):
        k = int(np.sum(P_arr == P))
        out[int(P)] = float(s)
        how[f"compute_scale[P={P}]"] = (
            f"least squares slope of measured against profiled action time over {k} (run, stage, kind) medians at P={P}"
        )
    return (
        out,
        float(values.get("action_ms", 0.0)),
        (float(values.get("loss_fwd_ms", 0.0)), float(values.get("loss_bwd_ms", 0.0))),
    )


def _fit_transfer(gaps, how, missing):
    """``(latency_ms, bandwidth_GBps)`` from ``(bytes, gap_ms)`` hand-offs to idle receivers."""
    if not gaps:
        how["latency_ms"] = "not fitted: no hand-off between ranks reached an idle receiver; 0"
        how["bandwidth_GBps"] = "not fitted (no hand-offs); transfers take latency_ms only"
        missing += ["latency_ms", "bandwidth_GBps"]
        return 0.0, math.inf
    nbytes = np.array([b for b, _ in gaps], float)
    gap = np.clip(np.array([g for _, g in gaps], float), 0.0, None)
    if nbytes.max() > 0 and np.ptp(nbytes) > 0.1 * nbytes.max():
        line = fit_latency_bandwidth(nbytes.tolist(), gap.tolist())
        if line is not None:
            intercept, slope = line
            how["latency_ms"] = (
                f"least squares intercept of gap = latency + bytes/bandwidth over {len(gaps)} hand-offs to idle receivers"
            )
            how["bandwidth_GBps"] = (
                f"inverse least squares slope over the same {len(gaps)} hand-offs ({len(np.unique(nbytes))} sizes)"
            )
            return float(intercept), float(1.0 / (slope * 1e6))
    latency = float(np.median(gap))
    how["latency_ms"] = f"median gap from a sender's end to an idle receiver's start over {len(gaps)} hand-offs"
    how["bandwidth_GBps"] = (
        "not fitted: the hand-offs carry one size (or no size trend), so bandwidth cannot be told from latency; "
        "transfers take latency_ms only"
    )
    missing.append("bandwidth_GBps")
    return latency, math.inf


def _minimize_scalar(f, lo, hi, grid=24, iterations=30) -> float:
    """The minimizer of ``f`` on ``[lo, hi]``: a grid, then golden-section search around its best point."""
    xs = np.linspace(lo, hi, grid + 1)
    values = [f(x) for x in xs]
    k = int(np.argmin(values))
    a, b = xs[max(0, k - 1)], xs[min(grid, k + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    best = (a + b) / 2
    return float(min([(values[k], xs[k]), (f(best), best)])[1])
