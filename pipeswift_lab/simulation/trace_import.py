"""The rows and meta of a measured :class:`~pipeswift_lab.simulation.timeline.Timeline` from the ``torch.profiler``
traces of a real pipeline job, one trace per rank (:func:`read_profiler_traces`, which
:meth:`Timeline.from_profiler` wraps).

Files are read one at a time (:mod:`.trace_files`), each rank's actions extracted (:mod:`.trace_actions`), then:

* **ranks** — a rank's pipeline position is given by the stages it ran: ranks running the same stages are
  data-parallel replicas of one position (numbered by global rank), positions are ordered by their first stage.
  GPipe's labels do not name the stage, so there rank ``r`` runs stage ``r`` (one replica);
* **clocks** — event times are microseconds after each file's ``baseTimeNanoseconds`` on its host's wall clock.
  Traces from one host share that clock and are aligned exactly (``clock_skew_ms`` 0). Across hosts the offsets
  are estimated from the hand-offs, as NTP estimates a clock from a round trip: a stage's forward cannot start
  before the previous stage's forward of the same micro-batch ended, nor a backward before the next stage's
  backward ended. Each adjacent pair of positions gets the middle of the interval of offsets these allow, and
  ``clock_skew_ms`` is the half-width, summed along the pipeline (the error bound of the farthest rank);
* **steps** — ``ProfilerStep#N`` numbers (:func:`torch.profiler.profile.step`), the same on every rank; the
  whole step of ``meta["step_ms"]`` runs from the first rank starting its ``ProfilerStep`` span to the last one
  ending it (optimizer step included, as ``RunResult.step_ms``).

Why not Holistic Trace Analysis: HTA (``holistictraceanalysis``) parses these files into a DataFrame per rank and
reports idle time by GPU stream, but it needs CUDA kernels to analyse (a CPU job's trace has none), knows no
pipeline action or schedule, and pulls in plotly, pydot, networkx, pytest and jupyterlab as install
requirements. What this import needs from a trace is a handful of fields of four event categories; the standard
library's ``json`` reads them at its own speed (``benchmarks/bench_traces.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import pandas as pd

from ..core.schedule_orders import compute_orders
from ..core.vocabulary import COMPUTE_KINDS, SCHEDULES
from .trace_actions import RankActions, rank_actions
from .trace_files import TraceError, TraceFile, read_trace, trace_paths

__all__ = ["read_profiler_traces"]


def read_profiler_traces(
    source: str | PathLike[str] | Sequence[str | PathLike[str]], schedule: str | None = None
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read one ``torch.profiler`` trace per rank and return the rows and the meta of the job's measured Timeline.

    ``source`` is a folder written by ``tensorboard_trace_handler`` (several profiling cycles of one rank are
    joined), a trace file, or a list of files (``export_chrome_trace``'s, gzipped or not). ``schedule`` names the
    schedule; by default it is the one whose per-rank order, as torch builds it, the first step's actions follow
    (``meta["schedule_order_matched"]``; when none does, as for a custom CSV schedule, one with the same kinds and
    placement). The rows have a ``time_source`` column besides the Timeline's, and the meta holds ``schedule``,
    ``P``, ``v``, ``m``, ``D``, ``step_ms`` and ``first_step`` (per profiled step), ``clock_skew_ms``,
    ``clock_alignment``, ``traces`` (the files), ``imported_from`` (``"torch.profiler"``) and ``dropped_actions``.

    Raises :class:`~pipeswift_lab.simulation.trace_files.TraceError` naming the file for a truncated or non-JSON
    file, a non-pipeline trace, a schedule that emits no action spans (with the way out), a missing rank, or two
    traces of one rank that overlap in steps; ``FileNotFoundError`` when there is nothing to read.
    """
    paths = trace_paths(source)
    by_rank: dict[int, list[tuple[TraceFile, RankActions]]] = {}
    hosts: dict[int, tuple[str | None, int]] = {}
    worlds: set[int] = set()
    for path in paths:
        trace = read_trace(path, single=len(paths) == 1)
        actions = rank_actions(trace)
        by_rank.setdefault(trace.rank, []).append((_without_events(trace), actions))
        hosts.setdefault(trace.rank, (trace.host, trace.base_ns))
        if trace.world_size is not None:
            worlds.add(trace.world_size)
        del trace  # the events: one file's at a time
    ranks = _check_ranks(by_rank, worlds, paths)
    per_rank = {r: _join_cycles(r, by_rank[r]) for r in ranks}
    styles = {actions.labels for entries in by_rank.values() for _, actions in entries}
    if len(styles) > 1:
        raise TraceError(
            f"the traces mix label styles {sorted(styles)} (PP: runtime spans and GPipe's Forward/Backward): give the "
            "traces of one job"
        )
    style = styles.pop()
    position, replica = _positions(per_rank, style)
    for r, (actions, steps) in per_rank.items():
        shift = (hosts[r][1] - hosts[ranks[0]][1]) / 1e3  # onto rank 0's clock base, µs
        per_rank[r] = _shifted(actions, steps, shift)
    one_host = len({hosts[r][0] for r in ranks}) == 1 and hosts[ranks[0]][0] is not None
    skew_ms, alignment = 0.0, "one host: every rank's trace on the same clock"
    if not one_host:
        skew_ms, alignment = _align_hosts(per_rank, position, replica)
    frames, step_frames = [], []
    for r, (actions, steps) in per_rank.items():
        frames.append(actions.assign(rank=position[r], replica=replica[r]))
        step_frames.append(steps)
    df = pd.concat(frames, ignore_index=True)
    step_spans = pd.concat(step_frames, ignore_index=True)
    origin = float(df["start_us"].min())
    if len(step_spans):
        origin = min(origin, float(step_spans["start_us"].min()))
    df = df.assign(start_ms=(df["start_us"] - origin) / 1e3, end_ms=(df["end_us"] - origin) / 1e3)
    meta = _meta(df, step_spans, schedule, paths, gpipe_labels=style == "gpipe")
    meta.update(clock_skew_ms=skew_ms, clock_alignment=alignment)
    columns = ["step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms", "replica", "time_source"]
    return df[columns], meta


def _without_events(trace: TraceFile) -> TraceFile:
    return TraceFile(trace.path, trace.rank, trace.world_size, trace.host, trace.base_ns, [])


def _check_ranks(
    by_rank: dict[int, list[tuple[TraceFile, RankActions]]], worlds: set[int], paths: list[Path]
) -> list[int]:
    """The ranks, ``0..world-1`` all present; an error naming the folder and the missing ranks otherwise."""
    ranks = sorted(by_rank)
    if len(worlds) > 1:
        raise TraceError(
            f"the traces come from jobs of different world sizes {sorted(worlds)}: {[str(p) for p in paths]}"
        )
    world = worlds.pop() if worlds else len(ranks)
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        where = sorted({str(p.parent) for p in paths})
        found = ", ".join(f"rank {r}: {by_rank[r][0][0].path.name}" for r in ranks)
        raise TraceError(
            f"the traces in {', '.join(where)} miss rank(s) {missing} of the job's {world} ({found}); every rank's "
            "trace is needed (was one rank not profiled, or its file not copied?)"
        )
    return ranks


def _join_cycles(rank: int, entries: list[tuple[TraceFile, RankActions]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One rank's actions and step spans over all its files (profiling cycles); files overlapping in steps are two
    runs, an error naming both."""
    seen: dict[int, Path] = {}
    for trace, actions in entries:
        for step in sorted(set(actions.actions["step"].tolist())):
            if step in seen:
                raise TraceError(
                    f"rank {rank} has step {step} in two traces, {seen[step]} and {trace.path}: traces of two runs? "
                    "give the files of one run"
                )
            seen[step] = trace.path
    actions = pd.concat([a.actions for _, a in entries], ignore_index=True)
    steps = pd.concat([a.steps for _, a in entries], ignore_index=True)
    return actions, steps


def _positions(
    per_rank: dict[int, tuple[pd.DataFrame, pd.DataFrame]], style: str
) -> tuple[dict[int, int], dict[int, int]]:
    """Each global rank's pipeline position and replica (see the module docstring)."""
    if style == "gpipe":
        return {r: r for r in per_rank}, {r: 0 for r in per_rank}
    stage_sets = {
        r: tuple(sorted(set(a.loc[a["kind"].isin(COMPUTE_KINDS), "stage"].tolist()))) for r, (a, _) in per_rank.items()
    }
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(per_rank):
        groups.setdefault(stage_sets[r], []).append(r)
    order = sorted(groups, key=lambda stages: stages[0] if stages else math.inf)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) > 1:
        raise TraceError(
            "the ranks' stages do not form equal replicas: "
            + "; ".join(f"stages {list(s)} on ranks {groups[s]}" for s in order)
        )
    position, replica = {}, {}
    for p, stages in enumerate(order):
        for d, r in enumerate(groups[stages]):
            position[r], replica[r] = p, d
    return position, replica


def _align_hosts(
    per_rank: dict[int, tuple[pd.DataFrame, pd.DataFrame]], position: dict[int, int], replica: dict[int, int]
) -> tuple[float, str]:
    """Shift the ranks of other hosts onto rank 0's clock from the hand-offs (module docstring); returns the error
    bound in ms and how the clocks were aligned."""
    lanes = {(replica[r], position[r]): r for r in per_rank}
    total_half, worst = 0.0, 0.0
    for d in sorted({replica[r] for r in per_rank}):
        total_half = 0.0
        for p in range(1, max(position.values()) + 1):
            a, b = lanes[(d, p - 1)], lanes[(d, p)]
            low, high = _offset_bounds(per_rank[a][0], per_rank[b][0])
            if not (math.isfinite(low) and math.isfinite(high)):
                raise TraceError(
                    f"the traces of ranks {a} and {b} come from different hosts and share no hand-off to align their "
                    "clocks on"
                )
            offset = (low + high) / 2  # b's clock minus a's
            total_half += abs(high - low) / 2
            for r in [x for x in per_rank if replica[x] == d and position[x] >= p]:
                per_rank[r] = _shifted(*per_rank[r], -offset)
        worst = max(worst, total_half)
    return worst / 1e3, "several hosts: offsets from the hand-offs between adjacent stages (NTP-style midpoint)"


def _shifted(actions: pd.DataFrame, steps: pd.DataFrame, by_us: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A rank's actions and step spans with every time moved by ``by_us``."""
    moved = {c: actions[c] + by_us for c in ("start_us", "end_us", "compute_us")}
    return actions.assign(**moved), steps.assign(start_us=steps["start_us"] + by_us, end_us=steps["end_us"] + by_us)


def _offset_bounds(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float]:
    """The interval ``(low, high)`` of ``clock(b) - clock(a)`` (µs) the hand-offs allow between ranks ``a`` and
    ``b`` (``b`` holds the next stages): a forward on ``b`` starts after the previous stage's forward ended on ``a``
    (an upper bound), a backward on ``a`` after the next stage's backward ended on ``b`` (a lower bound). The starts
    are the compute's own (``compute_us``), not the rows' starts, which include the runtime's preparation before the
    input arrived. Infinite where no such hand-off exists."""
    key = ["step", "stage", "microbatch"]
    fwd = (
        a[a["kind"] == "F"]
        .assign(stage=lambda x: x["stage"] + 1)
        .merge(b[b["kind"] == "F"], on=key, suffixes=("_a", "_b"))
    )
    high = float((fwd["compute_us_b"] - fwd["end_us_a"]).min()) if len(fwd) else math.inf
    back = ["B", "I"]
    bwd = a[a["kind"].isin(back)].merge(
        b[b["kind"].isin(back)].assign(stage=lambda x: x["stage"] - 1), on=key, suffixes=("_a", "_b")
    )
    low = float((bwd["end_us_b"] - bwd["compute_us_a"]).max()) if len(bwd) else -math.inf
    return low, high


def _meta(
    df: pd.DataFrame,
    step_spans: pd.DataFrame,
    schedule: str | None,
    paths: list[Path],
    gpipe_labels: bool,
) -> dict[str, Any]:
    """The imported Timeline's meta (see :func:`read_profiler_traces`)."""
    compute = df[df["kind"].isin(COMPUTE_KINDS)]
    P = int(df["rank"].max()) + 1
    n_stages = int(compute["stage"].max()) + 1
    v = max(1, n_stages // P)
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {list(SCHEDULES)}")
    meta: dict[str, Any] = {
        "schedule": schedule,
        "P": P,
        "v": v,
        "m": int(compute["microbatch"].max()) + 1,
        "D": int(df["replica"].max()) + 1,
        "imported_from": "torch.profiler",
        "traces": [str(p) for p in paths],
        "time_source": df["time_source"].value_counts().to_dict(),
    }
    if schedule is None:
        meta["schedule"], meta["schedule_order_matched"] = (
            ("GPipe", True) if gpipe_labels else _infer_schedule(compute, P, v)
        )
    if len(step_spans):
        whole = step_spans.groupby("step").agg(start=("start_us", "min"), end=("end_us", "max"))
        whole = whole[whole.index.isin(df["step"].unique())]
        meta["first_step"] = int(whole.index.min())
        meta["step_ms"] = ((whole["end"] - whole["start"]) / 1e3).round(6).tolist()
        expected = list(range(int(whole.index.min()), int(whole.index.max()) + 1))
        if list(whole.index) != expected:
            meta["step_ms_steps"] = [int(s) for s in whole.index]
    return meta


def _infer_schedule(compute: pd.DataFrame, P: int, v: int) -> tuple[str, bool]:
    """The schedule whose per-rank order (:func:`~pipeswift_lab.core.schedule_orders.compute_orders`, read from torch)
    the first step's actions follow, and True; when none does (a custom CSV schedule), a schedule of the same kinds
    and placement, and False."""
    m = int(compute["microbatch"].max()) + 1
    first = compute[compute["step"] == compute["step"].min()].sort_values(["rank", "start_ms"], kind="stable")
    seen = {
        int(r): list(zip(g["kind"], g["stage"].astype(int), g["microbatch"].astype(int)))
        for r, g in first.groupby("rank")
    }
    for name in SCHEDULES:
        try:
            orders = compute_orders(P, m, name, v)
        except (ValueError, NotImplementedError, RuntimeError):
            continue
        if all([tuple(a) for a in orders.get(r, [])] == seen.get(r, []) for r in range(P)):
            return name, True
    kinds = set(compute["kind"])
    if v == 1:
        return "1F1B", False
    stages = compute.groupby("rank")["stage"].agg(lambda x: tuple(sorted(set(x))))
    v_shape = all(st == (r, 2 * P - 1 - r) for r, st in stages.items())
    if {"I", "W"} & kinds:
        return ("ZBVZeroBubble" if v_shape else "InterleavedZeroBubble"), False
    return "Interleaved1F1B", False
