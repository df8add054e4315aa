"""What every rank runs: process group, its stages, torch's schedule, the steps, the gather.

One entry point, :func:`main` (under torch elastic's ``@record``, which writes the error file the agent reads),
serves every launch: ``run()`` calls it through torch's elastic agent (in processes forked from a warm server, or
as the command ``python -m pipeswift_lab.runner SPEC --out DIR``), and ``torchrun ... -m pipeswift_lab.runner
SPEC`` runs that same command on one or many machines. The rank, world size and local rank come from the
environment torch's launchers set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).

Files a rank writes in ``DIR``: ``rank{r}.pid`` at start; ``rank{r}.done`` when it finished (JSON: the OS
threads left after teardown); ``rank{r}.error`` (the traceback) if it raises; ``rank{r}.stacks`` (every thread's
stack, via ``faulthandler``) when the launcher sends ``SIGUSR1`` to a rank it believes hung; ``progress`` (steps
done, from the rank holding the last stage, when asked); ``result.pt`` from rank 0 with what every rank measured.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib
import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ..processes import alive
from ..run_files import RESULT_FILE, RESULT_FORMAT, rank_file
from .inputs import RankInputs, RankMesh
from .stage_build import build_stages
from .train_loop import train

if TYPE_CHECKING:
    from torch.distributed import Store

    from ..spec import RunSpec

#: torch modules every rank imports before its process group exists. See [Note: the process group outlives its
#: destroy]. The fork server preloads them too.
DISTRIBUTED_MODULES = (
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.device_mesh",
    "torch.nn.parallel",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
)
#: Name prefixes of the OS threads a gloo process group runs (its work loops and its TCP event loop).
GLOO_THREADS = ("pt_gloo", "gloo_")
#: Seconds a rank that failed because a peer died waits before exiting, so the peer's death is reported first.
PEER_FAILURE_DELAY_S = 1.0
#: Seconds between two checks that the caller is still alive.
WATCHDOG_PERIOD_S = 0.5


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


@record
def main(
    spec_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = False,
    caller_pid: int | None = None,
) -> None:
    """Run this process's rank of the spec at ``spec_path``; write its files into ``out_dir``.

    ``caller_pid`` is the process that called ``run()``: the worker exits when it dies.

    Writes ``rank{r}.error`` with the traceback before re-raising anything the rank raises.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = _env_int("RANK")
    watchdog = None
    gc.freeze()  # what is loaded by now (torch, pandas, ...) lives to the end: the teardown's collection skips it
    for stale in ("error", "done", "sigterm"):  # left by an earlier attempt of this run (elastic restarts)
        (out_dir / rank_file(rank, stale)).unlink(missing_ok=True)
    (out_dir / rank_file(rank, "pid")).write_text(str(os.getpid()))
    if caller_pid is not None:
        watchdog = start_caller_watchdog(int(caller_pid))
    stacks = open(out_dir / rank_file(rank, "stacks"), "w")  # kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        from ..spec import load_spec
        from .memory_probe import resident_bytes

        resident = resident_bytes()
        run_rank(load_spec(spec_path), out_dir, progress=progress, resident_start=resident[0] if resident else None)
        (out_dir / rank_file(rank, "done")).write_text(json.dumps({"threads_after_teardown": os_threads()}))
    except BaseException:
        text = traceback.format_exc()
        (out_dir / rank_file(rank, "error")).write_text(text)
        if _lost_a_peer(text):
            # Let the elastic agent see the peer that died first, with its exit signal, before this
            # consequence of it: the agent reports only the first failure it observes.
            time.sleep(PEER_FAILURE_DELAY_S)
        raise
    finally:
        if watchdog is not None:
            watchdog.set()


def os_threads() -> list[str]:
    """Names of this process's live OS threads (``/proc/self/task/*/comm``; empty where there is no ``/proc``)."""
    names: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - not Linux
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(names)


def _lost_a_peer(traceback_text: str) -> bool:
    from ..errors import exception_summary, is_peer_error

    return is_peer_error(exception_summary(traceback_text))


def start_caller_watchdog(caller_pid: int) -> threading.Event:
    """Exit this worker when the process that called ``run()`` dies (a notebook kernel restarted or killed).

    Without it, workers forked from the fork server outlive their caller: they finish training
    and then block forever in the gather, holding CPUs or GPUs. A daemon thread checks the
    caller's pid (handed over by ``run()``; not used under torchrun, whose agent watches its
    own workers) every ``WATCHDOG_PERIOD_S`` and SIGKILLs this process when it is gone.
    Returns the event that stops it, set when the rank's work is over.
    """
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCHDOG_PERIOD_S):
            if not alive(caller_pid, any_user=False):  # another user's process with its pid: the caller is gone
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pipeswift-caller-watchdog", daemon=True).start()
    return stop


def _device(spec: RunSpec, local_rank: int) -> torch.device:
    if spec.device_type == "cuda" and spec.devices is not None:  # pragma: no cover - needs GPUs
        device = torch.device("cuda", spec.devices[local_rank])
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def stage_loss(spec: RunSpec) -> Any:
    """The loss torch's schedule calls with the last stage's output: ``spec.loss_fn``, given the model's output
    structure back when the last stage returns it as a flat tuple (traced and manual stages)."""
    from ..stages.outputs import StructuredLoss
    from ..stages.precision import autocast_loss, mixed

    structure = spec.traced.output if spec.traced is not None else spec.manual.output if spec.manual else None
    loss = spec.loss_fn if structure is None else StructuredLoss(spec.loss_fn, structure)
    return autocast_loss(loss, spec.device_type) if mixed(spec.precision) else loss


def _schedule(spec: RunSpec, stages: list[Any]) -> Any:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        _PipelineScheduleRuntime,
        get_schedule_class,
    )

    from ...core.schedule import Schedule, torch_actions

    loss_fn = stage_loss(spec)
    if isinstance(spec.plan.schedule, Schedule):  # a user's order, lowered to sends and receives by torch's runtime
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=spec.m, loss_fn=loss_fn)
        schedule._prepare_schedule_with_comms(torch_actions(spec.plan.schedule))
        cls = type(schedule)
    else:
        cls = get_schedule_class(spec.plan.schedule)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=spec.m, loss_fn=loss_fn)
        schedule = cls(stages, n_microbatches=spec.m, loss_fn=loss_fn)
    mapping = tuple(schedule.stage_index_to_group_rank[s] for s in range(spec.plan.n_stages))
    if mapping != spec.plan.stage_to_rank:
        raise RuntimeError(
            f"torch's {cls.__name__} places stages on ranks {list(mapping)}, the plan on "
            f"{list(spec.plan.stage_to_rank)}"
        )
    return schedule


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> Store:
    """The launcher's c10d store (``env://``, as ``init_process_group`` would open it) under a per-attempt prefix.

    After an elastic restart the workers meet in the same store as the attempt before; without
    the prefix a new rank can read a dead rank's gloo address and fail to connect.
    """
    import torch.distributed as dist

    from .train_loop import attempt_number

    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"pipeswift/attempt{attempt_number()}", store)


def run_rank(spec: RunSpec, out_dir: Path, progress: bool = False, resident_start: int | None = None) -> None:
    """Train ``spec.steps`` steps on this rank, then gather every rank's measurements to rank 0. ``resident_start`` is
    the process's resident size before it read the spec."""
    import numpy  # noqa: F401 - gloo pipelining needs numpy at run time (recv_object_list)
    import torch.distributed as dist

    proc_start = process_start_ns()
    entered = time.time_ns()
    for name in DISTRIBUTED_MODULES:  # before init_process_group: see [Note: the process group outlives its destroy]
        importlib.import_module(name)
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), int(os.environ.get("LOCAL_RANK", 0))
    if world != spec.world_size:
        raise RuntimeError(
            f"the spec has P*D*fsdp*tp = {spec.P}*{spec.D}*{spec.fsdp}*{spec.tp} = {spec.world_size} ranks but the "
            f"launcher started WORLD_SIZE={world}; use --nproc-per-node {spec.world_size} on one machine "
            "(or --nnodes N --nproc-per-node world/N)"
        )
    if spec.threads_per_rank is not None:
        torch.set_num_threads(spec.threads_per_rank)
    if spec.device_type == "cpu":
        from .memory_probe import return_freed_memory

        return_freed_memory()
    device = _device(spec, local_rank)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = _attempt_store(rank, world, timeout)
    if spec.backend == "nccl":  # pragma: no cover - needs GPUs
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
        gather_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        gather_group = None
    topo: RankMesh | None = None
    inputs: RankInputs | None = None
    try:
        topo = RankMesh(rank, spec.P, spec.D, device.type, spec.fsdp, spec.tp)
        inputs = RankInputs(
            spec=spec,
            topo=topo,
            world=world,
            device=device,
            out_dir=out_dir,
            progress=progress,
            gather_group=gather_group,
            proc_start_ns=proc_start,
            entered_ns=entered,
            build_stages=build_stages,
            make_schedule=_schedule,
            resident_start_bytes=resident_start,
        )
        gathered = train(inputs)
        if rank == 0:
            result = {"format": RESULT_FORMAT, "ranks": gathered, "gathered_ns": time.time_ns()}
            tmp = out_dir / (RESULT_FILE + ".tmp")
            torch.save(result, tmp)
            os.replace(tmp, out_dir / RESULT_FILE)
        # no rank tears its connections down while a peer (another node's replica) may still use them: a gloo
        # pair closed under a peer's pending operation aborts that peer
        dist.barrier(group=gather_group)
    finally:
        topo = gather_group = inputs = None  # the mesh's groups, and through the stages DDP's, go with the default one
        gc.collect()  # stage modules in reference cycles hold DDP reducers, which hold their groups
        dist.destroy_process_group()


# [Note: the process group outlives its destroy]
# Cold workers (``start_method="subprocess"``, torchrun) used to abort now and then *after* a successful run:
# "terminate called without an active exception", SIGABRT from C++ with no Python frame. The cause is the order
# of two imports. ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` as the default argument of
# ten collectives (``broadcast``, ``all_reduce``, ...), evaluated when the module is first imported. It is
# imported by ``torch.distributed.pipelining``, which a rank used to import lazily, after
# ``init_process_group``: the default process group then sat in ten functions' ``__defaults__`` for the rest
# of the process, ``destroy_process_group`` dropped only the registry's reference, and the gloo group's three
# C++ threads (two ``pt_gloo_runloop`` work loops and the ``gloo_tcp_loop`` socket loop) kept running into
# interpreter shutdown. There the group is freed (or not) while modules are torn down and, at ``exit()``,
# static destructors run, racing its own threads and the peers closing their sockets: the rare abort. The
# fork server never showed it, as it imports ``pipelining`` before any group exists and its children leave
# through ``os._exit``.
# So: (1) every rank imports DISTRIBUTED_MODULES before ``init_process_group``, and its teardown drops the
# mesh's groups and collects the stage modules' reference cycles, which hold DDP's reducers and their groups
# (``gc.freeze()`` at start keeps that collection to the run's own objects: 0.01 s instead of 0.5 s);
# ``rank{r}.done`` records the threads left after teardown (tests check no gloo thread is among them); (2) the
# command line exits through ``os._exit`` once its output is flushed (``pipeswift_lab.runner.__main__``), as
# multiprocessing's children do, so no teardown race can turn a finished run into a failed one.


__all__ = [
    "DISTRIBUTED_MODULES",
    "GLOO_THREADS",
    "main",
    "os_threads",
    "PEER_FAILURE_DELAY_S",
    "process_start_ns",
    "run_rank",
    "stage_loss",
    "start_caller_watchdog",
    "WATCHDOG_PERIOD_S",
]
