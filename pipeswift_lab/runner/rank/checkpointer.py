"""One rank's side of the run's checkpoints: :class:`Checkpointer` saves (all ranks, collectively), commits (rank 0)
and decides when to save at ``checkpoint_every="auto"``.

The automatic interval is Young/Daly's √(2·C·MTBF) (Young, CACM 1974; Daly, FGCS 2006) from the *measured* save
time C and step time. Rank 0 logs every committed checkpoint as one JSON line of ``checkpoints.log`` in the run
directory.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from ..stages.tied import alias_map, parameter_names
from .inputs import RankInputs
from .state_files import save_rank_state

__all__ = ["Checkpointer", "CHECKPOINTS_LOG", "broadcast", "gather", "append_line"]

CHECKPOINTS_LOG = "checkpoints.log"


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
    """Saves (all ranks, collectively) and commits (rank 0) this run's checkpoints; decides when at ``"auto"``."""

    def __init__(
        self, inputs: RankInputs, module: torch.nn.Module, optimizer: torch.optim.Optimizer, attempt: int
    ) -> None:
        self.inputs, self.spec, self.job = inputs, inputs.spec, inputs.spec.job
        self.root = Path(self.job.checkpoint_dir) if self.job.checkpoint_dir else None
        self.rank, self.world, self.group = inputs.rank, inputs.world, inputs.gather_group
        self.module, self.optimizer, self.attempt = module, optimizer, attempt
        self.save_s: list[float] = []
        self.step_s: list[float] = []
        self.last_saved_step: int | None = None
        self.latest: str | None = None
        self.saves = 0  # saves this attempt took, counted on every rank
        self.aliases = alias_map(parameter_names(self.spec.model))  # tied weights: stored once, under one name

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
        if self.job.checkpoint_every != "auto" or not self.save_s or not self.step_s or self.job.mtbf_s is None:
            return None
        tau_s = math.sqrt(2.0 * statistics.median(self.save_s) * self.job.mtbf_s)
        return max(1, round(tau_s / statistics.median(self.step_s)))

    def auto_vote(self, done: int) -> bool:
        """Rank 0's vote at ``"auto"``: save after this attempt's first step (to measure C), then every τ steps."""
        if not self.enabled or self.job.checkpoint_every != "auto" or self.rank != 0 or done >= self.spec.steps:
            return False
        interval = self.interval_steps()
        if not self.save_s or interval is None or self.last_saved_step is None:
            return True
        return done - self.last_saved_step >= interval

    def save(self, step: int, kind: str) -> None:
        """Every rank writes its state for ``step`` steps done; rank 0 commits and logs it (with the stall,
        ``blocking_ms``)."""
        if self.root is None:
            raise RuntimeError("Checkpointer.save needs a checkpoint root (the run has no checkpoint_dir)")
        t0 = time.perf_counter()
        tmp = broadcast(str(ckpt.new_tmp_dir(self.root, step)) if self.rank == 0 else None, self.group)
        mine = save_rank_state(
            Path(tmp),
            self.rank,
            self.module,
            self.optimizer,
            self.inputs.device,
            self.group,
            step=step,
            fault=self.job.write_fault,
            aliases=self.aliases,
        )
        parts = gather(mine, self.rank, self.world, self.group)
        if parts is not None:
            path = ckpt.commit(Path(tmp), self._manifest(step, kind), parts, keep=self.job.keep)
            self._log(step, kind, path, parts, blocking_ms=(time.perf_counter() - t0) * 1e3)
        self.last_saved_step = step
        self.saves += 1

    def _log(self, step: int, kind: str, path: Path, parts: list[dict[str, Any]], blocking_ms: float) -> None:
        """Rank 0: one line of ``checkpoints.log`` for the committed checkpoint; C is what the job stalled for."""
        record = {
            "step": step,
            "path": str(path),
            "bytes": sum(f["bytes"] for p in parts for f in p["files"].values()),
            "largest_rank_bytes": max(sum(f["bytes"] for f in p["files"].values()) for p in parts),
            "largest_rank_state_bytes": max(p["state_bytes"] for p in parts),
            "save_ms": max(p["save_ms"] for p in parts),
            "blocking_ms": blocking_ms,
            "kind": kind,
            "attempt": self.attempt,
            "interval_steps": self.interval_steps(),
            "end_ns": time.time_ns(),
        }
        append_line(self.inputs.out_dir / CHECKPOINTS_LOG, json.dumps(record))
        self.save_s.append(blocking_ms / 1e3)  # DCP write, checksums, commit
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
            "aliases": self.aliases,
            "seed": spec.seed,
            "device_type": spec.device_type,
            "run_id": self.job.run_id,
        }
