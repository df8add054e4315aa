"""P=2 stages x D=2 replicas on this machine's CPU (4 gloo processes) against the planner's prediction.

* ``measured_step_ms`` — the median whole step after the first (``RunResult.steady_step_ms``)
  of a 1F1B run of the reference MLP at P=2 x D=2 on a global batch of ``2 * m * b``, and of
  the same pipeline at D=1 on one replica's share (``m * b``): the same work per rank, so
  their difference is what the replicas add, the gradient all-reduce (plus contention: four
  processes share the two cores where two did);
* ``predicted_step_ms`` — the planner's step for the same row (``plan(..., P=2)``), which
  adds the ring model's all-reduce ``allreduce_ms`` = ``2(D-1)/D * bytes / bw + 2(D-1) * latency``
  over the default ``dp_link`` (:func:`pipeswift_lab.core.costs.allreduce_ms`, on the largest
  rank's parameter bytes);
* ``allreduce_ms`` — measured two ways against that ring estimate: the ``REDUCE_GRAD`` actions
  the runner times through a DDP comm hook (``RunResult.allreduce_ms``: the longest stage's
  buckets from first launch to last completion, median over steps after the first), and the
  D=2 step minus the D=1 step (what the all-reduce adds to the step, after its overlap with
  the last backward).

The default ``dp_link`` describes a GPU interconnect; the last lines measure the link the
replicas really have here (two gloo processes all-reducing buffers of 64 KB to 16 MB, a
least-squares line ``t = bytes / bw + 2 * latency``, the ring model at D=2) and give the ring
estimate over it.

Run: ``python benchmarks/bench_replicas.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICROBATCH = 8
M = 4
STEPS = 8
WIDTHS = (256, 512, 512, 512, 10)


SIZES = tuple(2**k for k in range(16, 25, 2))  # bytes
REPEATS = 15


def _allreduce_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    times = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm-up: the pair's connection and buffers
        samples = []
        for _ in range(REPEATS):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            samples.append((time.perf_counter() - t0) * 1e3)
        times[nbytes] = float(np.median(samples))
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def measured_dp_link():
    """The gloo all-reduce between two processes here, fitted to the ring model at D=2; returns (Link, per-size ms)."""
    from pipeswift_lab.core.link import Link

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_allreduce_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2)
        times = torch.load(out)
    n = np.array(list(times), float)
    t = np.array(list(times.values()))
    slope, intercept = np.polyfit(n, t, 1)  # ring at D=2: t = bytes / bw + 2 * latency
    return Link(latency_ms=max(0.0, intercept / 2), bandwidth_GBps=1.0 / (slope * 1e6)), times


def main() -> pd.DataFrame:
    import pipeswift_lab as psl
    from pipeswift_lab.fidelity.calibrator import CalibrationWarning
    from pipeswift_lab.planning.planner import DEFAULT_DP_LINK
    from pipeswift_lab.runner import run, run_arguments

    setup = psl.models.reference("mlp", batch_size=2 * M * MICROBATCH, widths=WIDTHS)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, psl.runner.spec.available_cores() // 4))
    try:
        prof = psl.profile(
            setup.model,
            setup.inputs[:MICROBATCH],
            target=setup.targets[:MICROBATCH],
            loss_fn=setup.loss_fn,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    plan = psl.plan(
        prof,
        4,
        2 * M * MICROBATCH,
        STEPS,
        P=2,
        schedules=["1F1B"],
        microbatch_sizes=[MICROBATCH],
        exhaustive=True,
        progress=False,
    )
    table = plan.table
    rows = []
    for D in (1, 2):
        batch = D * M * MICROBATCH
        chosen = table[(table["P"] == 2) & (table["D"] == 2) & (table["m"] == M) & table["simulated"]]
        args = run_arguments(plan, chosen.index[0])
        args["D"] = D
        data = (setup.inputs[:batch], setup.targets[:batch])
        result = run(
            setup.model, data, setup.loss_fn, steps=STEPS, progress=False, launch=psl.Launch(timeout_s=300), **args
        )
        if D == 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CalibrationWarning)
                calibration = psl.calibrate([result], prof)
        rows.append(
            {
                "P": 2,
                "D": D,
                "global_batch": batch,
                "measured_step_ms": result.steady_step_ms,
                "measured_allreduce_ms": result.allreduce_ms,
            }
        )
    row = chosen.iloc[0]
    out = pd.DataFrame(rows)
    out["predicted_step_ms"] = [float(row["pipeline_ms"]) + float(row["optimizer_ms"]), float(row["step_ms"])]
    out["rel_error"] = (out["predicted_step_ms"] - out["measured_step_ms"]) / out["measured_step_ms"]
    measured_ar = out["measured_step_ms"].iloc[1] - out["measured_step_ms"].iloc[0]
    print(out.to_string(index=False))
    print(
        f"all-reduce: measured {out['measured_allreduce_ms'].iloc[1]:.3g} ms (REDUCE_GRAD actions), "
        f"{measured_ar:.3g} ms (D=2 step - D=1 step), vs the ring model's {float(row['allreduce_ms']):.3g} ms "
        f"over the default dp_link ({DEFAULT_DP_LINK})"
    )
    link, times = measured_dp_link()
    print("gloo all-reduce here, 2 processes: " + ", ".join(f"{k / 2**20:g} MiB {v:.3g} ms" for k, v in times.items()))
    print(f"fitted link: {link}")
    for label, extra in (
        ("over the measured link", {}),
        ("and calibrated on the D=1 run", {"calibration": calibration}),
    ):
        replanned = psl.plan(
            prof,
            4,
            2 * M * MICROBATCH,
            STEPS,
            P=2,
            schedules=["1F1B"],
            microbatch_sizes=[MICROBATCH],
            exhaustive=True,
            progress=False,
            dp_link=link,
            **extra,
        ).table
        again = replanned[
            (replanned["P"] == 2) & (replanned["D"] == 2) & (replanned["m"] == M) & replanned["simulated"]
        ].iloc[0]
        print(
            f"planner {label}: all-reduce {float(again['allreduce_ms']):.3g} ms, "
            f"D=2 step {float(again['step_ms']):.3g} ms "
            f"(measured {out['measured_allreduce_ms'].iloc[1]:.3g} ms and {out['measured_step_ms'].iloc[1]:.3g} ms)"
        )
    return out


if __name__ == "__main__":
    main()
