"""Speed and JCT of the trace-driven cluster simulation (``pipeswift_lab.cluster``).

Prints two tables:

1. **Speed**: the full Philly trace (82,247 jobs, ``psl.data.philly_jobs()``) on a fixed
   1,024-GPU cluster, once per policy: events handled, the event loop's wall time, events
   per second, and the whole call (checking the jobs, building the per-job scaling tables).
2. **JCT**: mean and p95 JCT per policy on stated windows of the trace and cluster sizes,
   and the elastic policy's change of mean JCT against the static scheduler (FIFO with
   backfilling) and against the preemptive one (Tiresias's two-queue LAS). Pollux (Qiao
   et al., OSDI 2021) reports that its elastic, goodput-driven scheduling cut average JCT
   by 37–50% against earlier schedulers (Tiresias, Optimus); a column says whether our
   (much simpler, greedy) elastic policy reaches that on each window, and
   ``shrink_only_vs_static`` isolates what elasticity buys without growing jobs beyond
   their request.

Figures are reported, never asserted. Run: ``python benchmarks/bench_cluster.py``
(``--quick`` for one window only).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import pandas as pd

os.environ.setdefault("TQDM_DISABLE", "1")

from pipeswift_lab import cluster
from pipeswift_lab.data import philly_jobs

POLICIES = ("static", "elastic", "preemptive")
DAY = 86_400.0
#: (label, window in days since the first submission, GPUs): a busy week on a cluster that keeps up with
#: it on average, the same week on half the GPUs, and the trace's busiest weeks, overloaded.
WINDOWS = (
    ("days 42-49 (week 7), 512 GPUs", (42, 49), 512),
    ("days 42-49 (week 7), 256 GPUs", (42, 49), 256),
    ("days 21-28 (week 4), 256 GPUs", (21, 28), 256),
    ("days 28-42 (weeks 5-6), 512 GPUs", (28, 42), 512),
)
POLLUX_LOW, POLLUX_HIGH = 0.37, 0.50


def speed_table(jobs) -> pd.DataFrame:
    rows = []
    for policy in POLICIES:
        start = time.perf_counter()
        result = cluster.simulate(jobs, 1024, policy=policy, progress=False)
        total = time.perf_counter() - start
        s = result.summary
        rows.append(
            {
                "policy": policy,
                "jobs": s["jobs"],
                "events": s["events"],
                "event_loop_s": round(s["wall_s"], 2),
                "events_per_s": round(s["events_per_s"]),
                "whole_call_s": round(total, 2),
                "mean_jct_h": round(s["mean_jct_s"] / 3600, 2),
                "p95_jct_h": round(s["p95_jct_s"] / 3600, 2),
                "utilization": round(s["utilization"], 3),
                "restarts": s["restarts"],
                "unfinished": s["unfinished"],
            }
        )
    return pd.DataFrame(rows)


def jct_table(windows) -> pd.DataFrame:
    rows = []
    for label, (d0, d1), gpus in windows:
        jobs = philly_jobs(window=(d0 * DAY, d1 * DAY))
        offered = jobs["gpu_s"].sum() / ((d1 - d0) * DAY * gpus)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = {p: cluster.simulate(jobs, gpus, policy=p, progress=False) for p in POLICIES}
            # the same elastic policy with no job holding more than it asked for: what shrinking alone buys
            shrink = cluster.simulate(jobs.assign(max_gpus=jobs["gpus"]), gpus, policy="elastic", progress=False)
        summaries = {p: r.summary for p, r in results.items()}
        elastic = summaries["elastic"]["mean_jct_s"]
        vs_static = elastic / summaries["static"]["mean_jct_s"] - 1
        vs_las = elastic / summaries["preemptive"]["mean_jct_s"] - 1
        reached = [name for name, cut in (("static", -vs_static), ("LAS", -vs_las)) if cut >= POLLUX_LOW]
        rows.append(
            {
                "window": label,
                "jobs": len(jobs),
                "offered_load": round(offered, 2),
                **{f"{p}_mean_h": round(summaries[p]["mean_jct_s"] / 3600, 2) for p in POLICIES},
                **{f"{p}_p95_h": round(summaries[p]["p95_jct_s"] / 3600, 2) for p in POLICIES},
                "elastic_vs_static": f"{vs_static:+.0%}",
                "elastic_vs_LAS": f"{vs_las:+.0%}",
                "shrink_only_vs_static": f"{shrink.summary['mean_jct_s'] / summaries['static']['mean_jct_s'] - 1:+.0%}",
                "pollux_37_50_cut_reached_vs": ", ".join(reached) or "neither",
                "unfinished": sum(s["unfinished"] for s in summaries.values()),
                "warnings": len(caught),
            }
        )
    return pd.DataFrame(rows)


def main(argv=None):
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    start = time.perf_counter()
    jobs = philly_jobs()
    print(f"Philly trace: {len(jobs):,} jobs loaded in {time.perf_counter() - start:.2f} s\n")
    print("Full trace on 1,024 GPUs, per policy (no periodic checkpoints):")
    print(speed_table(jobs).to_string(index=False))
    print("\nMean and p95 JCT (hours) per policy on windows of the trace (submit times in days since the first job):")
    table = jct_table(WINDOWS[:1] if quick else WINDOWS)
    print(table.to_string(index=False))
    print(
        f"\nPollux (OSDI '21) anchor: elastic scheduling cut average JCT by {POLLUX_LOW:.0%}-{POLLUX_HIGH:.0%} "
        "against earlier schedulers. 'reached vs' names the baselines our elastic policy beats by at least 37% "
        "on a window."
    )


if __name__ == "__main__":
    main()
