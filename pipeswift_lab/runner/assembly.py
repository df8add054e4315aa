"""A :class:`~pipeswift_lab.runner.result.RunResult` assembled from what the workers left in the run directory.

Rank 0 gathers every rank's measurements into ``result.pt`` (:func:`read_gathered`); every attempt of the run
logs its steps, checkpoints and restores (:func:`read_history`). :func:`build_result` puts them on one clock and
measures the JCT terms: assembly (launch to the first step), training, cleanup (the final save and teardown) and
preemption loss (periodic save stalls, steps redone, recovery and restore). :func:`read_run_dir` does the same for
the directory of a ``torchrun ... -m pipeswift_lab.runner SPEC --out DIR`` run. The file names and columns are
:mod:`.run_files`'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.jct import JCT
from ..core.schedule import schedule_meta
from .result import RunResult
from .run_files import (
    ATTEMPT_GLOB,
    CHECKPOINT_COLUMNS,
    CHECKPOINTS_LOG,
    KINDS,
    RESULT_FILE,
    RESULT_FORMAT,
    SPEC_FILE,
    STEPS_LOG,
    TIMELINE_COLUMNS,
)

if TYPE_CHECKING:
    from ..simulation.timeline import Timeline
    from .spec import RunSpec

__all__ = ["build_result", "read_run_dir", "read_gathered", "read_history", "history_terms", "timeline_frame"]

#: What one rank reported (``train``'s payload): step stamps, losses, state, restores, checkpoints.
Payload = dict[str, Any]


def read_history(run_dir: Path) -> dict[str, Any]:
    """What every attempt left in ``run_dir``: ``steps`` (attempt, step, start_ns, end_ns), ``checkpoints``,
    ``attempts`` (by number: where each one resumed from)."""
    steps = []
    if (run_dir / STEPS_LOG).exists():
        for line in (run_dir / STEPS_LOG).read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                steps.append(tuple(int(x) for x in parts))
    checkpoints = []
    if (run_dir / CHECKPOINTS_LOG).exists():
        checkpoints = [
            json.loads(line) for line in (run_dir / CHECKPOINTS_LOG).read_text().splitlines() if line.strip()
        ]
    attempts = {}
    for path in run_dir.glob(ATTEMPT_GLOB):
        info = json.loads(path.read_text())
        attempts[int(info["attempt"])] = info
    return {"steps": steps, "checkpoints": checkpoints, "attempts": attempts}


def read_gathered(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Load ``result.pt`` written by rank 0 into ``out_dir``; returns its dict (``format``, ``ranks``,
    ``gathered_ns``)."""
    path = Path(out_dir) / RESULT_FILE
    gathered = torch.load(path, weights_only=True)
    if not isinstance(gathered, dict) or gathered.get("format") != RESULT_FORMAT:
        raise ValueError(f"{str(path)!r} is not a pipeswift_lab run result")
    return gathered


def read_run_dir(out_dir: str | os.PathLike[str], spec: RunSpec | None = None) -> RunResult:
    """The :class:`RunResult` of a ``torchrun ... -m pipeswift_lab.runner SPEC --out DIR`` run, from ``DIR``.

    ``spec`` defaults to the copy of the spec the runner left in ``DIR``. Under torchrun the
    launch is taken as the earliest rank's process start (torchrun's own start-up is not seen)
    and the end as rank 0 finishing the gather.
    """
    from .spec import load_spec

    out_dir = Path(out_dir)
    spec = load_spec(out_dir / SPEC_FILE) if spec is None else spec
    gathered = read_gathered(out_dir)
    starts = [p["process_start_ns"] or p["entered_ns"] for p in gathered["ranks"]]
    return build_result(
        spec, gathered, launch_ns=min(starts), end_ns=gathered["gathered_ns"], launched_by="torchrun", out_dir=out_dir
    )


def representative(payload: Payload) -> bool:
    """Whether ``payload`` is its pipeline rank's representative in the timeline: the process at FSDP rank 0 and
    tensor-parallel rank 0 of its replica (the others run the same actions on their shards)."""
    return payload.get("fsdp_rank", 0) == 0 and payload.get("tp_rank", 0) == 0


def last_stage_process(ranks: list[Payload], last_rank: int) -> Payload:
    """The payload of the process that reports the losses: replica 0's representative of pipeline rank
    ``last_rank``."""
    return next(
        p for p in ranks if p.get("pp_rank", p["rank"]) == last_rank and p.get("replica", 0) == 0 and representative(p)
    )


def timeline_frame(ranks: list[Payload], t0_ns: int) -> pd.DataFrame:
    """Every rank's recorded actions as one timeline table (:data:`TIMELINE_COLUMNS`, ``replica`` and ``bytes``, what
    each moved: 0 for compute and for records without the column), in ms since ``t0_ns``, sorted by step, replica,
    rank and start."""
    frames = []
    for payload in ranks:
        rows = payload["records"]
        if len(rows) == 0 or not representative(payload):
            continue
        rows = rows.to(torch.int64)
        frames.append(
            pd.DataFrame(
                {
                    "step": rows[:, 0].numpy(),
                    "rank": payload.get("pp_rank", payload["rank"]),
                    "stage": rows[:, 2].numpy(),
                    "microbatch": rows[:, 3].numpy(),
                    "kind": [KINDS[k] for k in rows[:, 1].tolist()],
                    "start_ms": (rows[:, 4] - t0_ns).numpy() / 1e6,
                    "end_ms": (rows[:, 5] - t0_ns).numpy() / 1e6,
                    "replica": payload.get("replica", 0),
                    "bytes": rows[:, 6].numpy() if rows.shape[1] > 6 else 0,
                }
            )
        )
    if not frames:
        df = pd.DataFrame({c: pd.Series(dtype="int64") for c in TIMELINE_COLUMNS[:4]})
        df["kind"] = pd.Series(dtype=object)
        df["start_ms"] = pd.Series(dtype="float64")
        df["end_ms"] = pd.Series(dtype="float64")
        df["replica"] = pd.Series(dtype="int64")
        df["bytes"] = pd.Series(dtype="int64")
        return df
    df = pd.concat(frames, ignore_index=True)
    for col in ("step", "rank", "stage", "microbatch", "replica", "bytes"):
        df[col] = df[col].astype("int64")
    df["kind"] = df["kind"].astype(object)
    df = df.sort_values(["step", "replica", "rank", "start_ms"], kind="stable").reset_index(drop=True)
    return df[list(TIMELINE_COLUMNS) + ["replica", "bytes"]]


def history_terms(history: dict[str, Any]) -> dict[str, Any]:
    """Restarts, steps redone, their time and the recovery time, from what every attempt logged.

    ``history["steps"]`` holds ``(attempt, step, start_ns, end_ns)`` of every step the last
    rank finished, across attempts; ``history["attempts"]`` the step each attempt resumed
    from; ``history["checkpoints"]`` every committed save with its attempt and ``end_ns``.
    Attempt ``a``'s execution of step ``s`` was lost when the next attempt that started
    resumed at a step ``<= s``; a restart's recovery is the gap from the end of the last step
    or save before it to the first step after it (detection, teardown, re-assembly, restore),
    so a save just before a crash is counted once, as a save stall. Returns ``restarts``,
    ``steps_redone``, ``redone_s`` and ``recovery_s``.
    """
    attempts = history.get("attempts", {})
    by_attempt: dict[int, list[tuple[int, int, int]]] = {}
    for attempt, step, start, end in history.get("steps", []):
        by_attempt.setdefault(attempt, []).append((step, start, end))
    saves_end: dict[int, int] = {}
    for record in history.get("checkpoints", []):
        if record.get("end_ns") is not None:
            saves_end[record["attempt"]] = max(saves_end.get(record["attempt"], 0), int(record["end_ns"]))
    restarts = max(set(attempts) | set(by_attempt)) if (attempts or by_attempt) else 0
    redone, redone_s, recovery_s, last_end = 0, 0.0, 0.0, None
    for n in range(restarts + 1):
        rows = sorted(by_attempt.get(n, []), key=lambda r: r[1])
        later = [k for k in sorted(attempts) if k > n]
        if later:
            resumed_at = int(attempts[later[0]].get("first_step", 0))
            lost = [(start, end) for step, start, end in rows if step >= resumed_at]
            redone += len(lost)
            redone_s += sum((end - start) / 1e9 for start, end in lost)
        if rows:
            if n > 0 and last_end is not None:
                recovery_s += max(0, rows[0][1] - last_end) / 1e9
            last_end = rows[-1][2]
        if n in saves_end:
            last_end = max(last_end or 0, saves_end[n])
    return {"restarts": restarts, "steps_redone": redone, "redone_s": redone_s, "recovery_s": recovery_s}


@dataclass(frozen=True, kw_only=True)
class _Clock:
    """The steps every rank finished, on the wall clock."""

    first_step: int
    """The step the measured steps start from (0, or the step the last attempt resumed from)."""
    starts: list[int]
    """Per step, the first rank starting it (ns)."""
    ends: list[int]
    """Per step, the last rank finishing it (ns)."""
    t0: int
    """The first step's start (ns); when no step ran, the moment the last rank was ready."""

    @property
    def n(self) -> int:
        """Steps every rank finished."""
        return len(self.starts)

    @property
    def t_end(self) -> int:
        """The last step's end (ns); ``t0`` when no step ran."""
        return self.ends[-1] if self.ends else self.t0


@dataclass(frozen=True, kw_only=True)
class _Recovery:
    """What the run's checkpoints, restores and restarts cost, from every attempt's logs."""

    checkpoints: pd.DataFrame
    """One row per committed checkpoint (:data:`CHECKPOINT_COLUMNS`)."""
    restored: list[dict[str, Any]]
    """What each rank restored when the run started from a checkpoint (empty otherwise)."""
    restore0_s: float
    """Loading the checkpoint the first attempt started from (s)."""
    periodic_stall_s: float
    """The step loop's stalls in the saves that are neither final nor preemption saves (s)."""
    first_start_ns: int
    """The first step any attempt started (ns)."""
    terms: dict[str, Any]
    """:func:`history_terms`: restarts, steps redone, their time, the recovery time."""


def build_result(
    spec: RunSpec,
    gathered: dict[str, Any],
    launch_ns: int,
    end_ns: int,
    launched_by: str = "run",
    history: dict[str, Any] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> RunResult:
    """Assemble a :class:`RunResult` from what rank 0 gathered (``result.pt``) and what every attempt logged.

    ``launch_ns`` is the wall-clock launch (``run`` entry; under torchrun the earliest rank's
    process start) and ``end_ns`` when the result was complete (``run`` return; under
    torchrun rank 0 after the gather). ``history`` is :func:`read_history`. ``out_dir`` is the run directory, where
    the ranks wrote the final shards (``run()``'s is temporary: they are moved out of it).
    """
    ranks = sorted(gathered["ranks"], key=lambda p: p["rank"])
    clock = _clock(ranks)
    recovery = _recovery(history or {}, ranks, clock)
    last = last_stage_process(ranks, spec.plan.last_rank)
    meta = _meta(spec, ranks, clock, recovery, launch_ns, end_ns, launched_by)
    return RunResult(
        timeline=_timeline(spec, ranks, clock, meta),
        step_ms=tuple((e - b) / 1e6 for b, e in zip(clock.starts, clock.ends)),
        losses=tuple(last["losses"][: clock.n]),
        jct=_jct(spec, clock, recovery, launch_ns, end_ns),
        schedule=spec.plan.schedule,
        P=spec.P,
        v=spec.plan.v,
        m=spec.m,
        steps=spec.steps,
        backend=spec.backend,
        device_type=spec.device_type,
        instrumented=spec.instrument,
        ranks=_ranks_table(ranks, clock),
        meta=meta,
        _state=_final_state(spec, ranks, Path(out_dir) if out_dir is not None else None, move=launched_by == "run"),
        status=next((p["status"] for p in ranks if p.get("status", "completed") != "completed"), "completed"),
        first_step=clock.first_step,
        checkpoints=recovery.checkpoints,
        checkpoint=_standing_checkpoint(ranks, recovery),
        restarts=recovery.terms["restarts"],
        steps_redone=recovery.terms["steps_redone"],
        recovery_s=recovery.terms["recovery_s"],
        restore_s=recovery.restore0_s,
        skipped_steps=tuple(ranks[0].get("skipped_steps", ())),
        D=spec.D,
    )


def _clock(ranks: list[Payload]) -> _Clock:
    n = min(len(p["step_start_ns"]) for p in ranks)
    starts = [min(p["step_start_ns"][k] for p in ranks) for k in range(n)]
    ends = [max(p["step_end_ns"][k] for p in ranks) for k in range(n)]
    t0 = starts[0] if starts else max(p["ready_ns"] for p in ranks)
    return _Clock(first_step=int(ranks[0].get("first_step", 0)), starts=starts, ends=ends, t0=t0)


def _final_state(spec: RunSpec, ranks: list[Payload], out_dir: Path | None, move: bool) -> Mapping[str, torch.Tensor]:
    """The trained parameters and buffers: the shards replica 0's ranks wrote into ``out_dir``
    (:class:`~pipeswift_lab.runner.final_weights.FinalWeights`, read on first use; moved out of a temporary run
    directory when ``move``), every name of a shared parameter (tied weights) pointing to one tensor, as in the
    model. Empty when no rank wrote a shard."""
    from .final_weights import keep_final_weights
    from .stages.tied import parameter_names

    shards = sorted({p["final_shard"] for p in ranks if p.get("final_shard")})
    if out_dir is None or not shards:
        return {}
    return keep_final_weights(out_dir, spec.state_keys, parameter_names(spec.model), shards, move)


def _recovery(history: dict[str, Any], ranks: list[Payload], clock: _Clock) -> _Recovery:
    attempts = history.get("attempts", {})
    restored = [p["restored"] for p in ranks if p.get("restored")]
    if attempts:
        restore0_s = attempts.get(0, {}).get("restore_ms", 0.0) / 1e3
    else:
        restore0_s = max(r["restore_ms"] for r in restored) / 1e3 if restored else 0.0
    checkpoints = pd.DataFrame(history.get("checkpoints", []), columns=list(CHECKPOINT_COLUMNS))
    stall_s = 0.0
    if len(checkpoints):
        final_kinds = checkpoints["kind"].isin(["final", "preempt"])
        stall_s = float(checkpoints.loc[~final_kinds, "blocking_ms"].sum() / 1e3)
    return _Recovery(
        checkpoints=checkpoints,
        restored=restored,
        restore0_s=restore0_s,
        periodic_stall_s=stall_s,
        first_start_ns=min([clock.t0] + [start for _, _, start, _ in history.get("steps", [])]),
        terms=history_terms(history),
    )


def _jct(spec: RunSpec, clock: _Clock, recovery: _Recovery, launch_ns: int, end_ns: int) -> JCT:
    """The measured JCT: assembly up to the first step (less the restore), cleanup after the last, preemption loss
    (restore, periodic save stalls, steps redone, recovery) and the training time that remains."""
    wall_s = (end_ns - launch_ns) / 1e9
    assembly_s = max(0.0, (recovery.first_start_ns - launch_ns) / 1e9 - recovery.restore0_s)
    cleanup_s = (end_ns - clock.t_end) / 1e9
    terms = recovery.terms
    preemption_s = recovery.restore0_s + recovery.periodic_stall_s + terms["redone_s"] + terms["recovery_s"]
    return JCT(
        queue_s=0.0,
        assembly_s=assembly_s,
        training_s=max(0.0, wall_s - assembly_s - cleanup_s - preemption_s),
        cleanup_s=cleanup_s,
        preemption_loss_s=preemption_s,
        label=f"measured {spec.plan.schedule} P={spec.P}" + (f" D={spec.D}" if spec.D > 1 else "") + f" m={spec.m}",
    )


def _assembly_phases(ranks: list[Payload], clock: _Clock, launch_ns: int) -> list[tuple[str, float]]:
    """The assembly's milestones of the slowest rank, as ``(phase, seconds)`` between consecutive ones."""

    def latest(key: str) -> int | None:
        values = [p[key] for p in ranks if p.get(key) is not None]
        return max(values) if values else None

    milestones = [
        ("launch", launch_ns),
        ("processes started", latest("process_start_ns")),
        ("runner entered (python, torch and the spec's model code loaded)", latest("entered_ns")),
        ("process groups and stages ready", latest("ready_ns")),
        ("first step started", clock.t0),
    ]
    known = [(name, ns) for name, ns in milestones if ns is not None]
    return [(f"{a} -> {b}", (nb - na) / 1e9) for (a, na), (b, nb) in zip(known, known[1:])]


def _meta(
    spec: RunSpec,
    ranks: list[Payload],
    clock: _Clock,
    recovery: _Recovery,
    launch_ns: int,
    end_ns: int,
    launched_by: str,
) -> dict[str, Any]:
    first, restored = ranks[0], recovery.restored
    last = last_stage_process(ranks, spec.plan.last_rank)
    return {
        "run": "measured",
        "launched_by": launched_by,
        "state_keys": tuple(spec.state_keys),
        "bounds": spec.plan.bounds,
        "stage_to_rank": spec.plan.stage_to_rank,
        "clock": "wall clock (time.time_ns) via a per-rank perf_counter offset",
        "t0_ns": clock.t0,
        "launch_ns": launch_ns,
        "end_ns": end_ns,
        "rebalances": list(first.get("rebalances") or []),
        "new_bounds": first.get("new_bounds"),
        "step_start_ms": tuple((x - clock.t0) / 1e6 for x in clock.starts),
        "assembly_phases": _assembly_phases(ranks, clock, launch_ns),
        "nonfinite": last.get("nonfinite"),
        "resumed_from": restored[0]["path"] if restored else None,
        "rng_restored": bool(restored and restored[0]["rng_restored"]),
        "restore_bytes": max((r["bytes"] for r in restored), default=0),
        "restore_read": restored[0].get("read") if restored else None,
        "redone_s": recovery.terms["redone_s"],
        "checkpoint_interval_steps": next((p.get("interval_steps") for p in ranks if p.get("interval_steps")), None),
        "job": spec.job,
        "tied": [{"names": g.names, "stages": g.stages} for g in spec.tied],
        "memory_measured": [
            {
                "replica": p.get("replica", 0),
                "rank": p.get("pp_rank", p["rank"]),
                "fsdp": p.get("fsdp_rank", 0),
                "tp": p.get("tp_rank", 0),
                "process": p["rank"],
                **p["memory"],
            }
            for p in ranks
            if p.get("memory")
        ],
        **spec.meta,
    }


def _ranks_table(ranks: list[Payload], clock: _Clock) -> pd.DataFrame:
    """One row per rank: where it ran, when it was ready (ms after the first step started), its resident size before
    it read the spec and its resident high-water over assembly and steps (bytes; None without ``/proc``)."""
    return pd.DataFrame(
        [
            {
                "rank": p["rank"],
                "pp_rank": p.get("pp_rank", p["rank"]),
                "replica": p.get("replica", 0),
                "pid": p["pid"],
                "host": p["host"],
                "device": p["device"],
                "stages": tuple(p["stages"]),
                "threads": p["threads"],
                "ready_ms": (p["ready_ns"] - clock.t0) / 1e6,
                "resident_start_bytes": p.get("resident_start_bytes"),
                "resident_peak_bytes": p.get("resident_peak_bytes"),
            }
            for p in ranks
        ]
    )


def _timeline(spec: RunSpec, ranks: list[Payload], clock: _Clock, meta: dict[str, Any]) -> Timeline | None:
    """The measured ``Timeline`` of the steps every rank finished (None when the run was not instrumented)."""
    if not spec.instrument:
        return None
    from ..simulation.timeline import Timeline

    df = timeline_frame(ranks, clock.t0)
    df = df[df["step"] < clock.first_step + clock.n].reset_index(drop=True)
    timeline_meta = {
        **schedule_meta(spec.plan.schedule),
        "P": spec.P,
        "D": spec.D,
        "v": spec.plan.v,
        "m": spec.m,
        "stage_to_rank": list(spec.plan.stage_to_rank),
        "step_start_ms": list(meta["step_start_ms"]),
    }
    return Timeline(df, source="measured", meta=timeline_meta)


def _standing_checkpoint(ranks: list[Payload], recovery: _Recovery) -> str | None:
    """The newest complete checkpoint: one a rank reported, else the last one logged, else the one restored."""
    standing = next((p.get("checkpoint") for p in ranks if p.get("checkpoint")), None)
    committed = [p for p in recovery.checkpoints["path"] if isinstance(p, str)] if len(recovery.checkpoints) else []
    if standing is None and committed:
        standing = committed[-1]
    if standing is None and recovery.restored:
        standing = recovery.restored[0]["path"]
    return standing
