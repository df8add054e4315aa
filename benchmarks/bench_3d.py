"""PP × FSDP × TP on this machine: six layouts of 4 processes, measured beside predicted.

The reference GPT (4 blocks, a 2,048-token vocabulary) trains 4 steps, m = 4, 1F1B, in each of P4, P2×tp2,
P2×fsdp2, tp2×fsdp2 (P = 1: no pipeline), tp4 and fsdp4. For each:

* ``measured_step_ms`` — the median step after the first (``RunResult.steady_step_ms``);
* ``predicted_step_ms`` — the profile's layers as one tensor-parallel rank computes them
  (:func:`pipeswift_lab.planning.sharding.tp_table`: compute ``/ tp`` where the plan shards it, the forward's and
  the backward's all-reduces added), simulated under the run's schedule, plus FSDP's all-gather before the step and
  its reduce-scatter after it. Every collective is priced on the gloo link measured here (two processes
  all-reducing 64 KB to 16 MB, ``bench_replicas.measured_dp_link``): CPU collectives do not carry over to NCCL, so
  the CPU runs are calibrated apart, and gloo's reduce-scatter, an emulated all-reduce, is priced as one;
* ``measured_peak_mib`` / ``predicted_peak_mib`` — the largest process's peak (the live-byte counter) and its
  prediction; ``worst_memory_error`` — the largest ``|predicted / measured - 1|`` over every process.

The profile is taken in this process with all its threads; a rank has fewer and shares the cores, so the predicted
step is the layout's compute alone, not the contention: compare the layouts' ratios, not the absolute times.

Run: ``python benchmarks/bench_3d.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import torch

import pipeswift_lab as psl
from pipeswift_lab.core.topology import all_gather_ms, all_reduce_ms
from pipeswift_lab.models import gpt, gpt_batch, lm_loss
from pipeswift_lab.planning.sharding import tp_table

#: (P, fsdp, tp) of the six layouts of 4 processes.
LAYOUTS = {
    "P4": (4, 1, 1),
    "P2×tp2": (2, 1, 2),
    "P2×fsdp2": (2, 2, 1),
    "tp2×fsdp2": (1, 2, 2),
    "tp4": (1, 1, 4),
    "fsdp4": (1, 4, 1),
}
MODEL = dict(vocab_size=2048, seq_len=32, d_model=128, n_layers=4, n_heads=4)
BATCH, M, STEPS = 16, 4, 4


def predicted_step_ms(prof: psl.Profile, part: psl.Partition, fsdp: int, tp: int, link: psl.Link) -> float:
    """The layout's step: the tensor-parallel rank's layers simulated, and FSDP's two collectives per step."""
    table = psl.Profile(tp_table(prof.df, tp, link), dict(prof.meta))
    local = psl.Partition.from_bounds(table, part.bounds, schedule=part.schedule, m=M)
    step = psl.simulate(local, M, link=link).step_ms
    if fsdp > 1:
        rank_bytes = max(
            sum(table.df["param_bytes"].iloc[a:b]) for a, b in part.bounds
        )  # the busiest pipeline rank's parameters (one stage per rank here)
        step += all_gather_ms(rank_bytes, fsdp, link) + all_reduce_ms(rank_bytes, fsdp, link)
    return float(step)


def main() -> pd.DataFrame:
    from bench_replicas import measured_dp_link

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    link, _ = measured_dp_link()
    x, y = gpt_batch(BATCH, MODEL["seq_len"], MODEL["vocab_size"])
    rows = []
    for name, (P, fsdp, tp) in LAYOUTS.items():
        micro = BATCH // (M * fsdp)
        prof = psl.profile(gpt(**MODEL), x[:micro], target=y[:micro], loss_fn=lm_loss, progress=False)
        part = psl.partition(prof, P=P, schedule="1F1B" if P > 1 else "GPipe", m=M)
        result = psl.run(gpt(**MODEL), (x, y), lm_loss, part, M, fsdp=fsdp, tp=tp, steps=STEPS, progress=False)
        memory = result.memory
        worst = memory.loc[memory["measured_peak_bytes"].idxmax()]
        rows.append(
            {
                "layout": name,
                "processes": P * fsdp * tp,
                "measured_step_ms": result.steady_step_ms,
                "predicted_step_ms": predicted_step_ms(prof, part, fsdp, tp, link),
                "measured_peak_mib": worst["measured_peak_bytes"] / 2**20,
                "predicted_peak_mib": worst["predicted_peak_bytes"] / 2**20,
                "worst_memory_error": float(np.abs(memory["error"]).max()),
            }
        )
    out = pd.DataFrame(rows)
    out["step_ratio"] = out["measured_step_ms"] / out["predicted_step_ms"]
    print(f"gloo link measured here: {link}")
    print(out.round(3).to_string(index=False))
    return out


if __name__ == "__main__":
    main()
