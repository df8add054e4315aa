"""Assembly of a pipeline run (launch to first step) and its memory, beside a plain torch job, in one run.

    python benchmarks/bench_assembly.py [--sizes 2,128,512,2048] [--P 2,4]

Models of 8 ``nn.Linear(w, w)`` layers holding 2 MB, 128 MB, 512 MB and 2 GB of fp32 weights run 2 steps of 1F1B
(SGD, m=4) at P=2 and P=4, four ways:

* ``plain`` — :mod:`plain_pipeline_job` under ``torchrun``: each rank builds only its stage (meta, ``to_empty``,
  ``reset_parameters``), nothing of pipeswift_lab inside; run with glibc's ``MALLOC_MMAP_THRESHOLD_`` set as the
  toolkit's CPU ranks set it (``mallopt``), so that freed gradients leave the resident set in both;
* ``eager`` — ``run(model, ...)`` of a model built in this process (its weights are written once as safetensors
  beside the spec and each rank reads its own);
* ``meta-init`` — ``run`` of the model built under ``torch.device("meta")``: each rank initializes its stage;
* ``meta-weights`` — the meta model with ``weights=`` a safetensors checkpoint of it.

Per row: assembly (launch to the first step, median of ``--repeats``), the caller's resident growth during the call
(``VmHWM`` after it, reset before it, minus ``VmRSS`` before it; the model a caller built before is not counted),
each rank's resident peak above its resident size before it read anything (the interpreter's own), and that stage's
training state (weights and gradients: SGD keeps no state). The toolkit's runs share a warm fork server, started by
one untimed run first. Then the goals: assembly at most 1.2 x the plain job's, a meta model's caller growth at most
5% of its weights, each rank's peak at most its stage's training state + 10%; and each rank's peak beside the plain
job's. Besides its weights and gradients a rank holds, for a moment, the weight gradient of its largest layer (each
micro-batch's is made, then added to ``.grad``) and a fixed share of libraries and gloo buffers (some 15 MB in the
plain job, 40 MB in the toolkit's ranks), so a stage of four equal layers peaks near 1.14 x its training state in
either job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_file
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.runner.rank.memory_probe import MMAP_THRESHOLD_BYTES

LAYERS, M, STEPS, BATCH = 8, 4, 2, 8
#: fp32 megabytes of weights -> layer width (8 layers of w*w + w parameters).
WIDTHS = {2: 256, 128: 2048, 512: 4096, 2048: 8192}
HERE = Path(__file__).resolve().parent


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])


def resident() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def partition(P: int) -> Partition:
    per = LAYERS // P
    profile = psl.Profile.synthetic(fwd_ms=[1.0] * LAYERS, bwd_ms=[1.0] * LAYERS)
    return Partition.from_bounds(profile, [(r * per, (r + 1) * per) for r in range(P)], schedule="1F1B")


def data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


def toolkit_run(built: nn.Module, width: int, P: int, weights: Path | None) -> dict:
    """One ``run()``: its assembly, the caller's growth, each rank's peak above its start."""
    batch = data(width)
    reset_high_water()
    before, _ = resident()
    result = psl.run(
        built, batch, nn.functional.mse_loss, partition(P), M, steps=STEPS, progress=False, weights=weights,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    )  # fmt: skip
    growth = resident()[1] - before
    ranks = result.ranks
    return {
        "assembly_s": result.jct.assembly_s,
        "caller_growth_mb": growth / 1e6,
        "rank_peak_mb": float((ranks["resident_peak_bytes"] - ranks["resident_start_bytes"]).max()) / 1e6,
    }


def plain_run(width: int, P: int) -> dict:
    """The plain job under torchrun: assembly from the command's start to the first rank's first step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}",
            str(HERE / "plain_pipeline_job.py"), "--width", str(width), "--layers", str(LAYERS), "--steps",
            str(STEPS), "--microbatches", str(M), "--batch", str(BATCH), "--out", str(out),
        ]  # fmt: skip
        launch_ns = time.time_ns()
        threads = str(max(1, (os.cpu_count() or 1) // P))
        # the allocator setting the toolkit's CPU ranks make (runner.rank.memory_probe.return_freed_memory)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}
        subprocess.run(command, check=True, env=env)
        ranks = json.loads(out.read_text())
    return {
        "assembly_s": (min(r["first_step_ns"] for r in ranks) - launch_ns) / 1e9,
        "caller_growth_mb": float("nan"),
        "rank_peak_mb": max(r["resident_peak_bytes"] - r["resident_start_bytes"] for r in ranks) / 1e6,
    }


def measure(size_mb: int, P: int, repeats: int, weights: Path) -> list[dict]:
    width = WIDTHS[size_mb]
    weight_bytes = LAYERS * (width * width + width) * 4
    state_mb = 2 * weight_bytes / P / 1e6  # weights and gradients of one stage
    ways = {
        "plain": lambda: plain_run(width, P),
        "eager": lambda: toolkit_run(model(width), width, P, None),
        "meta-init": lambda: toolkit_run(meta(width), width, P, None),
        "meta-weights": lambda: toolkit_run(meta(width), width, P, weights),
    }
    rows = []
    for way, go in ways.items():
        runs = [go() for _ in range(repeats)]
        rows.append(
            {
                "weights_mb": round(weight_bytes / 1e6),
                "P": P,
                "way": way,
                "assembly_s": statistics.median(r["assembly_s"] for r in runs),
                "caller_growth_mb": statistics.median(r["caller_growth_mb"] for r in runs),
                "rank_peak_mb": max(r["rank_peak_mb"] for r in runs),
                "stage_state_mb": state_mb,
            }
        )
        print(rows[-1], flush=True)
    return rows


def meta(width: int) -> nn.Sequential:
    with torch.device("meta"):
        return model(width)


def goals(table: pd.DataFrame) -> pd.DataFrame:
    """One row per size, P and toolkit way: each goal's figure and whether it is met."""
    plain = table[table["way"] == "plain"].set_index(["weights_mb", "P"])
    rows = []
    for _, r in table[table["way"] != "plain"].iterrows():
        baseline = plain.loc[(r["weights_mb"], r["P"])]
        ratio = r["assembly_s"] / baseline["assembly_s"]
        growth = r["caller_growth_mb"] / r["weights_mb"]
        peak = r["rank_peak_mb"] / r["stage_state_mb"]
        rows.append(
            {
                "weights_mb": r["weights_mb"],
                "P": r["P"],
                "way": r["way"],
                "assembly_vs_plain": round(ratio, 2),
                "assembly_ok": ratio <= 1.2,
                "caller_growth_share": round(growth, 3),
                "caller_ok": growth <= 0.05 if r["way"] != "eager" else None,
                "rank_peak_vs_state": round(peak, 2),
                "rank_ok": peak <= 1.1,
                "rank_peak_vs_plain": round(r["rank_peak_mb"] / baseline["rank_peak_mb"], 2),
            }
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,128,512,2048", help="MB of fp32 weights, comma-separated")
    parser.add_argument("--P", default="2,4", help="pipeline ranks, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; the assembly's median is printed")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    Ps = [int(p) for p in args.P.split(",")]
    toolkit_run(model(64), 64, 2, None)  # starts the warm fork server every later run uses
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            weights = Path(tmp) / f"w{size}.safetensors"
            save_file(model(WIDTHS[size]).state_dict(), str(weights))
            for P in Ps:
                rows += measure(size, P, args.repeats, weights)
            weights.unlink()
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.precision", 2):
        print(table.to_string(index=False))
        print()
        print(goals(table).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
