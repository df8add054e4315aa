"""Cost models of the JCT terms outside the training steps: queue, assembly, cleanup, preemption.

The planner (:mod:`pipeswift_lab.planning.planner`) adds these to the simulated training term.
Every default is stated here and every model can be calibrated or replaced:

* :class:`Availability` — free GPUs over time, a step function; the queue term is the
  wait until a configuration's GPUs are free.
* :class:`AssemblyModel` — start-up cost from launch to the first step, by stages and
  replicas; :meth:`AssemblyModel.calibrate` fits it to the runner's measured ``jct.assembly_s``.
* :class:`CheckpointModel` — what a periodic checkpoint stalls training (a staging copy when saves are
  asynchronous), a full waited save (the final one is cleanup, a resize pays one), a restore, and the
  shortest interval between saves.
* :func:`young_daly_interval_s` and :func:`preemption_loss_s` — the checkpoint interval
  τ ≈ √(2·C·MTBF) (Young, *A first order approximation to the optimum checkpoint
  interval*, CACM 1974; Daly, *A higher order estimate of the optimum checkpoint
  interval for restart dumps*, FGCS 2006) and the expected time lost to preemptions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import check_flag, check_int, check_time


@dataclass(frozen=True)
class Availability:
    """Free GPUs over time: ``points`` are ``(seconds_from_now, free_gpus)`` pairs, a step function.

    ``Availability([(0, 16), (7200, 32)])`` means 16 GPUs are free now and 32 from two
    hours on. After the last point the last count holds.
    """

    points: tuple[tuple[float, int], ...]

    def __init__(self, points: Iterable[Sequence[float]] | Availability) -> None:
        if isinstance(points, Availability):
            points = points.points
        try:
            pairs = [tuple(p) for p in points]
        except TypeError:
            raise TypeError(
                f"availability must be (seconds_from_now, free_gpus) pairs, e.g. [(0, 16), (7200, 32)]; got {points!r}"
            ) from None
        if not pairs:
            raise ValueError(
                "availability is empty; give at least one (seconds_from_now, free_gpus) pair, e.g. [(0, 16)]"
            )
        checked = []
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise ValueError(f"availability[{i}]={pair!r} is not a (seconds_from_now, free_gpus) pair")
            t = check_time(f"availability[{i}] seconds_from_now", pair[0])
            n = check_int(f"availability[{i}] free_gpus", pair[1], minimum=0)
            checked.append((t, n))
        times = [t for t, _ in checked]
        if times != sorted(times) or len(set(times)) != len(times):
            raise ValueError(f"availability times must be strictly increasing; got {times}")
        if times[0] != 0:
            raise ValueError(
                f"availability must start at seconds_from_now=0 (what is free now); it starts at {times[0]}"
            )
        object.__setattr__(self, "points", tuple(checked))

    @classmethod
    def now(cls, gpus: int) -> Availability:
        """``gpus`` free now and forever."""
        return cls([(0, gpus)])

    @property
    def max_gpus(self) -> int:
        """The most GPUs that are ever free."""
        return max(n for _, n in self.points)

    def wait_s(self, gpus: int) -> float:
        """Seconds until ``gpus`` are free (``inf`` if never)."""
        for t, n in self.points:
            if n >= gpus:
                return t
        return math.inf

    def free_at(self, seconds: float) -> int:
        """Free GPUs at ``seconds`` from now."""
        free = 0
        for t, n in self.points:
            if t <= seconds:
                free = n
        return free


@dataclass(frozen=True)
class AssemblyModel:
    """Seconds from launch to the first training step: ``base_s + per_stage_s*P + per_gpu_s*P*D``.

    Defaults describe a cluster start: 60 s for scheduling, container and process start
    and rendezvous; 2 s per stage for building it, loading its shard and shape inference;
    0.25 s per GPU for communicator set-up, which grows with the world size.
    """

    base_s: float = 60.0
    per_stage_s: float = 2.0
    per_gpu_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("base_s", "per_stage_s", "per_gpu_s"):
            object.__setattr__(self, name, check_time(name, getattr(self, name)))

    def seconds(self, P: int, D: int = 1) -> float:
        """Predicted assembly time of ``P`` stages times ``D`` replicas."""
        return self.base_s + self.per_stage_s * P + self.per_gpu_s * P * D

    @classmethod
    def calibrate(cls, measurements: Iterable[Any]) -> AssemblyModel:
        """Fit ``base_s`` and ``per_stage_s`` to measured ``(P, assembly_s)`` pairs (or RunResults).

        A RunResult counts once per segment (``RunResult.segments``: each configuration's P and
        measured assembly, restore included, so resizes teach the model too), or as ``(its P,
        its jct.assembly_s)`` when it has no segment table. One measurement sets
        ``base_s`` alone (keeping the default per-stage cost); several fit both by least
        squares, clamped at zero slope. ``per_gpu_s`` is kept at 0: one machine cannot see it.
        """
        pairs = []
        for item in measurements:
            if hasattr(item, "jct") and hasattr(item, "segments"):
                if len(item.segments):
                    pairs += [
                        (int(r.P), float(r.assembly_s + (r.restore_s if r.segment > 0 else 0.0)))
                        for r in item.segments.itertuples()
                    ]
                else:
                    pairs.append((item.P, item.jct.assembly_s))
            else:
                P, seconds = item
                pairs.append((check_int("P", P, minimum=1), check_time("assembly_s", seconds)))
        if not pairs:
            raise ValueError("AssemblyModel.calibrate needs at least one (P, assembly_s) measurement")
        default = cls()
        Ps = [p for p, _ in pairs]
        if len(set(Ps)) == 1:
            mean_s = sum(s for _, s in pairs) / len(pairs)
            per_stage = min(default.per_stage_s, mean_s / Ps[0])
            return cls(base_s=mean_s - per_stage * Ps[0], per_stage_s=per_stage, per_gpu_s=0.0)
        mean_P = sum(Ps) / len(Ps)
        mean_s = sum(s for _, s in pairs) / len(pairs)
        slope = sum((p - mean_P) * (s - mean_s) for p, s in pairs) / sum((p - mean_P) ** 2 for p in Ps)
        slope = max(0.0, slope)
        return cls(base_s=max(0.0, mean_s - slope * mean_P), per_stage_s=slope, per_gpu_s=0.0)


@dataclass(frozen=True)
class CheckpointModel:
    """Checkpoint costs: every stage writes and reads its own shard in parallel.

    Three costs of a shard of ``bytes`` (the largest stage's parameters and optimizer state):

    * :meth:`save_s` — a full save the job waits for, ``save_latency_s + bytes / write_GBps``: a
      fixed part (planning, file creation, fsync, checksum, commit) and a bandwidth part. The final
      save (:meth:`cleanup_s`, with ``teardown_s`` of process and communicator teardown), the save
      before a resize and every save with ``asynchronous=False`` cost this.
    * :meth:`stall_s` — what a *periodic* checkpoint stalls training, the checkpoint cost C of
      Young/Daly. ``asynchronous=True`` (``Checkpointing(dir, asynchronous=True)``, the runner's default) stalls
      only for a copy of the state into a staging buffer,
      ``staging_latency_s + bytes / staging_GBps``, and writes it in the background: staging, then
      persisting, as torch.distributed.checkpoint's ``async_save`` and CheckFreq (Mohan et al.,
      *CheckFreq: Frequent, Fine-Grained DNN Checkpointing*, FAST 2021) do. Synchronous saves stall
      for the whole :meth:`save_s`.
    * :meth:`min_interval_s` — at most one asynchronous save is in flight, so saves cannot come
      closer than one :meth:`save_s` (a save due sooner is skipped); 0 when synchronous.

    :meth:`interval_s` is the checkpoint interval the planner uses: Young/Daly's √(2·C·MTBF) with
    C = :meth:`stall_s` (Young, CACM 1974; Daly, FGCS 2006), never shorter than :meth:`min_interval_s`.
    A restore takes ``restore_latency_s + bytes / read_GBps``.

    Defaults: writes at 1 GB/s and reads at 2 GB/s per stage (a shared file system), a staging copy at
    4 GB/s (a memory copy; ~3.7 GB/s measured on a 2-core CPU), no fixed parts, 10 s of teardown,
    asynchronous saves. :meth:`calibrate` measures them all on real runs.
    """

    write_GBps: float = 1.0
    read_GBps: float = 2.0
    teardown_s: float = 10.0
    save_latency_s: float = 0.0
    restore_latency_s: float = 0.0
    staging_GBps: float = 4.0
    staging_latency_s: float = 0.0
    asynchronous: bool = True

    def __post_init__(self) -> None:
        for name in ("write_GBps", "read_GBps", "staging_GBps"):
            object.__setattr__(self, name, check_time(name, getattr(self, name), allow_zero=False))
        for name in ("teardown_s", "save_latency_s", "restore_latency_s", "staging_latency_s"):
            object.__setattr__(self, name, check_time(name, getattr(self, name)))
        check_flag("asynchronous", self.asynchronous)

    def save_s(self, largest_stage_bytes: float) -> float:
        """Seconds of a full, waited save (a final, resize or synchronous one) of a checkpoint whose largest stage
        shard (parameters + optimizer state) has ``largest_stage_bytes``."""
        return self.save_latency_s + check_time("largest_stage_bytes", largest_stage_bytes) / (self.write_GBps * 1e9)

    def stall_s(self, largest_stage_bytes: float) -> float:
        """Seconds a periodic checkpoint stalls training (Young/Daly's C): the staging copy when asynchronous,
        else the whole :meth:`save_s`."""
        if not self.asynchronous:
            return self.save_s(largest_stage_bytes)
        nbytes = check_time("largest_stage_bytes", largest_stage_bytes)
        return self.staging_latency_s + nbytes / (self.staging_GBps * 1e9)

    def min_interval_s(self, largest_stage_bytes: float) -> float:
        """The shortest interval between periodic checkpoints, in seconds: one :meth:`save_s` when asynchronous
        (a save cannot begin before the last one is committed), else 0."""
        return self.save_s(largest_stage_bytes) if self.asynchronous else 0.0

    def interval_s(self, largest_stage_bytes: float, mtbf_s: float) -> float:
        """The checkpoint interval in seconds for a job preempted every ``mtbf_s`` on average: Young/Daly's
        √(2·C·MTBF) with C = :meth:`stall_s`, floored at :meth:`min_interval_s`."""
        stall = self.stall_s(largest_stage_bytes)
        return max(young_daly_interval_s(stall, mtbf_s), self.min_interval_s(largest_stage_bytes))

    def restore_s(self, largest_stage_bytes: float) -> float:
        """Seconds to read it back."""
        return self.restore_latency_s + check_time("largest_stage_bytes", largest_stage_bytes) / (self.read_GBps * 1e9)

    def cleanup_s(self, largest_stage_bytes: float) -> float:
        """The final save (a waited :meth:`save_s`) plus teardown, in seconds."""
        return self.save_s(largest_stage_bytes) + self.teardown_s

    @classmethod
    def calibrate(cls, runs: Any) -> CheckpointModel:
        """Fit the model to what real runs measured (``RunResult``s of ``run(..., checkpoint=...)``, or with
        resizes): one ``RunResult`` or an iterable of them. Returns the fitted :class:`CheckpointModel`.

        Only committed checkpoints of ``RunResult.checkpoints`` count (``status``; skipped ones are ignored);
        tables of older runs without ``mode``, ``status`` or ``write_ms`` read as synchronous, committed saves
        whose write took the whole stall.

        * stalls — every asynchronous save (``mode="async"``): the largest rank's state bytes
          (``largest_rank_state_bytes``, the tensors, as the planner counts a shard) against the stall it
          caused (``blocking_ms``, its staging copy), fitted as ``staging_latency_s`` and ``staging_GBps``;
          ``asynchronous`` is whether there was any (without, staging keeps its defaults);
        * saves — every save, fitted as ``save_latency_s`` and ``write_GBps``: the largest rank's file
          (``largest_rank_bytes``) against the whole save, the stall of one the step loop waited for
          (``mode`` sync or waited) and the staging copy plus the background write
          (``staging_ms + write_ms``) of an asynchronous one;
        * restores — every restore (a ``resume_from`` run's, or each resize's in
          ``RunResult.segments``): the bytes the largest rank loaded against its time;
        * each is fitted as ``latency + bytes / bandwidth`` by least squares when the shards
          differ in size by at least 10% and the fit is physical, else as latency with the
          default bandwidth (one size, or small noisy shards, cannot tell them apart); restores
          keep the defaults, with a warning, when nothing was restored;
        * ``teardown_s`` — the median of ``jct.cleanup_s`` minus the final save's stall.

        Raises ``ValueError`` when no run saved a checkpoint.
        """
        import warnings
        from statistics import median

        samples = _CheckpointSamples.of(_as_runs(runs))
        if not samples.saves:
            raise ValueError(
                "CheckpointModel.calibrate needs runs that saved checkpoints (run(..., checkpoint=...)); "
                "none of the runs given did"
            )
        default = cls()
        save_latency, write = _latency_bandwidth(samples.saves, default.write_GBps)
        if samples.stalls:
            staging_latency, staging = _latency_bandwidth(samples.stalls, default.staging_GBps)
        else:
            staging_latency, staging = default.staging_latency_s, default.staging_GBps
        if samples.restores:
            restore_latency, read = _latency_bandwidth(samples.restores, default.read_GBps)
        else:
            warnings.warn(
                f"nothing was restored, so read_GBps keeps its default {default.read_GBps} GB/s; calibrate with a "
                "run(..., resume_from=...) or a resize to measure it",
                UserWarning,
                stacklevel=2,
            )
            restore_latency, read = default.restore_latency_s, default.read_GBps
        return cls(
            write_GBps=write,
            read_GBps=read,
            teardown_s=median(samples.teardown) if samples.teardown else default.teardown_s,
            save_latency_s=save_latency,
            restore_latency_s=restore_latency,
            staging_GBps=staging,
            staging_latency_s=staging_latency,
            asynchronous=bool(samples.stalls),
        )


def _as_runs(runs: Any) -> list[Any]:
    """``runs`` (one ``RunResult`` or an iterable of them) as a list, each checked to be a RunResult."""
    runs = [runs] if hasattr(runs, "checkpoints") else list(runs)
    for i, run in enumerate(runs):
        if not hasattr(run, "checkpoints") or not hasattr(run, "jct"):
            raise TypeError(f"runs[{i}] must be a RunResult; got {type(run).__name__}")
    return runs


@dataclass(frozen=True, kw_only=True)
class _CheckpointSamples:
    """What runs measured of their checkpoints, the samples :meth:`CheckpointModel.calibrate` fits."""

    saves: list[tuple[float, float]]
    """``(largest rank's file bytes, seconds of the whole save)`` of every committed checkpoint."""
    stalls: list[tuple[float, float]]
    """``(largest rank's state bytes, seconds the save stalled training)`` of every committed asynchronous one."""
    restores: list[tuple[float, float]]
    """``(bytes the largest rank loaded, seconds)`` of every restore."""
    teardown: list[float]
    """Per run with a final save, its cleanup seconds beyond that save's stall."""

    @classmethod
    def of(cls, runs: list[Any]) -> _CheckpointSamples:
        """The samples of ``runs`` (RunResults)."""
        saves: list[tuple[float, float]] = []
        stalls: list[tuple[float, float]] = []
        restores: list[tuple[float, float]] = []
        teardown: list[float] = []
        for run in runs:
            table = _committed(run.checkpoints)
            for _, r in table.iterrows():
                state = _number(r, "largest_rank_state_bytes", _number(r, "largest_rank_bytes"))
                blocking_ms = _number(r, "blocking_ms")
                whole_ms = blocking_ms  # a save the step loop waited for: all of it
                if r["mode"] == "async":
                    stalls.append((state, blocking_ms / 1e3))
                    write_ms = _number(r, "write_ms")
                    if write_ms == write_ms:  # the staging copy, then the background write
                        whole_ms = _number(r, "staging_ms", blocking_ms) + write_ms
                saves.append((_number(r, "largest_rank_bytes", state), whole_ms / 1e3))
            final = table[table["kind"].isin(["final", "preempt"])]
            if len(final):
                teardown.append(max(0.0, run.jct.cleanup_s - float(final["blocking_ms"].iloc[-1]) / 1e3))
            segments = getattr(run, "segments", None)
            pairs = (
                [(r.restore_bytes, r.restore_s) for r in segments.itertuples()]
                if segments is not None and len(segments)
                else [(run.meta.get("restore_bytes", 0), run.restore_s)]
            )
            restores += [(float(b), float(t)) for b, t in pairs if t > 0 and b]
        return cls(saves=saves, stalls=stalls, restores=restores, teardown=teardown)


def _committed(table: Any) -> Any:
    """The committed rows of a ``RunResult.checkpoints`` table with a ``mode`` column: tables of older runs (no
    ``status``: every row committed; no ``mode``: synchronous) read alike; rows that stalled nothing are dropped."""
    table = table.copy()
    if "status" not in table:
        table["status"] = "committed"
    if "mode" not in table:
        table["mode"] = "sync"
    table["mode"] = table["mode"].fillna("sync")
    return table[(table["status"].fillna("committed") == "committed") & (table["blocking_ms"] > 0)]


def _number(row: Any, column: str, default: float = math.nan) -> float:
    """``row[column]`` as a float, ``default`` when the column is missing or empty (None, NaN)."""
    value = row.get(column)
    if value is None or value != value:  # None or NaN
        return default
    return float(value)


def _latency_bandwidth(samples: Sequence[tuple[float, float]], default_GBps: float) -> tuple[float, float]:
    """``(latency_s, GBps)`` of ``seconds = latency + bytes / (GBps * 1e9)`` fitted to ``(bytes, seconds)`` samples.

    Least squares when the sizes differ by 10% or more and the fit is physical (positive
    slope, non-negative intercept); otherwise the median time beyond what ``default_GBps``
    explains is latency (small shards: the fixed costs dominate and hide the bandwidth).
    """
    from statistics import median

    from .link import fit_latency_bandwidth

    sizes = [b for b, _ in samples]
    if len(samples) >= 2 and max(sizes) >= 1.1 * min(sizes):
        line = fit_latency_bandwidth(sizes, [t for _, t in samples])
        if line is not None:
            return line[0], 1.0 / (line[1] * 1e9)
    return max(0.0, median(t for _, t in samples) - median(sizes) / (default_GBps * 1e9)), default_GBps


def young_daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval √(2·C·MTBF) in seconds (Young 1974; Daly 2006)."""
    checkpoint_s = check_time("checkpoint_s", checkpoint_s)
    mtbf_s = check_time("mtbf_s", mtbf_s, allow_zero=False)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def preemption_loss_s(
    training_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float, interval_s: float | None = None
) -> float:
    """Expected seconds lost to preemptions over ``training_s`` of work.

    With checkpoints every ``interval_s`` (Young/Daly's τ by default), each stalling training
    ``checkpoint_s`` (C: :meth:`CheckpointModel.stall_s`), the loss is the checkpoint overhead
    ``(training_s/τ)·C`` plus, for each of the expected ``wall/MTBF`` preemptions, half an
    interval of redone work and ``restart_s`` (re-assembly and restore). ``wall`` is solved as
    the fixed point ``wall = training_s + overhead + (wall/MTBF)·(τ/2 + restart_s)``; if a
    preemption costs more than the MTBF, the job never finishes and ``inf`` is returned.
    ``interval_s`` may be 0 only for free checkpoints (``checkpoint_s=0``). The work a
    preemption loses while an asynchronous save is still being written (at most one write) is
    not counted. Returns seconds.
    """
    training_s = check_time("training_s", training_s)
    checkpoint_s = check_time("checkpoint_s", checkpoint_s)
    restart_s = check_time("restart_s", restart_s)
    mtbf_s = check_time("mtbf_s", mtbf_s, allow_zero=False)
    tau = (
        young_daly_interval_s(checkpoint_s, mtbf_s)
        if interval_s is None
        else check_time("interval_s", interval_s, allow_zero=checkpoint_s == 0)
    )
    if tau == 0:  # free checkpoints: checkpoint continuously, lose only restarts
        overhead, redo = 0.0, 0.0
    else:
        overhead, redo = (training_s / tau) * checkpoint_s, tau / 2.0
    per_failure = redo + restart_s
    if per_failure >= mtbf_s:
        return math.inf
    wall = (training_s + overhead) / (1.0 - per_failure / mtbf_s)
    return wall - training_s


def allreduce_ms(nbytes: float, D: int, bandwidth_GBps: float, latency_ms: float = 0.0) -> float:
    """Ring all-reduce time of ``nbytes`` over ``D`` replicas: ``2(D-1)/D·bytes/bw + 2(D-1)·latency``.

    (Patarasuk and Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
    workstations*, JPDC 2009.) Zero for ``D = 1``.
    """
    nbytes = check_time("nbytes", nbytes)
    D = check_int("D", D, minimum=1)
    bandwidth_GBps = check_time("bandwidth_GBps", bandwidth_GBps, allow_zero=False)
    latency_ms = check_time("latency_ms", latency_ms)
    if D == 1:
        return 0.0
    return 2 * (D - 1) / D * nbytes / (bandwidth_GBps * 1e9) * 1e3 + 2 * (D - 1) * latency_ms


__all__ = [
    "allreduce_ms",
    "AssemblyModel",
    "Availability",
    "CheckpointModel",
    "cost_models",
    "preemption_loss_s",
    "young_daly_interval_s",
]


def cost_models(costs: Any) -> tuple[AssemblyModel | None, CheckpointModel | None]:
    """``costs=`` of :func:`~pipeswift_lab.plan` and :func:`~pipeswift_lab.cluster.simulate` as
    ``(AssemblyModel | None, CheckpointModel | None)``: the costs a job's assembly and checkpoints pay.

    Accepts ``None``; one :class:`~pipeswift_lab.core.costs.AssemblyModel` or
    :class:`~pipeswift_lab.core.costs.CheckpointModel` (e.g. from ``AssemblyModel.calibrate(runs)`` or
    ``CheckpointModel.calibrate(runs)`` on this toolkit's own ``RunResult``s); a list or tuple of them, at most one
    of each kind; or a dict with the keys ``"assembly"`` and/or ``"checkpoint"``. Raises ``TypeError`` naming the
    item of a wrong type, ``ValueError`` for two models of one kind or an unknown key.
    """
    kinds = {"assembly": AssemblyModel, "checkpoint": CheckpointModel}
    if costs is None:
        return None, None
    if isinstance(costs, dict):
        unknown = sorted(set(map(str, costs)) - set(kinds))
        if unknown:
            raise ValueError(f"costs has unknown keys {unknown}; use 'assembly' and/or 'checkpoint'")
        items = []
        for key, model in costs.items():
            if model is not None and not isinstance(model, kinds[key]):
                raise TypeError(f"costs[{key!r}] is {type(model).__name__}; give a costs.{kinds[key].__name__}")
            items.append((f"costs[{key!r}]", model))
    elif isinstance(costs, (AssemblyModel, CheckpointModel)):
        items = [("costs", costs)]
    elif isinstance(costs, (list, tuple)):
        items = [(f"costs[{i}]", v) for i, v in enumerate(costs)]
    else:
        items = [("costs", costs)]
    found: dict[type, Any] = {}
    for where, model in items:
        if model is None:
            continue
        if not isinstance(model, (AssemblyModel, CheckpointModel)):
            raise TypeError(
                f"{where} is {type(model).__name__} {model!r}; give a costs.AssemblyModel or costs.CheckpointModel "
                "(e.g. AssemblyModel.calibrate(runs), CheckpointModel.calibrate(runs)), a list of them or a dict"
            )
        kind = AssemblyModel if isinstance(model, AssemblyModel) else CheckpointModel
        if kind in found:
            raise ValueError(f"costs has two {kind.__name__}s; give at most one of each")
        found[kind] = model
    return found.get(AssemblyModel), found.get(CheckpointModel)
