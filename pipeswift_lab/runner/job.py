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

from .assembly import build_result, read_history
from .checkpoint import Checkpoint
from .errors import RunError
from .final_weights import KEPT_PREFIX
from .launcher import Preemption, check_main_guard, launch
from .options import CheckpointOptions, ElasticOptions, LaunchOptions, job_options
from .preflight import JobPlan, OptimizerFactory, plan_job
from .processes import alive
from .result import RunResult
from .segments import combine
from .spec import RunSpec, make_spec

if TYPE_CHECKING:
    from ..partitioning.stages import Partition

__all__ = ["run", "clean_stale_run_dirs", "read_history", "job_options"]

_RUN_DIR_PREFIX = "pipeswift_run_"
_OWNER_FILE = "owner.pid"


def run(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    partition: Partition,
    m: int,
    *,
    schedule: str | None = None,
    steps: int = 10,
    optimizer: OptimizerFactory | None = None,
    nprocs: int | None = None,
    backend: str | None = None,
    devices: Any = None,
    timeout_s: float = 300,
    progress: bool = True,
    save_spec: str | os.PathLike[str] | None = None,
    instrument: bool = True,
    profiler_trace: str | os.PathLike[str] | None = None,
    seed: int = 0,
    start_method: str = "forkserver",
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | str | None = None,
    keep: int = 2,
    resume_from: str | os.PathLike[str] | Checkpoint | None = None,
    max_restarts: int = 0,
    mtbf_s: float | None = None,
    checkpoint_async: bool = True,
    preempt_grace_s: float = 30,
    on_nonfinite: str = "raise",
    resize_at: dict[int, int] | None = None,
    partitions: dict[int, Partition] | None = None,
    profile: Any = None,
    rebalance_every: int | None = None,
    D: int = 1,
    split: str | None = None,
    recompute: str | dict[int, list[str]] | None = None,
    precision: str | None = None,
    weights: str | os.PathLike[str] | Any = None,
    init: Callable[[nn.Module], None] | None = None,
) -> RunResult:
    """Train ``model`` for ``steps`` steps as a real pipeline on ``torch.distributed.pipelining`` and measure it.

    * ``model`` — an ``nn.Sequential`` (stage ``s`` is its children ``partition.bounds[s]``), or
      any model torch's tracer can split, Hugging Face models as they are: the first layer name of
      each stage (a Partition from ``profile(model, x, layers=[...])`` or ``layers="auto"``)
      becomes a split point of ``torch.distributed.pipelining.pipeline`` (see
      :mod:`~pipeswift_lab.runner.stages.traced`; a KV cache is turned off for the trace and the
      run). The model's output reaches ``loss_fn`` as the model returns it (a ``ModelOutput``,
      dict, tuple or tensor). A parameter used by several stages (tied embeddings) is held by
      each and its gradients are summed between them every step, as Megatron-LM does
      (:mod:`~pipeswift_lab.runner.stages.tied`); ``RunResult.tied_weights`` lists them.
    * ``model`` may be built on the meta device (``with torch.device("meta"): ...``, for Hugging Face
      ``AutoModelForCausalLM.from_config(config)`` under it): no process ever holds more than its
      stages. The spec carries the model's structure, never its tensors; each rank makes only its
      stages' tensors on its device (``to_empty``) and fills them
      (:mod:`~pipeswift_lab.core.meta_device`). A model holding real tensors has them written
      once, as a safetensors file in the run directory, and each rank reads only its keys.
    * ``weights`` — the starting tensors: a Hugging Face safetensors checkpoint (a file, or a directory with
      ``model.safetensors`` or shards and ``model.safetensors.index.json``), a ``torch.distributed.checkpoint``
      directory or a pipeswift_lab checkpoint (:mod:`~pipeswift_lab.runner.weights`); each rank reads only its
      stages' tensors. Their names and shapes are checked against the model before launch.
    * ``init`` — with a meta model and no ``weights``: ``init(module)`` fills the tensors each submodule holds;
      ``None`` takes a Hugging Face model's ``_init_weights``, else each submodule's ``reset_parameters()``. The RNG
      is seeded by ``seed`` and the submodule's name, so the model starts the same for any P.
    * ``split`` — ``None`` (an ``nn.Sequential`` is cut between its children, any other model
      traced), ``"trace"``, or ``"manual"`` for a forward the tracer cannot capture: each stage
      is a copy of the model without the other stages' layers, run eagerly
      (:mod:`~pipeswift_lab.runner.stages.manual`).
    * ``recompute`` — which activations each stage recomputes in its backward instead of keeping:
      ``None`` (none), ``"full"`` (every layer keeps only its input), ``"selective"`` (every layer
      keeps its matrix multiplications' results and recomputes the rest) or ``{stage: [layer names or
      globs]}`` (full recomputation of those layers), with ``torch.utils.checkpoint``
      (non-reentrant) under every schedule; the trained parameters are the same bit for bit
      (:mod:`~pipeswift_lab.core.recompute`).
    * ``precision`` — ``None``/``"fp32"`` (the model's own dtype), ``"bf16-mixed"`` (every stage's forward and
      the loss under ``torch.autocast`` in bf16; weights, gradients and optimizer state fp32) or
      ``"bf16-mixed-zero1"`` (with the optimizer state sharded over the ``D`` replicas by torch's
      ``ZeroRedundancyOptimizer``; :mod:`~pipeswift_lab.runner.stages.precision`).
    * ``data`` — an ``(inputs, targets)`` batch used every step, a ``callable(step) -> (inputs,
      targets)`` (called with torch's RNG seeded to ``seed + step``, so ranks agree), or an
      iterable of batches (the first ``steps`` are taken). Only the rank holding the first
      stage reads inputs and only the one holding the last stage reads targets.
    * ``loss_fn(outputs, targets)`` — a mean over the micro-batch; torch scales gradients by
      ``1/m`` (``scale_grads=True``), so a step equals single-process training on the mean of
      the ``m`` micro-batch losses.
    * ``partition`` — a ``Partition`` (``bounds``, ``P``, ``v``, ``schedule``, ``stage_to_rank``).
    * ``m`` — micro-batches per step; it must divide the batch size.
    * ``schedule`` — a name from ``SCHEDULES``; ``None`` takes the partition's, or when it has
      none ``"1F1B"`` (``v == 1``) / ``"Interleaved1F1B"`` (``v > 1``).
    * ``steps`` — the job's total; a resumed job continues from the checkpoint's step to ``steps``.
    * ``optimizer`` — a factory ``lambda params: torch.optim.X(params, ...)`` called on every rank
      with its stages' parameters; ``None`` is SGD with ``lr=0.01`` (``spec.DEFAULT_LR``).
    * ``D`` — data-parallel replicas of the pipeline: ``P * D`` processes in a ``("dp", "pp")``
      mesh, each stage wrapped in DDP over its ``D`` copies (gradients are all-reduced at the
      last micro-batch's backward); replica ``d`` trains on rows ``d*B/D .. (d+1)*B/D - 1`` of
      each global batch ``B``, ``m`` micro-batches each, so a step equals one process on the
      global batch. ``D`` must divide ``B``. Checkpoints hold the replicated state once (replica
      0 writes it) and resume on any ``D``; not yet with resizes or rebalancing, nor with
      the zero-bubble schedules.
    * ``nprocs`` — worker processes; one per rank, so ``None`` or ``P * D``.
    * ``backend``/``devices`` — ``None``: NCCL and one GPU per rank when there are GPUs, gloo and
      one CPU process per rank (``torch.set_num_threads`` = cores // P) otherwise; see
      :func:`~pipeswift_lab.runner.devices.resolve_devices`.
    * ``timeout_s`` — the call raises :class:`RunError` within this many seconds if a rank
      raises, dies or hangs, naming the rank and its traceback; no worker is left running.
    * ``save_spec`` — also write the run's spec there, for
      ``torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC``.
    * ``instrument`` — record every compute action (False: step times only, the overhead baseline).
    * ``profiler_trace`` — a directory (made if missing; an existing file is a ``ValueError``): every rank records
      its steps with ``torch.profiler`` (CPU, and CUDA on a GPU) and writes
      ``rank{r}.{time_ns}.pt.trace.json`` there (``r`` the global rank) for Perfetto or
      ``Timeline.from_profiler(dir)``: a ``ProfilerStep#N`` span per step, ``N`` the run's step (a resumed run
      starts at its checkpoint's), around torch's spans (``PP:{stage}{kind}{mb}`` from the runtime schedules
      such as Interleaved1F1B, ``Forward i``/``Backward i`` from GPipe; torch's 1F1B marks none). Each attempt
      and segment (restart, resize, rebalance) writes its own file per rank; ``meta["profiler_trace"]`` names
      the directory. ``None``: no profiler (see :mod:`~pipeswift_lab.runner.rank.profiler_trace`).
    * ``seed`` — ``torch.manual_seed`` on every rank before the first step.
    * ``start_method`` — ``"forkserver"`` (warm workers) or ``"subprocess"`` (cold interpreters,
      as under torchrun); see :mod:`~pipeswift_lab.runner.launcher`.

    Surviving a shared cluster (see :mod:`~pipeswift_lab.runner.checkpoint` for the files):

    * ``checkpoint_dir`` — a checkpoint root; with it the job saves a final checkpoint (its
      cleanup) and a preemption saves too. ``checkpoint_every`` — an int (every N steps),
      ``"auto"`` (Young/Daly's √(2·C·MTBF) from the measured save stall C and ``mtbf_s``) or
      ``None``. ``keep`` — newest complete checkpoints kept. ``checkpoint_async`` (default) —
      a save stalls the step loop only for a copy of each rank's state (one staging buffer per
      rank, as large as its parameters and optimizer state); the file, fsync, checksums and the
      commit run in the background, one save at a time (a periodic save due while the last is
      still being written is skipped, and ``RunResult.checkpoints`` says so). Final, preemption
      and rebalance saves are never skipped and are committed before the workers exit.
      ``checkpoint_async=False`` waits for every write.
    * ``resume_from`` — a checkpoint root (its newest complete checkpoint), one ``step-*``
      directory or a ``Checkpoint`` (``latest_checkpoint(root)``): training continues at its step,
      on this or another partition and P
      (parameters and optimizer state are regrouped by name; RNG states are restored when
      the partition is the same).
    * ``max_restarts`` — after a worker dies or raises, torch's elastic agent restarts all
      workers up to this many times; they resume from the newest checkpoint in ``checkpoint_dir``.
    * SIGTERM to this process or to any worker is a preemption notice: every rank finishes its
      step, all save at that step, and the result has ``status="preempted"``. After
      ``preempt_grace_s`` without a clean save the workers are killed, the previous checkpoint
      stands and :class:`RunError` (``reason="preempted"``) is raised.
    * ``on_nonfinite`` — at a NaN/inf loss: ``"raise"`` (stop before the update; ``RunError``
      with ``reason="nonfinite"`` naming the step and rank; the last good checkpoint stands),
      ``"skip"`` (drop that step's update and count it in ``skipped_steps``) or ``"ignore"``.

    Changing the configuration within one job (:mod:`~pipeswift_lab.runner.segments`):

    * ``resize_at={step: P}`` (with ``profile``, the Profile the partition came from) or
      ``partitions={step: Partition}``: at each step every rank checkpoints, the workers stop,
      the model is re-partitioned for the new P (balanced, memory caps respected) and new
      workers restore and train on until ``steps``;
    * ``rebalance_every=N`` (with ``profile``): every N steps each stage's measured compute is
      compared with its profile; when the balanced partition of the rescaled profile is
      predicted to save more over the remaining steps than a reconfiguration costs (measured),
      the job moves its stage boundaries (same P). Every decision is a row of
      ``RunResult.rebalances``; every segment one of ``RunResult.segments``.

    Without ``checkpoint_dir`` the changes go through a temporary checkpoint root.

    Objects defined in a notebook cell or a test are serialized by value (cloudpickle). Workers
    exit when this process dies. Returns a :class:`RunResult`. Raises ``TypeError``/``ValueError``
    before any process starts for what can be checked in advance.
    """
    launch_ns = time.time_ns()
    options = LaunchOptions(
        nprocs=nprocs,
        backend=backend,
        devices=devices,
        timeout_s=timeout_s,
        progress=progress,
        save_spec=save_spec,
        instrument=instrument,
        profiler_trace=profiler_trace,
        seed=seed,
        start_method=start_method,
    )
    check_main_guard(options.start_method)
    checkpoints = CheckpointOptions(
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        resume_from=resume_from,
        mtbf_s=mtbf_s,
        checkpoint_async=checkpoint_async,
    )
    elastic = ElasticOptions(
        max_restarts=max_restarts,
        preempt_grace_s=preempt_grace_s,
        on_nonfinite=on_nonfinite,
        resize_at=resize_at,
        partitions=partitions,
        profile=profile,
        rebalance_every=rebalance_every,
    )
    job = plan_job(
        model,
        data,
        loss_fn,
        partition,
        m,
        schedule=schedule,
        steps=steps,
        optimizer=optimizer,
        D=D,
        split=split,
        recompute=recompute,
        precision=precision,
        weights=weights,
        init=init,
        launch=options,
        checkpoints=checkpoints,
        elastic=elastic,
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
            plan.launch.progress,
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
