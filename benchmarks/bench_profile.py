"""Benchmark of the per-layer profiler on the reference models (gpt, vit, mlp).

For each model, three rounds of: ``warmup + repeats`` plain forward+loss+backward steps,
then :func:`pipeswift_lab.profiling.measure.profile` with the same ``warmup`` and ``repeats``.
Printed per model (medians over the rounds unless said otherwise):

* ``plain_s`` / ``profile_s`` — wall time of the plain steps / of the whole ``profile`` call;
* ``overhead`` — ``profile_s / plain_s``, the profiler's cost over the same number of steps;
* ``coverage`` — sum of the layers over the measured whole step;
* ``step_cv`` — ``Profile.cv``, run-to-run variation of the step inside one profile;
* ``total_cv`` — std / mean of ``Profile.total_ms`` across the three profiles.

``--unit-by-unit`` instead profiles a model of layers that sleep a known time twice, whole and one unit at a time
(built on the meta device), and prints both readings of each unit beside its sleeps and their largest gap (once
asserted within 3 ms in ``tests/profiling/test_unit_by_unit.py``: a timing against a timing, which a busy core moves).

Usage: ``python benchmarks/bench_profile.py [--repeats 10] [--warmup 3] [--batch-size 8] [--threads N]
[--unit-by-unit]``.
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


def unit_by_unit_agreement(repeats: int, warmup: int) -> None:
    """Print each unit's times profiled whole and one unit at a time, for layers that sleep a known time."""
    import sys
    from pathlib import Path

    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from sleep_layers import Sleep  # the tests' own sleeping layers

    sleeps_ms = [(6.0, 10.0), (12.0, 4.0), (6.0, 10.0), (3.0, 3.0)]

    def sleepy() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[Sleep(f / 1e3, b / 1e3) for f, b in sleeps_ms])

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kwargs = dict(target=y, loss_fn=F.mse_loss, warmup=warmup, repeats=repeats, progress=False)
    whole = profile(sleepy(), x, **kwargs)
    with torch.device("meta"):
        meta = sleepy()
    units = profile(meta, x, **kwargs)
    gaps = []
    print(f"{'unit':<6}{'sleep f/b ms':>14}{'whole f/b ms':>16}{'unit-by-unit f/b ms':>22}")
    for (f, b), (_, a), (_, u) in zip(sleeps_ms, whole.df.iterrows(), units.df.iterrows()):
        gaps += [abs(u["fwd_ms"] - a["fwd_ms"]), abs(u["bwd_ms"] - a["bwd_ms"])]
        print(
            f"{a['name']:<6}{f:>7.1f}/{b:<6.1f}{a['fwd_ms']:>9.2f}/{a['bwd_ms']:<6.2f}"
            f"{u['fwd_ms']:>15.2f}/{u['bwd_ms']:<6.2f}"
        )
    print(
        f"largest gap between the two readings of a unit {max(gaps):.2f} ms; steps {whole.step_ms:.1f} ms whole, "
        f"{units.step_ms:.1f} ms unit by unit (cv {whole.cv:.3f}, {units.cv:.3f}); load average "
        + ", ".join(f"{v:.1f}" for v in os.getloadavg())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--models", default="gpt,vit,mlp")
    parser.add_argument("--unit-by-unit", action="store_true", help="whole against unit-by-unit, sleeping layers")
    args = parser.parse_args()
    if args.unit_by_unit:
        unit_by_unit_agreement(args.repeats, args.warmup)
        return
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
