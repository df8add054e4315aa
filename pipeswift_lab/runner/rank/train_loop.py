"""One rank's training loop: steps, the per-step agreement between ranks, checkpoints, preemption.

After torch's schedule has run a step's forwards and backwards, and before the optimizer
updates, the ranks agree in one small all-reduce (MAX over three flags) on

* ``nonfinite`` — the rank holding the last stage saw a NaN/inf loss: ``on_nonfinite="raise"``
  stops before the update (the last good checkpoint stands), ``"skip"`` drops this step's
  update, ``"ignore"`` updates anyway;
* ``stop`` — some rank was asked to stop (SIGTERM: a preemption notice; or the launcher's
  ``preempt`` file): every rank finishes this step, all save at the same step, and exit;
* ``save`` — rank 0's vote for a checkpoint at ``Checkpointing(every="auto")``: the Young/Daly
  interval √(2·C·MTBF) (Young, CACM 1974; Daly, FGCS 2006) from the *measured* save stall C
  and step time (:mod:`.checkpointer`);
* ``hold`` — rank 0's last save is still being written in the background, or the steps left
  take less time than a background write: a periodic or automatic save due now is skipped on
  every rank.

Files written into the run directory for the launcher: ``steps.log`` (the last rank: one
``attempt step start_ns end_ns`` line per step), ``checkpoints.log`` (rank 0: one JSON line
per committed checkpoint) and ``attempt{n}.json`` (rank 0: where attempt ``n`` resumed from): the names of
:mod:`~pipeswift_lab.runner.run_files`."""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from ..final_weights import write_rank_shard
from ..run_files import PROGRESS_FILE, STEPS_LOG, attempt_file
from ..stages.precision import sharded_optimizer
from ..stages.release import release_unheld
from ..stages.tied import TiedGradients, unique_parameters
from .checkpointer import Checkpointer, append_line, broadcast, gather
from .inputs import RankInputs
from .instrument import ActionRecorder
from .memory_probe import MemoryProbe, lifetime_high_water, probed_step, resident_bytes
from .profiler_trace import StepTrace
from .state_files import restore_rank_state
from .stop_request import StopRequest

__all__ = [
    "train",
    "RankInputs",
    "StopRequest",
    "attempt_number",
    "rank_module",
    "unwrapped",
]


def attempt_number() -> int:
    """Which attempt of the run this process belongs to (torch elastic's restart count; 0 at first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def rank_module(stages: list[Any]) -> torch.nn.Module:
    """This rank's layers in one module whose state keys are the full model's (every stage's children, by name).

    Traced stages (:mod:`~pipeswift_lab.runner.stages.traced`) are merged FQN by FQN, since two of
    them may share a container (``blocks``).
    """
    from torch.fx import GraphModule

    if any(isinstance(unwrapped(stage.submod), GraphModule) for stage in stages):
        from ..stages.traced import merged_module

        return merged_module([unwrapped(stage.submod) for stage in stages])
    children: OrderedDict[str, torch.nn.Module] = OrderedDict()
    for stage in stages:
        children.update(unwrapped(stage.submod).named_children())
    return torch.nn.Sequential(children)


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The stage module inside a ``DistributedDataParallel`` wrapper (``module`` itself when it has none)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


@dataclass(kw_only=True)
class RankState:
    """What a rank built before its first step: stages, optimizer, schedule, recorder, and where it resumes."""

    stages: list[Any]
    """This rank's ``PipelineStage`` objects (their modules DDP-wrapped with ``D > 1``)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the stages' parameters."""
    tied: TiedGradients
    """Sums the gradients of the tied parameters' copies between the stages holding them."""
    schedule: Any
    """torch's schedule over the stages."""
    recorder: ActionRecorder
    """Times every action (or only the steps, when not instrumented)."""
    memory: MemoryProbe
    """Measures the rank's memory: the tensor-level peak of one step and the process's high-water."""
    stop: StopRequest
    """Set by SIGTERM or the launcher's ``preempt`` file."""
    saver: Checkpointer
    """This rank's side of the checkpoints."""
    attempt: int
    """Which attempt of the run this is (0, then one per elastic restart)."""
    first_step: int = 0
    """The step training starts at: 0, or the step of the checkpoint restored."""
    restored: dict[str, Any] | None = None
    """What :func:`~pipeswift_lab.runner.rank.state_files.restore_rank_state` reported, with ``path``, ``step`` and
    ``rng_restored``; ``None`` when nothing was restored."""
    ready_ns: int = 0
    assembly_high_water: int | None = None
    """The process's resident high-water (``VmHWM``) when it was ready, before the memory probe resets it."""
    """Wall clock when the rank was ready to train (stages built, state restored)."""
    trace: StepTrace | None = None
    """The profiler over the step loop (``run(..., profiler_trace=DIR)``); ``None``: no profiler at all."""


@dataclass(kw_only=True)
class StepLog:
    """What a rank's step loop measured and how it ended; filled step by step."""

    step_start_ns: list[int] = field(default_factory=list)
    """Wall-clock start of every step this rank ran."""
    step_end_ns: list[int] = field(default_factory=list)
    """Wall-clock end of every step this rank ran (optimizer step included)."""
    losses: list[float] = field(default_factory=list)
    """The mean micro-batch loss of every step (the rank holding the last stage only)."""
    skipped: list[int] = field(default_factory=list)
    """Steps whose update was dropped at a non-finite loss (``on_nonfinite="skip"``)."""
    status: str = "completed"
    """``"completed"``, ``"preempted"``, ``"nonfinite"`` or ``"rebalance"``."""
    nonfinite: dict[str, Any] | None = None
    """The step, rank and loss that stopped training (``on_nonfinite="raise"``)."""
    new_bounds: Any = None
    """The stage bounds a rebalance decided on (``status="rebalance"``)."""
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    """Every rebalance decision (rank 0 only)."""


def train(inputs: RankInputs) -> list[dict[str, Any]] | None:
    """Run this rank's steps (resuming where a checkpoint says), then gather every rank's measurements to rank 0.

    ``inputs.topo`` is the rank's :class:`~pipeswift_lab.runner.rank.inputs.RankMesh` (global rank,
    mesh coordinates and their groups); the process at data rank ``r = replica * fsdp + fsdp_rank`` reads rows
    ``r*b .. (r+1)*b - 1`` of every global batch (``b`` = global batch / (D * fsdp)). Returns every rank's payload on
    rank 0, ``None`` on the others.
    """
    state = _set_up(inputs)
    _restore(inputs, state)
    if inputs.spec.profiler_trace is not None:
        state.trace = StepTrace(inputs.spec.profiler_trace, inputs.rank, inputs.device, state.first_step)
    with state.trace if state.trace is not None else nullcontext():  # the profiler warms up before the barrier
        _announce(inputs, state)
        log = _train_steps(inputs, state)
    interval = state.saver.interval_steps()  # the interval the run used, before the final save joins the measurements
    job, saver = inputs.spec.job, state.saver
    if log.status == "completed" and saver.enabled and job.final_kind and saver.last_saved_step != inputs.spec.steps:
        saver.save(inputs.spec.steps, job.final_kind, at_exit=True)  # written while the results are gathered
    final_ns = state.recorder.now_ns()
    gathered = gather(_payload(inputs, state, log, interval, final_ns), inputs.rank, inputs.world, inputs.gather_group)
    saver.close()  # the save in flight (the final one, or the last good state at a non-finite loss) is committed
    if gathered is not None and saver.latest is not None:
        for payload in gathered:
            payload["checkpoint"] = saver.latest
    return gathered


def _set_up(inputs: RankInputs) -> RankState:
    """Build the stages, the optimizer over them, torch's schedule and the recorder; take SIGTERM."""
    spec = inputs.spec
    stages = inputs.build_stages(spec, inputs.topo, inputs.device)
    release_unheld(spec.model, [unwrapped(stage.submod) for stage in stages])
    params = unique_parameters(stage.submod for stage in stages)
    if spec.precision == "bf16-mixed-zero1":
        optimizer = sharded_optimizer(spec.optimizer, params, inputs.topo.replica_group)
    else:
        optimizer = spec.optimizer(params)
    tied = TiedGradients(
        spec.tied,
        {stage.stage_index: unwrapped(stage.submod) for stage in stages},
        spec.plan.stage_to_rank,
        P=spec.P,
        D=spec.D,
        replica=inputs.topo.replica,
    )
    schedule = inputs.make_schedule(spec, stages)
    recorder = ActionRecorder(stages, schedule, inputs.device, enabled=spec.instrument)
    torch.manual_seed(spec.seed)
    stop = StopRequest(inputs.out_dir, inputs.rank, spec.job.preempt_grace_s)
    stop.install()
    attempt = attempt_number()
    saver = Checkpointer(inputs, rank_module(stages), optimizer, attempt)
    memory = MemoryProbe(inputs.device, None, enabled=spec.instrument)
    memory.watch(stages, schedule, optimizer)
    memory.keep_staging(saver.staging_buffers())
    return RankState(
        stages=stages,
        optimizer=optimizer,
        tied=tied,
        schedule=schedule,
        recorder=recorder,
        memory=memory,
        stop=stop,
        saver=saver,
        attempt=attempt,
    )


def _restore_source(inputs: RankInputs, attempt: int) -> str | None:
    """The checkpoint this attempt starts from: after a restart the newest complete one in the root, else
    ``resume_from``."""
    job = inputs.spec.job
    if attempt > 0 and job.checkpoint_dir:
        chosen = None
        if inputs.rank == 0:
            found = ckpt.latest_checkpoint(job.checkpoint_dir, run_id=job.run_id)  # this run's own saves only
            chosen = str(found.path) if found is not None else job.resume_from
        return broadcast(chosen, inputs.gather_group)
    return job.resume_from


def _restore(inputs: RankInputs, state: RankState) -> None:
    """Load this rank's layers, optimizer state and (on the same ranks) RNG states from the checkpoint the attempt
    starts from, if any; note where training starts and when the rank was ready."""
    source = _restore_source(inputs, state.attempt)
    if source is not None:
        plan, world = inputs.spec.plan, inputs.world
        checkpoint = ckpt.Checkpoint(Path(source), ckpt.read_manifest(Path(source)))  # verified by who chose it
        manifest = checkpoint.manifest
        same = (
            tuple(tuple(b) for b in manifest["bounds"]) == plan.bounds
            and tuple(manifest["stage_to_rank"]) == plan.stage_to_rank
            and int(manifest.get("world_size", world)) == world
        )  # RNG states are per rank: the same ranks, D included
        restored = restore_rank_state(
            checkpoint,
            inputs.rank,
            state.saver.module,
            state.optimizer,
            inputs.device,
            inputs.gather_group,
            restore_rng=same,
            aliases=state.saver.aliases,
            pp_rank=inputs.topo.pp_rank if inputs.spec.fsdp * inputs.spec.tp == 1 else None,  # sharded: DCP reshards
        )
        restored.update(read=restored["path"], path=str(source), step=int(manifest["step"]), rng_restored=same)
        state.restored, state.first_step = restored, restored["step"]
        state.saver.last_saved_step = state.first_step
    state.memory.probe_step = probed_step(state.first_step, inputs.spec.steps) if state.memory.enabled else None
    state.ready_ns = state.recorder.now_ns()
    resident = resident_bytes()
    state.assembly_high_water = resident[1] if resident else None


def _announce(inputs: RankInputs, state: RankState) -> None:
    """Rank 0 writes ``attempt{n}.json`` (where this attempt resumed from, and when it was ready); all ranks meet."""
    import torch.distributed as dist

    if inputs.rank == 0:
        restored = state.restored
        info = {
            "attempt": state.attempt,
            "first_step": state.first_step,
            "checkpoint": restored["path"] if restored else None,
            "ready_ns": state.ready_ns,
            "restore_ms": restored["restore_ms"] if restored else 0.0,
        }
        (inputs.out_dir / attempt_file(state.attempt)).write_text(json.dumps(info))
    dist.barrier()


def _train_steps(inputs: RankInputs, state: RankState) -> StepLog:
    """The step loop: train, agree on the step's flags, update (or not), record, save, rebalance; stop at the last
    step, a preemption, a non-finite loss (``on_nonfinite="raise"``) or a rebalance taken."""
    spec, job, saver = inputs.spec, inputs.spec.job, state.saver
    log = StepLog()
    state.memory.start()
    for step in range(state.first_step, spec.steps):
        if state.trace is not None:
            state.trace.begin(step)  # ProfilerStep#step
        saver.raise_if_failed()  # a background write that failed ends the run here, naming the checkpoint
        with state.memory.step(step):
            start_ns, loss = _run_step(inputs, state, step)
            bad, stopping, vote, hold = _agree(inputs, state, loss, step + 1)
            if bad and job.on_nonfinite == "raise":
                log.status = "nonfinite"
                log.nonfinite = {
                    "step": step,
                    "rank": spec.plan.last_rank,
                    "loss": loss if _holds_last(inputs) else None,
                }
                break
            if bad and job.on_nonfinite == "skip":
                log.skipped.append(step)
            else:
                with state.memory.during("optimizer step"):
                    state.optimizer.step()
            if step == state.memory.probe_step:
                state.memory.note_state([unwrapped(stage.submod) for stage in state.stages], state.optimizer)
            state.optimizer.zero_grad(set_to_none=True)
        _record_step(inputs, state, log, step, start_ns, loss)
        done = step + 1
        if stopping:
            log.status = "preempted"
            if saver.enabled:
                saver.save(done, "preempt", wait=True)
            break
        if saver.periodic_due(done) or vote:
            if hold:
                saver.skip(done, "auto" if vote else "periodic")
            else:
                saver.save(done, "auto" if vote else "periodic")
        if _rebalanced(inputs, state, log, done):
            break
    return log


def _holds_first(inputs: RankInputs) -> bool:
    return inputs.topo.pp_rank == inputs.spec.plan.first_rank


def _holds_last(inputs: RankInputs) -> bool:
    return inputs.topo.pp_rank == inputs.spec.plan.last_rank


def _run_step(inputs: RankInputs, state: RankState, step: int) -> tuple[int, float]:
    """One step of torch's schedule on this replica's slice of the batch; returns its start (ns) and its loss (the
    mean over the micro-batches and the replicas; 0 on a rank without the last stage)."""
    import torch.distributed as dist

    topo, device = inputs.topo, inputs.device
    holds_first, holds_last = _holds_first(inputs), _holds_last(inputs)
    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, Any] = {}
    if holds_first or holds_last:
        inputs_b, targets_b = inputs.spec.data.batch(step)
        readers = topo.D * topo.fsdp  # the tensor-parallel ranks of one group read the same slice
        if readers > 1:
            b = inputs_b.shape[0] // readers
            rows = slice(topo.data_rank * b, (topo.data_rank + 1) * b)
            inputs_b, targets_b = inputs_b[rows], targets_b[rows]
        args = (inputs_b.to(device),) if holds_first else ()
        kwargs = {"target": targets_b.to(device), "losses": []} if holds_last else {}
        state.memory.note_batch([*args, *([kwargs["target"]] if holds_last else [])])
    start_ns = state.recorder.start_step(step)
    if inputs.spec.fsdp * inputs.spec.tp > 1 and not inputs.spec.reshard_after_forward:  # FSDP2 stages
        state.recorder.unshard(state.stages)
    state.schedule.step(*args, return_outputs=False, **kwargs)
    with state.memory.during("tied gradients"):
        state.tied.sync()
    state.memory.settle()
    loss = float(torch.stack([x.detach() for x in kwargs["losses"]]).float().mean()) if holds_last else 0.0
    if holds_last and topo.data_group is not None:  # the global batch's loss: the mean over the batch's readers
        mean = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(mean, group=topo.data_group)
        loss = float(mean) / (topo.D * topo.fsdp)
    return start_ns, loss


def _agree(inputs: RankInputs, state: RankState, loss: float, done: int) -> tuple[bool, bool, bool, bool]:
    """One all-reduce (MAX) over every rank's flags: ``(non-finite loss, stop requested, rank 0 votes to save, periodic
    saves on hold: :meth:`~.checkpointer.Checkpointer.holding`)``."""
    import torch.distributed as dist

    flags = torch.tensor(
        [
            int(_holds_last(inputs) and not math.isfinite(loss)),
            int(state.stop.requested()),
            int(state.saver.auto_vote(done)),
            int(state.saver.holding(done)),
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=inputs.gather_group)
    bad, stopping, vote, hold = (bool(x) for x in flags.tolist())
    return bad, stopping, vote, hold


def _record_step(inputs: RankInputs, state: RankState, log: StepLog, step: int, start_ns: int, loss: float) -> None:
    """End the step's timing; log it (``steps.log`` and the loss on the last stage's rank, progress if asked)."""
    end_ns = state.recorder.end_step()
    log.step_start_ns.append(start_ns)
    log.step_end_ns.append(end_ns)
    state.saver.step_s.append((end_ns - start_ns) / 1e9)
    if _holds_last(inputs):
        log.losses.append(loss)
    topo = inputs.topo
    if _holds_last(inputs) and (topo.replica, topo.fsdp_rank, topo.tp_rank) == (0, 0, 0):  # one process logs steps
        append_line(inputs.out_dir / STEPS_LOG, f"{state.attempt} {step} {start_ns} {end_ns}")
        if inputs.progress:
            (inputs.out_dir / PROGRESS_FILE).write_text(str(step + 1))


def _rebalanced(inputs: RankInputs, state: RankState, log: StepLog, done: int) -> bool:
    """At a rebalance point, decide; when the decision is taken, save and note the new bounds (True: stop)."""
    plan = inputs.spec.job.rebalance
    if plan is None or done >= inputs.spec.steps or (done - state.first_step) % plan.every:
        return False
    decision = _rebalance_decision(inputs, state, done)
    if inputs.rank == 0:
        log.rebalances.append(decision)
    if not decision["taken"]:
        return False
    state.saver.save(done, "rebalance", wait=True)
    log.status, log.new_bounds = "rebalance", decision["new_bounds"]
    return True


def _rebalance_decision(inputs: RankInputs, state: RankState, done: int) -> dict[str, Any]:
    """Gather every stage's measured compute per step since the last decision; rank 0 decides; all get the decision.

    The reconfiguration cost is measured: the previous switch's (save, teardown, assembly,
    restore) when there was one; otherwise this worker's start-to-ready (process, rendezvous,
    process groups, stages, restore; a fork server's one-time start is left out, a new segment
    does not pay it again), a save taken now if none was yet (a real checkpoint), and a restore
    estimated as long as that save.
    """
    from ..rebalance import decide, measured_stage_ms

    spec, saver, first_step = inputs.spec, state.saver, state.first_step
    plan = spec.job.rebalance
    if plan is None:
        raise RuntimeError("a rebalance decision needs the job's rebalance plan")
    if plan.cost_s is None and saver.saves == 0:
        saver.save(done, "periodic", wait=True)
    start = max(done - plan.every, first_step + 1 if done - first_step > 1 else first_step)  # not the warm-up step
    mine = measured_stage_ms(state.recorder.rows(), spec.plan.stages_of(inputs.topo.pp_rank), start, done)
    parts = gather(mine, inputs.rank, inputs.world, inputs.gather_group)
    decision = None
    if parts is not None:
        stage_ms: dict[int, float] = {}
        for part in parts:
            stage_ms.update(part)
        cost_s = plan.cost_s if plan.cost_s is not None else _first_switch_cost(inputs, state)
        decision = decide(plan, spec.plan.bounds, [stage_ms[s] for s in range(spec.plan.n_stages)], done, cost_s)
    return broadcast(decision, inputs.gather_group)


def _first_switch_cost(inputs: RankInputs, state: RankState) -> float:
    """Rank 0's estimate of a reconfiguration before any was measured: its start-to-ready, its last save, and a
    restore as long as the one it made (or as that save)."""
    started = max(x for x in (inputs.proc_start_ns, inputs.spec.job.launch_ns, 0) if x is not None)
    assembly_s = max(0.0, (state.ready_ns - started) / 1e9) if started else 0.0
    save_s = state.saver.save_s[-1] if state.saver.save_s else 0.0
    restore_s = state.restored["restore_ms"] / 1e3 if state.restored else save_s
    return assembly_s + save_s + restore_s


def _payload(inputs: RankInputs, state: RankState, log: StepLog, interval: int | None, final_ns: int) -> dict[str, Any]:
    """What this rank reports to rank 0: where it ran, its records, steps, losses, the name of its final shard (it
    writes its stages' tensors there, :mod:`~pipeswift_lab.runner.final_weights`), restores, saves."""
    topo = inputs.topo
    return {
        "rank": topo.rank,
        "pp_rank": topo.pp_rank,
        "replica": topo.replica,
        "fsdp_rank": topo.fsdp_rank,
        "tp_rank": topo.tp_rank,
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "device": str(inputs.device),
        "stages": inputs.spec.plan.stages_of(topo.pp_rank),
        "records": state.recorder.rows(with_bytes=True),
        "step_start_ns": log.step_start_ns,
        "step_end_ns": log.step_end_ns,
        "losses": log.losses,
        "final_shard": write_rank_shard(
            inputs.out_dir,
            inputs.spec,
            topo.pp_rank,
            topo.replica,
            {s.stage_index: unwrapped(s.submod) for s in state.stages},
            (topo.fsdp_rank, topo.tp_rank),
        ),
        "process_start_ns": inputs.proc_start_ns,
        "entered_ns": inputs.entered_ns,
        "resident_start_bytes": inputs.resident_start_bytes,
        "resident_peak_bytes": lifetime_high_water(state.assembly_high_water),
        "ready_ns": state.ready_ns,
        "threads": torch.get_num_threads(),
        "first_step": state.first_step,
        "status": log.status,
        "nonfinite": log.nonfinite,
        "skipped_steps": log.skipped,
        "restored": state.restored,
        "final_ns": final_ns,
        "attempt": state.attempt,
        "checkpoint": state.saver.latest,
        "interval_steps": interval,
        "rebalances": log.rebalances,
        "new_bounds": log.new_bounds,
        "memory": state.memory.report(),
    }
