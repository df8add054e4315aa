"""Stress process start and exit: cold launches while another process keeps a core busy; count the aborts.

    python benchmarks/bench_launch.py [--cold 30] [--two-node 30]

Each cold launch is ``run(..., launch=Launch(start_method="subprocess"))`` (fresh interpreters that import torch
on every rank, as torchrun starts them); each two-node launch is two ``torchrun`` agents of two
ranks each (one replica per node, D=2), as in ``tests/runner/test_multinode.py``. Prints one row
per kind: launches, completed, aborted at exit (SIGABRT, "terminate called ..."), other
failures and the median seconds per launch. Exits non-zero on any abort or failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch_stress import busy_core, cold_run, save_spec, two_node_launch  # the tests' own launch helpers


def _measure(kind: str, n: int, launch) -> dict:
    outcomes, seconds = [], []
    for _ in tqdm(range(n), desc=kind, leave=False):
        t0 = time.perf_counter()
        outcomes.append(launch())
        seconds.append(time.perf_counter() - t0)
    for o in outcomes:
        if not o["ok"]:
            print(f"{kind}: {'ABORT' if o['abort'] else 'failure'}: {o['error']}", file=sys.stderr)
    return {
        "launch": kind,
        "launches": n,
        "completed": sum(o["ok"] for o in outcomes),
        "aborted": sum(o["abort"] for o in outcomes),
        "other_failures": sum(not o["ok"] and not o["abort"] for o in outcomes),
        "median_s": round(statistics.median(seconds), 2) if seconds else float("nan"),
    }


def main(argv=None) -> int:
    """Run the launches with a core busy, print the table; return 1 on any abort or failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cold", type=int, default=30, help="cold run(launch=Launch(start_method='subprocess')) launches"
    )
    parser.add_argument("--two-node", type=int, default=30, help="two-node torchrun launches (D=2, 2 ranks a node)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = save_spec(Path(tmp) / "job.pkl", D=2)
        with busy_core():
            rows = [
                _measure('run(launch=Launch(start_method="subprocess"))', args.cold, cold_run),
                _measure("two torchrun nodes, D=2", args.two_node, lambda: two_node_launch(spec)),
            ]
    table = pd.DataFrame(rows)
    print("with one core kept busy by a spinning process:")
    print(table.to_string(index=False))
    return int(bool((table["aborted"] + table["other_failures"]).sum()))


if __name__ == "__main__":
    sys.exit(main())
