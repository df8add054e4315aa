"""Planner time on a large search: a 96-layer profile over 1,024 GPUs with every schedule.

Prints the number of configurations weighed, the wall time, and the best plan.
Run: python benchmarks/bench_planner.py
"""
import time

import numpy as np

from pipeswift_lab import Profile
from pipeswift_lab.planner import plan
from pipeswift_lab.schedules import compute_orders


def main():
    rng = np.random.default_rng(0)
    L = 96
    fwd = rng.uniform(8, 12, L)
    fwd[0], fwd[-1] = 4.0, 30.0  # embedding light, LM head heavy (ms at micro-batch 4)
    prof = Profile.synthetic(
        fwd_ms=fwd.tolist(),
        bwd_ms=(2 * fwd).tolist(),
        param_bytes=[4 * 200e6] * L,  # 200M parameters a layer, fp32
        activation_bytes=[2e9] * L,
        output_bytes=[64e6] * L,
        meta={"batch_size": 4, "device": "cuda"},
    )
    compute_orders(2, 4, "Interleaved1F1B", 2)  # import torch's pipelining once, outside the timing
    start = time.perf_counter()
    result = plan(prof, gpus=1024, global_batch=1024, steps=10_000, mem_per_gpu_bytes=80e9, availability=[(0, 512), (4 * 3600, 1024)], progress=False)
    seconds = time.perf_counter() - start
    table = result.table
    print(f"96 layers, 1,024 GPUs, all schedules: {len(table):,} configurations ({int(table['feasible'].sum()):,} feasible) in {seconds:.1f} s")
    print(result.best.label, f"JCT {result.best.total_s / 3600:.2f} h")
    print(result.explain())


if __name__ == "__main__":
    main()
