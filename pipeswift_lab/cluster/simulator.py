"""Replay a job trace on a shared cluster under a scheduling policy: :func:`simulate`."""

from __future__ import annotations

import heapq
import math
import numbers
import time
import warnings
from functools import cache

import numpy as np
import pandas as pd

from ..profiling.measure import Profile
from .engine import CAPACITY, FINISH, Cluster, Job
from .inputs import check_capacity, check_jobs
from .policies import Preemptive, get_policy
from .result import ClusterResult
from .scaling import ScalingModel, default_profile, profile_library


@cache
def _library_model(name: str) -> ScalingModel:
    """The shared ScalingModel of a library profile (pure: tables depend only on the profile)."""
    library = profile_library()
    if name not in library:
        raise ValueError(
            f"profile={name!r} is not in the library; use one of {list(library)} or a pipeswift_lab.Profile"
        )
    return ScalingModel(library[name])


def _models(table: pd.DataFrame) -> tuple[list, list]:
    names, models, by_id = [], [], {}
    profiles = table["profile"] if "profile" in table.columns else [None] * len(table)
    for gpus, profile in zip(table["gpus"], profiles):
        if isinstance(profile, Profile):
            model = by_id.setdefault(id(profile), ScalingModel(profile))
            names.append(profile.meta.get("model", "custom"))
        else:
            name = profile if isinstance(profile, str) else default_profile(int(gpus))
            model = _library_model(name)
            names.append(name)
        models.append(model)
    return names, models


def simulate(jobs, gpus, policy="static", *, checkpoint_every_s=None, progress=True, seed=0) -> ClusterResult:
    """Replay ``jobs`` on a cluster of ``gpus`` under ``policy``; return a :class:`ClusterResult`.

    * ``jobs`` — a DataFrame with ``submit_s``, ``gpus`` (requested) and ``duration_s`` (run
      time on the requested GPUs), optionally ``name``, ``priority``, ``min_gpus``,
      ``max_gpus`` and ``profile`` (a library name, see
      :func:`~pipeswift_lab.cluster.scaling.profile_library`, or a
      :class:`~pipeswift_lab.Profile`; by default chosen by requested GPUs). E.g.
      :func:`pipeswift_lab.data.philly_jobs`.
    * ``gpus`` — the capacity: an int, or ``(time_s, gpus)`` pairs (a list or a DataFrame
      with ``time_s`` and ``gpus``) for a capacity that changes, e.g. spot instances; when it
      drops below the GPUs in use, the policy's victims are preempted.
    * ``policy`` — ``"static"``, ``"elastic"``, ``"preemptive"`` or a
      :class:`~pipeswift_lab.cluster.Policy` instance.
    * ``checkpoint_every_s`` — periodic checkpoints every that many seconds of training
      (each costs the job's checkpoint write); ``None``: none, so a preempted job loses
      everything since its last (re)start.
    * ``seed`` — seeds ``cluster.rng``, the generator a policy may draw from (the built-in
      policies are deterministic); the same seed gives identical results.

    A discrete-event simulation on an event heap (finishes, capacity changes, policy
    events; arrivals merged in from the sorted jobs). Jobs that can never run (more GPUs
    than the cluster ever has, a profile that does not fit) are reported unfinished with
    their ``reason`` and counted in a warning; so are jobs still queued when the events
    run out. Shows a ``tqdm.auto`` bar unless ``progress=False`` or ``TQDM_DISABLE`` is set.
    """
    table = check_jobs(jobs)
    capacity = check_capacity(gpus)
    policy = get_policy(policy)
    if checkpoint_every_s is not None:
        if (
            isinstance(checkpoint_every_s, bool)
            or not isinstance(checkpoint_every_s, numbers.Real)
            or not (0 < checkpoint_every_s < math.inf)
        ):
            raise ValueError(
                f"checkpoint_every_s={checkpoint_every_s!r} is invalid; give a finite number of seconds > 0, or None for no periodic checkpoints"
            )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer; got {type(seed).__name__} {seed!r}")
    max_capacity = max(n for _, n in capacity)
    profile_names, models = _models(table)
    has_priority = "priority" in table.columns
    if isinstance(policy, Preemptive):
        policy.las = not has_priority

    jobs_list = []
    for i, row in enumerate(table.itertuples(index=False)):
        g, model = int(row.gpus), models[i]
        cap = max(g, min(2 * g, model.max_useful_gpus, max_capacity))
        model.ensure(max(g, int(getattr(row, "max_gpus", 0) or 0), cap))
        lo = int(row.min_gpus) if "min_gpus" in table.columns else max(math.ceil(g / 2), model.min_gpus or g)
        hi = int(row.max_gpus) if "max_gpus" in table.columns else max(lo, cap)
        model.ensure(hi)
        if has_priority:
            priority = float(row.priority)
        else:
            priority = 1.0 if isinstance(policy, Preemptive) else 0.0
        job = Job(i, row.name, float(row.submit_s), g, min(lo, hi), hi, priority, model)
        job.work = float(row.duration_s)
        if model.speed[g] <= 0:
            job.reason = f"its profile ({profile_names[i]}) does not fit in memory on the {g} GPUs it asks for"
        else:
            job.ref_speed = model.speed[g]
            smallest = policy.smallest(job)
            if smallest > max_capacity:
                job.reason = f"asks for at least {smallest} GPUs under {policy.name!r}; the capacity never exceeds {max_capacity}"
            elif model.speed[smallest] <= 0:
                job.reason = f"its profile ({profile_names[i]}) does not fit in memory on {smallest} GPUs"
        jobs_list.append(job)

    cluster = Cluster(jobs_list, capacity, checkpoint_every_s, policy)
    cluster.rng = np.random.default_rng(seed)
    policy.reset(cluster)
    for t, _ in capacity[1:]:
        cluster.push(t, CAPACITY, -1)
    capacity_at = dict(capacity)

    started = time.perf_counter()
    from ..core.progress import progress_bar

    bar = progress_bar(total=len(jobs_list), desc=f"cluster {policy.name}", progress=progress, unit="job", leave=False)
    submit = table["submit_s"].to_numpy(float)
    n_jobs, nxt, done, shown = len(jobs_list), 0, 0, 0
    heap = cluster.heap
    skipped = [job for job in jobs_list if job.reason]
    cluster.record(0.0)
    while True:
        t_arrival = submit[nxt] if nxt < n_jobs else math.inf
        t_event = heap[0][0] if heap else math.inf
        t = min(t_arrival, t_event)
        if t == math.inf:
            break
        cluster.now = t
        while heap and heap[0][0] == t:
            _, kind, _, idx, version = heapq.heappop(heap)
            if kind == CAPACITY:
                cluster.events += 1
                cluster.capacity = capacity_at[t]
                deficit = cluster.used - cluster.capacity
                if deficit > 0:
                    for victim in policy.victims(cluster, deficit, t):
                        cluster.preempt(victim, t)
                    if cluster.used > cluster.capacity:
                        raise RuntimeError(
                            f"policy {policy.name!r} left {cluster.used} GPUs in use after the capacity fell to {cluster.capacity}"
                        )
                continue
            job = jobs_list[idx]
            if version != job.version:
                continue  # stale: the segment was stopped or resized
            cluster.events += 1
            if kind == FINISH:
                cluster.finish(job, t)
                done += 1
            else:
                policy.on_event(cluster, job, kind, t)
        while nxt < n_jobs and submit[nxt] == t:
            job = jobs_list[nxt]
            cluster.events += 1
            nxt += 1
            if job.reason:
                job.state = "unfinished"
                done += 1
                continue
            cluster.enqueue(job, t)
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
    wall_s = time.perf_counter() - started

    end_t = cluster.now
    waiting = [jobs_list[idx] for _, idx in cluster.queue]
    for job in waiting:
        job.queue += end_t - job.wait_since
        job.wait_since = end_t
        job.state = "unfinished"
        job.reason = (
            f"still queued when the events ran out at t={end_t:.0f} s: needs {policy.smallest(job)} GPUs, "
            f"the capacity stays {cluster.capacity}"
        )
    unfinished = len(skipped) + len(waiting)
    if unfinished:
        reasons = pd.Series([j.reason.split(":")[0].split(";")[0] for j in skipped + waiting]).value_counts()
        detail = "; ".join(f"{n} {r}" for r, n in reasons.head(3).items())
        warnings.warn(
            f"{unfinished} of {n_jobs} jobs did not finish under {policy.name!r} ({detail}); see result.jobs['reason']",
            stacklevel=2,
        )
    return ClusterResult.from_cluster(cluster, profile_names, policy, capacity, checkpoint_every_s, wall_s, seed)
