"""Scheduling policies: small classes that decide who runs, on how many GPUs, and who yields.

A policy sees the :class:`~pipeswift_lab.cluster.engine.Cluster` (free GPUs, the sorted
queue, running jobs, predicted ends) after every instant with events and starts,
resizes or preempts jobs through it. The hooks, all optional to override:

* :meth:`Policy.queue_key` — the queue order (default: submission order, FIFO);
* :meth:`Policy.size` — GPUs to start a queued job on now, 0 to keep it waiting;
* :meth:`Policy.smallest` — the fewest GPUs a job can ever run on (jobs asking for more
  than the cluster ever has are reported unfinished, never silently dropped);
* :meth:`Policy.blocked` — what to do when the head of the queue cannot start (preempt);
* :meth:`Policy.rebalance` — after admissions (grow or shrink running jobs);
* :meth:`Policy.victims` — whom to stop when the capacity drops (in :meth:`Policy.victim_key` order).

A custom policy is a few lines, e.g. shortest-job-first with the same backfilling::

    class ShortestFirst(psl.cluster.Static):
        name = "shortest-first"
        def queue_key(self, job):
            return (job.gpus * job.work, job.idx)   # requested GPU-seconds

    psl.cluster.simulate(jobs, 64, policy=ShortestFirst())

Queued jobs are started by EASY backfilling (Lifka, *The ANL/IBM SP scheduling system*,
JSSPP 1995; Mu'alem and Feitelson, IEEE TPDS 2001): the head of the queue gets a
reservation at the time enough GPUs free up, and later jobs start ahead of it only if
they end before then or fit in the GPUs it will not need.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from ..core.checks import check_time
from .engine import DEMOTE, Cluster, ClusterJob

__all__ = ["Elastic", "Policy", "Preemptive", "Static"]


def _enough(order: Iterable[ClusterJob], need: int) -> tuple[list[ClusterJob], int]:
    """``(jobs, gpus)``: the first jobs of ``order`` whose GPUs add up to ``need`` (all of them when they fall short),
    and the GPUs they hold."""
    chosen, freed = [], 0
    for job in order:
        if freed >= need:
            break
        chosen.append(job)
        freed += job.n
    return chosen, freed


class Policy:
    """FIFO with EASY backfilling, each job on exactly the GPUs it asked for. Subclass to change."""

    #: Name in results and tables.
    name: str = "policy"
    #: The most queued jobs a pass examines after the head blocks (None: all), as Slurm's ``bf_max_job_test``.
    depth: int | None = None

    def reset(self, cluster: Cluster) -> None:
        """Called once before a simulation starts: clear any state from an earlier run."""

    def queue_key(self, job: ClusterJob) -> Hashable:
        """Sort key of a queued job (smaller first). Default: submission order."""
        return (job.idx,)

    def smallest(self, job: ClusterJob) -> int:
        """The fewest GPUs ``job`` can run on under this policy."""
        return job.gpus

    def size(self, cluster: Cluster, job: ClusterJob, free: int, t: float) -> int:
        """GPUs to start ``job`` on now with ``free`` GPUs free (0: keep it queued)."""
        return job.gpus if job.gpus <= free else 0

    def on_start(self, cluster: Cluster, job: ClusterJob, t: float) -> None:
        """Called after every segment start."""

    def on_event(self, cluster: Cluster, job: ClusterJob, kind: int, t: float) -> None:
        """Called for policy events (e.g. a priority change) the policy scheduled itself."""

    def blocked(self, cluster: Cluster, job: ClusterJob, t: float) -> bool:
        """The head ``job`` cannot start; return True if the policy made it start anyway."""
        return False

    def rebalance(self, cluster: Cluster, t: float) -> None:
        """After admissions: grow or shrink running jobs."""

    def victim_key(self, job: ClusterJob, t: float) -> tuple[float, ...]:
        """Sort key of a running job when the capacity drops (smaller is preempted first). Default: the lowest
        priority first, then the most recently started (least work lost)."""
        return (job.priority, -job.seg_start, -job.idx)

    def victims(self, cluster: Cluster, deficit: int, t: float) -> list[ClusterJob]:
        """Running jobs to preempt when the capacity drops ``deficit`` GPUs below those in use, in
        :meth:`victim_key` order until enough GPUs are free."""
        order = sorted(cluster.running.values(), key=lambda j: self.victim_key(j, t))
        return _enough(order, deficit)[0]

    def schedule(self, cluster: Cluster, t: float) -> None:
        """One scheduling pass: admit queued jobs in order with EASY backfilling, then :meth:`rebalance`."""
        self._admit(cluster, t)
        self.rebalance(cluster, t)

    def _admit(self, cluster: Cluster, t: float) -> None:
        if not cluster.queue:
            return
        shadow, spare, scanned = None, 0, 0
        for _, idx in list(cluster.queue):
            free = cluster.free
            job = cluster.jobs[idx]
            if shadow is None:
                n = self.size(cluster, job, free, t) if free > 0 else 0
                if n:
                    cluster.dequeue(job)
                    cluster.start(job, n, t)
                    continue
                if self.blocked(cluster, job, t):
                    continue
                if cluster.free <= 0:
                    break
                shadow, spare = cluster.when_free(self.reserve(job), t)
                continue
            if free <= 0:
                break
            n = self.size(cluster, job, free, t)
            scanned += 1
            if self.depth is not None and scanned > self.depth:
                break
            if n and (t + job.runtime_s(n, cluster.interval) <= shadow or n <= spare):
                if t + job.runtime_s(n, cluster.interval) > shadow:
                    spare -= n
                cluster.dequeue(job)
                cluster.start(job, n, t)

    def reserve(self, job: ClusterJob) -> int:
        """GPUs the blocked head of the queue reserves (default: :meth:`smallest`)."""
        return self.smallest(job)


class Static(Policy):
    """Each job waits for exactly the GPUs it asked for; FIFO with EASY backfilling.

    What Philly itself did, minus its locality constraints (Jeon et al., ATC 2019).
    """

    name = "static"


class Preemptive(Policy):
    """Higher priority first; a blocked higher-priority job preempts lower-priority running ones.

    Priorities come from the jobs' ``priority`` column (larger first). Without one, this is
    Tiresias's discretized two-queue Least-Attained-Service (Gu et al., *Tiresias: A GPU
    Cluster Manager for Distributed Deep Learning*, NSDI 2019): a job has priority 1 until
    it has held ``threshold_gpu_s`` GPU-seconds, then 0. Preempted jobs lose the training
    since their last checkpoint (``checkpoint_every_s``) and pay a restore when they restart.
    """

    name = "preemptive"

    def __init__(self, threshold_gpu_s: float = 3600.0) -> None:
        self.threshold_gpu_s = check_time("threshold_gpu_s", threshold_gpu_s, allow_zero=False)
        self.las = True  # set by simulate: False when the jobs carry their own priority

    def queue_key(self, job: ClusterJob) -> Hashable:
        return (-job.priority, job.idx)

    def on_start(self, cluster: Cluster, job: ClusterJob, t: float) -> None:
        if self.las and job.priority > 0:
            left = self.threshold_gpu_s - job.attained
            cluster.push(t + max(0.0, left) / job.n, DEMOTE, job.idx, job.version)

    def on_event(self, cluster: Cluster, job: ClusterJob, kind: int, t: float) -> None:
        if kind == DEMOTE and job.state == "running":
            job.priority = 0.0

    def blocked(self, cluster: Cluster, job: ClusterJob, t: float) -> bool:
        need = job.gpus - cluster.free
        lower = sorted(
            (j for j in cluster.running.values() if j.priority < job.priority),
            key=lambda j: (j.priority, -j.seg_start, -j.idx),
        )
        chosen, freed = _enough(lower, need)
        if freed < need:
            return False
        for victim in chosen:
            cluster.preempt(victim, t)
        cluster.dequeue(job)
        cluster.start(job, job.gpus, t)
        return True


class Elastic(Policy):
    """Pipelines that shrink and grow: start on what is free when that finishes sooner, grow when GPUs idle.

    A job runs on ``min_gpus``…``max_gpus`` (defaults: half its request, or the fewest its
    stages fit on, up to twice its request). Its speed on ``n`` GPUs comes from its
    profile's best ``P × D`` (:class:`~pipeswift_lab.cluster.scaling.ScalingModel`), and
    every change pays a checkpoint, a re-assembly and a restore. In the spirit of Pollux
    (Qiao et al., OSDI 2021) and AFS (Hwang et al., *Elastic Resource Sharing for
    Distributed Deep Learning*, NSDI 2021), greedily rather than by optimization:

    * admission in FIFO order with EASY backfilling; a queued job starts on fewer GPUs
      than it asked for only if its predicted end on them comes before its predicted end
      after waiting for all of them (the wait read from the running jobs' predicted ends);
      the last job in the queue may take up to ``max_gpus``;
    * when the head of the queue is blocked, jobs holding more than they asked for give
      back the surplus (shrink to their request);
    * when nobody waits, running jobs grow onto free GPUs if the training time saved
      exceeds ``gain_factor`` times the change's cost.
    """

    name = "elastic"

    def __init__(self, gain_factor: float = 2.0) -> None:
        self.gain_factor = check_time("gain_factor", gain_factor)
        if self.gain_factor < 1:
            raise ValueError(f"gain_factor={gain_factor!r} is invalid; it must be a finite number >= 1")
        self.growable: set[int] = set()

    def reset(self, cluster: Cluster) -> None:
        self.growable.clear()

    def smallest(self, job: ClusterJob) -> int:
        return job.min_gpus

    @staticmethod
    def target(job: ClusterJob) -> int:
        """The GPUs a job aims for: its request, within its ``min_gpus``…``max_gpus``."""
        return min(max(job.gpus, job.min_gpus), job.max_gpus)

    def reserve(self, job: ClusterJob) -> int:
        return self.target(job)

    def size(self, cluster: Cluster, job: ClusterJob, free: int, t: float) -> int:
        if free < job.min_gpus:
            return 0
        target = self.target(job)
        last = cluster.queue[-1][1] == job.idx
        n = min(job.max_gpus if last else target, free)
        if n >= target:
            return n
        wait, _ = cluster.when_free(target, t)
        interval = cluster.interval
        return n if t + job.runtime_s(n, interval) < wait + job.runtime_s(target, interval) else 0

    def on_start(self, cluster: Cluster, job: ClusterJob, t: float) -> None:
        if job.n < job.max_gpus:
            self.growable.add(job.idx)

    def _cost(self, job: ClusterJob, n: int) -> float:
        """What growing ``job`` to ``n`` GPUs must save: the move there."""
        return self._move_s(job, n)

    def _move_s(self, job: ClusterJob, n: int) -> float:
        """Seconds a move of ``job`` to ``n`` GPUs costs it: a save on its GPUs, an assembly and a restore on ``n``."""
        m = job.model
        return m.save_s[job.n] + m.assembly_s[n] + m.restore_s[n]

    def rebalance(self, cluster: Cluster, t: float) -> None:
        if cluster.queue:
            self._reclaim(cluster, t)
        elif cluster.free > 0 and self.growable:
            self._grow(cluster, t)

    def _reclaim(self, cluster: Cluster, t: float) -> None:
        head = cluster.jobs[cluster.queue[0][1]]
        deficit = head.min_gpus - cluster.free
        if deficit <= 0:
            return
        grown = [j for j in cluster.running.values() if j.n > self.target(j) and j.resizable(t)]
        if sum(j.n - self.target(j) for j in grown) < deficit:
            return
        for job in sorted(grown, key=lambda j: (-(j.n - self.target(j)), j.idx)):
            if deficit <= 0:
                break
            n = max(self.target(job), job.n - deficit)
            deficit -= job.n - n
            cluster.resize(job, n, t)
        self._admit(cluster, t)

    def _grow(self, cluster: Cluster, t: float) -> None:
        options = []
        for idx in list(self.growable):
            job = cluster.jobs[idx]
            if job.state != "running" or job.n >= job.max_gpus:
                self.growable.discard(idx)
                continue
            if not job.resizable(t):
                continue
            n = min(job.max_gpus, job.n + cluster.free)
            saved = job.work_left(t) * job.ref_speed * (1.0 / job.model.speed[job.n] - 1.0 / job.model.speed[n])
            cost = self._cost(job, n)
            if saved > self.gain_factor * cost:
                options.append((-(saved - cost), idx))
        for _, idx in sorted(options):
            job = cluster.jobs[idx]
            n = min(job.max_gpus, job.n + cluster.free)
            if n > job.n:
                cluster.resize(job, n, t)
