"""A plain ``torch.distributed.pipelining`` training job that writes a ``torch.profiler`` trace per rank.

No pipeswift_lab here: this is the kind of script a cluster runs (torchtitan's pipeline does the same with its own
model), and what ``psl.Timeline.from_profiler`` reads back. Launch it with torch's elastic launcher::

    torchrun --nproc-per-node 2 examples/torch_pipeline_job.py --schedule Interleaved1F1B --trace-dir traces

Each rank builds the stages it holds from ``--bounds`` (layer ranges of :func:`build_model`, stage ``s`` on rank
``s % world_size``), trains ``--steps`` steps on gloo (NCCL when ``--cuda``) and profiles the last ``--active``
of them with ``torch.profiler.tensorboard_trace_handler`` (or ``export_chrome_trace`` with ``--chrome``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

#: Schedules by the names torch gives them (``Schedule<name>``); the interleaved ones hold several stages per rank.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS")


def build_model(layers: int = 8, width: int = 256, seed: int = 0) -> nn.Sequential:
    """The job's model: ``layers`` blocks of Linear and GELU, then a Linear head; the same weights for a seed."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Sequential(nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def parse_bounds(text: str) -> list[tuple[int, int]]:
    """``"0:3,3:9"`` as ``[(0, 3), (3, 9)]``: each stage's half-open range of the model's children."""
    return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]


def one_f_one_b_order(P: int, m: int) -> dict[int, list[torch_schedules._Action]]:
    """1F1B's per-rank order as a table (what torchtitan reads from a CSV): ``P - 1 - r`` warm-up forwards on rank
    ``r``, then a forward and a backward in turn, then the remaining backwards (Narayanan et al., SOSP 2019)."""
    order = {}
    for r in range(P):
        warm = min(P - 1 - r, m)
        actions = [f"{r}F{i}" for i in range(warm)]
        forward = warm
        for backward in range(m):
            if forward < m:
                actions.append(f"{r}F{forward}")
                forward += 1
            actions.append(f"{r}B{backward}")
        order[r] = [torch_schedules._Action.from_str(a) for a in actions]
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="Interleaved1F1B", choices=SCHEDULES)
    parser.add_argument("--bounds", default=None, help="stage layer ranges, e.g. 0:3,3:9 (default: equal split)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (m)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--active", type=int, default=4, help="profiled steps (the last ones)")
    parser.add_argument("--trace-dir", required=True)
    parser.add_argument("--chrome", action="store_true", help="export_chrome_trace files instead of the handler's")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument(
        "--through-runtime",
        action="store_true",
        help="run 1F1B through torch's _PipelineScheduleRuntime loaded with 1F1B's order as a table (as torchtitan "
        "runs a CSV schedule): it labels every action in the trace; torch's Schedule1F1B labels none",
    )
    args = parser.parse_args()

    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.cuda else "cpu")
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model(args.layers, args.width)
    multi = args.schedule not in ("GPipe", "1F1B")
    n_stages = world * (2 if multi else 1)
    n = len(model)
    bounds = (
        parse_bounds(args.bounds)
        if args.bounds
        else [(s * n // n_stages, (s + 1) * n // n_stages) for s in range(n_stages)]
    )
    if len(bounds) != n_stages:
        raise SystemExit(f"--bounds gives {len(bounds)} stages; {args.schedule} on {world} ranks needs {n_stages}")
    stages = []
    for s in range(rank, n_stages, world):
        a, b = bounds[s]
        module = nn.Sequential(*list(model.children())[a:b]).to(device)
        stages.append(PipelineStage(module, s, n_stages, device))
    schedule_class = getattr(torch_schedules, f"Schedule{args.schedule}")
    loss_fn = nn.MSELoss()
    if args.through_runtime and args.schedule == "1F1B":
        # torchtitan's way for a schedule it has as a table: the runtime, loaded with the schedule's own order
        order = one_f_one_b_order(world, args.microbatches)
        pipe = torch_schedules._PipelineScheduleRuntime(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
        pipe._prepare_schedule_with_comms(order)
    elif multi:
        pipe = schedule_class(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    else:
        pipe = schedule_class(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator).to(device)
    y = torch.randn(args.batch, args.width, generator=generator).to(device)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.cuda else [])
    wait = args.steps - args.active - 1
    handler = None if args.chrome else tensorboard_trace_handler(args.trace_dir, worker_name=f"rank{rank}")
    with profile(
        activities=activities,
        schedule=schedule(wait=max(wait, 0), warmup=1, active=args.active),
        on_trace_ready=handler,
    ) as prof:
        for _ in range(args.steps):
            optimizer.zero_grad()
            holds_first = any(st.is_first for st in stages)
            holds_last = any(st.is_last for st in stages)
            if holds_first:
                pipe.step(x, target=y if holds_last else None)
            elif holds_last:
                pipe.step(target=y)
            else:
                pipe.step()
            optimizer.step()
            prof.step()
    if args.chrome:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"rank{rank}.pt.trace.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
