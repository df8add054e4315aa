"""What a real run measured: :class:`RunResult` (timeline, step times, losses, JCT, final parameters)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ..core.display import html_card, text_card
from ..core.jct import JCT
from .rank.instrument import KINDS
from .rank.worker import RESULT_FILE

#: Columns of ``RunResult.checkpoints``: one row per committed checkpoint.
CHECKPOINT_COLUMNS = (
    "step",
    "path",
    "bytes",
    "largest_rank_bytes",
    "largest_rank_state_bytes",
    "save_ms",
    "blocking_ms",
    "kind",
    "attempt",
    "interval_steps",
)
#: Timeline columns, in the simulator's order.
TIMELINE_COLUMNS = ("step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms")


@dataclass(frozen=True, repr=False)
class RunResult:
    """One real pipeline run, measured.

    * ``timeline`` — a ``Timeline`` with ``source="measured"``: one row per executed compute
      action (``F``, ``B``, ``I``, ``W``) of every rank and step, and with ``D`` > 1 replicas
      one ``REDUCE_GRAD`` per stage and step (the gradient all-reduce, see
      :attr:`allreduce_ms`), in ms since the first step started (None when the run was not
      instrumented);
    * ``step_ms`` — every step, from the first rank starting it to the last rank finishing it
      (optimizer step included);
    * ``losses`` — per step, the mean of the micro-batch losses on the last stage;
    * ``jct`` — measured ``JCT``: ``assembly_s`` from launch to the first step (processes,
      imports, rendezvous, process groups, stage build), ``training_s`` the steps,
      ``cleanup_s`` gathering the final state and teardown until the result is back;
      ``queue_s`` is 0 (nothing waited for machines);
    * :meth:`state_dict` — the trained parameters gathered from every rank, with the keys of
      ``model.state_dict()``;
    * ``status`` — ``"completed"``, ``"preempted"`` (stopped by SIGTERM after a clean save at
      the same step on every rank) or ``"nonfinite"`` (carried by the ``RunError``);
    * ``segments`` — one row per configuration the job ran in (``P``, ``bounds``, steps, and the
      measured ``save_s``, ``teardown_s``, ``assembly_s``, ``restore_s`` of each change; see
      ``run(resize_at=...)``); ``rebalances`` — every rebalancing decision, taken or not;
    * ``first_step`` — the step the measured steps start from: 0, or the step the run (or its
      last restart) resumed from; ``step_ms``, ``losses`` and the timeline cover steps
      ``first_step`` .. the last step done;
    * ``checkpoints`` — one row per checkpoint committed (``step``, ``path``, ``bytes`` of its
      files, ``largest_rank_bytes`` the largest rank's files, ``largest_rank_state_bytes`` the
      tensors behind them, ``save_ms`` the slowest rank's DCP write, ``blocking_ms`` the
      stall of the step loop, ``kind`` periodic/auto/preempt/final, ``attempt``);
      ``checkpoint`` — the newest complete one (None without ``checkpoint_dir``);
    * ``restarts`` — workers restarted after a crash; ``steps_redone`` — steps trained again
      because they came after the checkpoint a restart resumed from; ``recovery_s`` — from the
      last step before each crash to the first step after it; ``restore_s`` — loading the
      checkpoint a ``resume_from`` run started from; ``skipped_steps`` — updates dropped at
      non-finite losses (``on_nonfinite="skip"``).

    With checkpoints, ``jct.cleanup_s`` is the final save plus teardown and
    ``jct.preemption_loss_s`` the periodic save stalls, the restore, the steps redone and the
    recovery; ``jct.total_s`` is the wall time from ``run()`` to its return.
    """

    timeline: object
    step_ms: tuple[float, ...]
    losses: tuple[float, ...]
    jct: JCT
    schedule: str
    P: int
    v: int
    m: int
    steps: int
    backend: str
    device_type: str
    instrumented: bool
    ranks: pd.DataFrame = field(compare=False, repr=False)
    meta: dict = field(default_factory=dict, compare=False, repr=False)
    _state: dict = field(default_factory=dict, compare=False, repr=False)
    status: str = "completed"
    first_step: int = 0
    checkpoints: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=list(CHECKPOINT_COLUMNS)), compare=False, repr=False
    )
    checkpoint: str | None = None
    restarts: int = 0
    steps_redone: int = 0
    recovery_s: float = 0.0
    restore_s: float = 0.0
    skipped_steps: tuple[int, ...] = ()
    segments: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(), compare=False, repr=False)
    rebalances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(), compare=False, repr=False)
    D: int = 1

    @property
    def allreduce_ms(self) -> float:
        """The measured gradient all-reduce across the D replicas (ms): per step its longest ``REDUCE_GRAD`` action
        (a stage's buckets, from the first one's launch to the last one's end, overlapping the last backward),
        the median over the steps after the first. NaN for D=1 or a run without a timeline."""
        if self.D == 1 or self.timeline is None:
            return float("nan")
        df = self.timeline.df
        reduce = df[df["kind"] == "REDUCE_GRAD"]
        per_step = (reduce["end_ms"] - reduce["start_ms"]).groupby(reduce["step"]).max()
        if per_step.empty:
            return float("nan")
        return float(per_step.iloc[1:].median() if len(per_step) > 1 else per_step.iloc[0])

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The final parameters and buffers from every rank, keyed and ordered like ``model.state_dict()`` (CPU tensors)."""
        return OrderedDict((k, self._state[k]) for k in self.meta["state_keys"])

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the final state into ``model`` (``load_state_dict``, strict) and return it."""
        model.load_state_dict(self.state_dict())
        return model

    @property
    def steady_step(self) -> int:
        """The step :attr:`steady_step_ms` is taken from: the median step after the first (see :data:`~pipeswift_lab.fidelity.comparison.MEASURED_STEP`)."""
        from ..simulation.steady import steady_step_index

        return self.first_step + steady_step_index(self.step_ms)

    @property
    def steady_step_ms(self) -> float:
        """The measured step: :data:`~pipeswift_lab.fidelity.comparison.MEASURED_STEP` (``compare``, ``calibrate`` and the report use it).

        The whole step (first rank starting it to the last rank finishing it, optimizer step
        included) of the median step after the first, which warms up allocators and
        communicators; for an even count the lower of the two middle steps, so the number is
        a step that happened and its Gantt chart can be shown. The only step if there is one.
        """
        return float(self.step_ms[self.steady_step - self.first_step])

    def step_stats(self, window=100) -> pd.DataFrame:
        """Step-time dispersion per window of ``window`` steps and for the whole run, each warm-up step excluded.

        One row per window (``window`` = 0, 1, ...; the last may be shorter) and a last row
        ``window="all"``: ``first_step``, ``last_step``, ``steps``, ``mean_ms``, ``std_ms``
        (sample std, NaN for one step), ``cv`` (std / mean), ``p50_ms``, ``p95_ms`` (linear
        interpolation), ``max_ms``. A run of several segments (a resize or a rebalance, see
        ``segments``) is tracked after every change: windows restart in each segment, each
        segment's first step (new workers warming up) is left out, every row names its
        ``segment`` and each segment gets its own ``"all"`` row before the whole run's
        (``segment`` = -1); "the 100-step mean and variance after every change" is one call.
        """
        from ..core.checks import check_int

        window = check_int("window", window, minimum=1)
        offset = self.first_step  # step numbers, for a run resumed at a later step
        steps = pd.Series(list(self.step_ms), index=range(offset, offset + len(self.step_ms)), dtype=float)
        starts = sorted(int(x) for x in self.segments["first_step"]) if len(self.segments) > 1 else [offset]

        def stats(name, part, segment):
            std = float(part.std(ddof=1)) if len(part) > 1 else float("nan")
            return {
                "segment": segment,
                "window": name,
                "first_step": int(part.index[0]),
                "last_step": int(part.index[-1]),
                "steps": len(part),
                "mean_ms": float(part.mean()),
                "std_ms": std,
                "cv": std / float(part.mean()),
                "p50_ms": float(part.median()),
                "p95_ms": float(part.quantile(0.95)),
                "max_ms": float(part.max()),
            }

        rows, kept = [], []
        for seg, begin in enumerate(starts):
            end = starts[seg + 1] if seg + 1 < len(starts) else offset + len(self.step_ms)
            part = steps.loc[begin : end - 1]
            part = part.iloc[1:] if len(part) > 1 else part
            if part.empty:
                continue
            kept.append(part)
            rows += [stats(k, part.iloc[i : i + window], seg) for k, i in enumerate(range(0, len(part), window))]
            if len(starts) > 1:
                rows.append(stats("all", part, seg))
        rows.append(stats("all", pd.concat(kept), -1 if len(starts) > 1 else 0))
        out = pd.DataFrame(rows)
        out["window"] = out["window"].astype(object)
        return out

    @property
    def measured_steps(self) -> range:
        """The step numbers ``step_ms`` and ``losses`` describe: ``first_step`` onwards."""
        return range(self.first_step, self.first_step + len(self.step_ms))

    @property
    def df(self) -> pd.DataFrame:
        """One row per measured step: ``step``, ``step_ms``, ``loss``."""
        return pd.DataFrame(
            {"step": list(self.measured_steps), "step_ms": list(self.step_ms), "loss": list(self.losses)}
        )

    @property
    def assembly_phases(self) -> pd.DataFrame:
        """The measured assembly, phase by phase (``phase``, ``seconds``): the milestones of the slowest rank."""
        return pd.DataFrame(self.meta["assembly_phases"], columns=["phase", "seconds"])

    def plot(self, ax=None, step=None):
        """Gantt chart of the measured timeline (one step, by default the median-time one after the first). Returns the Axes."""
        if not self.instrumented:
            raise ValueError("this run was not instrumented (instrument=False): there is no timeline to plot")
        from ..simulation.steady import pick_step

        step = pick_step(self, step)
        return self.timeline.plot(ax=ax, step=step)

    def _summary(self) -> dict:
        out = {"schedule": self.schedule, "P": self.P, "v": self.v, "m": self.m, "steps": self.steps}
        if self.D > 1:
            out["D"] = self.D
        if self.status != "completed" or self.first_step:
            out.update(status=self.status, first_step=self.first_step)
        out.update({"device": f"{self.device_type} ({self.backend})", "steady_step_ms": self.steady_step_ms})
        if self.D > 1:
            out["allreduce_ms"] = self.allreduce_ms
        out.update(
            {
                "final_loss": self.losses[-1] if self.losses else float("nan"),
                "jct_total_s": self.jct.total_s,
                "assembly_s": self.jct.assembly_s,
                "training_s": self.jct.training_s,
                "cleanup_s": self.jct.cleanup_s,
            }
        )
        if self.checkpoint is not None or self.jct.preemption_loss_s:
            out.update(
                preemption_loss_s=self.jct.preemption_loss_s,
                checkpoints=len(self.checkpoints),
                checkpoint=self.checkpoint,
            )
        if self.restarts:
            out.update(restarts=self.restarts, steps_redone=self.steps_redone, recovery_s=self.recovery_s)
        if self.skipped_steps:
            out.update(skipped_steps=len(self.skipped_steps))
        return out

    def _repr_html_(self) -> str:
        from ..core.display import noise_warning

        status = "" if self.status == "completed" else f" ({self.status} at step {self.first_step + len(self.step_ms)})"
        cv = float(self.step_stats().iloc[-1]["cv"]) if len(self.step_ms) > 2 else float("nan")
        return html_card(
            f"RunResult: {self.schedule}, P={self.P}, m={self.m}, {self.steps} steps{status}", self._summary(), self.df
        ) + noise_warning(cv, "the measured step after the warm-up")

    def __str__(self) -> str:
        return text_card(f"RunResult {self.schedule} P={self.P} m={self.m}", self._summary())

    __repr__ = __str__


def _timeline_frame(ranks: list[dict], t0_ns: int) -> pd.DataFrame:
    frames = []
    for payload in ranks:
        rows = payload["records"]
        if len(rows) == 0:
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
                }
            )
        )
    if not frames:
        df = pd.DataFrame({c: pd.Series(dtype="int64") for c in TIMELINE_COLUMNS[:4]})
        df["kind"] = pd.Series(dtype=object)
        df["start_ms"] = pd.Series(dtype="float64")
        df["end_ms"] = pd.Series(dtype="float64")
        df["replica"] = pd.Series(dtype="int64")
        return df
    df = pd.concat(frames, ignore_index=True)
    for col in ("step", "rank", "stage", "microbatch", "replica"):
        df[col] = df[col].astype("int64")
    df["kind"] = df["kind"].astype(object)
    df = df.sort_values(["step", "replica", "rank", "start_ms"], kind="stable").reset_index(drop=True)
    return df[list(TIMELINE_COLUMNS) + ["replica"]]


def _history_terms(history: dict) -> dict:
    """Restarts, steps redone, their time and the recovery time, from what every attempt logged.

    ``history["steps"]`` holds ``(attempt, step, start_ns, end_ns)`` of every step the last
    rank finished, across attempts; ``history["attempts"]`` the step each attempt resumed
    from; ``history["checkpoints"]`` every committed save with its attempt and ``end_ns``.
    Attempt ``a``'s execution of step ``s`` was lost when the next attempt that started
    resumed at a step ``<= s``; a restart's recovery is the gap from the end of the last step
    or save before it to the first step after it (detection, teardown, re-assembly, restore),
    so a save just before a crash is counted once, as a save stall.
    """
    attempts = history.get("attempts", {})
    by_attempt: dict[int, list] = {}
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


def build_result(
    spec, gathered: dict, launch_ns: int, end_ns: int, launched_by: str = "run", history: dict | None = None
) -> RunResult:
    """Assemble a :class:`RunResult` from what rank 0 gathered (``result.pt``) and what every attempt logged.

    ``launch_ns`` is the wall-clock launch (``run`` entry; under torchrun the earliest rank's
    process start) and ``end_ns`` when the result was complete (``run`` return; under
    torchrun rank 0 after the gather). ``history`` is :func:`~pipeswift_lab.runner.job.read_history`.
    """
    from ..simulation.timeline import Timeline

    history = history or {}
    ranks = sorted(gathered["ranks"], key=lambda p: p["rank"])
    first = ranks[0]
    first_step = int(first.get("first_step", 0))
    n = min(len(p["step_start_ns"]) for p in ranks)
    starts = [min(p["step_start_ns"][k] for p in ranks) for k in range(n)]
    ends = [max(p["step_end_ns"][k] for p in ranks) for k in range(n)]
    ready_ns = max(p["ready_ns"] for p in ranks)
    t0 = starts[0] if starts else ready_ns
    t_end = ends[-1] if ends else t0
    last = next(p for p in ranks if p["rank"] == spec.plan.last_rank)
    state = {}
    for p in ranks:
        if p.get("replica", 0) == 0:  # the replicas hold the same parameters (DDP keeps them equal)
            state.update(p["state"])
    missing = [k for k in spec.state_keys if k not in state]
    if missing:
        raise RuntimeError(f"the gathered state lacks {len(missing)} keys of the model, e.g. {missing[:3]}")

    def latest(key):
        values = [p[key] for p in ranks if p.get(key) is not None]
        return max(values) if values else None

    attempts = history.get("attempts", {})
    terms = _history_terms(history)
    restored = [p.get("restored") for p in ranks if p.get("restored")]
    attempt0 = attempts.get(0, {})
    restore0_s = (
        attempt0.get("restore_ms", 0.0) / 1e3
        if attempts
        else (max(r["restore_ms"] for r in restored) / 1e3 if restored else 0.0)
    )
    first_start = min([t0] + [start for _, _, start, _ in history.get("steps", [])])
    checkpoints = pd.DataFrame(history.get("checkpoints", []), columns=list(CHECKPOINT_COLUMNS))
    final_kinds = checkpoints["kind"].isin(["final", "preempt"]) if len(checkpoints) else pd.Series(dtype=bool)
    periodic_stall_s = float(checkpoints.loc[~final_kinds, "blocking_ms"].sum() / 1e3) if len(checkpoints) else 0.0

    milestones = [
        ("launch", launch_ns),
        ("processes started", latest("process_start_ns")),
        ("runner entered (python + torch imported)", latest("entered_ns")),
        ("process groups and stages ready", latest("ready_ns")),
        ("first step started", t0),
    ]
    milestones = [(name, ns) for name, ns in milestones if ns is not None]
    phases = [(f"{a} -> {b}", (nb - na) / 1e9) for (a, na), (b, nb) in zip(milestones, milestones[1:])]
    wall_s = (end_ns - launch_ns) / 1e9
    assembly_s = max(0.0, (first_start - launch_ns) / 1e9 - restore0_s)
    cleanup_s = (end_ns - t_end) / 1e9
    preemption_s = restore0_s + periodic_stall_s + terms["redone_s"] + terms["recovery_s"]
    training_s = max(0.0, wall_s - assembly_s - cleanup_s - preemption_s)
    jct = JCT(
        queue_s=0.0,
        assembly_s=assembly_s,
        training_s=training_s,
        cleanup_s=cleanup_s,
        preemption_loss_s=preemption_s,
        label=f"measured {spec.plan.schedule} P={spec.P}" + (f" D={spec.D}" if spec.D > 1 else "") + f" m={spec.m}",
    )
    ranks_df = pd.DataFrame(
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
                "ready_ms": (p["ready_ns"] - t0) / 1e6,
            }
            for p in ranks
        ]
    )
    df = _timeline_frame(ranks, t0) if spec.instrument else None
    if df is not None:
        df = df[df["step"] < first_step + n].reset_index(drop=True)
    status = next((p["status"] for p in ranks if p.get("status", "completed") != "completed"), "completed")
    standing = next((p.get("checkpoint") for p in ranks if p.get("checkpoint")), None)
    if standing is None and len(checkpoints):
        standing = str(checkpoints["path"].iloc[-1])
    if standing is None and restored:
        standing = restored[0]["path"]
    meta = {
        "run": "measured",
        "launched_by": launched_by,
        "state_keys": tuple(spec.state_keys),
        "bounds": spec.plan.bounds,
        "stage_to_rank": spec.plan.stage_to_rank,
        "clock": "wall clock (time.time_ns) via a per-rank perf_counter offset",
        "t0_ns": t0,
        "launch_ns": launch_ns,
        "end_ns": end_ns,
        "rebalances": list(first.get("rebalances") or []),
        "new_bounds": first.get("new_bounds"),
        "step_start_ms": tuple((x - t0) / 1e6 for x in starts),
        "assembly_phases": phases,
        "nonfinite": last.get("nonfinite"),
        "resumed_from": restored[0]["path"] if restored else None,
        "rng_restored": bool(restored and restored[0]["rng_restored"]),
        "restore_bytes": max((r["bytes"] for r in restored), default=0),
        "redone_s": terms["redone_s"],
        "checkpoint_interval_steps": next((p.get("interval_steps") for p in ranks if p.get("interval_steps")), None),
        "job": spec.job,
        **spec.meta,
    }
    timeline = None
    if df is not None:
        timeline = Timeline(
            df,
            source="measured",
            meta={
                "schedule": spec.plan.schedule,
                "P": spec.P,
                "D": spec.D,
                "v": spec.plan.v,
                "m": spec.m,
                "stage_to_rank": list(spec.plan.stage_to_rank),
                "step_start_ms": list(meta["step_start_ms"]),
            },
        )
    return RunResult(
        timeline=timeline,
        step_ms=tuple((e - b) / 1e6 for b, e in zip(starts, ends)),
        losses=tuple(last["losses"][:n]),
        jct=jct,
        schedule=spec.plan.schedule,
        P=spec.P,
        v=spec.plan.v,
        m=spec.m,
        steps=spec.steps,
        backend=spec.backend,
        device_type=spec.device_type,
        instrumented=spec.instrument,
        ranks=ranks_df,
        meta=meta,
        _state=state,
        status=status,
        first_step=first_step,
        checkpoints=checkpoints,
        checkpoint=standing,
        restarts=terms["restarts"],
        steps_redone=terms["steps_redone"],
        recovery_s=terms["recovery_s"],
        restore_s=restore0_s,
        skipped_steps=tuple(first.get("skipped_steps", ())),
        D=spec.D,
    )


def read_gathered(out_dir) -> dict:
    """Load ``result.pt`` written by rank 0 into ``out_dir``."""
    path = Path(out_dir) / RESULT_FILE
    gathered = torch.load(path, weights_only=True)
    if not isinstance(gathered, dict) or gathered.get("format") != "pipeswift_lab.run":
        raise ValueError(f"{str(path)!r} is not a pipeswift_lab run result")
    return gathered


def load_result(out_dir, spec=None) -> RunResult:
    """The :class:`RunResult` of a ``torchrun ... -m pipeswift_lab.runner SPEC --out DIR`` run, from ``DIR``.

    ``spec`` defaults to the copy of the spec the runner left in ``DIR``. Under torchrun the
    launch is taken as the earliest rank's process start (torchrun's own start-up is not seen)
    and the end as rank 0 finishing the gather.
    """
    from .spec import load_spec

    out_dir = Path(out_dir)
    spec = load_spec(out_dir / "spec.pkl") if spec is None else spec
    gathered = read_gathered(out_dir)
    starts = [p["process_start_ns"] or p["entered_ns"] for p in gathered["ranks"]]
    return build_result(spec, gathered, launch_ns=min(starts), end_ns=gathered["gathered_ns"], launched_by="torchrun")
