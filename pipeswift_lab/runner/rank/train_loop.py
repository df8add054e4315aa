"""One rank's training loop: steps, the per-step agreement between ranks, checkpoints, preemption.

After torch's schedule has run a step's forwards and backwards, and before the optimizer
updates, the ranks agree in one small all-reduce (MAX over three flags) on

* ``nonfinite`` — the rank holding the last stage saw a NaN/inf loss: ``on_nonfinite="raise"``
  stops before the update (the last good checkpoint stands), ``"skip"`` drops this step's
  update, ``"ignore"`` updates anyway;
* ``stop`` — some rank was asked to stop (SIGTERM: a preemption notice; or the launcher's
  ``preempt`` file): every rank finishes this step, all save at the same step, and exit;
* ``save`` — rank 0's vote for a checkpoint at ``checkpoint_every="auto"``: the Young/Daly
  interval √(2·C·MTBF) (Young, CACM 1974; Daly, FGCS 2006) from the *measured* save time C
  and step time.

Files written into the run directory for the launcher: ``steps.log`` (the last rank: one
``attempt step start_ns end_ns`` line per step), ``checkpoints.log`` (rank 0: one JSON line
per committed checkpoint) and ``attempt{n}.json`` (rank 0: where attempt ``n`` resumed from).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from collections import OrderedDict
from pathlib import Path

import torch

from .. import checkpoint as ckpt
from .instrument import ActionRecorder

STEPS_LOG = "steps.log"
CHECKPOINTS_LOG = "checkpoints.log"
PREEMPT_FILE = "preempt"
PROGRESS_FILE = "progress"


def attempt_number() -> int:
    """Which attempt of the run this process belongs to (torch elastic's restart count; 0 at first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class StopRequest:
    """Set by SIGTERM (a preemption notice) or by the launcher's ``preempt`` file in the run directory.

    A SIGTERM also starts ``grace_s``: a rank that has not exited by then kills itself, and the
    previous checkpoint stands (a save never half-commits).
    """

    def __init__(self, out_dir: Path, rank: int, grace_s: float):
        self.flag = False
        self.grace_s = grace_s
        self._file = out_dir / PREEMPT_FILE
        self._marker = out_dir / f"rank{rank}.sigterm"

    def install(self) -> None:
        """Take SIGTERM: note it (in ``rank{r}.sigterm`` too) instead of dying mid-step."""
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: leave SIGTERM as it is
            pass

    def _on_sigterm(self, signum, frame):
        if not self.flag:
            import threading

            timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        self.flag = True
        try:
            self._marker.write_text(str(time.time_ns()))
        except OSError:
            pass

    def requested(self) -> bool:
        """Whether this rank has been asked to stop."""
        return self.flag or self._file.exists()


def rank_module(stages) -> torch.nn.Module:
    """This rank's layers in one module whose state keys are the full model's (every stage's children, by name).

    Traced stages (:mod:`~pipeswift_lab.runner.stages.traced`) are merged FQN by FQN, since two of
    them may share a container (``blocks``).
    """
    from torch.fx import GraphModule

    if any(isinstance(unwrapped(stage.submod), GraphModule) for stage in stages):
        from ..stages.traced import merged_module

        return merged_module([unwrapped(stage.submod) for stage in stages])
    children = OrderedDict()
    for stage in stages:
        children.update(unwrapped(stage.submod).named_children())
    return torch.nn.Sequential(children)


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The stage module inside a ``DistributedDataParallel`` wrapper (``module`` itself when it has none)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _broadcast(obj, group):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _gather(obj, rank, world, group):
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


class Checkpointer:
    """Saves (all ranks, collectively) and commits (rank 0) this run's checkpoints; decides when at ``"auto"``."""

    def __init__(self, spec, rank, world, device, group, out_dir: Path, module, optimizer, attempt: int):
        self.job = spec.job
        self.root = Path(self.job.checkpoint_dir) if self.job.checkpoint_dir else None
        self.spec, self.rank, self.world, self.device, self.group = spec, rank, world, device, group
        self.out_dir, self.module, self.optimizer, self.attempt = out_dir, module, optimizer, attempt
        self.save_s: list[float] = []
        self.step_s: list[float] = []
        self.last_saved_step = None
        self.latest = None
        self.saves = 0  # saves this attempt took, counted on every rank

    @property
    def enabled(self) -> bool:
        """Whether the run has a checkpoint root."""
        return self.root is not None

    def periodic_due(self, done: int) -> bool:
        """Whether ``checkpoint_every=N`` asks for a save after ``done`` steps (the final save is separate)."""
        every = self.job.checkpoint_every
        return self.enabled and isinstance(every, int) and done % every == 0 and done < self.spec.steps

    def interval_steps(self) -> int | None:
        """Steps between saves at ``"auto"``: τ = √(2·C·MTBF) over the median step (None before the first save)."""
        if self.job.checkpoint_every != "auto" or not self.save_s or not self.step_s:
            return None
        tau_s = math.sqrt(2.0 * statistics.median(self.save_s) * self.job.mtbf_s)
        return max(1, round(tau_s / statistics.median(self.step_s)))

    def auto_vote(self, done: int) -> bool:
        """Rank 0's vote at ``"auto"``: save after this attempt's first step (to measure C), then every τ steps."""
        if not self.enabled or self.job.checkpoint_every != "auto" or self.rank != 0 or done >= self.spec.steps:
            return False
        if not self.save_s:
            return True
        return done - self.last_saved_step >= self.interval_steps()

    def save(self, step: int, kind: str) -> None:
        """Every rank writes its state for ``step`` steps done; rank 0 commits and logs it (with the stall, ``blocking_ms``)."""
        t0 = time.perf_counter()
        tmp = _broadcast(str(ckpt.new_tmp_dir(self.root, step)) if self.rank == 0 else None, self.group)
        mine = ckpt.save_rank_state(
            Path(tmp),
            self.rank,
            self.module,
            self.optimizer,
            self.device,
            self.group,
            step=step,
            fault=self.job.write_fault,
        )
        parts = _gather(mine, self.rank, self.world, self.group)
        if self.rank == 0:
            path = ckpt.commit(Path(tmp), self._manifest(step, kind), parts, keep=self.job.keep)
            blocking_ms = (time.perf_counter() - t0) * 1e3
            largest = max(sum(f["bytes"] for f in p["files"].values()) for p in parts)
            record = {
                "step": step,
                "path": str(path),
                "bytes": sum(f["bytes"] for p in parts for f in p["files"].values()),
                "largest_rank_bytes": largest,
                "largest_rank_state_bytes": max(p["state_bytes"] for p in parts),
                "save_ms": max(p["save_ms"] for p in parts),
                "blocking_ms": blocking_ms,
                "kind": kind,
                "attempt": self.attempt,
                "interval_steps": self.interval_steps(),
                "end_ns": time.time_ns(),
            }
            _append(self.out_dir / CHECKPOINTS_LOG, json.dumps(record))
            self.save_s.append(blocking_ms / 1e3)  # C is what the job stalls for: DCP write, checksums, commit
            self.latest = str(path)
        self.last_saved_step = step
        self.saves += 1

    def _manifest(self, step: int, kind: str) -> dict:
        spec, plan = self.spec, self.spec.plan
        return {
            "step": step,
            "steps": spec.steps,
            "kind": kind,
            "P": plan.P,
            "D": spec.D,
            "v": plan.v,
            "m": spec.m,
            "schedule": plan.schedule,
            "microbatch_size": spec.meta.get("microbatch_size"),
            "batch_size": spec.meta.get("batch_size"),
            "bounds": [list(b) for b in plan.bounds],
            "stage_to_rank": list(plan.stage_to_rank),
            "layer_names": list(spec.meta.get("layer_names", [])),
            "world_size": self.world,
            "torch_version": torch.__version__,
            "optimizer": type(self.optimizer).__module__ + "." + type(self.optimizer).__qualname__,
            "rng_states": True,
            "state_keys": list(spec.state_keys),
            "seed": spec.seed,
            "device_type": spec.device_type,
            "run_id": self.job.run_id,
        }


def _restore_source(spec, rank, group, attempt):
    """The checkpoint this attempt starts from: after a restart the newest complete one in the root, else ``resume_from``."""
    job = spec.job
    if attempt > 0 and job.checkpoint_dir:
        chosen = None
        if rank == 0:
            found = ckpt.latest_checkpoint(job.checkpoint_dir, run_id=job.run_id)  # this run's own saves only
            chosen = str(found.path) if found is not None else job.resume_from
        return _broadcast(chosen, group)
    return job.resume_from


def _rebalance_due(plan, done: int, first_step: int, segment_end: int) -> bool:
    return done < segment_end and (done - first_step) % plan.every == 0


def _rebalance_decision(
    spec, rank, world, group, recorder, saver, done, first_step, ready_ns, restored, proc_start_ns
) -> dict:
    """Gather every stage's measured compute per step since the last decision; rank 0 decides; all get the decision.

    The reconfiguration cost is measured: the previous switch's (save, teardown, assembly,
    restore) when there was one; otherwise this worker's start-to-ready (process, rendezvous,
    process groups, stages, restore; a fork server's one-time start is left out, a new segment
    does not pay it again), a save taken now if none was yet (a real checkpoint), and a restore
    estimated as long as that save.
    """
    from ..rebalance import decide, measured_stage_ms

    plan = spec.job.rebalance
    if plan.cost_s is None and saver.saves == 0:
        saver.save(done, "periodic")
    start = max(
        done - plan.every, first_step + 1 if done - first_step > 1 else first_step
    )  # leave out the warm-up step
    mine = measured_stage_ms(recorder.rows(), spec.plan.stages_of(rank), start, done)
    parts = _gather(mine, rank, world, group)
    decision = None
    if rank == 0:
        stage_ms = {}
        for part in parts:
            stage_ms.update(part)
        if plan.cost_s is not None:
            cost_s = plan.cost_s
        else:
            started = max(x for x in (proc_start_ns, spec.job.launch_ns, 0) if x is not None)
            assembly_s = max(0.0, (ready_ns - started) / 1e9) if started else 0.0
            save_s = saver.save_s[-1] if saver.save_s else 0.0
            restore_s = restored["restore_ms"] / 1e3 if restored else save_s
            cost_s = assembly_s + save_s + restore_s
        decision = decide(plan, spec.plan.bounds, [stage_ms[s] for s in range(spec.plan.n_stages)], done, cost_s)
    return _broadcast(decision, group)


def train(
    spec, topo, world, device, out_dir: Path, progress, gather_group, proc_start, entered, build_stages, make_schedule
):
    """Run this rank's steps (resuming where a checkpoint says), then gather every rank's measurements to rank 0.

    ``topo`` is the rank's :class:`~pipeswift_lab.runner.rank.worker.Topology` (global rank,
    pipeline rank, replica and their groups); replica ``d`` reads rows
    ``d*b .. (d+1)*b - 1`` of every global batch (``b`` = global batch / D).
    """
    import torch.distributed as dist

    plan, job = spec.plan, spec.job
    rank = topo.rank
    attempt = attempt_number()
    stages = build_stages(spec, topo, device)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = spec.optimizer(params)
    schedule = make_schedule(spec, stages)
    recorder = ActionRecorder(stages, schedule, device, enabled=spec.instrument)
    module = rank_module(stages)
    holds_first, holds_last = topo.pp_rank == plan.first_rank, topo.pp_rank == plan.last_rank
    torch.manual_seed(spec.seed)
    stop = StopRequest(out_dir, rank, job.preempt_grace_s)
    stop.install()

    first_step, restored = 0, None
    source = _restore_source(spec, rank, gather_group, attempt)
    if source is not None:
        manifest = ckpt.verify(source).manifest
        same = (
            tuple(tuple(b) for b in manifest["bounds"]) == plan.bounds
            and tuple(manifest["stage_to_rank"]) == plan.stage_to_rank
            and int(manifest.get("world_size", world)) == world
        )  # RNG states are per rank: the same ranks, D included
        restored = ckpt.restore_rank_state(
            Path(source), rank, module, optimizer, device, gather_group, restore_rng=same
        )
        restored.update(path=str(source), step=int(manifest["step"]), rng_restored=same)
        first_step = restored["step"]
    saver = Checkpointer(spec, rank, world, device, gather_group, out_dir, module, optimizer, attempt)
    if source is not None:
        saver.last_saved_step = first_step
    ready = recorder.now_ns()
    if rank == 0:
        (out_dir / f"attempt{attempt}.json").write_text(
            json.dumps(
                {
                    "attempt": attempt,
                    "first_step": first_step,
                    "checkpoint": source,
                    "ready_ns": ready,
                    "restore_ms": restored["restore_ms"] if restored else 0.0,
                }
            )
        )
    dist.barrier()

    progress_path = out_dir / PROGRESS_FILE if progress and holds_last else None
    step_start, step_end, losses, skipped = [], [], [], []
    status, nonfinite, new_bounds, rebalances = "completed", None, None, []
    flags = torch.zeros(3, dtype=torch.int64)
    for step in range(first_step, spec.steps):
        if holds_first or holds_last:
            inputs, targets = spec.data.batch(step)
            if topo.D > 1:
                b = inputs.shape[0] // topo.D
                inputs, targets = (
                    inputs[topo.replica * b : (topo.replica + 1) * b],
                    targets[topo.replica * b : (topo.replica + 1) * b],
                )
        args = (inputs.to(device),) if holds_first else ()
        kwargs = {"target": targets.to(device), "losses": []} if holds_last else {}
        start_ns = recorder.start_step(step)
        schedule.step(*args, return_outputs=False, **kwargs)
        loss = float(torch.stack([x.detach() for x in kwargs["losses"]]).float().mean()) if holds_last else 0.0
        if holds_last and topo.dp_group is not None:  # the global batch's loss: the mean over the replicas
            mean = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(mean, group=topo.dp_group)
            loss = float(mean) / topo.D
        flags.zero_()
        flags[0] = int(holds_last and not math.isfinite(loss))
        flags[1] = int(stop.requested())
        flags[2] = int(saver.auto_vote(step + 1))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=gather_group)
        bad, stopping, vote = (bool(x) for x in flags.tolist())
        if bad and job.on_nonfinite == "raise":
            nonfinite = {"step": step, "rank": plan.last_rank, "loss": loss if holds_last else None}
            status = "nonfinite"
            break
        if bad and job.on_nonfinite == "skip":
            skipped.append(step)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end_ns = recorder.end_step()
        step_start.append(start_ns)
        step_end.append(end_ns)
        saver.step_s.append((end_ns - start_ns) / 1e9)
        if holds_last:
            losses.append(loss)
            _append(out_dir / STEPS_LOG, f"{attempt} {step} {start_ns} {end_ns}")
        if progress_path is not None:
            progress_path.write_text(str(step + 1))
        done = step + 1
        if stopping:
            status = "preempted"
            if saver.enabled:
                saver.save(done, "preempt")
            break
        if saver.periodic_due(done) or vote:
            saver.save(done, "auto" if vote else "periodic")
        if job.rebalance is not None and _rebalance_due(job.rebalance, done, first_step, spec.steps):
            decision = _rebalance_decision(
                spec, rank, world, gather_group, recorder, saver, done, first_step, ready, restored, proc_start
            )
            if rank == 0:
                rebalances.append(decision)
            if decision["taken"]:
                saver.save(done, "rebalance")
                status, new_bounds = "rebalance", decision["new_bounds"]
                break
    interval = saver.interval_steps()  # the interval the run used, before the final save joins the measurements
    if status == "completed" and saver.enabled and job.final_kind and saver.last_saved_step != spec.steps:
        saver.save(spec.steps, job.final_kind)
    final_ns = recorder.now_ns()

    state = {}
    for stage in stages:
        state.update({k: t.detach().to("cpu", copy=True) for k, t in unwrapped(stage.submod).state_dict().items()})
    payload = {
        "rank": rank,
        "pp_rank": topo.pp_rank,
        "replica": topo.replica,
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "device": str(device),
        "stages": plan.stages_of(topo.pp_rank),
        "records": recorder.rows(),
        "step_start_ns": step_start,
        "step_end_ns": step_end,
        "losses": losses,
        "state": state,
        "process_start_ns": proc_start,
        "entered_ns": entered,
        "ready_ns": ready,
        "threads": torch.get_num_threads(),
        "first_step": first_step,
        "status": status,
        "nonfinite": nonfinite,
        "skipped_steps": skipped,
        "restored": restored,
        "final_ns": final_ns,
        "attempt": attempt,
        "checkpoint": saver.latest,
        "interval_steps": interval,
        "rebalances": rebalances,
        "new_bounds": new_bounds,
    }
    return _gather(payload, rank, world, gather_group)
