"""A job checked and resolved before any process starts: :class:`JobPlan`, made by :func:`plan_job`.

The preflight of :func:`~pipeswift_lab.runner.job.run`: the options are checked (the checkpoint to resume from is
read and compared with the model), the segments that ``resize_at``/``partitions`` ask for are planned, the
rebalance plan is made, and every planned segment's spec is built and checked, so that whatever can be known in
advance fails in the caller's cell, not in a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from ..core.checks import check_flag, check_int
from ..core.schedule import ScheduleLike
from .checkpoint import Checkpoint
from .options import Checkpointing, Elastic, Faults, JobOptions, Launch, job_options
from .segments import PlannedSegment, plan_segments
from .sources import DataSource, make_data_source
from .spec import RunSpec, make_spec

if TYPE_CHECKING:
    from ..partitioning.stages import Partition
    from .rebalance import RebalancePlan

__all__ = ["JobPlan", "plan_job", "OptimizerFactory"]

#: An optimizer factory: ``optimizer(params) -> torch.optim.Optimizer``.
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """A job checked and resolved before anything starts: what every segment of :func:`run` launches from."""

    model: nn.Module
    """The full model."""
    data: DataSource
    """Every step's batch, made once: every segment's spec reads the same batches."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(outputs, targets)``."""
    m: int
    """Micro-batches per step."""
    schedule: ScheduleLike | None
    """The schedule asked for (``None``: the partition's)."""
    steps: int
    """The job's total steps."""
    first_step: int
    """The step the job starts at: 0, or the step of the checkpoint it resumes from."""
    spec_kwargs: dict[str, Any]
    """:func:`~pipeswift_lab.runner.spec.make_spec`'s keyword arguments shared by every segment."""
    job: JobOptions
    """What the workers are told about checkpoints, resume, preemption and non-finite losses."""
    launch: Launch
    """How the workers start."""
    progress: bool
    """Show a progress bar of the steps done."""
    max_restarts: int
    """Restarts of all workers by torch's elastic agent after a failure."""
    planned: list[PlannedSegment]
    """The segments known before launch: the first one, then one per resize."""
    specs: dict[int, RunSpec]
    """The spec of every planned segment, by its first step, built and checked before launch."""
    rebalance: RebalancePlan | None
    """How the workers decide to rebalance (``None``: they never do)."""
    profile: Any
    """The Profile the partition came from (rebalanced partitions are made from it)."""

    @property
    def changes(self) -> bool:
        """Whether the job may change configuration (a resize or a rebalance), through checkpoints."""
        return len(self.planned) > 1 or self.rebalance is not None

    @property
    def first_spec(self) -> RunSpec:
        """The spec of the job's first segment."""
        return self.specs[self.planned[0].start_step]

    def segment_end(self, start: int) -> int:
        """The step a segment starting at ``start`` runs to: the next planned change, or the job's end."""
        return next((seg.start_step for seg in self.planned if seg.start_step > start), self.steps)


def plan_job(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    partition: Partition,
    m: int,
    *,
    schedule: ScheduleLike | None,
    steps: int,
    optimizer: OptimizerFactory | None,
    seed: int = 0,
    progress: bool = True,
    D: int = 1,
    fsdp: Any = 1,
    tp: Any = 1,
    tp_plan: Any = None,
    split: str | None = None,
    recompute: Any = None,
    precision: str | None = None,
    weights: Any = None,
    init: Any = None,
    resume_from: Any = None,
    profiler_trace: Any = None,
    checkpoint: Checkpointing | None = None,
    faults: Faults,
    elastic: Elastic,
    launch: Launch,
) -> JobPlan:
    """Check and resolve a job before any process starts; return its :class:`JobPlan`.

    The options are checked (the checkpoint to resume from is read and compared with ``model``), the segments
    planned, and every planned segment's spec built (:func:`~pipeswift_lab.runner.spec.make_spec`). Raises
    ``TypeError``/``ValueError`` for whatever can be known in advance.
    """
    steps = check_int("steps", steps, minimum=1)
    D = check_int("D", D, minimum=1)
    progress = check_flag("progress", progress)
    for name, value in elastic.changes().items() if D > 1 else ():
        raise ValueError(f"D={D} replicas cannot be combined with {name}={value!r} yet; use D=1 for {name}")
    sharded = {"fsdp": fsdp, "tp": tp}
    for name, value in elastic.changes().items() if any(v != 1 for v in sharded.values()) else ():
        raise ValueError(f"{sharded} cannot be combined with {name}={value!r} yet; use fsdp=1 and tp=1 for {name}")
    if weights is not None and resume_from is not None:
        raise ValueError(
            f"weights={str(weights)!r} and resume_from={str(resume_from)!r} both give the starting "
            "state; a resumed job takes everything from its checkpoint, so give only one of them"
        )
    job, resume = job_options(model, steps, checkpoint, resume_from, faults)
    source = make_data_source(data, steps, check_int("seed", seed))
    first_step = resume.step if resume is not None else 0
    planned = plan_segments(
        model, partition, steps, first_step, elastic.resize_at, elastic.partitions, elastic.profile, m, schedule
    )
    rebalance = _rebalance_plan(elastic.rebalance_every, elastic.profile, partition, m, steps, launch.instrument)
    spec_kwargs = {
        "steps": steps,
        "optimizer": optimizer,
        "seed": seed,
        "D": D,
        "fsdp": fsdp,
        "tp": tp,
        "tp_plan": tp_plan,
        "split": split,
        "recompute": recompute,
        "precision": precision,
        "weights": weights,
        "init": init,
        "profiler_trace": profiler_trace,
        "launch": launch,
    }
    specs = {
        seg.start_step: make_spec(model, source, loss_fn, seg.partition, m, schedule=schedule, job=job, **spec_kwargs)
        for seg in planned
    }
    first = specs[planned[0].start_step]
    if resume is not None:
        _check_same_optimizer(first, resume)
    if launch.save_spec is not None:  # the model's tensors are written once, beside it, and the ranks read them there
        first = specs[planned[0].start_step] = first.with_weights_beside(launch.save_spec)
        first.save(launch.save_spec)
    return JobPlan(
        model=model,
        data=source,
        loss_fn=loss_fn,
        m=m,
        schedule=schedule,
        steps=steps,
        first_step=first_step,
        spec_kwargs=spec_kwargs,
        job=job,
        launch=launch,
        progress=progress,
        max_restarts=faults.max_restarts,
        planned=planned,
        specs=specs,
        rebalance=rebalance,
        profile=elastic.profile,
    )


def _check_same_optimizer(spec: RunSpec, resume: Checkpoint) -> None:
    """Refuse to resume a checkpoint that holds another optimizer class's state than ``spec.optimizer`` makes."""
    saved = resume.manifest.get("optimizer")
    probe = spec.optimizer([p for p in spec.model.parameters()])
    own = type(probe).__module__ + "." + type(probe).__qualname__
    if saved and saved != own:
        raise ValueError(
            f"the checkpoint {str(resume.path)!r} holds the state of a {saved} optimizer, but optimizer makes a "
            f"{own}; resume with the same optimizer class"
        )


def _rebalance_plan(
    rebalance_every: int | None, profile: Any, partition: Partition, m: int, steps: int, instrument: bool
) -> RebalancePlan | None:
    """The :class:`~pipeswift_lab.runner.rebalance.RebalancePlan` of ``rebalance_every`` (None without), checked."""
    if rebalance_every is None:
        return None
    from .rebalance import RebalancePlan

    every = check_int("rebalance_every", rebalance_every, minimum=1)
    if profile is None:
        raise ValueError(
            "rebalance_every needs profile=... (the Profile the partition came from) to compare measured stage "
            "times with"
        )
    if not instrument:
        raise ValueError("rebalance_every needs the measured stage times: use launch=Launch(instrument=True)")
    table = profile.df if hasattr(profile, "df") else profile
    if not isinstance(table, pd.DataFrame):
        raise TypeError(
            f"profile must be a pipeswift_lab.Profile or a per-layer DataFrame; got {type(profile).__name__}"
        )
    if len(table) != partition.bounds[-1][1]:
        raise ValueError(
            f"profile has {len(table)} layers but the partition cuts {partition.bounds[-1][1]}; pass the profile it "
            "came from"
        )
    kwargs = {
        "schedule": partition.schedule,
        "v": partition.v,
        "m": m,
        "mem_per_gpu_bytes": partition.mem_per_gpu_bytes,
        "optimizer": partition.optimizer,
        "link": partition.link,
    }
    return RebalancePlan(every=every, profile=table.reset_index(drop=True), partition_kwargs=kwargs, job_steps=steps)
