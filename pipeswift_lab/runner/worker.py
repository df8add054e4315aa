"""What every rank runs: process group, its stages, torch's schedule, the steps, the gather.

One entry point, :func:`main`, serves every launch: ``run()`` calls it through torch's
elastic agent (:func:`entry`, in processes forked from a warm server, or as the command
``python -m pipeswift_lab.runner SPEC --out DIR``), and ``torchrun ... -m pipeswift_lab.runner
SPEC`` runs that same command on one or many machines. The rank, world
size and local rank come from the environment torch's launchers set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``).

Files a rank writes in ``DIR``: ``rank{r}.pid`` at start; ``rank{r}.done`` when it finished;
``rank{r}.error`` (the traceback) if it raises; ``rank{r}.stacks`` (every thread's stack, via ``faulthandler``) when the launcher
sends ``SIGUSR1`` to a rank it believes hung; ``progress`` (steps done, from the rank holding
the last stage, when asked); ``result.pt`` from rank 0 with what every rank measured.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from .instrument import ActionRecorder

RESULT_FILE = "result.pt"
PROGRESS_FILE = "progress"


def process_start_ns() -> int | None:
    """Wall-clock start of this process in ns, from ``/proc`` (Linux, ~10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, ticks since boot
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        now = time.time_ns()
        return now - int((uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")) * 1e9)
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return None


def _env_int(name: str) -> int:
    if name not in os.environ:
        raise RuntimeError(
            f"environment variable {name} is not set: start the runner with torchrun "
            "(`torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC`) or pipeswift_lab.run(...)"
        )
    return int(os.environ[name])


def main(spec_path, out_dir, progress: bool = False) -> None:
    """Run this process's rank of the spec at ``spec_path``; write its files into ``out_dir``.

    Writes ``rank{r}.error`` with the traceback before re-raising anything the rank raises.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = _env_int("RANK")
    (out_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    stacks = open(out_dir / f"rank{rank}.stacks", "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        from .spec import load_spec

        run_rank(load_spec(spec_path), out_dir, progress=progress)
        (out_dir / f"rank{rank}.done").write_text("")
    except BaseException:
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def entry(spec_path, out_dir, progress: bool = False) -> None:
    """:func:`main` under torch elastic's ``@record`` (error file for the agent); the callable ``run()`` launches."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)(spec_path, out_dir, progress)


def _device(spec, local_rank: int) -> torch.device:
    if spec.device_type == "cuda":  # pragma: no cover - needs GPUs
        device = torch.device("cuda", spec.devices[local_rank])
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _build_stages(spec, rank, device):
    from torch.distributed.pipelining import PipelineStage

    from .stages import stage_module

    plan = spec.plan
    stages = []
    for s in plan.stages_of(rank):
        module = stage_module(spec.model, plan.bounds[s]).to(device)
        in_spec, out_spec = spec.boundaries[s]
        stages.append(PipelineStage(module, s, plan.n_stages, device,
                                    input_args=in_spec.empty(device), output_args=out_spec.empty(device)))
    return stages


def _schedule(spec, stages):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(spec.plan.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=spec.m, loss_fn=spec.loss_fn)
    schedule = cls(stages, n_microbatches=spec.m, loss_fn=spec.loss_fn)
    mapping = tuple(schedule.stage_index_to_group_rank[s] for s in range(spec.plan.n_stages))
    if mapping != spec.plan.stage_to_rank:
        raise RuntimeError(f"torch's {cls.__name__} places stages on ranks {list(mapping)}, the plan on {list(spec.plan.stage_to_rank)}")
    return schedule


def run_rank(spec, out_dir: Path, progress: bool = False) -> None:
    """Train ``spec.steps`` steps on this rank, then gather every rank's measurements to rank 0."""
    import numpy  # noqa: F401 - gloo pipelining needs numpy at run time (recv_object_list)
    import torch.distributed as dist

    proc_start = process_start_ns()
    entered = time.time_ns()
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), int(os.environ.get("LOCAL_RANK", 0))
    if world != spec.P:
        raise RuntimeError(f"the spec has P={spec.P} ranks but the launcher started WORLD_SIZE={world}; use --nproc-per-node {spec.P} on one machine")
    if spec.threads_per_rank is not None:
        torch.set_num_threads(spec.threads_per_rank)
    device = _device(spec, local_rank)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "nccl":  # pragma: no cover - needs GPUs
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        gather_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        gather_group = None
    try:
        _train(spec, rank, world, device, out_dir, progress, gather_group, proc_start, entered)
    finally:
        dist.destroy_process_group()


def _train(spec, rank, world, device, out_dir, progress, gather_group, proc_start, entered):
    import torch.distributed as dist

    plan = spec.plan
    stages = _build_stages(spec, rank, device)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = spec.optimizer(params)
    schedule = _schedule(spec, stages)
    recorder = ActionRecorder(stages, schedule, device, enabled=spec.instrument)
    holds_first, holds_last = rank == plan.first_rank, rank == plan.last_rank
    torch.manual_seed(spec.seed)
    progress_path = out_dir / PROGRESS_FILE if progress and holds_last else None
    ready = recorder.now_ns()
    dist.barrier()

    step_start, step_end, losses = [], [], []
    for step in range(spec.steps):
        if holds_first or holds_last:
            inputs, targets = spec.data.batch(step)
        args = (inputs.to(device),) if holds_first else ()
        kwargs = {"target": targets.to(device), "losses": []} if holds_last else {}
        step_start.append(recorder.start_step(step))
        schedule.step(*args, return_outputs=False, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_end.append(recorder.end_step())
        if holds_last:
            losses.append(float(torch.stack([loss.detach() for loss in kwargs["losses"]]).float().mean()))
        if progress_path is not None:
            progress_path.write_text(str(step + 1))

    state = {}
    for stage in stages:
        state.update({k: t.detach().to("cpu", copy=True) for k, t in stage.submod.state_dict().items()})
    payload = {
        "rank": rank, "pid": os.getpid(), "host": os.uname().nodename, "device": str(device), "stages": plan.stages_of(rank),
        "records": recorder.rows(), "step_start_ns": step_start, "step_end_ns": step_end, "losses": losses,
        "state": state, "process_start_ns": proc_start, "entered_ns": entered, "ready_ns": ready,
        "threads": torch.get_num_threads(),
    }
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0, group=gather_group)
    if rank == 0:
        result = {"format": "pipeswift_lab.run", "ranks": gathered, "gathered_ns": time.time_ns()}
        tmp = out_dir / (RESULT_FILE + ".tmp")
        torch.save(result, tmp)
        os.replace(tmp, out_dir / RESULT_FILE)
