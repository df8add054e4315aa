"""The option records of :func:`~pipeswift_lab.run`, each a concern with rare knobs, checked on creation (as
torchtitan's job config is):

* :class:`Checkpointing` (``checkpoint=``, or a path) — where and how often the job saves;
* :class:`Faults` (``faults=``) — restarts after a crash, preemption grace, non-finite losses;
* :class:`Elastic` (``elastic=``) — resizes and rebalancing within one job;
* :class:`Launch` (``launch=``) — how the workers start: processes, backend, devices, timeout, start method;
* :class:`FSDP` (``fsdp=``, or the degree) — FSDP2's shard degree and when it frees the gathered parameters.

What a cell types every time stays a flat argument of ``run``. :func:`job_options` resolves the checkpointing,
the checkpoint to resume from (read and checked against the model) and the faults into the :class:`JobOptions`
that travel to the workers in the run's spec.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from ..core.checks import check_choice, check_flag, check_int, check_time
from . import checkpoint as ckpt
from .faults import active_slow_disk_s, active_write_fault

if TYPE_CHECKING:
    from .rebalance import RebalancePlan

__all__ = [
    "ON_NONFINITE",
    "MAX_TIMEOUT_S",
    "Checkpointing",
    "Elastic",
    "FSDP",
    "Faults",
    "JobOptions",
    "Launch",
    "as_checkpointing",
    "as_fsdp",
    "check_record",
    "check_timeout",
    "check_trace_dir",
    "job_options",
]

#: What ``Faults(on_nonfinite=...)`` may do at a NaN/inf loss.
ON_NONFINITE = ("raise", "skip", "ignore")
#: Ways to start the workers (see :mod:`~pipeswift_lab.runner.launcher`).
START_METHODS = ("forkserver", "subprocess")
#: The longest ``preempt_grace_s`` (seconds).
MAX_GRACE_S = 1e6
#: The longest ``timeout_s`` (seconds): torch's process groups and stores overflow beyond it.
MAX_TIMEOUT_S = 1e9

_Record = TypeVar("_Record", "Launch", "Faults", "Elastic")


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
class Launch:
    """How the workers of a run start: ``run(..., launch=psl.Launch(...))``.

    ``start_method``, ``timeout_s`` and ``instrument`` are checked here; ``nprocs``, ``backend`` and ``devices``,
    which need the partition (``nprocs`` must be ``P * D``), by :func:`~pipeswift_lab.runner.spec.make_spec`.
    """

    nprocs: int | None = None
    """Worker processes: one per rank, so ``None`` or ``P * D``."""
    backend: str | None = None
    """``None`` (``nccl`` on CUDA, ``gloo`` on CPU), ``"gloo"`` or ``"nccl"``."""
    devices: Any = None
    """``None`` (one GPU per rank when there are GPUs, else one CPU process per rank with ``cores // P`` threads),
    ``"cpu"``, ``"cuda"`` or a list of CUDA device indices (:func:`~pipeswift_lab.runner.devices.resolve_devices`)."""
    timeout_s: float = 300.0
    """The whole run; the call raises ``RunError`` within it if a rank raises, dies or hangs, naming the rank and
    its traceback; no worker is left running."""
    start_method: str = "forkserver"
    """``"forkserver"`` (warm workers) or ``"subprocess"`` (cold interpreters, as under torchrun); see
    :mod:`~pipeswift_lab.runner.launcher`."""
    save_spec: str | os.PathLike[str] | None = None
    """Also write the first segment's spec there, for ``torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC``."""
    instrument: bool = True
    """Record every compute action (False: step times only, the overhead baseline)."""

    def __post_init__(self) -> None:
        check_choice("start_method", self.start_method, START_METHODS)
        _set(self, "timeout_s", check_timeout(self.timeout_s))
        check_flag("instrument", self.instrument)


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often a job saves: ``run(..., checkpoint="ckpt/")`` or
    ``run(..., checkpoint=psl.Checkpointing("ckpt/", every=50))``; checked and normalized on creation.

    With a checkpoint directory the job saves a final checkpoint (its cleanup) and a preemption saves too
    (:mod:`~pipeswift_lab.runner.checkpoint` describes the files).
    """

    dir: str | os.PathLike[str]
    """The checkpoint root (stored as an absolute path, a ``str``)."""
    every: int | str | None = None
    """An int (every N steps), ``"auto"`` (Young/Daly's interval sqrt(2·C·MTBF) from the measured save stall C and
    the job's MTBF, ``mtbf_s`` over its GPUs) or ``None`` (no periodic saves)."""
    keep: int = 2
    """Newest complete checkpoints kept."""
    asynchronous: bool = True
    """A save stalls the step loop only for a copy of each rank's state (one staging buffer per rank, as large as
    its parameters and optimizer state); the file, fsync, checksums and the commit run in the background, one save
    at a time (a periodic save due while the last is still being written is skipped, and
    ``RunResult.checkpoints`` says so). Final, preemption and rebalance saves are never skipped and are committed
    before the workers exit. ``False`` waits for every write."""
    mtbf_s: float | None = None
    """Mean time between failures of one GPU (seconds), as in :func:`~pipeswift_lab.plan`: a job on N GPUs fails
    every ``mtbf_s / N`` on average. For ``every="auto"`` only."""

    def __post_init__(self) -> None:
        if not isinstance(self.asynchronous, bool):
            raise TypeError(f"Checkpointing.asynchronous must be True or False; got {self.asynchronous!r}")
        _set(self, "dir", _checkpoint_root(self.dir))
        _set(self, "every", self._interval())
        _set(self, "keep", check_int("keep", self.keep, minimum=1))
        if self.mtbf_s is not None:
            _set(self, "mtbf_s", check_time("mtbf_s", self.mtbf_s, allow_zero=False))
            if self.every != "auto":
                raise ValueError(
                    f"mtbf_s={self.mtbf_s:g} is used only to choose the interval of every='auto'; every is "
                    f"{self.every!r}"
                )

    def _interval(self) -> int | str | None:
        """``every``, checked: ``"auto"`` needs ``mtbf_s``."""
        every = self.every
        if every is None:
            return None
        if every == "auto":
            if self.mtbf_s is None:
                raise ValueError(
                    "every='auto' takes the Young/Daly interval sqrt(2*save_s*MTBF) and needs mtbf_s (one GPU's "
                    "mean time between failures, in seconds)"
                )
            return every
        if isinstance(every, str):
            raise ValueError(f"every={every!r} is not valid; use an int (every N steps), 'auto' or None")
        return check_int("every", every, minimum=1)


def _checkpoint_root(directory: Any) -> str:
    """A checkpoint root as an absolute path; refuse what is not a path and a path that is a file."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"the checkpoint directory must be a path (str or os.PathLike); got {type(directory).__name__}")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"checkpoint directory {str(directory)!r} exists and is not a directory")
    return str(Path(directory).resolve())


def as_checkpointing(checkpoint: Any) -> Checkpointing | None:
    """``run``'s ``checkpoint=``: ``None``, a path (``Checkpointing(path)``) or a :class:`Checkpointing`."""
    if checkpoint is None or isinstance(checkpoint, Checkpointing):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        return Checkpointing(checkpoint)
    raise TypeError(
        f"checkpoint must be a directory (str or os.PathLike), a pipeswift_lab.Checkpointing or None; got "
        f"{type(checkpoint).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class Faults:
    """What a job does when something fails: ``run(..., faults=psl.Faults(max_restarts=2))``.

    SIGTERM to the calling process or to any worker is a preemption notice: every rank finishes its step, all save
    at that step, and the result has ``status="preempted"``.
    """

    max_restarts: int = 0
    """After a worker dies or raises, torch's elastic agent restarts all workers up to this many times; they resume
    from the newest checkpoint (it needs ``checkpoint=``)."""
    preempt_grace_s: float = 30.0
    """After SIGTERM, seconds the workers get to finish their step and save; after that they are killed, the
    previous checkpoint stands and ``RunError`` (``reason="preempted"``) is raised."""
    on_nonfinite: str = "raise"
    """At a NaN/inf loss: ``"raise"`` (stop before the update; ``RunError`` with ``reason="nonfinite"`` naming the
    step and rank; the last good checkpoint stands), ``"skip"`` (drop that step's update and count it in
    ``skipped_steps``) or ``"ignore"``."""

    def __post_init__(self) -> None:
        _set(self, "max_restarts", check_int("max_restarts", self.max_restarts, minimum=0))
        grace_s = check_time("preempt_grace_s", self.preempt_grace_s, allow_zero=False)
        if grace_s > MAX_GRACE_S:
            raise ValueError(f"preempt_grace_s={grace_s:g} is invalid; it must be at most {MAX_GRACE_S:g} seconds")
        _set(self, "preempt_grace_s", grace_s)
        check_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)


@dataclass(frozen=True)
class FSDP:
    """FSDP2 inside each replica: ``run(..., fsdp=2)`` or ``run(..., fsdp=psl.FSDP(2, reshard_after_forward=True))``.

    Each stage's layers are sharded over ``degree`` processes (HSDP with ``D > 1`` replicas): the sharded parameters
    and optimizer state are ``1 / degree`` per process.
    """

    degree: int
    """Processes each stage's parameters are sharded over."""
    reshard_after_forward: bool | None = None
    """Free the all-gathered parameters after each forward and gather them again for the backward (ZeRO-3), or keep
    them for the whole step. ``None`` keeps them (as torchtitan does under a pipeline): every run, ``P = 1``
    included, goes through a schedule of ``m`` micro-batches whose gradients stay unsharded until the last one, and
    freeing the parameters between them gathers them ``2m`` times a step for little memory (a ``P = 1``,
    ``fsdp = 2`` run here peaked 25% higher with ``True``). ``True`` is refused under the schedules that split the
    backward (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV): FSDP2 then gives wrong gradients."""

    def __post_init__(self) -> None:
        _set(self, "degree", check_int("fsdp", self.degree, minimum=1))
        if self.reshard_after_forward is not None:
            check_flag("reshard_after_forward", self.reshard_after_forward)


def as_fsdp(fsdp: Any) -> FSDP:
    """``fsdp=`` as an :class:`FSDP` record: an int is the degree."""
    if isinstance(fsdp, FSDP):
        return fsdp
    if isinstance(fsdp, bool) or not isinstance(fsdp, int):
        raise TypeError(f"fsdp must be an int (the shard degree) or a psl.FSDP; got {type(fsdp).__name__} {fsdp!r}")
    return FSDP(fsdp)


@dataclass(frozen=True, kw_only=True)
class Elastic:
    """Changes of configuration within one job (:mod:`~pipeswift_lab.runner.segments`):
    ``run(..., elastic=psl.Elastic(resize_at={20: 2}, profile=prof))``.

    At each change every rank checkpoints, the workers stop and new workers restore and train on; without
    ``checkpoint=`` the changes go through a temporary checkpoint root. Every segment is a row of
    ``RunResult.segments``, every rebalance decision one of ``RunResult.rebalances``. The changes need the
    partition and are checked by :func:`~pipeswift_lab.runner.segments.plan_segments` and the rebalance plan.
    """

    resize_at: dict[int, int] | None = None
    """``{step: P}``: at each step the model is re-partitioned for the new P from ``profile`` (balanced, memory caps
    respected) and the job continues on it."""
    partitions: dict[int, Any] | None = None
    """``{step: Partition}``: at each step the job continues on the given partition."""
    profile: Any = None
    """The Profile the partition came from (for ``resize_at`` and ``rebalance_every``)."""
    rebalance_every: int | None = None
    """Every N steps each stage's measured compute is compared with its profile; when the balanced partition of the
    rescaled profile is predicted to save more over the remaining steps than a reconfiguration costs (measured),
    the job moves its stage boundaries (same P)."""

    def changes(self) -> dict[str, Any]:
        """The changes of configuration asked for (``resize_at``, ``partitions``, ``rebalance_every``), by name."""
        asked = {"resize_at": self.resize_at, "partitions": self.partitions, "rebalance_every": self.rebalance_every}
        return {name: value for name, value in asked.items() if value is not None}


def check_record(name: str, value: Any, kind: type[_Record]) -> _Record:
    """``value`` for ``run``'s record argument ``name``: ``None`` is ``kind()`` with its defaults; anything else
    must be a ``kind``."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a pipeswift_lab.{kind.__name__} or None; got {type(value).__name__}")
    return value


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` checked: positive seconds, no more than the workers' process groups can wait."""
    timeout_s = check_time("timeout_s", timeout_s, allow_zero=False)
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout_s={timeout_s:g} is more than the {MAX_TIMEOUT_S:g} s (about 31 years) the workers' process "
            f"groups and stores can wait (a longer timeout overflows torch's clock); give timeout_s <= "
            f"{MAX_TIMEOUT_S:g}"
        )
    return timeout_s


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
    """One GPU's mean time between failures (seconds), for ``"auto"``; the job's is this over its world size."""
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
    model: nn.Module,
    steps: int,
    checkpointing: Checkpointing | None,
    resume_from: str | os.PathLike[str] | ckpt.Checkpoint | None,
    faults: Faults,
) -> tuple[JobOptions, ckpt.Checkpoint | None]:
    """The :class:`JobOptions` of a job, and the checkpoint it resumes from (``None`` when it starts afresh).

    Everything that can be known before launch raises ``TypeError``/``ValueError`` (a
    :class:`~pipeswift_lab.runner.checkpoint.CheckpointError` for a checkpoint that cannot be
    used) here, and nothing in the checkpoint directory is written or removed by a failed call.
    """
    directory = str(checkpointing.dir) if checkpointing is not None else None
    if faults.max_restarts and directory is None:
        raise ValueError(
            f"max_restarts={faults.max_restarts} restarts the workers from the newest checkpoint and needs "
            "checkpoint= (a directory)"
        )
    resume = _resume_checkpoint(model, steps, directory, resume_from)
    options = JobOptions(
        checkpoint_dir=str(directory) if directory is not None else None,
        checkpoint_every=checkpointing.every if checkpointing else None,
        keep=checkpointing.keep if checkpointing else 2,
        resume_from=str(resume.path) if resume else None,
        mtbf_s=checkpointing.mtbf_s if checkpointing else None,
        checkpoint_async=checkpointing.asynchronous if checkpointing else True,
        on_nonfinite=faults.on_nonfinite,
        preempt_grace_s=faults.preempt_grace_s,
        run_id=uuid.uuid4().hex,
        write_fault=active_write_fault(),
        slow_disk_s=active_slow_disk_s(),
    )
    return options, resume


def _resume_checkpoint(
    model: nn.Module, steps: int, directory: str | None, resume_from: str | os.PathLike[str] | ckpt.Checkpoint | None
) -> ckpt.Checkpoint | None:
    """The checkpoint ``resume_from`` names, checked against ``model`` and ``steps``; refuse a checkpoint
    ``directory`` that holds an earlier run's checkpoints when not resuming."""
    if resume_from is None:
        earlier = ckpt.complete_checkpoints(directory) if directory is not None and Path(directory).is_dir() else []
        if earlier:
            raise ValueError(
                f"checkpoint={directory!r} already holds checkpoints of an earlier run (newest "
                f"{earlier[0].name}): pass resume_from={directory!r} to continue that job, or use an empty directory"
            )
        return None
    found = ckpt.load_checkpoint(resume_from)
    ckpt.check_same_model(found, model)
    resume = ckpt.Checkpoint(found.path.resolve(), found.manifest)  # workers may run in another directory
    if steps <= resume.step:
        raise ValueError(
            f"steps={steps} is the job's total, but the checkpoint {str(resume.path)!r} is already at step "
            f"{resume.step}: give steps > {resume.step} to train on"
        )
    return resume
