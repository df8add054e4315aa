"""Speed and JCT of the trace-driven cluster simulation (``pipeswift_lab.cluster``), every policy in one run.

Prints four tables:

1. **Speed**: the full Philly trace (82,247 jobs, ``psl.data.philly_jobs()``) on a fixed 1,024-GPU cluster, once
   per policy: events handled, the event loop's wall time, events per second, and the whole call (checking the
   jobs, building the per-job scaling tables). The goal for ``jct``: the whole call under 60 s.
2. **JCT on the issue's four windows** (two roomy, two overloaded): mean and p95 JCT per policy, the joint
   policy against the best other one, and whether it has the lowest mean with no fewer finished jobs.
3. **Held-out windows**: other weeks of the trace at 256 and 512 GPUs, which the policy was not developed on.
4. **A small workload of another shape**: ~160 jobs on 64 GPUs given only name, submit time, GPUs and duration
   (seeded: Poisson arrivals, power-of-two sizes, log-normal run times).
5. **Wrong declarations**: the joint policy orders jobs by the run time they declare. Here each job declares its
   true run time times a log-normal error (median 1, σ of its log 0.5, 1 and 2: off by 1.6×, 2.7× and 7.4× at
   one σ), on a busy and a roomy window, against the best other policy (which does not use declarations).

Pollux (Qiao et al., OSDI 2021) reports 37–50% lower mean JCT than Tiresias under load, and Sia (Jayaram
Subramanya et al., SOSP 2023) 30–93% lower than Pollux. Figures are reported, never asserted.
Run: ``python benchmarks/bench_cluster.py`` (``--quick``: the speed table and one window of each kind).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np
import pandas as pd

os.environ.setdefault("TQDM_DISABLE", "1")

from pipeswift_lab import cluster
from pipeswift_lab.data import philly_jobs

#: Every policy, the joint one last; ``jct-p95`` is JointJCT(objective="p95").
POLICIES = ("static", "elastic", "preemptive", "jct", "jct-p95")
DAY = 86_400.0
#: The issue's windows: (days since the first submission, GPUs).
WINDOWS = (((42, 49), 512), ((28, 42), 512), ((42, 49), 256), ((21, 28), 256))
#: Weeks not used while developing the policy, at both cluster sizes.
HELD_OUT = tuple((w, g) for w in ((14, 21), (28, 35), (49, 56), (56, 63), (63, 70)) for g in (256, 512))


def _policy(name: str) -> str | cluster.Policy:
    return cluster.JointJCT(objective="p95") if name == "jct-p95" else name


def speed_table(jobs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for name in POLICIES[:-1]:
        start = time.perf_counter()
        s = cluster.simulate(jobs, 1024, policy=_policy(name), progress=False).summary
        rows.append(
            {
                "policy": name,
                "jobs": s["jobs"],
                "events": s["events"],
                "event_loop_s": round(s["wall_s"], 2),
                "events_per_s": round(s["events_per_s"]),
                "whole_call_s": round(time.perf_counter() - start, 2),
                "mean_jct_h": round(s["mean_jct_s"] / 3600, 2),
                "p95_jct_h": round(s["p95_jct_s"] / 3600, 2),
                "utilization": round(s["utilization"], 3),
                "restarts": s["restarts"],
                "unfinished": s["unfinished"],
            }
        )
    return pd.DataFrame(rows)


def small_workload(n: int = 160, gpus: int = 64, load: float = 1.5, seed: int = 0) -> pd.DataFrame:
    """``n`` jobs with only ``name``, ``submit_s``, ``gpus`` and ``duration_s``, offering ``load`` times what ``gpus``
    GPUs can do over the arrivals."""
    rng = np.random.default_rng(seed)
    size = rng.choice([1, 2, 4, 8, 16], size=n, p=[0.5, 0.2, 0.15, 0.1, 0.05])
    duration = np.exp(rng.normal(np.log(3600.0), 1.5, size=n)).clip(60.0, 30 * 3600.0)
    span = (size * duration).sum() / (load * gpus)
    submit = np.sort(rng.uniform(0.0, span, size=n))
    names = [f"job-{i}" for i in range(n)]
    return pd.DataFrame({"name": names, "submit_s": submit, "gpus": size, "duration_s": duration})


def jct_table(workloads: list[tuple[str, pd.DataFrame, int, float]]) -> pd.DataFrame:
    """One row per workload: each policy's mean and p95 JCT (h), and how the joint policy ranks."""
    rows = []
    for label, jobs, gpus, offered in workloads:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = [
                cluster.simulate(jobs, gpus, policy=_policy(p), workload=label, progress=False).relabel(p)
                for p in POLICIES
            ]
        s = {r.label: r.summary for r in results}
        others = [p for p in POLICIES if not p.startswith("jct")]
        best = min(others, key=lambda p: s[p]["mean_jct_s"])
        jct = s["jct"]
        rows.append(
            {
                "workload": label,
                "jobs": len(jobs),
                "offered_load": round(offered, 2),
                **{f"{p}_mean_h": round(s[p]["mean_jct_s"] / 3600, 2) for p in POLICIES},
                **{f"{p}_p95_h": round(s[p]["p95_jct_s"] / 3600, 1) for p in POLICIES},
                "best_other": best,
                "jct_vs_best_other": f"{jct['mean_jct_s'] / s[best]['mean_jct_s'] - 1:+.0%}",
                "jct_p95_vs_best_other_p95": f"{jct['p95_jct_s'] / min(s[p]['p95_jct_s'] for p in others) - 1:+.0%}",
                "jct_lowest_mean": all(jct["mean_jct_s"] <= s[p]["mean_jct_s"] for p in others),
                "jct_finished_no_fewer": all(jct["finished"] >= s[p]["finished"] for p in POLICIES),
                "jct_resizes": jct["resizes"],
                "jct_suspensions": jct["suspensions"],
                "jct_preemptions": jct["preemptions"],
            }
        )
    return pd.DataFrame(rows)


def estimate_error_table(workloads: list[tuple[str, pd.DataFrame, int, float]], sigmas=(0.0, 0.5, 1.0, 2.0)):
    """The joint policy's mean JCT when declared run times are off by a seeded log-normal factor."""
    rows = []
    for label, jobs, gpus, _ in workloads:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            others = {p: cluster.simulate(jobs, gpus, policy=p, progress=False).summary for p in POLICIES[:3]}
            best = min(others, key=lambda p: others[p]["mean_jct_s"])
            best_h = round(others[best]["mean_jct_s"] / 3600, 2)
            row = {"workload": label, "best_other": best, "best_other_mean_h": best_h}
            rng = np.random.default_rng(0)
            noise = rng.standard_normal(len(jobs))
            for sigma in sigmas:
                declared = jobs.assign(declared_s=jobs["duration_s"] * np.exp(sigma * noise))
                s = cluster.simulate(declared, gpus, policy="jct", progress=False).summary
                row[f"jct_sigma_{sigma:g}_mean_h"] = round(s["mean_jct_s"] / 3600, 2)
                row[f"vs_best_sigma_{sigma:g}"] = f"{s['mean_jct_s'] / others[best]['mean_jct_s'] - 1:+.0%}"
        rows.append(row)
    return pd.DataFrame(rows)


def trace_windows(windows) -> list[tuple[str, pd.DataFrame, int, float]]:
    out = []
    for (d0, d1), gpus in windows:
        jobs = philly_jobs(window=(d0 * DAY, d1 * DAY))
        out.append((f"days {d0}-{d1}, {gpus} GPUs", jobs, gpus, jobs["gpu_s"].sum() / ((d1 - d0) * DAY * gpus)))
    return out


def main(argv: list[str] | None = None) -> None:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 40)
    start = time.perf_counter()
    jobs = philly_jobs()
    print(f"Philly trace: {len(jobs):,} jobs loaded in {time.perf_counter() - start:.2f} s\n")
    print("1. Full trace on 1,024 GPUs, per policy (no periodic checkpoints):")
    print(speed_table(jobs).to_string(index=False))
    columns = ["workload", "offered_load", *(f"{p}_mean_h" for p in POLICIES), "best_other", "jct_vs_best_other"]
    tail = ["workload", *(f"{p}_p95_h" for p in POLICIES), "jct_p95_vs_best_other_p95"]
    checks = [
        "workload",
        "jobs",
        "jct_lowest_mean",
        "jct_finished_no_fewer",
        "jct_resizes",
        "jct_suspensions",
        "jct_preemptions",
    ]
    sections = [
        ("2. The issue's windows (mean JCT, hours)", trace_windows(WINDOWS[2:3] if quick else WINDOWS)),
        ("3. Held-out weeks (mean JCT, hours)", trace_windows(HELD_OUT[:1] if quick else HELD_OUT)),
        ("4. A small workload: 160 jobs on 64 GPUs, name/submit/GPUs/duration only", []),
    ]
    small = small_workload()
    offered = (small["gpus"] * small["duration_s"]).sum() / (small["submit_s"].max() * 64)
    sections[2][1].append(("160 jobs, 64 GPUs", small, 64, offered))
    for title, workloads in sections:
        table = jct_table(workloads)
        print(f"\n{title}:")
        print(table[columns].to_string(index=False))
        print("p95 JCT (hours):")
        print(table[tail].to_string(index=False))
        print(table[checks].to_string(index=False))
    print("\n5. Declared run times off by a log-normal factor (sigma of its log); mean JCT, hours:")
    errors = trace_windows((((21, 28), 256),) if quick else (((21, 28), 256), ((42, 49), 512)))
    print(estimate_error_table(errors).to_string(index=False))


if __name__ == "__main__":
    main()
