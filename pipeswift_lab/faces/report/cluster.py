"""The report's cluster section: a window of the Philly trace under four scheduling policies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ReportContext, Section

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CLUSTER_GPUS", "CLUSTER_WINDOW_DAYS", "POLICIES", "section_cluster"]

#: The cluster section's default window of the Philly trace (days since its first job) and cluster size.
CLUSTER_WINDOW_DAYS, CLUSTER_GPUS = (42, 44), 256


def section_cluster(ctx: ReportContext) -> Section:
    """Two busy days of the Philly trace on a shared cluster under the static, elastic, preemptive and joint-JCT
    policies."""
    import warnings

    import matplotlib.pyplot as plt

    from ... import cluster
    from ...data import philly_jobs

    days = (42, 43) if ctx.quick else CLUSTER_WINDOW_DAYS
    jobs = philly_jobs(window=(days[0] * 86_400.0, days[1] * 86_400.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [cluster.simulate(jobs, CLUSTER_GPUS, policy=p, progress=False) for p in POLICIES]
    comparison = cluster.compare(*results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    comparison.plot(ax=left)
    comparison.plot_breakdown(ax=right)
    fig.tight_layout()
    table = comparison.table
    by = table.set_index("policy")
    summary = [
        f"cluster days {days[0]}-{days[1]} on {CLUSTER_GPUS} GPUs: mean JCT "
        + ", ".join(f"{p} {by.loc[p, 'mean_jct_s'] / 3600:.2f} h" for p in by.index)
    ]
    return Section(
        title="A shared cluster: the Philly trace under four policies",
        intro_html=_intro(days, len(jobs), by, unfinished=int(table["unfinished"].sum()), warned=len(caught)),
        figures=[fig],
        tables={
            "cluster_policies": table[_COLUMNS],
            "cluster_breakdown": comparison.breakdown().reset_index(names="policy"),
        },
        summary=summary,
    )


#: The policies compared, in the table's order.
POLICIES = ("static", "elastic", "preemptive", "jct")

_COLUMNS = [
    "policy",
    "jobs",
    "finished",
    "mean_jct_s",
    "p50_jct_s",
    "p95_jct_s",
    "p99_jct_s",
    "mean_queue_s",
    "utilization",
    "restarts",
    "mean_jct_vs_first",
]


def _intro(days: tuple[int, int], n_jobs: int, by: pd.DataFrame, *, unfinished: int, warned: int) -> str:
    """The section's text: the trace, the three policies and their mean and median JCT (``by`` is indexed by policy)."""

    def hours(policy: str, column: str) -> float:
        return by.loc[policy, column] / 3600

    return (
        f"<p>The Philly trace (Jeon et al., ATC 2019; as derived for Pollux, OSDI 2021), days {days[0]}–{days[1]}: "
        f"{n_jobs:,} jobs replayed on {CLUSTER_GPUS} GPUs by <code>psl.cluster.simulate</code>. <em>static</em> "
        "runs each job on exactly the GPUs it asked for (FIFO with EASY backfilling); <em>elastic</em> shrinks and "
        "grows pipelines, paying checkpoint, re-assembly and restore for each change; <em>preemptive</em> is "
        "Tiresias's two-queue least-attained-service; <em>jct</em> chooses queue order and GPU counts together to "
        "minimize the predicted sum of JCTs (shortest remaining GPU-time first, shrinking or suspending longer jobs "
        "when the saving beats the move's cost, growing onto idle GPUs). "
        + "Mean JCT: "
        + ", ".join(f"{p} {hours(p, 'mean_jct_s'):.3g} h" for p in POLICIES)
        + "; median JCT "
        + ", ".join(f"{p} {hours(p, 'p50_jct_s'):.3g} h" for p in POLICIES)
        + ". "
        + (f"{unfinished} jobs did not finish ({warned} warnings).</p>" if unfinished else "Every job finished.</p>")
    )
