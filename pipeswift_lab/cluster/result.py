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
    *("restarts", "resizes", "preemptions", "suspensions", "min_gpus_held", "max_gpus_held", "finished", "reason"),
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
      loss that was training thrown away), ``restarts`` (= ``resizes + preemptions + suspensions``; a suspension is a
      policy's checkpoint-and-requeue, a preemption an involuntary stop),
      ``min_gpus_held``/``max_gpus_held``, ``finished`` and, if not, the ``reason``;
    * ``usage`` — the step function ``time_s``, ``gpus_used``, ``capacity``;
    * ``summary`` — jobs, finished, mean/p50/p95/p99 JCT, mean queue, makespan, utilization,
      restarts, resizes, preemptions, events and the simulation's wall time;
    * ``label`` (the policy's name by default), ``inputs`` (policy, checkpoint interval, seed, capacity and,
      when given, the ``workload`` label), ``workload`` (the window the result belongs to);
    * ``compare(*others)`` — a :class:`ClusterComparison` of this result and others.
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
        workload: str | None = None,
    ) -> ClusterResult:
        """Collect a finished :class:`~pipeswift_lab.cluster.engine.Cluster` into a result (``workload``: the label
        of its window, ``None`` to derive one, see :attr:`workload`). Returns the :class:`ClusterResult`."""
        rows = [_job_row(job, profile) for job, profile in zip(cluster.jobs, profile_names)]
        jobs = pd.DataFrame(rows, columns=list(JOB_COLUMNS))
        usage = pd.DataFrame(cluster.usage, columns=["time_s", "gpus_used", "capacity"])
        inputs = {"policy": policy.name, "checkpoint_every_s": checkpoint_every_s, "seed": seed, "capacity": capacity}
        inputs["workload"] = workload
        stats = {"events": cluster.events, "wall_s": wall_s}
        return cls(jobs, usage, policy.name, inputs, stats)

    def relabel(self, label: str) -> ClusterResult:
        """The same result under another label (for :func:`compare`)."""
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str; got {label!r}")
        return ClusterResult(self.jobs, self.usage, label, self.inputs, self.stats)

    @property
    def workload(self) -> str:
        """The window this result belongs to: ``inputs["workload"]`` when one was given, else a label from the
        jobs and the capacity, e.g. ``"1,234 jobs, days 42.0-49.0, 512 GPUs"`` (``"≤512 GPUs"`` when the capacity
        varies; ``hours`` when the submissions span less than a day). Results of the same jobs and capacity get
        the same label, so :meth:`ClusterComparison.ranking` ranks them together. Returns a str."""
        given = self.inputs.get("workload")
        if given is not None:
            return str(given)
        capacity = self.inputs.get("capacity")
        if not capacity:
            capacity = tuple(zip(self.usage["time_s"].tolist(), self.usage["capacity"].tolist()))
        return _workload_label(self.jobs["submit_s"].to_numpy(float), capacity)

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
        """Mean, p50, p95, p99 JCT (s) of the finished jobs, mean queue, makespan, utilization, restarts, resizes,
        preemptions, suspensions (sums over the jobs), events, wall time. Returns a dict."""
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
            "resizes": int(self.jobs["resizes"].sum()),
            "preemptions": int(self.jobs["preemptions"].sum()),
            "suspensions": int(self.jobs["suspensions"].sum()),
            "events": events,
            "wall_s": wall,
            "events_per_s": events / wall if wall > 0 else math.nan,
        }

    def compare(self, *others: ClusterResult) -> ClusterComparison:
        """This result side by side with ``others`` (``static.compare(elastic, preemptive)``): the same as
        :func:`compare` ``(self, *others)``. Returns a :class:`ClusterComparison`."""
        return compare(self, *others)

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
        first, end = float(self.jobs["submit_s"].min()), float(u["time_s"].max())
        if end > first and ax.get_xscale() == "linear":
            ax.set_xlim(first / _scale(unit), end / _scale(unit))  # from the first submission
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


def _workload_label(submit_s: np.ndarray, capacity: Sequence[tuple[float, int]]) -> str:
    """``"<n> jobs, days <first>-<last submission>, <max> GPUs"`` (``≤<max>`` when the capacity varies)."""
    parts = [f"{len(submit_s):,} jobs"]
    if len(submit_s):
        lo, hi = float(submit_s.min()), float(submit_s.max())
        unit, scale = ("days", 86400.0) if hi - lo >= 86400.0 else ("hours", 3600.0)
        parts.append(f"{unit} {lo / scale:.1f}-{hi / scale:.1f}")
    gpus = [int(n) for _, n in capacity]
    if gpus:
        parts.append(f"{'' if len(set(gpus)) == 1 else '≤'}{max(gpus):,} GPUs")
    return ", ".join(parts)


def _job_row(job: ClusterJob, profile: str) -> tuple[Any, ...]:
    """One row of :attr:`ClusterResult.jobs`, in the order of :data:`JOB_COLUMNS`."""
    finished = job.state == "done"
    end = job.end if finished else math.nan
    terms = (job.queue, job.assembly, job.training, job.cleanup, job.loss)
    counts = (job.restarts, job.resizes, job.preemptions, job.suspensions, job.held_min, job.held_max)
    identity = (job.name, job.submit, job.gpus, profile, job.priority, job.start, end)
    return (*identity, *terms, end - job.submit, job.lost_work, *counts, finished, job.reason)


@dataclass(frozen=True, eq=False)
class ClusterComparison:
    """Several :class:`ClusterResult` side by side, from one window (workload) or several.

    * ``ranking`` — per workload, the policies from the lowest mean JCT: mean, p50, p95 JCT, the mean JCT terms,
      utilization, resizes, restarts, preemptions, suspensions (hours; what a researcher reads first);
    * ``table`` — one :attr:`ClusterResult.summary` row each (seconds), ``breakdown()`` — the mean terms (seconds);
    * ``plot()`` — JCT CDFs and GPU usage over time, ``plot_usage()``, ``plot_breakdown()``.
    """

    results: tuple[ClusterResult, ...] = field(repr=False)

    @property
    def workloads(self) -> list[str]:
        """The results' :attr:`ClusterResult.workload` labels, each once, in order of first appearance."""
        return list(dict.fromkeys(r.workload for r in self.results))

    @property
    def table(self) -> pd.DataFrame:
        """One row per result: its :attr:`ClusterResult.summary`, plus mean JCT relative to the first."""
        table = pd.DataFrame([r.summary for r in self.results])
        table["mean_jct_vs_first"] = table["mean_jct_s"] / table["mean_jct_s"].iloc[0] - 1.0
        return table

    @property
    def ranking(self) -> pd.DataFrame:
        """The policies ranked per workload; returns a DataFrame, one row per result.

        Columns: ``workload``, ``rank`` (1 = the lowest mean JCT in its workload; ties go to the lower p95, then
        to the earlier result; a result with no finished job ranks last), ``policy`` (the label), ``jobs``,
        ``finished``, ``mean_jct_h``, ``p50_jct_h``, ``p95_jct_h`` (of the finished jobs), the mean hours per
        finished job of each JCT term — ``queue_h``, ``assembly_h``, ``training_h``, ``cleanup_h``,
        ``preemption_loss_h``, which sum to ``mean_jct_h`` — ``utilization``, ``resizes``, ``restarts``,
        ``preemptions``, ``suspensions`` (sums over the jobs) and ``mean_vs_best`` (mean JCT over the best mean
        JCT of its workload, minus 1: 0.23 is 23% slower). Sorted by workload (in order of first appearance), then rank.
        """
        rows = []
        for r in self.results:
            s, finished = r.summary, r.finished
            row: dict[str, Any] = {"workload": r.workload, "policy": r.label, "jobs": s["jobs"]}
            row["finished"] = s["finished"]
            row.update({f"{q}_jct_h": s[f"{q}_jct_s"] / 3600.0 for q in ("mean", "p50", "p95")})
            for term in TERMS:
                mean = float(finished[term].mean()) if len(finished) else math.nan
                row[f"{term.removesuffix('_s')}_h"] = mean / 3600.0
            row.update({k: s[k] for k in ("utilization", "resizes", "restarts", "preemptions", "suspensions")})
            rows.append(row)
        df = pd.DataFrame(rows)
        order = {w: i for i, w in enumerate(self.workloads)}
        df["_workload"], df["_position"] = df["workload"].map(order), range(len(df))
        keys = ["_workload", "mean_jct_h", "p95_jct_h", "_position"]
        df = df.sort_values(keys, na_position="last", kind="stable")
        df.insert(1, "rank", df.groupby("_workload").cumcount() + 1)
        df["mean_vs_best"] = df["mean_jct_h"] / df.groupby("_workload")["mean_jct_h"].transform("min") - 1.0
        return df.drop(columns=["_workload", "_position"]).reset_index(drop=True)

    def breakdown(self) -> pd.DataFrame:
        """Mean seconds per finished job of each JCT term, one row per result."""
        return pd.concat([r.breakdown() for r in self.results])

    # -- plots ----------------------------------------------------------------------------
    def _of(self, workload: str | None) -> tuple[str, list[ClusterResult]]:
        """The workload (the first when ``None``; checked) and its results, in order."""
        names = self.workloads
        name = names[0] if workload is None else check_choice("workload", workload, names)
        return name, [r for r in self.results if r.workload == name]

    def plot(self, ax: Axes | None = None, unit: str = "h", workload: str | None = None) -> Axes:
        """Each policy's JCT distribution (CDF) and, with ``ax=None``, the cluster's GPU usage over time.

        With ``ax``: the JCT CDFs on that Axes — of ``workload``'s results, or of every result when ``workload``
        is None (labelled ``"policy (workload)"`` when there are several workloads). With ``ax=None``: a new
        figure of two panels for one workload (``workload``, by default the first): left the JCT CDF of each of
        its results, right :meth:`plot_usage`, in matching colors. Returns the Axes of the CDFs (the usage panel
        of a new figure is ``ax.figure.axes[1]``).
        """
        if ax is not None:
            if workload is not None:
                results = self._of(workload)[1]
            elif len(self.workloads) > 1:
                results = [r.relabel(f"{r.label} ({r.workload})") for r in self.results]
            else:
                results = list(self.results)
            for r in results:
                r.plot_cdf(ax=ax, unit=unit)
            ax.legend(loc="lower right", fontsize="small")
            return ax
        import matplotlib.pyplot as plt
        import seaborn as sns

        name, results = self._of(workload)
        _scale(unit)
        sns.set_theme(style="whitegrid", context="notebook")
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
        for r, color in zip(results, sns.color_palette(n_colors=len(results))):
            r.plot_cdf(ax=left, unit=unit, color=color)
        left.legend(loc="lower right", fontsize="small")
        left.set_title(f"JCT: {name}", fontsize="medium")
        self.plot_usage(ax=right, unit=unit, workload=name)
        fig.tight_layout()
        return left

    def plot_usage(self, ax: Axes | None = None, unit: str = "h", workload: str | None = None) -> Axes:
        """GPUs in use over time under each policy of ``workload`` (by default the first): one step line per
        result, the capacity dashed once (the first result's). Returns the Axes."""
        import seaborn as sns
        from matplotlib.ticker import MaxNLocator

        from ..core.plot import get_ax

        name, results = self._of(workload)
        scale = _scale(unit)
        ax = get_ax(ax)
        end = max(float(r.usage["time_s"].max()) for r in results)
        cap = results[0].usage
        t = np.append(cap["time_s"].to_numpy(float), end) / scale
        capacity = np.append(cap["capacity"].to_numpy(float), float(cap["capacity"].iloc[-1]))
        ax.step(t, capacity, where="post", color="0.2", linestyle="--", linewidth=1.2, label="capacity", zorder=3)
        for r, color in zip(results, sns.color_palette(n_colors=len(results))):
            u = r.usage
            ax.step(u["time_s"] / scale, u["gpus_used"], where="post", color=color, linewidth=1.0, label=r.label)
        first = min(float(r.jobs["submit_s"].min()) for r in results)
        if end > first and ax.get_xscale() == "linear":
            ax.set_xlim(first / scale, end / scale)  # from the first submission: a trace's clock may start long before
        ax.set_xlabel(f"time ({unit})")
        ax.set_ylabel("GPUs in use")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"GPU usage: {name}", fontsize="medium")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
        return ax

    def plot_breakdown(self, ax: Axes | None = None, unit: str = "h") -> Axes:
        """Stacked bars of the mean JCT terms per result. Returns the Axes."""
        from ..core.jct import JCT

        rows = self.breakdown()
        jcts = [JCT(**{t: float(row[t]) for t in TERMS}, label=str(label)) for label, row in rows.iterrows()]
        return JCT.plot_many(jcts, ax=ax, unit=unit)

    def _repr_html_(self) -> str:
        ranking = self.ranking
        best = ranking[ranking["rank"] == 1]
        summary = {
            "workloads": "; ".join(self.workloads),
            "labels": ", ".join(r.label for r in self.results),
            "best (mean JCT)": "; ".join(f"{p} ({w})" for p, w in zip(best["policy"], best["workload"])),
        }
        return html_card(f"{len(self.results)} cluster simulations", summary, ranking)


def compare(*results: ClusterResult) -> ClusterComparison:
    """Compare results of :func:`~pipeswift_lab.cluster.simulate`; returns a :class:`ClusterComparison`.

    Results may come from several workloads (:attr:`ClusterResult.workload`); within one, labels must be
    distinct (see :meth:`ClusterResult.relabel`)."""
    if not results:
        raise ValueError("compare needs at least one ClusterResult")
    for r in results:
        if not isinstance(r, ClusterResult):
            raise TypeError(f"compare takes ClusterResult objects; got {type(r).__name__}")
    seen: set[tuple[str, str]] = set()
    for r in results:
        key = (r.workload, r.label)
        if key in seen:
            labels = [x.label for x in results if x.workload == r.workload]
            raise ValueError(
                f"labels must be distinct within a workload to compare results; {r.label!r} appears more than once "
                f"in workload {r.workload!r} (its labels: {labels}; use result.relabel('...'))"
            )
        seen.add(key)
    return ClusterComparison(tuple(results))
