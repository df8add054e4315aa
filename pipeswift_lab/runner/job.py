"""``run()``: a training job on real pipeline workers, from a notebook cell, surviving what a cluster does to it.

The job loop above :func:`~pipeswift_lab.runner.launcher.launch`: it checks every argument
(checkpoint options and the checkpoint to resume from included) before any process starts,
launches the workers (torch's elastic agent restarts them after a crash when
``max_restarts >= 1``; they resume from the newest complete checkpoint), turns SIGTERM to the
calling process into a clean stop-and-save, and reads back from the run directory what every
attempt did (steps, checkpoints, restores) to measure the JCT terms a cluster adds: cleanup
(the final save and teardown) and preemption loss (periodic save stalls, steps redone,
recovery and restore time).

``run`` reads as its steps: gather the options (:mod:`~pipeswift_lab.runner.options`), plan the job (every
segment's spec built and checked), run the segments one launch each, and combine their results.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.checks import moved_keywords
from ..core.schedule import ScheduleLike
from ..core.tp_plan import TP
from .assembly import build_result, read_history
from .checkpoint import Checkpoint
from .errors import RunError
from .final_weights import KEPT_PREFIX
from .launcher import Preemption, check_main_guard, launch
from .options import FSDP, Checkpointing, Elastic, Faults, Launch, as_checkpointing, check_record
from .preflight import JobPlan, OptimizerFactory, plan_job
from .processes import alive
from .result import RunResult
from .segments import combine
from .spec import RunSpec, make_spec

if TYPE_CHECKING:
    from ..partitioning.stages import Partition

__all__ = ["run", "clean_stale_run_dirs", "read_history"]

_RUN_DIR_PREFIX = "pipeswift_run_"
_LAUNCH_FIELDS = ("nprocs", "backend", "devices", "timeout_s", "start_method", "save_spec", "instrument")
_OWNER_FILE = "owner.pid"


_MOVED = {
    **{name: f"launch=psl.Launch({name}=...)" for name in _LAUNCH_FIELDS},
    "checkpoint_dir": 'checkpoint="DIR" (or psl.Checkpointing("DIR", ...))',
    "checkpoint_every": 'checkpoint=psl.Checkpointing("DIR", every=...)',
    "keep": 'checkpoint=psl.Checkpointing("DIR", keep=...)',
    "checkpoint_async": 'checkpoint=psl.Checkpointing("DIR", asynchronous=...)',
    "mtbf_s": 'checkpoint=psl.Checkpointing("DIR", every="auto", mtbf_s=...) (one GPU\'s MTBF, as in plan)',
    **{name: f"faults=psl.Faults({name}=...)" for name in ("max_restarts", "preempt_grace_s", "on_nonfinite")},
    **{name: f"elastic=psl.Elastic({name}=...)" for name in ("resize_at", "partitions", "profile", "rebalance_every")},
}


@moved_keywords(_MOVED)
def run(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    partition: Partition,
    m: int,
    *,
    schedule: ScheduleLike | None = None,
    steps: int = 10,
    optimizer: OptimizerFactory | None = None,
    seed: int = 0,
    progress: bool = True,
    D: int = 1,
    fsdp: int | FSDP = 1,
    tp: int | TP = 1,
    tp_plan: dict[str, str] | None = None,
    recompute: str | dict[int, list[str]] | None = None,
    precision: str | None = None,
    weights: str | os.PathLike[str] | Any = None,
    init: Callable[[nn.Module], None] | None = None,
    resume_from: str | os.PathLike[str] | Checkpoint | None = None,
    split: str | None = None,
    profiler_trace: str | os.PathLike[str] | None = None,
    checkpoint: str | os.PathLike[str] | Checkpointing | None = None,
    faults: Faults | None = None,
    elastic: Elastic | None = None,
    launch: Launch | None = None,
) -> RunResult:
    """Train ``model`` for ``steps`` steps as a real pipeline on ``torch.distributed.pipelining`` and measure it;
    return a :class:`RunResult`.

    What a cell types every time is a flat argument; each concern with rare knobs is one record (``docs/running.md``
    and ``docs/fault_tolerance.md`` show them in use).

    * ``model`` — an ``nn.Sequential`` (stage ``s`` is its children ``partition.bounds[s]``), or any model torch's
      tracer can split, Hugging Face models as they are: the first layer name of each stage becomes a split point
      of ``torch.distributed.pipelining.pipeline`` (:mod:`~pipeswift_lab.runner.stages.traced`). A parameter used
      by several stages (tied embeddings) is held by each and its gradients are summed every step, as Megatron-LM
      does (:mod:`~pipeswift_lab.runner.stages.tied`). A model built on the meta device is never held whole by any
      process: each rank makes and fills only its stages' tensors (:mod:`~pipeswift_lab.core.meta_device`).
    * ``data`` — an ``(inputs, targets)`` batch used every step, a ``callable(step) -> (inputs, targets)`` (called
      with torch's RNG seeded to ``seed + step``) or an iterable of batches. ``loss_fn(outputs, targets)`` — a mean
      over the micro-batch; gradients are scaled by ``1/m``, so a step equals one process on the whole batch.
    * ``partition`` — a :class:`~pipeswift_lab.Partition`; ``m`` — micro-batches per step (it divides the batch).
    * ``schedule`` — a name from ``SCHEDULES``; ``None`` takes the partition's, else ``"1F1B"`` (``v == 1``) or
      ``"Interleaved1F1B"``. ``steps`` — the job's total (a resumed job continues to it). ``optimizer`` — a factory
      ``lambda params: torch.optim.X(params, ...)`` called on every rank (``None``: SGD, ``lr=0.01``). ``seed`` —
      ``torch.manual_seed`` on every rank. ``progress`` — a progress bar of the steps.
    * ``D`` — data-parallel replicas of the pipeline; ``fsdp`` — the FSDP2 shard degree inside a replica (an int or
      :class:`~pipeswift_lab.FSDP`; HSDP with ``D > 1``); ``tp`` — the tensor-parallel degree (an int or
      :class:`~pipeswift_lab.TP`, whose ``sequence_parallel=True`` adds sequence parallelism), with ``tp_plan``
      (``{module glob: style}``; ``None``: the model's own, a Hugging Face config's or a reference model's,
      :mod:`~pipeswift_lab.core.tp_plan`). The run uses ``P * D * fsdp * tp`` processes meshed ``(pp, dp, fsdp, tp)``
      (:mod:`~pipeswift_lab.core.layout`); ``P = 1`` (a one-stage partition) is FSDP and/or TP without a pipeline.
      Each stage is in DDP over its ``D`` copies when ``fsdp == tp == 1``, else split with DTensor and sharded with
      FSDP2 (:mod:`~pipeswift_lab.runner.stages.sharding`); process ``(dp, f)`` trains on its slice of
      ``B / (D * fsdp)`` rows of each global batch.
    * ``recompute`` — ``None``, ``"full"``, ``"selective"`` or ``{stage: [layer names or globs]}``, with
      ``torch.utils.checkpoint`` (:mod:`~pipeswift_lab.core.recompute`). ``precision`` — ``None``/``"fp32"``,
      ``"bf16-mixed"`` or ``"bf16-mixed-zero1"`` (:mod:`~pipeswift_lab.runner.stages.precision`).
    * ``weights`` — the starting tensors: a Hugging Face safetensors checkpoint (file or folder, its stored names
      converted as ``from_pretrained`` converts them), a ``torch.distributed.checkpoint`` directory or a
      pipeswift_lab checkpoint (:mod:`~pipeswift_lab.runner.weights`); each rank reads only its stages' tensors.
      ``init`` — with a meta model and no ``weights``: ``init(module)`` fills each submodule (``None``: a Hugging
      Face model's ``_init_weights``, else ``reset_parameters()``), seeded by ``seed`` and the submodule's name.
    * ``resume_from`` — a checkpoint root (its newest complete checkpoint), one ``step-*`` directory or a
      :class:`Checkpoint`: training continues at its step, on this or another partition and P.
    * ``split`` — ``None`` (an ``nn.Sequential`` is cut between its children, any other model traced),
      ``"trace"``, or ``"manual"`` (each stage a copy of the model run eagerly; :mod:`~.stages.manual`).
    * ``profiler_trace`` — a directory: every rank writes a ``torch.profiler`` trace of its steps there
      (:mod:`~pipeswift_lab.runner.rank.profiler_trace`), read back by ``Timeline.from_profiler(dir)``.

    The records (:mod:`~pipeswift_lab.runner.options`, each field documented there):

    * ``checkpoint`` — a directory, or :class:`~pipeswift_lab.Checkpointing` (``every``, ``keep``,
      ``asynchronous``, ``mtbf_s``): the job saves at its end, on preemption and every ``every`` steps;
    * ``faults`` — :class:`~pipeswift_lab.Faults` (``max_restarts``, ``preempt_grace_s``, ``on_nonfinite``);
      SIGTERM to this process or any worker is a preemption notice: every rank saves at its step and the result
      has ``status="preempted"``;
    * ``elastic`` — :class:`~pipeswift_lab.Elastic` (``resize_at``, ``partitions``, ``profile``,
      ``rebalance_every``): changes of configuration within the job, through checkpoints;
    * ``launch`` — :class:`~pipeswift_lab.Launch` (``nprocs``, ``backend``, ``devices``, ``timeout_s``,
      ``start_method``, ``save_spec``, ``instrument``): how the workers start.

    Objects defined in a notebook cell are serialized by value (cloudpickle); workers exit when this process dies.
    Raises ``TypeError``/``ValueError`` before any process starts for what can be checked in advance (a keyword
    that moved into a record names its new home), :class:`RunError` for what fails in a worker.
    """
    launch_ns = time.time_ns()
    launch = check_record("launch", launch, Launch)
    check_main_guard(launch.start_method)
    job = plan_job(
        model,
        data,
        loss_fn,
        partition,
        m,
        schedule=schedule,
        steps=steps,
        optimizer=optimizer,
        seed=seed,
        progress=progress,
        D=D,
        fsdp=fsdp,
        tp=tp,
        tp_plan=tp_plan,
        split=split,
        recompute=recompute,
        precision=precision,
        weights=weights,
        init=init,
        resume_from=resume_from,
        profiler_trace=profiler_trace,
        checkpoint=as_checkpointing(checkpoint),
        faults=check_record("faults", faults, Faults),
        elastic=check_record("elastic", elastic, Elastic),
        launch=launch,
    )
    results, reasons = _run_segments(job, launch_ns)
    return _raise_if_nonfinite(combine(results, reasons))


@dataclass(frozen=True, kw_only=True)
class _Segment:
    """One stretch of the job on one configuration, about to be launched."""

    partition: Partition
    """The partition it runs on."""
    spec: RunSpec | None
    """Its spec when planned before launch; ``None`` for a rebalanced partition (built and checked at launch)."""
    start_step: int
    """The step it starts at."""
    reason: str
    """Why it starts: ``"start"``, ``"resize"`` or ``"rebalance"``."""
    launch_ns: int
    """Wall clock when its launch began (the previous segment's end)."""
    resume_from: str | None
    """The checkpoint it restores (``None``: the job's first segment, starting afresh)."""


def _run_segments(plan: JobPlan, launch_ns: int) -> tuple[list[RunResult], list[str]]:
    """Launch the job's segments one after the other in a temporary run directory; return every segment's result
    and the reason it started."""
    deadline = time.monotonic() + plan.first_spec.timeout_s
    clean_stale_run_dirs()
    preemption = Preemption(plan.job.preempt_grace_s)
    results: list[RunResult] = []
    reasons: list[str] = []
    with tempfile.TemporaryDirectory(prefix=_RUN_DIR_PREFIX) as tmp:
        (Path(tmp) / _OWNER_FILE).write_text(str(os.getpid()))  # a later run() removes the directory if we die
        root = plan.job.checkpoint_dir or str(Path(tmp) / "checkpoints")
        segment: _Segment | None = _Segment(
            partition=plan.planned[0].partition,
            spec=plan.first_spec,
            start_step=plan.first_step,
            reason="start",
            launch_ns=launch_ns,
            resume_from=plan.job.resume_from,
        )
        while segment is not None:
            spec = _segment_spec(plan, segment, root, results)
            result = _run_segment(plan, segment, spec, Path(tmp) / f"segment{len(results)}", deadline, preemption)
            results.append(result)
            reasons.append(segment.reason)
            segment = _next_segment(plan, segment, result)
    return results, reasons


def _segment_spec(plan: JobPlan, segment: _Segment, root: str, results: list[RunResult]) -> RunSpec:
    """The spec a segment launches: its planned one (or one made for a rebalanced partition) with the segment's
    job options: checkpoint root, checkpoint to restore, its final save, the rebalance cost measured so far."""
    job, end = plan.job, plan.segment_end(segment.start_step)
    rebalance = plan.rebalance
    segment_job = dataclasses.replace(
        job,
        checkpoint_dir=root if plan.changes else job.checkpoint_dir,
        resume_from=segment.resume_from,
        launch_ns=segment.launch_ns,
        final_kind=("final" if job.checkpoint_dir else None) if end >= plan.steps else "resize",
        rebalance=dataclasses.replace(rebalance, cost_s=_last_switch_cost(results)) if rebalance else None,
    )
    if segment.spec is not None:
        return dataclasses.replace(segment.spec, job=segment_job, steps=end)
    kwargs = {**plan.spec_kwargs, "steps": end, "schedule": plan.schedule, "job": segment_job}
    return make_spec(plan.model, plan.data, plan.loss_fn, segment.partition, plan.m, **kwargs)  # new stages, checked


def _run_segment(
    plan: JobPlan, segment: _Segment, spec: RunSpec, run_dir: Path, deadline: float, preemption: Preemption
) -> RunResult:
    """Launch one segment's workers in ``run_dir`` and assemble its :class:`RunResult`."""
    run_dir.mkdir()
    (run_dir / _OWNER_FILE).write_text(str(os.getpid()))
    spec_path = spec.save(run_dir / "spec.pkl")
    label = f" (segment {run_dir.name.removeprefix('segment')})" if plan.changes else ""
    with _sigterm_to(preemption):
        gathered = launch(
            spec_path,
            run_dir,
            spec.world_size,
            deadline,
            spec.timeout_s,
            spec.steps,
            plan.progress,
            f"{spec.plan.schedule} P={spec.P} m={spec.m}{label}",
            plan.launch.start_method,
            max_restarts=plan.max_restarts,
            preemption=preemption,
        )
    history = read_history(run_dir)
    return build_result(spec, gathered, segment.launch_ns, time.time_ns(), history=history, out_dir=run_dir)


def _next_segment(plan: JobPlan, segment: _Segment, result: RunResult) -> _Segment | None:
    """The segment after ``segment`` (which ended with ``result``): a rebalanced or a planned resize; None when the
    job is over (completed, preempted or stopped at a non-finite loss)."""
    end = plan.segment_end(segment.start_step)
    spec: RunSpec | None
    if result.status == "rebalance":
        partition = _rebalanced(plan.profile, segment.partition, result.meta["new_bounds"], plan.m)
        spec, reason = None, "rebalance"
    elif result.status == "completed" and end < plan.steps:
        partition = next(seg.partition for seg in plan.planned if seg.start_step == end)
        spec, reason = plan.specs[end], "resize"
    else:
        return None
    return _Segment(
        partition=partition,
        spec=spec,
        start_step=result.first_step + len(result.step_ms),
        reason=reason,
        launch_ns=result.meta["end_ns"],
        resume_from=result.checkpoint,
    )


def _raise_if_nonfinite(result: RunResult) -> RunResult:
    """``result``, or the :class:`RunError` (``reason="nonfinite"``, carrying it) when training stopped at a
    non-finite loss."""
    if result.status != "nonfinite":
        return result
    info = result.meta["nonfinite"]
    standing = result.checkpoint or "none was saved"
    err = RunError(
        f"step {info['step']}: the loss on rank {info['rank']} (the last stage's) is {info['loss']}, not finite; "
        f"training stopped before that step's update (on_nonfinite='raise'). Last good checkpoint: {standing}. "
        "Use on_nonfinite='skip' to drop such steps, or lower the learning rate.",
        reason="nonfinite",
        rank=info["rank"],
        step=info["step"],
    )
    err.result = result
    raise err


def clean_stale_run_dirs() -> list[str]:
    """Remove the temporary run directories, and the folders of final shards, of callers that died (their
    ``owner.pid`` is gone); return them."""
    removed = []
    root = Path(tempfile.gettempdir())
    for path in [*root.glob(_RUN_DIR_PREFIX + "*"), *root.glob(KEPT_PREFIX + "*")]:
        try:
            owner = int((path / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@contextmanager
def _sigterm_to(preemption: Preemption) -> Iterator[None]:
    """While the run lasts, SIGTERM to this process is a preemption notice, not death (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: preemption.request())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rebalanced(profile: Any, current: Partition, bounds: list[list[int]], m: int) -> Partition:
    """The partition of ``profile`` at the new ``bounds``, with ``current``'s schedule, v, link, optimizer and cap."""
    from ..partitioning.stages import Partition

    return Partition.from_bounds(
        profile,
        [(int(a), int(b)) for a, b in bounds],
        v=current.v,
        schedule=current.schedule,
        link=current.link,
        m=m,
        optimizer=current.optimizer,
        mem_per_gpu_bytes=current.mem_per_gpu_bytes,
        method="rebalanced",
    )


def _last_switch_cost(results: list[RunResult]) -> float | None:
    """The measured cost of the last change of configuration: its save and teardown (the cleanup of the segment
    before), the next assembly and restore (None before any change)."""
    if len(results) < 2:
        return None
    before, after = results[-2], results[-1]
    return before.jct.cleanup_s + after.jct.assembly_s + after.restore_s
