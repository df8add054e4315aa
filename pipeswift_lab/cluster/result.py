"""What a cluster simulation returns (:class:`ClusterResult`) and how results compare (:func:`compare`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.checks import check_choice
from ..core.display import html_card, text_card
from ..core.jct import TERMS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .engine import Cluster, ClusterJob
    from .policies import Policy

__all__ = ["JOB_COLUMNS", "UNITS", "ClusterComparison", "ClusterResult", "compare"]

#: Columns of :attr:`ClusterResult.jobs`, in order.
JOB_COLUMNS = (
    *("name", "submit_s", "gpus", "profile", "priority", "start_s", "end_s", *TERMS, "jct_s", "lost_work_s"),
    *("restarts", "resizes", "preemptions", "min_gpus_held", "max_gpus_held", "finished", "reason"),
)
#: Time units of the plots: seconds per unit.
UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


@dataclass(frozen=True, eq=False)
class ClusterResult:
    """One simulated trace under one policy.

    * ``jobs`` — one row per job: ``name``, ``submit_s``, ``gpus`` (requested), ``profile``,
      ``priority`` (at the end), ``start_s`` (first start), ``end_s``, the JCT terms
      ``queue_s``, ``assembly_s``, ``training_s``, ``cleanup_s``, ``preemption_loss_s`` and
      their sum ``jct_s = end_s - submit_s``; ``lost_work_s`` (the part of the preemption
      loss that was training thrown away), ``restarts`` (= ``resizes + preemptions``),
      ``min_gpus_held``/``max_gpus_held``, ``finished`` and, if not, the ``reason``;
    * ``usage`` — the step function ``time_s``, ``gpus_used``, ``capacity``;
    * ``summary`` — jobs, finished, mean/p50/p95/p99 JCT, mean queue, makespan, utilization,
      events and the simulation's wall time;
    * ``label`` (the policy's name by default), ``inputs`` (policy, checkpoint interval, seed, capacity).
    """

    jobs: pd.DataFrame = field(repr=False)
    usage: pd.DataFrame = field(repr=False)
    label: str
    inputs: dict[str, Any] = field(repr=False)
    stats: dict[str, Any] = field(repr=False)

    @classmethod
    def from_cluster(
        cls,
        cluster: Cluster,
        profile_names: Sequence[str],
        policy: Policy,
        capacity: Sequence[tuple[float, int]],
        checkpoint_every_s: float | None,
        wall_s: float,
        seed: int,
    ) -> ClusterResult:
        """Collect a finished :class:`~pipeswift_lab.cluster.engine.Cluster` into a result."""
        rows = [_job_row(job, profile) for job, profile in zip(cluster.jobs, profile_names)]
        jobs = pd.DataFrame(rows, columns=list(JOB_COLUMNS))
        usage = pd.DataFrame(cluster.usage, columns=["time_s", "gpus_used", "capacity"])
        inputs = {"policy": policy.name, "checkpoint_every_s": checkpoint_every_s, "seed": seed, "capacity": capacity}
        stats = {"events": cluster.events, "wall_s": wall_s}
        return cls(jobs, usage, policy.name, inputs, stats)

    def relabel(self, label: str) -> ClusterResult:
        """The same result under another label (for :func:`compare`)."""
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str; got {label!r}")
        return ClusterResult(self.jobs, self.usage, label, self.inputs, self.stats)

    @property
    def finished(self) -> pd.DataFrame:
        """The rows of :attr:`jobs` that finished."""
        return self.jobs[self.jobs["finished"]]

    @property
    def utilization(self) -> float:
        """GPU-seconds used over GPU-seconds of capacity, from the first submission to the last end."""
        u = self.usage
        start = float(self.jobs["submit_s"].min())
        end = float(self.finished["end_s"].max()) if len(self.finished) else start
        if end <= start:
            return math.nan
        times = np.clip(np.append(u["time_s"].to_numpy(float), end), start, end)
        dt = np.diff(times)
        cap = float((u["capacity"].to_numpy(float) * dt).sum())
        return float((u["gpus_used"].to_numpy(float) * dt).sum() / cap) if cap > 0 else math.nan

    @property
    def summary(self) -> dict[str, Any]:
        """Mean, p50, p95, p99 JCT (s) of the finished jobs, mean queue, makespan, utilization, events, wall time."""
        jct = self.finished["jct_s"].to_numpy(float)
        pct = np.percentile(jct, [50, 95, 99]) if len(jct) else [math.nan] * 3
        events, wall = self.stats["events"], self.stats["wall_s"]
        makespan = float(self.finished["end_s"].max() - self.jobs["submit_s"].min()) if len(jct) else math.nan
        return {
            "policy": self.label,
            "jobs": len(self.jobs),
            "finished": int(len(jct)),
            "unfinished": int(len(self.jobs) - len(jct)),
            "mean_jct_s": float(jct.mean()) if len(jct) else math.nan,
            "p50_jct_s": float(pct[0]),
            "p95_jct_s": float(pct[1]),
            "p99_jct_s": float(pct[2]),
            "mean_queue_s": float(self.finished["queue_s"].mean()) if len(jct) else math.nan,
            "makespan_s": makespan,
            "utilization": self.utilization,
            "restarts": int(self.jobs["restarts"].sum()),
            "events": events,
            "wall_s": wall,
            "events_per_s": events / wall if wall > 0 else math.nan,
        }

    def breakdown(self) -> pd.DataFrame:
        """Mean seconds per finished job of each JCT term (one row), with ``jct_s``."""
        return self.finished[[*TERMS, "jct_s"]].mean().to_frame(self.label).T

    # -- plots ----------------------------------------------------------------------------
    def plot_cdf(self, ax: Axes | None = None, unit: str = "h", **kwargs: Any) -> Axes:
        """The empirical CDF of the finished jobs' JCT (log x axis). Returns the Axes."""
        from ..core.plot import get_ax

        ax = get_ax(ax)
        x = np.sort(self.finished["jct_s"].to_numpy(float)) / _scale(unit)
        ax.step(x, np.arange(1, len(x) + 1) / max(1, len(x)), where="post", label=self.label, **kwargs)
        ax.set_xscale("log")
        ax.set_xlabel(f"job completion time ({unit})")
        ax.set_ylabel("fraction of jobs")
        ax.set_ylim(0, 1.0)
        return ax

    def plot_usage(self, ax: Axes | None = None, unit: str = "h") -> Axes:
        """GPUs used and the capacity over time. Returns the Axes."""
        from ..core.plot import get_ax

        ax = get_ax(ax)
        u = self.usage
        t = u["time_s"].to_numpy(float) / _scale(unit)
        ax.step(t, u["capacity"], where="post", color="0.3", linestyle="--", label="capacity")
        ax.fill_between(t, u["gpus_used"], step="post", alpha=0.6, label=f"used ({self.label})")
        ax.set_xlabel(f"time ({unit})")
        ax.set_ylabel("GPUs")
        ax.legend(loc="upper right", fontsize="small")
        return ax

    def plot(self, ax: Axes | None = None, unit: str = "h") -> Axes:
        """The JCT CDF; with ``ax=None``, also the utilization over time in a second panel.

        Returns the Axes of the CDF (the usage panel is ``ax.figure.axes[1]``).
        """
        if ax is not None:
            return self.plot_cdf(ax=ax, unit=unit)
        import matplotlib.pyplot as plt
        import seaborn as sns

        sns.set_theme(style="whitegrid", context="notebook")
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
        self.plot_cdf(ax=left, unit=unit)
        left.set_title(f"{self.label}: mean JCT {self.summary['mean_jct_s'] / 3600:.3g} h")
        self.plot_usage(ax=right, unit=unit)
        right.set_title(f"utilization {self.utilization:.0%}")
        fig.tight_layout()
        return left

    # -- display --------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        return html_card(f"ClusterResult {self.label}", self.summary, self.jobs)

    def __repr__(self) -> str:
        return text_card(f"ClusterResult {self.label}", self.summary)


def _scale(unit: str) -> float:
    """Seconds per ``unit`` (one of :data:`UNITS`)."""
    return UNITS[check_choice("unit", unit, UNITS)]


def _job_row(job: ClusterJob, profile: str) -> tuple[Any, ...]:
    """One row of :attr:`ClusterResult.jobs`, in the order of :data:`JOB_COLUMNS`."""
    finished = job.state == "done"
    end = job.end if finished else math.nan
    terms = (job.queue, job.assembly, job.training, job.cleanup, job.loss)
    counts = (job.restarts, job.resizes, job.preemptions, job.held_min, job.held_max)
    identity = (job.name, job.submit, job.gpus, profile, job.priority, job.start, end)
    return (*identity, *terms, end - job.submit, job.lost_work, *counts, finished, job.reason)


@dataclass(frozen=True, eq=False)
class ClusterComparison:
    """Several :class:`ClusterResult` side by side: ``table`` (one summary row each), CDFs, breakdowns."""

    results: tuple[ClusterResult, ...] = field(repr=False)

    @property
    def table(self) -> pd.DataFrame:
        """One row per result: its :attr:`ClusterResult.summary`, plus mean JCT relative to the first."""
        table = pd.DataFrame([r.summary for r in self.results])
        table["mean_jct_vs_first"] = table["mean_jct_s"] / table["mean_jct_s"].iloc[0] - 1.0
        return table

    def breakdown(self) -> pd.DataFrame:
        """Mean seconds per finished job of each JCT term, one row per result."""
        return pd.concat([r.breakdown() for r in self.results])

    def plot(self, ax: Axes | None = None, unit: str = "h") -> Axes:
        """JCT CDFs of every result on one Axes. Returns the Axes."""
        from ..core.plot import get_ax

        ax = get_ax(ax)
        for r in self.results:
            r.plot_cdf(ax=ax, unit=unit)
        ax.legend(loc="lower right", fontsize="small")
        return ax

    def plot_breakdown(self, ax: Axes | None = None, unit: str = "h") -> Axes:
        """Stacked bars of the mean JCT terms per result. Returns the Axes."""
        from ..core.jct import JCT

        rows = self.breakdown()
        jcts = [JCT(**{t: float(row[t]) for t in TERMS}, label=str(label)) for label, row in rows.iterrows()]
        return JCT.plot_many(jcts, ax=ax, unit=unit)

    def _repr_html_(self) -> str:
        return html_card(
            f"{len(self.results)} cluster simulations", {"labels": ", ".join(r.label for r in self.results)}, self.table
        )


def compare(*results: ClusterResult) -> ClusterComparison:
    """Compare results of :func:`~pipeswift_lab.cluster.simulate` (distinct labels; see
    :meth:`ClusterResult.relabel`)."""
    if not results:
        raise ValueError("compare needs at least one ClusterResult")
    for r in results:
        if not isinstance(r, ClusterResult):
            raise TypeError(f"compare takes ClusterResult objects; got {type(r).__name__}")
    labels = [r.label for r in results]
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must be distinct to compare results; got {labels} (use result.relabel('...'))")
    return ClusterComparison(tuple(results))
