"""The joint objective on a shared cluster: :class:`JointJCT`, the policy behind ``policy="jct"``.

At every scheduling pass the policy weighs the queue and the pipelines together: whom to start, on how many
GPUs, whom to shrink or suspend to let them in, and whom to grow onto idle GPUs, choosing what lowers the
predicted sum of the jobs' remaining completion times. Every prediction comes from the job's
:class:`~pipeswift_lab.cluster.scaling.ScalingModel`: its speed at the best ``P × D`` for each GPU count, and the
costs of a move (a save, a re-assembly, a restore), which ``simulate(..., costs=...)`` can take from measured runs.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..core.checks import check_choice, check_time
from .engine import Cluster, ClusterJob
from .policies import Elastic

__all__ = ["OBJECTIVES", "JointJCT"]

#: What :class:`JointJCT` minimizes, and the order it gives jobs for it.
OBJECTIVES = {
    "mean": "least predicted remaining GPU-time first (SRPT): the lowest mean JCT",
    "p95": "earliest virtual finish first (submission + remaining run time, as fair queueing): aims at the tail",
}


class JointJCT(Elastic):
    """Queue and pipeline configuration chosen together to minimize the jobs' predicted remaining JCT.

    Each pass, in the order of the objective (``"mean"``: least predicted remaining GPU-seconds first, the
    shortest-remaining-processing-time rule that minimizes the mean (Schrage, *Operations Research* 1968), with
    the two-dimensional GPU × time service of Tiresias (Gu et al., NSDI 2019); ``"p95"``: earliest virtual finish
    time, submission plus remaining run time, as fair queueing (Demers et al., SIGCOMM 1989), which bounds how
    long a job can be passed over):

    * **admit**: a queued job starts on the GPUs it asked for, or on fewer when its predicted end on them comes
      before its predicted end after waiting (the wait read from the running jobs' predicted ends); EASY
      backfilling behind the head, as the static policy;
    * **make room**: when the head cannot start, the policy frees GPUs for it if that lowers the predicted sum of
      JCTs. GPUs a grown job holds beyond its request come back first (a loan: the move back was paid for when
      it grew). Then it takes GPUs from jobs of lower priority, for about as long as the head runs: shrinking
      one that can run smaller (its JCT grows by the training it forgoes meanwhile, plus the move), else
      suspending it (a checkpoint; it waits and restarts later: its JCT grows by about the head's run time, plus
      the move; more if higher-priority jobs arrive meanwhile). It acts when the head's predicted wait exceeds
      ``margin`` times the sum of those losses: the exchange argument behind SRPT, with each move's cost counted,
      as Optimus (Peng et al., EuroSys 2018) weighs marginal gains and Sia (Jayaram Subramanya et al., SOSP 2023)
      counts re-allocation costs;
    * **grow**: with nobody waiting, running jobs grow onto free GPUs when the training time saved exceeds
      ``margin`` times the cost of the move there and back, largest net saving first, as Pollux (Qiao et al.,
      OSDI 2021) re-sizes jobs to their goodput. Pollux charges every re-allocation a fixed 30 s; here each move
      pays its job's own save, assembly and restore.

    Running jobs are suspended with a checkpoint (Gandiva's suspend-resume, Xiao et al., OSDI 2018), so a move
    loses no training. Only a capacity drop preempts (involuntarily), lowest priority first.

    The order comes from the job's declared length: a pipeline training job states its steps in its config, and
    its step time is measured. A ``declared_s`` column of the jobs gives it (seconds at the requested GPUs; an
    estimate, which may be wrong), else the true ``duration_s`` is used. The predicted run times that weigh a
    move come from the simulator's own estimates, as for the other policies' backfilling. Jobs with equal
    priority are ordered by attained GPU-seconds, then submission, as least-attained-service does. A ``priority``
    column of the jobs is not used: the objective sets the order. A shrunk job's loss assumes its GPUs come back
    when the head ends; on a cluster that stays busy it runs small for longer, so shrinks are slightly favoured.
    """

    name = "jct"

    def __init__(self, objective: str = "mean", margin: float = 1.0) -> None:
        self.objective = check_choice("objective", objective, OBJECTIVES)
        self.margin = check_time("margin", margin)
        if self.margin < 1:
            raise ValueError(f"margin={margin!r} is invalid; a move must save at least its cost, so margin >= 1")
        super().__init__(gain_factor=self.margin)
        self._targets: list[int] = []
        if self.objective != "mean":
            self.name = f"jct-{self.objective}"

    def priority(self, job: ClusterJob, t: float) -> float:
        """The job's place at ``t`` (smaller first): remaining GPU-seconds (``"mean"``) or virtual finish time."""
        left = job.work_left(t) * job.declared
        return left * job.gpus if self.objective == "mean" else job.submit + left

    def reset(self, cluster: Cluster) -> None:
        super().reset(cluster)
        self._targets = [self.target(job) for job in cluster.jobs]

    def queue_key(self, job: ClusterJob) -> Hashable:
        return (self.priority(job, job.wait_since), job.attained, job.idx)

    def victim_key(self, job: ClusterJob, t: float) -> tuple[float, ...]:
        """When the capacity drops, the lowest priority (the largest :meth:`priority`) is preempted first."""
        return (-self.priority(job, t), -job.idx)

    def rebalance(self, cluster: Cluster, t: float) -> None:
        if not cluster.queue and cluster.free > 0 and self.growable:
            self._grow(cluster, t)

    def blocked(self, cluster: Cluster, job: ClusterJob, t: float) -> bool:
        """Make room for the blocked head ``job`` when the predicted sum of JCTs drops; return whether it started."""
        target = self._targets[job.idx]
        need = target - cluster.free
        wait = cluster.when_free(target, t)[0] - t
        run = job.runtime_s(target, cluster.interval)
        if need <= 0 or wait <= 0:
            return False
        plan = self._room(cluster, job, need, min(run, wait), t)
        if plan is None or not wait > self.margin * sum(loss for _, _, loss in plan):
            return False
        for victim, n, _ in plan:
            if n:
                cluster.resize(victim, n, t)
            else:
                cluster.suspend(victim, t)
        cluster.dequeue(job)
        cluster.start(job, target, t)
        return True

    def _room(
        self, cluster: Cluster, job: ClusterJob, need: int, delay: float, t: float
    ) -> list[tuple[ClusterJob, int, float]] | None:
        """The moves that free ``need`` GPUs for ``job``: ``(victim, GPUs it keeps (0: suspended), predicted JCT
        increase)``, GPUs held beyond a request first, then the lowest priority; ``None`` when they cannot."""
        head = job.key[0]
        mean, targets = self.objective == "mean", self._targets
        surplus, lower = [], []
        for other in cluster.running.values():  # inlined work_left, priority and resizable: the hot loop
            if t >= other.seg_end - other.seg_C or other.seg_start == t:  # cleaning up, or started or moved just now
                continue
            if other.n > targets[other.idx]:
                surplus.append(other)
                continue
            trained = t - other.seg_start - other.seg_A - other.seg_L
            left = other.work - trained * other.model.speed[other.n] / other.ref_speed if trained > 0 else other.work
            left = max(0.0, left) * other.declared
            rank = left * other.gpus if mean else other.submit + left
            if rank > head:
                lower.append((rank, other))
        plan, freed = [], 0
        for victim in sorted(surplus, key=lambda j: (targets[j.idx] - j.n, j.idx)):
            if freed >= need:
                break
            keep = max(targets[victim.idx], victim.n - (need - freed))
            plan.append((victim, keep, 0.0))  # GPUs on loan: the move back was paid for when the job grew
            freed += victim.n - keep
        for _, victim in sorted(lower, key=lambda pair: (-pair[0], -pair[1].idx)):
            if freed >= need:
                break
            keep = victim.n - (need - freed)
            if keep >= victim.min_gpus and victim.model.speed[keep] > 0:
                plan.append((victim, keep, self._shrink_loss(victim, keep, delay, t)))
            else:
                keep = 0
                plan.append((victim, 0, delay + self._move_s(victim, victim.n)))
            freed += victim.n - keep
        if freed < need:
            return None
        for move in list(plan):  # the last move may free enough alone: drop the earlier ones it makes needless
            victim, keep, _ = move
            if freed - (victim.n - keep) >= need:
                plan.remove(move)
                freed -= victim.n - keep
        return plan

    def _cost(self, job: ClusterJob, n: int) -> float:
        """What growing ``job`` to ``n`` GPUs must save: the move there and the move back to its request, since GPUs
        lent to a grown job come back whenever a queued job needs them."""
        m, target = job.model, self._targets[job.idx]
        return self._move_s(job, n) + m.save_s[n] + m.assembly_s[target] + m.restore_s[target]

    def _shrink_loss(self, job: ClusterJob, n: int, delay: float, t: float) -> float:
        """Seconds ``job``'s JCT grows if it lends GPUs for ``delay`` seconds, running on ``n`` meanwhile: the training
        it does not do in that time (capped by its remaining run) plus the move."""
        m = job.model
        slower = min(delay, job.seg_end - t) * (1.0 - m.speed[n] / m.speed[job.n])
        return slower + self._move_s(job, n)
