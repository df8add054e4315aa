"""Benchmark of the per-layer profiler on the reference models (gpt, vit, mlp).

For each model, three rounds of: ``warmup + repeats`` plain forward+loss+backward steps,
then :func:`pipeswift_lab.profiling.measure.profile` with the same ``warmup`` and ``repeats``.
Printed per model (medians over the rounds unless said otherwise):

* ``plain_s`` / ``profile_s`` — wall time of the plain steps / of the whole ``profile`` call;
* ``overhead`` — ``profile_s / plain_s``, the profiler's cost over the same number of steps;
* ``coverage`` — sum of the layers over the measured whole step;
* ``step_cv`` — ``Profile.cv``, run-to-run variation of the step inside one profile;
* ``total_cv`` — std / mean of ``Profile.total_ms`` across the three profiles.

Usage: ``python benchmarks/bench_profile.py [--repeats 10] [--warmup 3] [--batch-size 8] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pipeswift_lab.models import reference
from pipeswift_lab.profiling.measure import profile


def plain_steps(setup, steps: int) -> float:
    """Wall seconds of ``steps`` forward+loss+backward steps, gradients reset as the profiler does."""
    model, params = setup.model, list(setup.model.parameters())
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        for p in params:
            p.grad = None
        setup.loss_fn(model(setup.inputs), setup.targets).backward()
    for p in params:
        p.grad = None
    return time.perf_counter() - start


def bench(name: str, repeats: int, warmup: int, batch_size: int, rounds: int = 3) -> dict:
    setup = reference(name, batch_size=batch_size)
    plain, wall, profiles = [], [], []
    for _ in range(rounds):
        plain.append(plain_steps(setup, warmup + repeats))
        start = time.perf_counter()
        profiles.append(
            profile(
                setup.model,
                setup.inputs,
                target=setup.targets,
                loss_fn=setup.loss_fn,
                warmup=warmup,
                repeats=repeats,
                progress=False,
            )
        )
        wall.append(time.perf_counter() - start)
    totals = [p.total_ms for p in profiles]
    return {
        "model": name,
        "layers": profiles[0].n_layers,
        "plain_s": statistics.median(plain),
        "profile_s": statistics.median(wall),
        "overhead": statistics.median(w / p for w, p in zip(wall, plain)),
        "coverage": statistics.median(p.coverage for p in profiles),
        "step_cv": statistics.median(p.cv for p in profiles),
        "total_cv": statistics.stdev(totals) / statistics.mean(totals),
        "step_ms": statistics.median(p.step_ms for p in profiles),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--models", default="gpt,vit,mlp")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"batch {args.batch_size}, warmup {args.warmup}, repeats {args.repeats}, 3 rounds"
    )
    header = (
        f"{'model':<6}{'layers':>7}{'step_ms':>9}{'plain_s':>9}{'profile_s':>10}{'overhead':>9}{'coverage':>9}"
        f"{'step_cv':>8}{'total_cv':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        r = bench(name.strip(), args.repeats, args.warmup, args.batch_size)
        print(
            f"{r['model']:<6}{r['layers']:>7}{r['step_ms']:>9.2f}{r['plain_s']:>9.3f}{r['profile_s']:>10.3f}"
            f"{r['overhead']:>9.2f}{r['coverage']:>9.2f}{r['step_cv']:>8.3f}{r['total_cv']:>9.3f}"
        )


if __name__ == "__main__":
    main()
