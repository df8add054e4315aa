"""A plain ``torch.distributed.pipelining`` job, with nothing of pipeswift_lab in it: the baseline of bench_assembly.

    python -m torch.distributed.run --nproc-per-node P benchmarks/plain_pipeline_job.py --width W --layers L --out F

Each rank builds only its own stage as torchtitan does (the model's structure on the meta device, ``to_empty`` on
its device, then ``reset_parameters`` of every layer), trains ``--steps`` steps of 1F1B with SGD on random data,
and reports when its first step started, its resident size before it built anything and its resident high-water.
Rank 0 writes every rank's figures as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


def resident() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def stage_module(width: int, layers: int, rank: int, P: int) -> nn.Sequential:
    """This rank's layers, built on meta and made on the CPU (``to_empty``), then initialized."""
    per = layers // P
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    stage = nn.Sequential(*list(model)[rank * per : (rank + 1) * per])
    stage.to_empty(device="cpu")
    with torch.no_grad():
        for layer in stage:
            layer.reset_parameters()
    return stage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start_rss, _ = resident()
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    stage = PipelineStage(stage_module(args.width, args.layers, rank, P), rank, P, torch.device("cpu"))
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    first_step_ns = None
    for _ in range(args.steps):
        if first_step_ns is None:
            first_step_ns = time.time_ns()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == P - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
    figures = {
        "rank": rank,
        "first_step_ns": first_step_ns,
        "resident_start_bytes": start_rss,
        "resident_peak_bytes": resident()[1],
        "stage_param_bytes": sum(p.numel() * p.element_size() for p in stage.submod.parameters()),
    }
    gathered = [None] * P
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
