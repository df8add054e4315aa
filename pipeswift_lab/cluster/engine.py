"""The discrete-event core of the cluster simulation: jobs, segments, GPUs and the event heap.

A job runs as one or more *segments*, each on a fixed number of GPUs ``n``::

    [assembly A][restore / resize checkpoint L][training R, with a checkpoint stall of stall_s every τ][cleanup C]

``A`` comes from :class:`~pipeswift_lab.core.costs.AssemblyModel`, ``L`` is the restore of the
last checkpoint (when there is one) plus, after a resize, the checkpoint written before
it (a whole save, ``save_s``: the job waits for it); ``R`` is the remaining work at the segment's
speed; a periodic checkpoint stalls training ``stall_s`` (only its staging copy when saves are
asynchronous, :meth:`~pipeswift_lab.core.costs.CheckpointModel.stall_s`); ``C`` is the final checkpoint and
teardown. A segment ends in one event (its finish), or early when the policy resizes or
suspends the job (a *voluntary* stop: all training so far is checkpointed; a suspended job
queues again) or preempts it (an *involuntary* stop: the training since the last periodic
checkpoint is lost).

Every second of a job's life is charged to exactly one term, so
``end_s - submit_s = queue_s + assembly_s + training_s + cleanup_s + preemption_loss_s``:
queue is time holding no GPU; assembly every segment's ``A``; training the training kept;
cleanup the final ``C``; preemption loss the restores, the checkpoints' stalls (periodic,
and the whole saves before resizes and suspensions) and the training lost to preemptions.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .scaling import ScalingModel

__all__ = ["CAPACITY", "DEMOTE", "FINISH", "Cluster", "ClusterJob", "PolicyHooks"]

#: Event kinds, in the order they are handled at one instant: GPUs freed first, then
#: capacity changes, then priority changes, then arrivals (read from the sorted jobs).
FINISH, CAPACITY, DEMOTE = 0, 1, 2


class ClusterJob:
    """One job's state while the cluster is simulated (``__slots__`` for speed); a policy reads and orders these."""

    __slots__ = (
        *("idx", "name", "submit", "gpus", "min_gpus", "max_gpus", "priority", "model", "ref_speed", "work"),
        *("has_state", "state", "n", "version", "wait_since", "reason", "key"),
        *("seg_start", "seg_A", "seg_L", "seg_save", "seg_R", "seg_k", "seg_C", "seg_stall", "seg_end"),  # its segment
        *("queue", "assembly", "training", "cleanup", "loss", "lost_work"),  # the JCT terms so far
        *("restarts", "resizes", "preemptions", "suspensions", "start", "end", "held_min", "held_max", "attained"),
        "declared",  # the run time the job declares over its true one: what a policy believes, 1 when exact
        "pending_save",  # seconds of a checkpoint written but not yet charged (a suspension's), paid at the next start
    )

    def __init__(
        self,
        *,
        idx: int,
        name: str,
        submit: float,
        gpus: int,
        min_gpus: int,
        max_gpus: int,
        priority: float,
        model: ScalingModel,
    ) -> None:
        self.idx, self.name, self.submit, self.gpus = idx, name, submit, gpus
        self.min_gpus, self.max_gpus, self.priority, self.model = min_gpus, max_gpus, priority, model
        self.ref_speed = 0.0
        self.work = 0.0  # remaining training, in seconds at the requested GPUs
        self.has_state = False  # a checkpoint exists to restore from
        self.state = "pending"
        self.n = 0
        self.version = 0
        self.seg_start = self.seg_A = self.seg_L = self.seg_save = self.seg_R = self.seg_C = self.seg_stall = 0.0
        self.seg_end = 0.0
        self.seg_k = 0
        self.wait_since = submit
        self.queue = self.assembly = self.training = self.cleanup = self.loss = 0.0
        self.lost_work = 0.0  # training (and partial cleanup) lost to preemptions, inside ``loss``
        self.restarts = self.resizes = self.preemptions = self.suspensions = 0
        self.start = self.end = math.nan
        self.held_min, self.held_max = 0, 0
        self.attained = 0.0  # GPU-seconds held so far
        self.pending_save = 0.0
        self.declared = 1.0
        self.reason = ""
        self.key: Any = None  # the policy's queue_key while queued

    def wall_s(self, n: int) -> float:
        """Seconds of training left on ``n`` GPUs (no checkpoints)."""
        return self.work * self.ref_speed / self.model.speed[n]

    def runtime_s(self, n: int, interval: float) -> float:
        """Predicted seconds from a start on ``n`` GPUs to the end: assembly, restore, training, periodic checkpoints'
        stalls and cleanup."""
        m = self.model
        R = self.wall_s(n)
        k = max(0, math.ceil(R / interval) - 1) if interval < math.inf and R > 0 else 0
        return m.assembly_s[n] + (m.restore_s[n] if self.has_state else 0.0) + R + k * m.stall_s[n] + m.cleanup_s[n]

    def work_left(self, t: float) -> float:
        """Training left at ``t``, in seconds on the requested GPUs: the segment's work less what its training phase
        has done by ``t`` (its checkpoints' stalls counted as training: a slight underestimate of the work left)."""
        if self.state != "running":
            return self.work
        trained = max(0.0, t - self.seg_start - self.seg_A - self.seg_L)
        return max(0.0, self.work - trained * self.model.speed[self.n] / self.ref_speed)

    def resizable(self, t: float) -> bool:
        """Whether the job runs at ``t`` and has not reached its cleanup (a resize would not be absurd)."""
        return self.state == "running" and t < self.seg_end - self.seg_C

    def in_training(self, t: float) -> bool:
        """Whether the job is in its training phase at ``t`` (past assembly and restore, before cleanup)."""
        return self.state == "running" and self.seg_start + self.seg_A + self.seg_L <= t < self.seg_end - self.seg_C


class PolicyHooks(Protocol):
    """What the cluster's event loop (here and in :mod:`.simulator`) calls on its policy.

    :class:`~pipeswift_lab.cluster.policies.Policy` has every hook; the engine names only this shape, so that it
    does not import the policies that drive it.
    """

    name: str

    def queue_key(self, job: ClusterJob) -> Hashable:
        """Sort key of a queued job (smaller first)."""
        ...

    def smallest(self, job: ClusterJob) -> int:
        """The fewest GPUs ``job`` can run on."""
        ...

    def on_start(self, cluster: Cluster, job: ClusterJob, t: float) -> None:
        """Called after every segment start."""
        ...

    def on_event(self, cluster: Cluster, job: ClusterJob, kind: int, t: float) -> None:
        """Called for the events the policy scheduled itself."""
        ...

    def schedule(self, cluster: Cluster, t: float) -> None:
        """One scheduling pass over the queue and the running jobs."""
        ...

    def victims(self, cluster: Cluster, deficit: int, t: float) -> list[ClusterJob]:
        """Running jobs to preempt when the capacity drops ``deficit`` GPUs below those in use."""
        ...


class Cluster:
    """GPUs, queue, running jobs and the event heap; policies act through its methods.

    ``queue`` is a list of ``(key, idx)`` kept sorted (the policy's :meth:`queue_key`);
    ``ends`` the running jobs' predicted ends, sorted, for reservations.
    """

    def __init__(
        self,
        jobs: Sequence[ClusterJob],
        capacity: Sequence[tuple[float, int]],
        interval_s: float | None,
        policy: PolicyHooks,
        *,
        seed: int = 0,
    ) -> None:
        self.jobs = jobs
        self.capacity_points = capacity
        self.capacity = capacity[0][1]
        self.used = 0
        self.queue: list[tuple[Any, int]] = []
        self.running: dict[int, ClusterJob] = {}
        self.ends: list[tuple[float, int]] = []
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.interval = interval_s if interval_s is not None else math.inf
        self.policy = policy
        self.now = 0.0
        self.usage: list[tuple[float, int, int]] = []  # (time_s, gpus_used, capacity)
        self.events = 0
        self.dirty = False  # the queue changed since the last schedule
        self.rng = np.random.default_rng(seed)  # the generator a policy may draw from (seeded by simulate's seed=)

    # -- events -------------------------------------------------------------------------
    def push(self, t: float, kind: int, idx: int, version: int = 0) -> None:
        """Schedule an event."""
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, idx, version))

    @property
    def free(self) -> int:
        """GPUs free now (can be negative for an instant after a capacity drop)."""
        return self.capacity - self.used

    # -- queue ----------------------------------------------------------------------------
    def enqueue(self, job: ClusterJob, t: float) -> None:
        """Put ``job`` in the queue at its policy key; it holds no GPU from ``t``."""
        job.state = "queued"
        job.wait_since = t
        job.key = self.policy.queue_key(job)
        insort(self.queue, (job.key, job.idx))
        self.dirty = True

    def dequeue(self, job: ClusterJob) -> None:
        """Take ``job`` out of the queue."""
        i = bisect_left(self.queue, (job.key, job.idx))
        del self.queue[i]

    # -- segments -------------------------------------------------------------------------
    def start(self, job: ClusterJob, n: int, t: float, resize_save_s: float = 0.0) -> None:
        """Start a segment of ``job`` on ``n`` GPUs at ``t`` (the job must hold none and not be queued)."""
        m = job.model
        if n < 1 or m.speed[n] <= 0:
            raise RuntimeError(f"policy {self.policy.name!r} started {job.name} on {n} GPUs, where it cannot run")
        if n > self.free:
            raise RuntimeError(f"policy {self.policy.name!r} started {job.name} on {n} GPUs with only {self.free} free")
        job.queue += t - job.wait_since
        if math.isnan(job.start):
            job.start = t
            job.held_min = n
        restore = m.restore_s[n] if job.has_state else 0.0
        save, job.pending_save = resize_save_s + job.pending_save, 0.0
        R = job.wall_s(n)
        k = max(0, math.ceil(R / self.interval) - 1) if self.interval < math.inf and R > 0 else 0
        job.n, job.state = n, "running"
        job.seg_start, job.seg_A, job.seg_L, job.seg_R, job.seg_k = t, m.assembly_s[n], restore + save, R, k
        job.seg_save = save
        job.seg_stall, job.seg_C = m.stall_s[n], m.cleanup_s[n]
        job.seg_end = t + job.seg_A + job.seg_L + R + k * job.seg_stall + job.seg_C
        job.held_min, job.held_max = min(job.held_min, n), max(job.held_max, n)
        job.version += 1
        self.used += n
        self.running[job.idx] = job
        insort(self.ends, (job.seg_end, job.idx))
        self.push(job.seg_end, FINISH, job.idx, job.version)
        self.policy.on_start(self, job, t)

    def _release(self, job: ClusterJob, t: float) -> None:
        self.used -= job.n
        job.attained += job.n * (t - job.seg_start)
        i = bisect_left(self.ends, (job.seg_end, job.idx))
        del self.ends[i]
        del self.running[job.idx]
        job.n = 0
        job.version += 1

    def finish(self, job: ClusterJob, t: float) -> None:
        """The segment reached its end: the job is done."""
        job.assembly += job.seg_A
        job.loss += job.seg_L + job.seg_k * job.seg_stall
        job.training += job.seg_R
        job.cleanup += job.seg_C
        job.work = 0.0
        self._release(job, t)
        job.state, job.end = "done", t

    def stop(self, job: ClusterJob, t: float, voluntary: bool) -> None:
        """End the running segment of ``job`` at ``t`` early and charge what it did.

        ``voluntary`` (a resize): the training done is checkpointed and kept. Otherwise (a
        preemption) only the training up to the last periodic checkpoint is kept; the rest
        is lost. The job then holds no GPU; the caller re-queues or restarts it.
        """
        elapsed = t - job.seg_start
        A, L = job.seg_A, job.seg_L
        # the checkpoint this segment carries (the first part of L) was written: what is not yet charged moves on
        job.pending_save += min(job.seg_save, max(0.0, A + job.seg_save - elapsed))
        if elapsed <= A:
            job.assembly += elapsed
        elif elapsed <= A + L:
            job.assembly += A
            job.loss += elapsed - A
        else:
            job.assembly += A
            job.loss += L
            x = elapsed - A - L
            R, stall, k = job.seg_R, job.seg_stall, job.seg_k
            if x >= R + k * stall:  # in cleanup: all training is done, the cleanup so far is lost
                kept, ckpt, lost = R, k * stall, x - R - k * stall
            elif self.interval == math.inf:
                kept, ckpt, lost = (x, 0.0, 0.0) if voluntary else (0.0, 0.0, x)
            else:
                cycle = self.interval + stall
                c = min(int(x // cycle), k)
                within = x - c * cycle
                if voluntary:
                    kept, ckpt, lost = (
                        c * self.interval + min(within, self.interval),
                        c * stall + max(0.0, within - self.interval),
                        0.0,
                    )
                else:
                    kept, ckpt = c * self.interval, c * stall
                    lost = x - kept - ckpt
            job.training += kept
            job.loss += ckpt + lost
            job.lost_work += lost
            job.work = max(0.0, job.work - kept * job.model.speed[job.n] / job.ref_speed)
            if kept > 0:
                job.has_state = True
        if voluntary and elapsed > A:
            job.has_state = True  # the resize writes a checkpoint of the training so far
        self._release(job, t)

    def preempt(self, job: ClusterJob, t: float) -> None:
        """Stop ``job`` involuntarily and put it back in the queue."""
        self.stop(job, t, voluntary=False)
        job.preemptions += 1
        job.restarts += 1
        self.enqueue(job, t)

    def suspend(self, job: ClusterJob, t: float) -> None:
        """Checkpoint ``job`` and put it back in the queue, keeping all its training (Gandiva's suspend-resume).

        The save (``save_s`` on its GPUs, when it has trained since its last start) is charged to its preemption loss
        when it restarts, with the restore (and carried on if that segment is stopped before the save is charged);
        its GPUs are free at once (the save's time on them is not modelled).
        """
        save = job.model.save_s[job.n] if job.in_training(t) else 0.0
        self.stop(job, t, voluntary=True)
        job.pending_save += save
        job.restarts += 1
        job.suspensions += 1
        self.enqueue(job, t)

    def resize(self, job: ClusterJob, n: int, t: float) -> None:
        """Checkpoint ``job`` and restart it on ``n`` GPUs at once (paying save, assembly and restore)."""
        save = job.model.save_s[job.n] if job.in_training(t) else 0.0  # nothing new to save before training
        self.stop(job, t, voluntary=True)
        job.resizes += 1
        job.restarts += 1
        job.wait_since = t
        self.start(job, n, t, resize_save_s=save)

    # -- reservations ---------------------------------------------------------------------
    def when_free(self, need: int, t: float) -> tuple[float, int]:
        """When ``need`` GPUs will be free if running jobs end as predicted: ``(time, GPUs to spare then)``.

        ``(inf, 0)`` when the running jobs alone never free enough at today's capacity.
        """
        free = self.free
        if free >= need:
            return t, free - need
        for end, idx in self.ends:
            free += self.jobs[idx].n
            if free >= need:
                return end, free - need
        return math.inf, 0

    def record(self, t: float) -> None:
        """Append the usage at ``t`` (one row per instant, the last write wins)."""
        if self.usage and self.usage[-1][0] == t:
            self.usage[-1] = (t, self.used, self.capacity)
        elif not self.usage or self.usage[-1][1:] != (self.used, self.capacity):
            self.usage.append((t, self.used, self.capacity))
