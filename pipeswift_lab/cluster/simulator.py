"""Replay a job trace on a shared cluster under a scheduling policy: :func:`simulate`."""

from __future__ import annotations

import heapq
import math
import time
import warnings
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_flag, check_int, check_time
from ..core.costs import AssemblyModel, CheckpointModel, cost_models
from ..profiling.table import Profile
from .engine import CAPACITY, FINISH, Cluster, ClusterJob
from .inputs import check_capacity, check_jobs
from .policies import Policy, Preemptive
from .registry import get_policy
from .result import ClusterResult
from .scaling import ScalingModel, default_profile, profile_library

__all__ = ["simulate"]


def simulate(
    jobs: pd.DataFrame,
    gpus: int | Sequence[tuple[float, int]] | pd.DataFrame,
    policy: str | Policy | type[Policy] = "static",
    *,
    checkpoint_every_s: float | None = None,
    costs: Any = None,
    workload: str | None = None,
    progress: bool = True,
    seed: int = 0,
) -> ClusterResult:
    """Replay ``jobs`` on a cluster of ``gpus`` under ``policy``; return a :class:`ClusterResult`.

    * ``jobs`` — a DataFrame with ``submit_s``, ``gpus`` (requested) and ``duration_s`` (run
      time on the requested GPUs), optionally ``name``, ``priority``, ``min_gpus``,
      ``max_gpus`` and ``profile`` (a library name, see
      :func:`~pipeswift_lab.cluster.scaling.profile_library`, or a
      :class:`~pipeswift_lab.Profile`; by default chosen by requested GPUs) and ``declared_s`` (the run time
      the job declares, an estimate the ``"jct"`` policy orders by; ``duration_s`` when absent). E.g.
      :func:`pipeswift_lab.data.philly_jobs`.
    * ``gpus`` — the capacity: an int, or ``(time_s, gpus)`` pairs (a list or a DataFrame
      with ``time_s`` and ``gpus``) for a capacity that changes, e.g. spot instances; when it
      drops below the GPUs in use, the policy's victims are preempted.
      Published availability traces (two points per change, ``(t, old), (t, new)``) are accepted as they are: at
      equal times the later count holds (:func:`~pipeswift_lab.cluster.read_capacity` reads such a file).
    * ``policy`` — ``"static"``, ``"elastic"``, ``"preemptive"``, ``"jct"``
      (:data:`~pipeswift_lab.cluster.POLICIES`; ``"jct"`` is :class:`~pipeswift_lab.cluster.JointJCT`), or a
      :class:`~pipeswift_lab.cluster.Policy` instance or subclass.
    * ``checkpoint_every_s`` — periodic checkpoints every that many seconds of training
      (each stalls the job ``ScalingModel.stall_s``: the staging copy of an asynchronous save, the whole
      write of a synchronous one); ``None``: none, so a preempted job loses
      everything since its last (re)start.
    * ``costs`` — the assembly and checkpoint cost models every job's moves pay, e.g. calibrated on this toolkit's
      own runs: ``costs=(AssemblyModel.calibrate(runs), CheckpointModel.calibrate(runs))`` (one model, a list
      or tuple, or a dict ``{"assembly": ..., "checkpoint": ...}``; the defaults of ``core.costs`` otherwise).
      With asynchronous saves the periodic checkpoint's stall is the calibrated staging copy.
    * ``workload`` — a label for the window these jobs and GPUs are (:attr:`ClusterResult.workload`, by which
      :meth:`ClusterComparison.ranking` groups); derived from the jobs and capacity when ``None``.
    * ``seed`` — seeds ``cluster.rng``, the generator a policy may draw from (the built-in
      policies are deterministic); the same seed gives identical results.

    A discrete-event simulation on an event heap (finishes, capacity changes, policy
    events; arrivals merged in from the sorted jobs). Jobs that can never run (more GPUs
    than the cluster ever has, a profile that does not fit) are reported unfinished with
    their ``reason`` and counted in a warning; so are jobs still queued when the events
    run out. Shows a ``tqdm.auto`` bar unless ``progress=False`` or ``TQDM_DISABLE`` is set.

    The steps: check the inputs, resolve each job's :class:`~pipeswift_lab.cluster.scaling.ScalingModel` and limits
    (:func:`_cluster_jobs`), replay the events (:func:`_replay`), close the queue (:func:`_close`), collect the
    :class:`ClusterResult`.
    """
    table = check_jobs(jobs)
    capacity = check_capacity(gpus)
    policy = get_policy(policy)
    if checkpoint_every_s is not None:
        checkpoint_every_s = check_time("checkpoint_every_s", checkpoint_every_s, allow_zero=False)
    seed = check_int("seed", seed)
    assembly, checkpoint = cost_models(costs)
    if workload is not None and (not isinstance(workload, str) or not workload):
        raise TypeError(f"workload must be a non-empty str or None; got {type(workload).__name__} {workload!r}")
    progress = check_flag("progress", progress)
    if isinstance(policy, Preemptive):
        policy.las = "priority" not in table.columns  # least-attained service unless the jobs carry priorities
    profile_names, models = _models(table, assembly, checkpoint)
    cluster_jobs = _cluster_jobs(table, models, profile_names, policy, max(n for _, n in capacity))
    cluster = Cluster(cluster_jobs, capacity, checkpoint_every_s, policy, seed=seed)
    policy.reset(cluster)
    started = time.perf_counter()
    _replay(cluster, table["submit_s"].to_numpy(float), progress)
    wall_s = time.perf_counter() - started
    _close(cluster)
    return ClusterResult.from_cluster(
        cluster, profile_names, policy, capacity, checkpoint_every_s, wall_s, seed, workload=workload
    )


# --------------------------------------------------------------------------- resolve
def _library_model(
    name: str, assembly: AssemblyModel | None = None, checkpoint: CheckpointModel | None = None
) -> ScalingModel:
    """The shared ScalingModel of a library profile under the given cost models (one per distinct arguments)."""
    return _shared_model(name, assembly, checkpoint)


@cache
def _shared_model(name: str, assembly: AssemblyModel | None, checkpoint: CheckpointModel | None) -> ScalingModel:
    """:func:`_library_model`, cached on its positional arguments (pure: tables depend only on them)."""
    library = profile_library()
    if name not in library:
        raise ValueError(
            f"profile={name!r} is not in the library; use one of {list(library)} or a pipeswift_lab.Profile"
        )
    return ScalingModel(library[name], assembly, checkpoint)


def _models(
    table: pd.DataFrame, assembly: AssemblyModel | None = None, checkpoint: CheckpointModel | None = None
) -> tuple[list[str], list[ScalingModel]]:
    """Each job's profile name and :class:`ScalingModel` under the cost models (one per distinct profile)."""
    names, models = [], []
    by_id: dict[int, ScalingModel] = {}
    profiles = table["profile"] if "profile" in table.columns else [None] * len(table)
    for gpus, profile in zip(table["gpus"], profiles):
        if isinstance(profile, Profile):
            model = by_id.setdefault(id(profile), ScalingModel(profile, assembly, checkpoint))
            names.append(profile.meta.get("model", "custom"))
        else:
            name = profile if isinstance(profile, str) else default_profile(int(gpus))
            model = _library_model(name, assembly, checkpoint)
            names.append(name)
        models.append(model)
    return names, models


def _cluster_jobs(
    table: pd.DataFrame, models: list[ScalingModel], profile_names: list[str], policy: Policy, max_capacity: int
) -> list[ClusterJob]:
    """One :class:`ClusterJob` per row: its GPU range (``min_gpus``…``max_gpus``, by default half to twice its
    request), its priority, and the ``reason`` it can never run, if any."""
    has = set(table.columns)
    out = []
    for i, row in enumerate(table.itertuples(index=False)):
        g, model = int(row.gpus), models[i]
        cap = max(g, min(2 * g, model.max_useful_gpus, max_capacity))
        model.ensure(max(g, int(getattr(row, "max_gpus", 0) or 0), cap))
        lo = int(row.min_gpus) if "min_gpus" in has else max(math.ceil(g / 2), model.min_gpus or g)
        hi = int(row.max_gpus) if "max_gpus" in has else max(lo, cap)
        model.ensure(hi)
        default_priority = 1.0 if isinstance(policy, Preemptive) else 0.0
        priority = float(row.priority) if "priority" in has else default_priority
        job = ClusterJob(
            idx=i,
            name=str(row.name),
            submit=float(row.submit_s),
            gpus=g,
            min_gpus=min(lo, hi),
            max_gpus=hi,
            priority=priority,
            model=model,
        )
        job.work = float(row.duration_s)
        if "declared_s" in has:
            job.declared = float(row.declared_s) / job.work
        job.ref_speed = max(model.speed[g], 0.0)
        job.reason = _never_runs(job, profile_names[i], policy, max_capacity)
        out.append(job)
    return out


def _never_runs(job: ClusterJob, profile_name: str, policy: Policy, max_capacity: int) -> str:
    """Why ``job`` can never run on this cluster under ``policy`` ("" when it can)."""
    speed = job.model.speed
    if speed[job.gpus] <= 0:
        return f"its profile ({profile_name}) does not fit in memory on the {job.gpus} GPUs it asks for"
    smallest = policy.smallest(job)
    if smallest > max_capacity:
        return f"asks for at least {smallest} GPUs under {policy.name!r}; the capacity never exceeds {max_capacity}"
    if speed[smallest] <= 0:
        return f"its profile ({profile_name}) does not fit in memory on {smallest} GPUs"
    return ""


# --------------------------------------------------------------------------- execute
def _replay(cluster: Cluster, submit: np.ndarray, progress: bool) -> None:
    """The discrete-event loop: at each instant, the heap's events, then the arrivals, then one scheduling pass."""
    from ..core.progress import progress_bar

    policy, n_jobs = cluster.policy, len(cluster.jobs)
    bar = progress_bar(total=n_jobs, desc=f"cluster {policy.name}", progress=progress, unit="job", leave=False)
    capacity_at = dict(cluster.capacity_points)
    for t, _ in cluster.capacity_points[1:]:
        cluster.push(t, CAPACITY, -1)
    nxt, done, shown = 0, 0, 0
    cluster.record(0.0)
    while True:
        t = min(submit[nxt] if nxt < n_jobs else math.inf, cluster.heap[0][0] if cluster.heap else math.inf)
        if t == math.inf:
            break
        cluster.now = t
        done += _handle_events(cluster, t, capacity_at)
        nxt, unrunnable = _arrive(cluster, submit, nxt, t)
        done += unrunnable
        policy.schedule(cluster, t)
        if cluster.used > cluster.capacity:
            raise RuntimeError(
                f"policy {policy.name!r} uses {cluster.used} GPUs, over the capacity {cluster.capacity} at t={t}"
            )
        cluster.record(t)
        if done - shown >= 1000:
            bar.update(done - shown)
            shown = done
    bar.update(done - shown)
    bar.close()


def _handle_events(cluster: Cluster, t: float, capacity_at: dict[float, int]) -> int:
    """Pop and handle every event at ``t``: capacity changes, finishes, policy events; return the jobs finished."""
    done = 0
    heap = cluster.heap
    while heap and heap[0][0] == t:
        _, kind, _, idx, version = heapq.heappop(heap)
        if kind == CAPACITY:
            cluster.events += 1
            _change_capacity(cluster, capacity_at[t], t)
            continue
        job = cluster.jobs[idx]
        if version != job.version:
            continue  # stale: the segment was stopped or resized
        cluster.events += 1
        if kind == FINISH:
            cluster.finish(job, t)
            done += 1
        else:
            cluster.policy.on_event(cluster, job, kind, t)
    return done


def _change_capacity(cluster: Cluster, capacity: int, t: float) -> None:
    """Set the capacity; when it falls below the GPUs in use, preempt the policy's victims."""
    cluster.capacity = capacity
    deficit = cluster.used - cluster.capacity
    if deficit <= 0:
        return
    policy = cluster.policy
    for victim in policy.victims(cluster, deficit, t):
        cluster.preempt(victim, t)
    if cluster.used > cluster.capacity:
        raise RuntimeError(
            f"policy {policy.name!r} left {cluster.used} GPUs in use after the capacity fell to {cluster.capacity}"
        )


def _arrive(cluster: Cluster, submit: np.ndarray, nxt: int, t: float) -> tuple[int, int]:
    """Queue the jobs submitted at ``t`` from index ``nxt``; return ``(next index, jobs that can never run)``, the
    latter marked unfinished."""
    unrunnable = 0
    while nxt < len(submit) and submit[nxt] == t:
        job = cluster.jobs[nxt]
        cluster.events += 1
        nxt += 1
        if job.reason:
            job.state = "unfinished"
            unrunnable += 1
            continue
        cluster.enqueue(job, t)
    return nxt, unrunnable


# --------------------------------------------------------------------------- close
def _close(cluster: Cluster) -> None:
    """Mark the jobs still queued when the events ran out unfinished, and warn, counting every unfinished job."""
    skipped = [job for job in cluster.jobs if job.state == "unfinished"]
    waiting = [cluster.jobs[idx] for _, idx in cluster.queue]
    policy, end_t = cluster.policy, cluster.now
    for job in waiting:
        job.queue += end_t - job.wait_since
        job.wait_since = end_t
        job.state = "unfinished"
        job.reason = (
            f"still queued when the events ran out at t={end_t:.0f} s: needs {policy.smallest(job)} GPUs, "
            f"the capacity stays {cluster.capacity}"
        )
    unfinished = skipped + waiting
    if unfinished:
        reasons = pd.Series([j.reason.split(":")[0].split(";")[0] for j in unfinished]).value_counts()
        detail = "; ".join(f"{n} {r}" for r, n in reasons.head(3).items())
        warnings.warn(
            f"{len(unfinished)} of {len(cluster.jobs)} jobs did not finish under {policy.name!r} ({detail}); "
            f"see result.jobs['reason']",
            stacklevel=3,  # _close, simulate, the caller
        )
