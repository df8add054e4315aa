"""The options of :func:`~pipeswift_lab.runner.job.run`, grouped as keyword-only records with a docstring per field.

``run()`` keeps its flat keyword arguments; its first step gathers them into three records, each checked in its
``__post_init__`` (as torchtitan's job config is):

* :class:`LaunchOptions` — how the workers start: processes, backend, devices, timeout, progress, start method;
* :class:`CheckpointOptions` — where and how often the job saves, and the checkpoint it resumes from;
* :class:`ElasticOptions` — what the job lives through: restarts, preemption, non-finite losses, resizes and
  rebalancing.

:func:`job_options` resolves the last two (the checkpoint to resume from is read and checked against the model)
into the :class:`JobOptions` that travel to the workers in the run's spec.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.checks import check_choice, check_flag, check_int, check_time
from . import checkpoint as ckpt
from .faults import active_slow_disk_s, active_write_fault

if TYPE_CHECKING:
    from .rebalance import RebalancePlan

__all__ = [
    "ON_NONFINITE",
    "JobOptions",
    "LaunchOptions",
    "CheckpointOptions",
    "ElasticOptions",
    "job_options",
    "check_trace_dir",
]

#: What ``run(..., on_nonfinite=...)`` may do at a NaN/inf loss.
ON_NONFINITE = ("raise", "skip", "ignore")
#: Ways to start the workers (see :mod:`~pipeswift_lab.runner.launcher`).
START_METHODS = ("forkserver", "subprocess")
#: The longest ``preempt_grace_s`` (seconds).
MAX_GRACE_S = 1e6


def check_trace_dir(directory: str | os.PathLike[str] | None) -> str | None:
    """``profiler_trace`` as an absolute path (``None`` stays ``None``); a path that is, or lies under, an existing
    file raises ``ValueError``. Nothing is created here: each rank makes the directory when it starts profiling."""
    if directory is None:
        return None
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"profiler_trace must be a directory (str or os.PathLike) or None; got {type(directory).__name__}"
        )
    path = Path(directory).resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        what = "exists and is not a directory" if existing == path else f"lies under {str(existing)!r}, a file"
        raise ValueError(
            f"profiler_trace={str(directory)!r} {what}: give a directory (made if missing) for every rank's "
            "torch.profiler trace file"
        )
    return str(path)


def _set(record: object, name: str, value: object) -> None:
    """Store a checked value on a frozen record (in ``__post_init__`` only)."""
    object.__setattr__(record, name, value)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How the workers of a run start. ``start_method`` and ``progress`` are checked here; the rest, which needs
    the partition (``nprocs`` must be ``P * D``), by :func:`~pipeswift_lab.runner.spec.make_spec`."""

    nprocs: int | None = None
    """Worker processes: one per rank, so ``None`` or ``P * D``."""
    backend: str | None = None
    """``None`` (``nccl`` on CUDA, ``gloo`` on CPU), ``"gloo"`` or ``"nccl"``."""
    devices: Any = None
    """``None`` (one GPU per rank when there are GPUs), ``"cpu"``, ``"cuda"`` or a list of CUDA device indices."""
    timeout_s: float = 300.0
    """The whole run; the call raises ``RunError`` within it if a rank raises, dies or hangs."""
    progress: bool = True
    """Show a progress bar of the steps done."""
    save_spec: str | os.PathLike[str] | None = None
    """Also write the first segment's spec there, for ``torchrun ... -m pipeswift_lab.runner SPEC``."""
    instrument: bool = True
    """Record every compute action (False: step times only, the overhead baseline)."""
    profiler_trace: str | os.PathLike[str] | None = None
    """A directory: every rank writes a ``torch.profiler`` trace of its steps there
    (:mod:`~pipeswift_lab.runner.rank.profiler_trace`); ``None``: no profiler."""
    seed: int = 0
    """``torch.manual_seed`` on every rank before the first step; data callables get ``seed + step``."""
    start_method: str = "forkserver"
    """``"forkserver"`` (warm workers) or ``"subprocess"`` (cold interpreters, as under torchrun)."""

    def __post_init__(self) -> None:
        check_choice("start_method", self.start_method, START_METHODS)
        check_flag("progress", self.progress)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and how often a job saves, and what it resumes from; checked and normalized on creation."""

    checkpoint_dir: str | os.PathLike[str] | None = None
    """A checkpoint root (stored as an absolute path, a ``str``); ``None``: no checkpoints."""
    checkpoint_every: int | str | None = None
    """An int (every N steps), ``"auto"`` (Young/Daly's interval from the measured save time and ``mtbf_s``) or
    ``None`` (no periodic saves)."""
    keep: int = 2
    """Newest complete checkpoints kept."""
    resume_from: str | os.PathLike[str] | ckpt.Checkpoint | None = None
    """A checkpoint root (its newest complete checkpoint) or one ``step-*`` directory to continue from."""
    mtbf_s: float | None = None
    """The job's mean time between failures (seconds), for ``checkpoint_every="auto"`` only."""
    checkpoint_async: bool = True
    """Write checkpoints in the background (the step loop waits only for a copy of the state); ``False`` waits
    for every save."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_async, bool):
            raise TypeError(f"checkpoint_async must be True or False; got {self.checkpoint_async!r}")
        directory = self.checkpoint_dir
        if directory is not None:
            if not isinstance(directory, (str, os.PathLike)):
                raise TypeError(
                    f"checkpoint_dir must be a path (str or os.PathLike) or None; got {type(directory).__name__}"
                )
            if Path(directory).exists() and not Path(directory).is_dir():
                raise ValueError(f"checkpoint_dir={str(directory)!r} exists and is not a directory")
            _set(self, "checkpoint_dir", str(Path(directory).resolve()))
        _set(self, "checkpoint_every", self._interval())
        _set(self, "keep", check_int("keep", self.keep, minimum=1))
        if self.mtbf_s is not None:
            _set(self, "mtbf_s", check_time("mtbf_s", self.mtbf_s, allow_zero=False))
            if self.checkpoint_every != "auto":
                raise ValueError(
                    f"mtbf_s={self.mtbf_s:g} is used only to choose the interval of checkpoint_every='auto'; "
                    f"checkpoint_every is {self.checkpoint_every!r}"
                )

    def _interval(self) -> int | str | None:
        """``checkpoint_every``, checked: it needs ``checkpoint_dir``, and ``"auto"`` needs ``mtbf_s``."""
        every = self.checkpoint_every
        if every is None:
            return None
        if every == "auto":
            if self.mtbf_s is None:
                raise ValueError(
                    "checkpoint_every='auto' takes the Young/Daly interval sqrt(2*save_s*mtbf_s) and needs mtbf_s "
                    "(the job's mean time between failures, in seconds)"
                )
        elif isinstance(every, str):
            raise ValueError(f"checkpoint_every={every!r} is not valid; use an int (every N steps), 'auto' or None")
        else:
            every = check_int("checkpoint_every", every, minimum=1)
        if self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every={every!r} needs checkpoint_dir: where should the checkpoints go?")
        return every


@dataclass(frozen=True, kw_only=True)
class ElasticOptions:
    """What a job lives through: restarts after a crash, preemption, non-finite losses, changes of configuration.

    The numbers and the choice are checked on creation; the changes of configuration need the partition and are
    checked by :func:`~pipeswift_lab.runner.segments.plan_segments` and the job's rebalance plan.
    """

    max_restarts: int = 0
    """Restarts of all workers by torch's elastic agent after one dies or raises (they resume from the newest
    checkpoint in ``checkpoint_dir``)."""
    preempt_grace_s: float = 30.0
    """After SIGTERM, seconds the workers get to finish their step and save before they are killed."""
    on_nonfinite: str = "raise"
    """At a NaN/inf loss: ``"raise"``, ``"skip"`` (drop that step's update) or ``"ignore"``."""
    resize_at: dict[int, int] | None = None
    """``{step: P}``: at each step the job re-partitions ``profile`` for the new P and continues on it."""
    partitions: dict[int, Any] | None = None
    """``{step: Partition}``: at each step the job continues on the given partition."""
    profile: Any = None
    """The Profile the partition came from (for ``resize_at`` and ``rebalance_every``)."""
    rebalance_every: int | None = None
    """Every N steps, move the stage boundaries when the measured stage times say it pays."""

    def __post_init__(self) -> None:
        _set(self, "max_restarts", check_int("max_restarts", self.max_restarts, minimum=0))
        grace_s = check_time("preempt_grace_s", self.preempt_grace_s, allow_zero=False)
        if grace_s > MAX_GRACE_S:
            raise ValueError(f"preempt_grace_s={grace_s:g} is invalid; it must be at most {MAX_GRACE_S:g} seconds")
        _set(self, "preempt_grace_s", grace_s)
        check_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)

    def changes(self) -> dict[str, Any]:
        """The changes of configuration asked for (``resize_at``, ``partitions``, ``rebalance_every``), by name."""
        asked = {"resize_at": self.resize_at, "partitions": self.partitions, "rebalance_every": self.rebalance_every}
        return {name: value for name, value in asked.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """How a run lives through a shared cluster: checkpoints, resume, preemption, non-finite losses.

    What the workers are told, inside the run's spec; built by :func:`job_options` before launch.
    """

    checkpoint_dir: str | None = None
    """The checkpoint root; ``None``: no checkpoints."""
    checkpoint_every: int | str | None = None
    """N steps, ``"auto"`` (Young/Daly from the measured save time and ``mtbf_s``) or ``None``."""
    keep: int = 2
    """Newest complete checkpoints kept."""
    resume_from: str | None = None
    """One ``step-*`` directory (resolved from a root before launch); ``None``: start at step 0."""
    mtbf_s: float | None = None
    """The job's mean time between failures (seconds), for ``"auto"``."""
    checkpoint_async: bool = True
    """Write checkpoints in the background; ``False``: every save waits for its write."""
    on_nonfinite: str = "raise"
    """``"raise"``, ``"skip"`` or ``"ignore"`` (see :data:`ON_NONFINITE`)."""
    preempt_grace_s: float = 30.0
    """After SIGTERM, seconds to finish the step and save before being killed."""
    run_id: str | None = None
    """Written into every manifest: restarts and retention see only this run's checkpoints."""
    final_kind: str | None = "final"
    """The save at the last step: ``"final"``, ``"resize"`` before a reconfiguration, ``None``: none."""
    rebalance: RebalancePlan | None = None
    """Decide every N steps whether to move stage boundaries; ``None``: never."""
    launch_ns: int | None = None
    """Wall clock when this segment's launch began (the measured assembly starts there)."""
    write_fault: dict[str, Any] | None = None
    """A :func:`~pipeswift_lab.runner.faults.write_fault` in force when ``run()`` was called: the writer fails as
    asked."""
    slow_disk_s: float = 0.0
    """A :func:`~pipeswift_lab.runner.faults.slow_disk` in force when ``run()`` was called: seconds per rank file."""


def job_options(
    model: nn.Module, steps: int, checkpoints: CheckpointOptions, elastic: ElasticOptions
) -> tuple[JobOptions, ckpt.Checkpoint | None]:
    """The :class:`JobOptions` of a job, and the checkpoint it resumes from (``None`` when it starts afresh).

    Everything that can be known before launch raises ``TypeError``/``ValueError`` (a
    :class:`~pipeswift_lab.runner.checkpoint.CheckpointError` for a checkpoint that cannot be
    used) here, and nothing in ``checkpoint_dir`` is written or removed by a failed call.
    """
    if elastic.max_restarts and checkpoints.checkpoint_dir is None:
        raise ValueError(
            f"max_restarts={elastic.max_restarts} restarts the workers from the newest checkpoint and needs "
            "checkpoint_dir"
        )
    resume = _resume_checkpoint(model, steps, checkpoints)
    directory = checkpoints.checkpoint_dir
    options = JobOptions(
        checkpoint_dir=str(directory) if directory is not None else None,
        checkpoint_every=checkpoints.checkpoint_every,
        keep=checkpoints.keep,
        resume_from=str(resume.path) if resume else None,
        mtbf_s=checkpoints.mtbf_s,
        checkpoint_async=checkpoints.checkpoint_async,
        on_nonfinite=elastic.on_nonfinite,
        preempt_grace_s=elastic.preempt_grace_s,
        run_id=uuid.uuid4().hex,
        write_fault=active_write_fault(),
        slow_disk_s=active_slow_disk_s(),
    )
    return options, resume


def _resume_checkpoint(model: nn.Module, steps: int, checkpoints: CheckpointOptions) -> ckpt.Checkpoint | None:
    """The checkpoint ``resume_from`` names, checked against ``model`` and ``steps``; refuse a ``checkpoint_dir``
    that holds an earlier run's checkpoints when not resuming."""
    directory = checkpoints.checkpoint_dir
    if checkpoints.resume_from is None:
        earlier = ckpt.complete_checkpoints(directory) if directory is not None and Path(directory).is_dir() else []
        if earlier:
            raise ValueError(
                f"checkpoint_dir={directory!r} already holds checkpoints of an earlier run (newest "
                f"{earlier[0].name}): pass resume_from={directory!r} to continue that job, or use an empty directory"
            )
        return None
    found = ckpt.load_checkpoint(checkpoints.resume_from)
    ckpt.check_same_model(found, model)
    resume = ckpt.Checkpoint(found.path.resolve(), found.manifest)  # workers may run in another directory
    if steps <= resume.step:
        raise ValueError(
            f"steps={steps} is the job's total, but the checkpoint {str(resume.path)!r} is already at step "
            f"{resume.step}: give steps > {resume.step} to train on"
        )
    return resume
