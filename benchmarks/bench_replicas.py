"""P=2 stages x D=2 replicas on this machine's CPU (4 gloo processes) against the planner's prediction.

* ``measured_step_ms`` — the median whole step after the first (``RunResult.steady_step_ms``)
  of a 1F1B run of the reference MLP at P=2 x D=2 on a global batch of ``2 * m * b``, and of
  the same pipeline at D=1 on one replica's share (``m * b``): the same work per rank, so
  their difference is what the replicas add, the gradient all-reduce (plus contention: four
  processes share the two cores where two did);
* ``predicted_step_ms`` — the planner's step for the same row (``plan(..., P=2)``), which
  adds the ring model's all-reduce ``allreduce_ms`` = ``2(D-1)/D * bytes / bw + 2(D-1) * latency``
  over the default ``dp_link`` (:func:`pipeswift_lab.costs.allreduce_ms`, on the largest
  rank's parameter bytes);
* ``allreduce_ms`` — measured (D=2 step minus D=1 step) against that ring estimate.

Run: ``python benchmarks/bench_replicas.py`` (about a minute on 2 cores).
"""
from __future__ import annotations

import pandas as pd
import torch

MICROBATCH = 8
M = 4
STEPS = 8
WIDTHS = (256, 512, 512, 512, 10)


def main() -> pd.DataFrame:
    import pipeswift_lab as psl
    from pipeswift_lab.runner import run, run_arguments

    setup = psl.models.reference("mlp", batch_size=2 * M * MICROBATCH, widths=WIDTHS)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, psl.runner.spec.available_cores() // 4))
    try:
        prof = psl.profile(setup.model, setup.inputs[:MICROBATCH], target=setup.targets[:MICROBATCH], loss_fn=setup.loss_fn,
                           progress=False)
    finally:
        torch.set_num_threads(threads)
    plan = psl.plan(prof, 4, 2 * M * MICROBATCH, STEPS, P=2, schedules=["1F1B"], microbatch_sizes=[MICROBATCH], exhaustive=True,
                    progress=False)
    table = plan.table
    rows = []
    for D in (1, 2):
        batch = D * M * MICROBATCH
        chosen = table[(table["P"] == 2) & (table["D"] == 2) & (table["m"] == M) & table["simulated"]]
        args = run_arguments(plan, chosen.index[0])
        args["D"] = D
        data = (setup.inputs[:batch], setup.targets[:batch])
        result = run(setup.model, data, setup.loss_fn, steps=STEPS, progress=False, timeout_s=300, **args)
        rows.append({"P": 2, "D": D, "global_batch": batch, "measured_step_ms": result.steady_step_ms})
    row = chosen.iloc[0]
    out = pd.DataFrame(rows)
    out["predicted_step_ms"] = [float(row["pipeline_ms"]) + float(row["optimizer_ms"]), float(row["step_ms"])]
    out["rel_error"] = (out["predicted_step_ms"] - out["measured_step_ms"]) / out["measured_step_ms"]
    measured_ar = out["measured_step_ms"].iloc[1] - out["measured_step_ms"].iloc[0]
    print(out.to_string(index=False))
    print(f"all-reduce: measured {measured_ar:.3g} ms (D=2 step - D=1 step) vs the ring model's {float(row['allreduce_ms']):.3g} ms "
          f"over the default dp_link ({psl.planner.DEFAULT_DP_LINK})")
    return out


if __name__ == "__main__":
    main()
