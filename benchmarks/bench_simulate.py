"""Speed of the simulator, the sweep and the balanced partitioner.

Prints one table:

* simulated actions per second for P=32, m=256, v=2 Interleaved1F1B (cold: the first call
  builds torch's order and lowers it, ``torch.distributed.pipelining`` already imported;
  warm: the lowered order is cached);
* the time of a 1,000-configuration sweep on a measured profile of the reference GPT
  (``pipeswift_lab.models.reference("gpt")``, profiled here on this machine);
* the balanced partitioner on a 1,000-layer profile at P=64 (and with a link).

Run: ``python benchmarks/bench_simulate.py``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pandas as pd

os.environ.setdefault("TQDM_DISABLE", "1")

from pipeswift_lab import models
from pipeswift_lab.core.link import Link
from pipeswift_lab.core.vocabulary import SCHEDULES
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.sweeps import sweep

#: Simulated actions per second the warm simulator should reach (Timeline included).
WARM_GOAL = 1_000_000


def timed(fn, repeats=1):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    import torch.distributed.pipelining  # noqa: F401 - a one-time import of ~1-3 s, not the simulator's cost

    rows = []
    P, m, v = 32, 256, 2
    stages = pd.DataFrame({"fwd_ms": [0.5] * (P * v), "bwd_ms": [1.0] * (P * v)})
    cold, tl = timed(lambda: simulate(stages, m, "Interleaved1F1B", v=v))
    warm, tl = timed(lambda: simulate(stages, m, "Interleaved1F1B", v=v), repeats=5)
    n = len(tl.df)
    rows.append(
        (
            "simulate Interleaved1F1B P=32 m=256 v=2, cold",
            f"{cold * 1e3:.0f} ms",
            f"{n / cold:,.0f} actions/s (torch's order built and lowered)",
        )
    )
    goal = "met" if n / warm >= WARM_GOAL else "MISSED"
    rows.append(
        (
            "simulate Interleaved1F1B P=32 m=256 v=2, warm",
            f"{warm * 1e3:.0f} ms",
            f"{n / warm:,.0f} actions/s (goal >= {WARM_GOAL:,.0f}: {goal})",
        )
    )
    linked = stages.assign(output_bytes=1e6)
    warm_link, tl_link = timed(lambda: simulate(linked, m, "Interleaved1F1B", v=v, link=Link(0.01, 50)), repeats=3)
    rows.append(
        (
            "  same with a Link (send/recv rows too)",
            f"{warm_link * 1e3:.0f} ms",
            f"{len(tl_link.df) / warm_link:,.0f} rows/s",
        )
    )

    setup = models.reference("gpt")
    prof_s, prof = timed(
        lambda: profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, progress=False)
    )
    grid = dict(
        P=[1, 2, 3, 4, 5, 6],
        m=[4, 6, 8, 12, 16, 24, 32, 48],
        schedules=list(SCHEDULES),
        methods=["uniform", "params", "balanced"],
    )
    n_configs = len(grid["P"]) * len(grid["m"]) * len(grid["schedules"]) * len(grid["methods"])
    sweep_s, table = timed(lambda: sweep(prof, steps=1000, progress=False, **grid))
    rows.append((f"profile reference GPT ({prof.n_layers} layers)", f"{prof_s:.2f} s", ""))
    rows.append(
        (
            f"sweep of {n_configs} configurations ({int(table['feasible'].sum())} feasible)",
            f"{sweep_s:.2f} s",
            f"{sweep_s / n_configs * 1e3:.1f} ms/config",
        )
    )

    rng = np.random.default_rng(0)
    big = Profile.synthetic(
        fwd_ms=rng.uniform(0.5, 2, 1000),
        bwd_ms=rng.uniform(1, 4, 1000),
        output_bytes=rng.integers(100_000, 10_000_000, 1000),
    )
    part_s, part = timed(lambda: partition(big, 64), repeats=3)
    rows.append(
        (
            "balanced partition, 1,000 layers, P=64",
            f"{part_s * 1e3:.0f} ms",
            f"bottleneck {part.bottleneck_ms:.2f} ms, imbalance {part.imbalance:.3f}",
        )
    )
    link_s, part = timed(lambda: partition(big, 64, link=Link(0.02, 25)), repeats=3)
    rows.append(
        ("  same with a Link (transfer-aware)", f"{link_s * 1e3:.0f} ms", f"bottleneck {part.bottleneck_ms:.2f} ms")
    )
    v2_s, part = timed(lambda: partition(big, 64, v=2, schedule="Interleaved1F1B"), repeats=3)
    rows.append(("  same with v=2 (128 stages)", f"{v2_s * 1e3:.0f} ms", f"bottleneck {part.bottleneck_ms:.2f} ms"))

    width = max(len(r[0]) for r in rows)
    print(f"{'benchmark'.ljust(width)}  {'time':>9}  rate")
    for name, t, rate in rows:
        print(f"{name.ljust(width)}  {t:>9}  {rate}")


if __name__ == "__main__":
    main()
