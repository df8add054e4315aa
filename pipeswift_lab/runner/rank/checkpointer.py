"""One rank's side of the run's checkpoints: :class:`Checkpointer` stages and hands over saves (all ranks), commits
(rank 0, in the background) and decides when to save at ``Checkpointing(every="auto")``.

A save stalls the step loop only for a copy of the rank's state into a staging buffer allocated once (pinned on
CUDA; :mod:`~pipeswift_lab.runner.checkpoint_files`); the file, its fsync, its checksum and the commit run in a
background thread (:mod:`.background_writer`). At most one save is in flight: a periodic or ``"auto"`` save that
falls due while the last one is still being written is skipped, on every rank alike (the ranks agree on it in the
step's all-reduce), and logged with ``status="skipped"``; so is one due when the steps left take less time than a
background write (the final save would only wait for it). Final, preemption and rebalance saves are never skipped:
they wait for the write in flight, and then for their own. ``Checkpointing(asynchronous=False)`` waits for every save.

The automatic interval is Young/Daly's √(2·C·MTBF) (Young, CACM 1974; Daly, FGCS 2006) from the *measured* stall C
and step time, and never shorter than a background write (a save due sooner would be skipped). Rank 0 logs every
committed or skipped checkpoint as one JSON line of ``checkpoints.log`` in the run directory.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ...core.schedule import schedule_meta
from .. import checkpoint as ckpt
from ..checkpoint_files import Stager
from ..run_files import CHECKPOINT_COLUMNS, CHECKPOINTS_LOG
from ..stages.tied import alias_map
from .background_writer import RankWriter, SaveJob
from .inputs import RankInputs
from .state_files import rank_flat_state, same_state

__all__ = ["Checkpointer", "broadcast", "gather", "append_line"]


def broadcast(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (``None``: the default group)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather(obj: Any, rank: int, world: int, group: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0, in rank order (``None`` on the other ranks)."""
    import torch.distributed as dist

    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def append_line(path: Path, line: str) -> None:
    """Append one line to the file at ``path``."""
    with open(path, "a") as f:
        f.write(line + "\n")


class Checkpointer:
    """Stages and hands over (all ranks) and commits (rank 0, in the background) this run's checkpoints; decides
    when at ``"auto"``."""

    def __init__(
        self, inputs: RankInputs, module: torch.nn.Module, optimizer: torch.optim.Optimizer, attempt: int
    ) -> None:
        self.inputs, self.spec, self.job = inputs, inputs.spec, inputs.spec.job
        self.root = Path(self.job.checkpoint_dir) if self.job.checkpoint_dir else None
        self.rank, self.world, self.group = inputs.rank, inputs.world, inputs.gather_group
        self.module, self.optimizer, self.attempt = module, optimizer, attempt
        self.save_s: list[float] = []
        """Rank 0: how long each save stalled the step loop (C of Young/Daly)."""
        self.step_s: list[float] = []
        self.last_saved_step: int | None = None
        self.latest: str | None = None
        self.saves = 0  # saves this attempt began, counted on every rank
        self.aliases = alias_map(self.spec.model)  # tied weights: stored once, under one name
        self.tag = f"{(self.job.run_id or 'run')[:8]}-a{attempt}"  # the saves' directory names, on every rank
        topo = inputs.topo
        # replicas hold the same state: replica 0 saves it; a sharded stage (FSDP, tensor parallelism) is gathered
        # whole by its processes of replica 0, and the first of them saves it
        self.whole = self.spec.fsdp * self.spec.tp > 1 and getattr(topo, "replica", 0) == 0
        self.training_state = getattr(topo, "replica", 0) == 0 and (
            getattr(topo, "fsdp_rank", 0),
            getattr(topo, "tp_rank", 0),
        ) == (0, 0)
        self.writer = RankWriter(
            self.rank,
            self.world,
            {"pp_rank": getattr(topo, "pp_rank", self.rank), "replica": getattr(topo, "replica", 0)},
            self._commit if self.rank == 0 else None,
            fault=self.job.write_fault,
            pace_s=getattr(self.job, "slow_disk_s", 0.0),
        )
        self._stager: Stager | None = None
        self._direct: bool | None = None  # whether reading the state without get_state_dict gives the same
        if self.enabled:
            self._stager_for(self._flat())  # the staging buffer exists before the first step (and is measured)

    def _flat(self) -> dict[str, Any]:
        """This rank's flat state: the first time with torch's ``get_state_dict``, compared with the direct read;
        from then on the direct read when the two agreed."""
        args = (self.rank, self.module, self.optimizer, self.inputs.device, self.aliases, self.training_state)
        if self.whole:
            return rank_flat_state(*args, whole=True)
        if self._direct is None and self.optimizer.state:
            flat = rank_flat_state(*args)
            self._direct = same_state(flat, rank_flat_state(*args, direct=True))
            return flat
        return rank_flat_state(*args, direct=bool(self._direct))

    def _stager_for(self, flat: dict[str, Any]) -> Stager:
        """The stager of ``flat``'s layout: planned and allocated once per topology and state shape."""
        if self._stager is None or not self._stager.fits(flat):
            self._stager = Stager(flat, self.inputs.device)
        return self._stager

    def staging_buffers(self) -> list[torch.Tensor]:
        """The staging buffer this rank holds for the whole run (none without one)."""
        return [self._stager.buffer] if self._stager is not None else []

    @property
    def enabled(self) -> bool:
        """Whether the run has a checkpoint root."""
        return self.root is not None

    @property
    def asynchronous(self) -> bool:
        """Whether saves are written in the background (``checkpoint_async``)."""
        return bool(getattr(self.job, "checkpoint_async", True))

    def busy(self) -> bool:
        """Whether this rank's last save is still being written (on rank 0: not yet committed)."""
        return self.writer.busy()

    def holding(self, done: int) -> bool:
        """Whether a periodic or automatic save due after ``done`` steps is to be skipped (every rank agrees on rank
        0's answer): the last save is still being written, or, in the background mode, the steps left take less
        time than a background write, so that the final save would only wait for it."""
        if self.busy():
            return True
        if self.rank != 0 or not self.asynchronous or not self.writer.write_s or not self.step_s:
            return False
        left_s = (self.spec.steps - done) * statistics.median(self.step_s)
        return left_s < statistics.median(self.writer.write_s)

    def periodic_due(self, done: int) -> bool:
        """Whether ``Checkpointing(every=N)`` asks for a save after ``done`` steps (the final save is separate)."""
        every = self.job.checkpoint_every
        return self.enabled and isinstance(every, int) and done % every == 0 and done < self.spec.steps

    def interval_steps(self) -> int | None:
        """Steps between saves at ``"auto"``: τ = √(2·C·MTBF) over the median step, MTBF the job's (one GPU's over
        the world size), and at least the steps a background write takes (None before the first save)."""
        if self.job.checkpoint_every != "auto" or not self.save_s or not self.step_s or self.job.mtbf_s is None:
            return None
        step_s = statistics.median(self.step_s)
        job_mtbf_s = self.job.mtbf_s / self.spec.world_size
        tau_s = math.sqrt(2.0 * statistics.median(self.save_s) * job_mtbf_s)
        writes = math.ceil(statistics.median(self.writer.write_s) / step_s) if self.writer.write_s else 1
        return max(1, round(tau_s / step_s), writes)

    def auto_vote(self, done: int) -> bool:
        """Rank 0's vote at ``"auto"``: save after this attempt's first step (to measure C), then every τ steps."""
        if not self.enabled or self.job.checkpoint_every != "auto" or self.rank != 0 or done >= self.spec.steps:
            return False
        if self.holding(done):  # the last save is still being written (vote when it is done), or the end is near
            return False
        interval = self.interval_steps()
        if not self.save_s or interval is None or self.last_saved_step is None:
            return True
        return done - self.last_saved_step >= interval

    def raise_if_failed(self) -> None:
        """Raise the error of a background write of this rank that failed (naming the checkpoint and the path)."""
        self.writer.raise_if_failed()

    def skip(self, step: int, kind: str) -> None:
        """Rank 0 logs a save due after ``step`` steps that was skipped (:meth:`holding`)."""
        if self.rank == 0:
            record = dict.fromkeys(CHECKPOINT_COLUMNS)
            record.update(step=step, kind=kind, status="skipped", attempt=self.attempt, blocking_ms=0.0)
            record.update(mode="async", interval_steps=self.interval_steps())
            append_line(self.inputs.out_dir / CHECKPOINTS_LOG, json.dumps(record))

    def save(self, step: int, kind: str, wait: bool = False, at_exit: bool = False) -> None:
        """Stage this rank's state for ``step`` steps done and hand it to the writer; with ``wait`` (or
        ``asynchronous=False``) return only when it is written (on rank 0: committed). ``at_exit`` (the final
        save): written in the background at full priority while the results are gathered, and waited for by
        :meth:`close` before the worker exits (logged as waited)."""
        if self.root is None:
            raise RuntimeError("Checkpointer.save needs a checkpoint root (the run has no checkpoint_dir)")
        wait = wait or not self.asynchronous
        started_ns, t0 = time.time_ns(), time.perf_counter()
        self.writer.wait()  # one save in flight at most: a save that may not be skipped waits for the last one
        t_stage = time.perf_counter()
        flat = self._flat()
        staged = self._stager_for(flat).stage(flat)
        staging_s = time.perf_counter() - t_stage
        job = SaveJob(
            step=step,
            kind=kind,
            tmp_dir=ckpt.new_tmp_dir(self.root, step, self.tag),
            staged=staged,
            started_ns=started_ns,
            staging_ms=staging_s * 1e3,
            waited=wait or at_exit,
            interval_steps=self.interval_steps(),
        )
        if wait:
            self.writer.write_now(job)
        else:
            self.writer.submit(job, yield_cores=not at_exit)
        if self.rank == 0:
            self.save_s.append(time.perf_counter() - t0)
        self.last_saved_step = step
        self.saves += 1

    def close(self) -> None:
        """Wait for the save in flight (on rank 0 until it is committed); raise its error if it failed."""
        self.writer.wait()

    def _commit(self, job: SaveJob, records: list[dict[str, Any]]) -> None:
        """Rank 0, in the writer's thread: commit the save every rank has written, and log it."""
        assert self.root is not None
        path = ckpt.commit(job.tmp_dir, self._manifest(job.step, job.kind), records, keep=self.job.keep, live=self.tag)
        end_ns = time.time_ns()
        rank_bytes = [int(r["bytes"]) for r in records]
        stall_ms = (end_ns - job.started_ns) / 1e6 if job.waited else max(r["staging_ms"] for r in records)
        record = {
            "step": job.step,
            "path": str(path),
            "bytes": sum(rank_bytes),
            "largest_rank_bytes": max(rank_bytes),
            "largest_rank_state_bytes": max(r["state_bytes"] for r in records),
            "save_ms": (end_ns - job.started_ns) / 1e6,
            "blocking_ms": stall_ms,
            "staging_ms": max(r["staging_ms"] for r in records),
            "write_ms": max(r["write_ms"] for r in records),
            "kind": job.kind,
            "status": "committed",
            "mode": "sync" if job.waited and not self.asynchronous else ("waited" if job.waited else "async"),
            "attempt": self.attempt,
            "interval_steps": job.interval_steps,
            "end_ns": end_ns,
        }
        append_line(self.inputs.out_dir / CHECKPOINTS_LOG, json.dumps(record))
        self.latest = str(path)

    def _manifest(self, step: int, kind: str) -> dict[str, Any]:
        spec, plan = self.spec, self.spec.plan
        return {
            "step": step,
            "steps": spec.steps,
            "kind": kind,
            "P": plan.P,
            "D": spec.D,
            "v": plan.v,
            "m": spec.m,
            **schedule_meta(plan.schedule),
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
            "aliases": self.aliases,
            "seed": spec.seed,
            "device_type": spec.device_type,
            "run_id": self.job.run_id,
        }
