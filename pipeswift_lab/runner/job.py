"""``run()``: a training job on real pipeline workers, from a notebook cell, surviving what a cluster does to it.

The job loop above :func:`~pipeswift_lab.runner.launcher.launch`: it checks every argument
(checkpoint options and the checkpoint to resume from included) before any process starts,
launches the workers (torch's elastic agent restarts them after a crash when
``max_restarts >= 1``; they resume from the newest complete checkpoint), turns SIGTERM to the
calling process into a clean stop-and-save, and reads back from the run directory what every
attempt did (steps, checkpoints, restores) to measure the JCT terms a cluster adds: cleanup
(the final save and teardown) and preemption loss (periodic save stalls, steps redone,
recovery and restore time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from ..core.checks import check_int, check_time
from . import checkpoint as ckpt
from .errors import RunError
from .faults import active_write_fault
from .launcher import Preemption, launch
from .rank.train_loop import CHECKPOINTS_LOG, STEPS_LOG
from .result import RunResult, build_result
from .spec import ON_NONFINITE, JobOptions, make_data_source, make_spec

_RUN_DIR_PREFIX = "pipeswift_run_"
_OWNER_FILE = "owner.pid"


def job_options(
    model,
    steps,
    checkpoint_dir=None,
    checkpoint_every=None,
    keep=2,
    resume_from=None,
    max_restarts=0,
    mtbf_s=None,
    preempt_grace_s=30,
    on_nonfinite="raise",
):
    """Check the job arguments of :func:`run`; return ``(JobOptions, resume Checkpoint or None, max_restarts)``.

    Everything that can be known before launch raises ``TypeError``/``ValueError`` (a
    :class:`~pipeswift_lab.runner.checkpoint.CheckpointError` for a checkpoint that cannot be
    used) here, and nothing in ``checkpoint_dir`` is written or removed by a failed call.
    """
    if checkpoint_dir is not None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(
                f"checkpoint_dir must be a path (str or os.PathLike) or None; got {type(checkpoint_dir).__name__}"
            )
        if Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
            raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} exists and is not a directory")
        checkpoint_dir = str(Path(checkpoint_dir).resolve())
    if checkpoint_every is not None:
        if checkpoint_every == "auto":
            if mtbf_s is None:
                raise ValueError(
                    "checkpoint_every='auto' takes the Young/Daly interval sqrt(2*save_s*mtbf_s) and needs mtbf_s "
                    "(the job's mean time between failures, in seconds)"
                )
        elif isinstance(checkpoint_every, str):
            raise ValueError(
                f"checkpoint_every={checkpoint_every!r} is not valid; use an int (every N steps), 'auto' or None"
            )
        else:
            checkpoint_every = check_int("checkpoint_every", checkpoint_every, minimum=1)
        if checkpoint_dir is None:
            raise ValueError(
                f"checkpoint_every={checkpoint_every!r} needs checkpoint_dir: where should the checkpoints go?"
            )
    keep = check_int("keep", keep, minimum=1)
    max_restarts = check_int("max_restarts", max_restarts, minimum=0)
    if max_restarts and checkpoint_dir is None:
        raise ValueError(
            f"max_restarts={max_restarts} restarts the workers from the newest checkpoint and needs checkpoint_dir"
        )
    if mtbf_s is not None:
        mtbf_s = check_time("mtbf_s", mtbf_s, allow_zero=False)
        if checkpoint_every != "auto":
            raise ValueError(
                f"mtbf_s={mtbf_s:g} is used only to choose the interval of checkpoint_every='auto'; "
                f"checkpoint_every is {checkpoint_every!r}"
            )
    preempt_grace_s = check_time("preempt_grace_s", preempt_grace_s, allow_zero=False)
    if preempt_grace_s > 1e6:
        raise ValueError(f"preempt_grace_s={preempt_grace_s:g} is invalid; it must be at most 1e6 seconds")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={on_nonfinite!r} is not valid; use one of {list(ON_NONFINITE)}")
    resume = None
    if resume_from is not None:
        resume = ckpt.load_checkpoint(resume_from)
        ckpt.check_same_model(resume, model)
        resume = ckpt.Checkpoint(resume.path.resolve(), resume.manifest)  # workers may run in another directory
        if steps <= resume.step:
            raise ValueError(
                f"steps={steps} is the job's total, but the checkpoint {str(resume.path)!r} is already at step "
                f"{resume.step}: give steps > {resume.step} to train on"
            )
    if checkpoint_dir is not None and resume is None and Path(checkpoint_dir).is_dir():
        earlier = ckpt.complete_checkpoints(checkpoint_dir)
        if earlier:
            raise ValueError(
                f"checkpoint_dir={checkpoint_dir!r} already holds checkpoints of an earlier run (newest "
                f"{earlier[0].name}): pass resume_from={checkpoint_dir!r} to continue that job, or use an empty directory"
            )
    options = JobOptions(
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        resume_from=str(resume.path) if resume else None,
        mtbf_s=mtbf_s,
        on_nonfinite=on_nonfinite,
        preempt_grace_s=preempt_grace_s,
        run_id=uuid.uuid4().hex,
        write_fault=active_write_fault(),
    )
    return options, resume, max_restarts


def _check_optimizer(spec, resume) -> None:
    saved = resume.manifest.get("optimizer")
    probe = spec.optimizer([p for p in spec.model.parameters()])
    own = type(probe).__module__ + "." + type(probe).__qualname__
    if saved and saved != own:
        raise ValueError(
            f"the checkpoint {str(resume.path)!r} holds the state of a {saved} optimizer, but optimizer makes a {own}; "
            "resume with the same optimizer class"
        )


def clean_stale_run_dirs() -> list[str]:
    """Remove the temporary run directories of callers that died (their ``owner.pid`` is gone); return them."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(_RUN_DIR_PREFIX + "*"):
        try:
            owner = int((path / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _sigterm_to(preemption: Preemption):
    """While the run lasts, SIGTERM to this process is a preemption notice, not death (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: preemption.request())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def read_history(run_dir: Path) -> dict:
    """What every attempt left in ``run_dir``: ``steps`` (attempt, step, start_ns, end_ns), ``checkpoints``, ``attempts``."""
    steps = []
    if (run_dir / STEPS_LOG).exists():
        for line in (run_dir / STEPS_LOG).read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                steps.append(tuple(int(x) for x in parts))
    checkpoints = []
    if (run_dir / CHECKPOINTS_LOG).exists():
        checkpoints = [
            json.loads(line) for line in (run_dir / CHECKPOINTS_LOG).read_text().splitlines() if line.strip()
        ]
    attempts = {}
    for path in run_dir.glob("attempt*.json"):
        info = json.loads(path.read_text())
        attempts[int(info["attempt"])] = info
    return {"steps": steps, "checkpoints": checkpoints, "attempts": attempts}


def run(
    model,
    data,
    loss_fn,
    partition,
    m,
    *,
    schedule=None,
    steps=10,
    optimizer=None,
    nprocs=None,
    backend=None,
    devices=None,
    timeout_s=300,
    progress=True,
    save_spec=None,
    instrument=True,
    seed=0,
    start_method="forkserver",
    checkpoint_dir=None,
    checkpoint_every=None,
    keep=2,
    resume_from=None,
    max_restarts=0,
    mtbf_s=None,
    preempt_grace_s=30,
    on_nonfinite="raise",
    resize_at=None,
    partitions=None,
    profile=None,
    rebalance_every=None,
    D=1,
) -> RunResult:
    """Train ``model`` for ``steps`` steps as a real pipeline on ``torch.distributed.pipelining`` and measure it.

    * ``model`` — an ``nn.Sequential`` (stage ``s`` is its children ``partition.bounds[s]``), or
      any model torch's tracer can split: the first layer name of each stage (a Partition
      from ``profile(model, x, layers=[...])``) becomes a split point of
      ``torch.distributed.pipelining.pipeline`` (see :mod:`~pipeswift_lab.runner.stages.traced`;
      tied weights across stages are refused).
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
      global batch. ``D`` must divide ``B``. Checkpoints hold the replicated state once (DCP
      deduplicates it) and resume on any ``D``; not yet with resizes or rebalancing, nor with
      the zero-bubble schedules.
    * ``nprocs`` — worker processes; one per rank, so ``None`` or ``P * D``.
    * ``backend``/``devices`` — ``None``: NCCL and one GPU per rank when there are GPUs, gloo and
      one CPU process per rank (``torch.set_num_threads`` = cores // P) otherwise; see
      :func:`~pipeswift_lab.runner.spec.resolve_devices`.
    * ``timeout_s`` — the call raises :class:`RunError` within this many seconds if a rank
      raises, dies or hangs, naming the rank and its traceback; no worker is left running.
    * ``save_spec`` — also write the run's spec there, for
      ``torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC``.
    * ``instrument`` — record every compute action (False: step times only, the overhead baseline).
    * ``seed`` — ``torch.manual_seed`` on every rank before the first step.
    * ``start_method`` — ``"forkserver"`` (warm workers) or ``"subprocess"`` (cold interpreters,
      as under torchrun); see :mod:`~pipeswift_lab.runner.launcher`.

    Surviving a shared cluster (see :mod:`~pipeswift_lab.runner.checkpoint` for the files):

    * ``checkpoint_dir`` — a checkpoint root; with it the job saves a final checkpoint (its
      cleanup) and a preemption saves too. ``checkpoint_every`` — an int (every N steps),
      ``"auto"`` (Young/Daly's √(2·C·MTBF) from the measured save time C and ``mtbf_s``) or
      ``None``. ``keep`` — newest complete checkpoints kept.
    * ``resume_from`` — a checkpoint root (its newest complete checkpoint) or one ``step-*``
      directory: training continues at its step, on this or another partition and P
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
    from .launcher import START_METHODS, check_main_guard
    from .segments import combine, plan_segments

    launch_ns = time.time_ns()
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not valid; use one of {list(START_METHODS)}")
    check_main_guard(start_method)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False; got {progress!r}")
    steps_checked = check_int("steps", steps, minimum=1)
    D = check_int("D", D, minimum=1)
    if D > 1:
        for name, value in (("resize_at", resize_at), ("partitions", partitions), ("rebalance_every", rebalance_every)):
            if value is not None:
                raise ValueError(f"D={D} replicas cannot be combined with {name}={value!r} yet; use D=1 for {name}")
    job, resume, max_restarts = job_options(
        model,
        steps_checked,
        checkpoint_dir,
        checkpoint_every,
        keep,
        resume_from,
        max_restarts,
        mtbf_s,
        preempt_grace_s,
        on_nonfinite,
    )
    data = make_data_source(
        data, steps_checked, check_int("seed", seed)
    )  # once: every segment's spec reads the same batches
    first_step = resume.step if resume is not None else 0
    planned = plan_segments(model, partition, steps_checked, first_step, resize_at, partitions, profile, m, schedule)
    rebalance = _rebalance_plan(rebalance_every, profile, partition, m, steps_checked, instrument)
    common = dict(
        steps=steps,
        optimizer=optimizer,
        nprocs=nprocs,
        backend=backend,
        devices=devices,
        timeout_s=timeout_s,
        instrument=instrument,
        seed=seed,
        D=D,
    )
    # every planned segment's spec, built and checked once before anything starts
    specs = {
        seg.start_step: make_spec(model, data, loss_fn, seg.partition, m, schedule=schedule, job=job, **common)
        for seg in planned
    }
    first_spec = specs[planned[0].start_step]
    if resume is not None:
        _check_optimizer(first_spec, resume)
    if save_spec is not None:
        first_spec.save(save_spec)
    deadline = time.monotonic() + first_spec.timeout_s
    clean_stale_run_dirs()
    preemption = Preemption(job.preempt_grace_s)
    changes = len(planned) > 1 or rebalance is not None
    results, reasons = [], []
    with tempfile.TemporaryDirectory(prefix=_RUN_DIR_PREFIX) as tmp:
        (Path(tmp) / _OWNER_FILE).write_text(
            str(os.getpid())
        )  # a later run() removes the directory if this process dies
        root = job.checkpoint_dir or str(Path(tmp) / "checkpoints")
        current, start, reason, seg_launch_ns = planned[0].partition, first_step, "start", launch_ns
        current_spec = first_spec
        resume_path = job.resume_from
        while True:
            end = next((seg.start_step for seg in planned if seg.start_step > start), steps_checked)
            is_last = end >= steps_checked
            seg_job = dataclasses.replace(
                job,
                checkpoint_dir=root if changes else job.checkpoint_dir,
                resume_from=resume_path,
                launch_ns=seg_launch_ns,
                final_kind=("final" if job.checkpoint_dir else None) if is_last else "resize",
                rebalance=dataclasses.replace(rebalance, cost_s=_last_switch_cost(results))
                if rebalance is not None
                else None,
            )
            if current_spec is not None:
                spec = dataclasses.replace(current_spec, job=seg_job, steps=end)
            else:  # a rebalanced partition: new stages, checked before launch
                spec = make_spec(
                    model, data, loss_fn, current, m, schedule=schedule, job=seg_job, **{**common, "steps": end}
                )
            run_dir = Path(tmp) / f"segment{len(results)}"
            run_dir.mkdir()
            (run_dir / _OWNER_FILE).write_text(str(os.getpid()))
            spec_path = spec.save(run_dir / "spec.pkl")
            desc = f"{spec.plan.schedule} P={spec.P} m={spec.m}" + (f" (segment {len(results)})" if changes else "")
            with _sigterm_to(preemption):
                gathered = launch(
                    spec_path,
                    run_dir,
                    spec.world_size,
                    deadline,
                    spec.timeout_s,
                    spec.steps,
                    progress,
                    desc,
                    start_method,
                    max_restarts=max_restarts,
                    preemption=preemption,
                )
            history = read_history(run_dir)
            seg_end_ns = time.time_ns()
            result = build_result(spec, gathered, seg_launch_ns, seg_end_ns, history=history)
            results.append(result)
            reasons.append(reason)
            if result.status == "rebalance":
                current, current_spec = _rebalanced(profile, current, result.meta["new_bounds"], m), None
                reason = "rebalance"
            elif result.status == "completed" and not is_last:
                current, current_spec = next(seg.partition for seg in planned if seg.start_step == end), specs[end]
                reason = "resize"
            else:
                break
            start = result.first_step + len(result.step_ms)
            resume_path = result.checkpoint
            seg_launch_ns = seg_end_ns
    result = combine(results, reasons)
    if result.status == "nonfinite":
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
    return result


def _rebalance_plan(rebalance_every, profile, partition, m, steps, instrument):
    """The :class:`~pipeswift_lab.runner.rebalance.RebalancePlan` of ``rebalance_every`` (None without), checked."""
    if rebalance_every is None:
        return None
    from .rebalance import RebalancePlan

    every = check_int("rebalance_every", rebalance_every, minimum=1)
    if profile is None:
        raise ValueError(
            "rebalance_every needs profile=... (the Profile the partition came from) to compare measured stage times with"
        )
    if not instrument:
        raise ValueError("rebalance_every needs the measured stage times: use instrument=True")
    table = profile.df if hasattr(profile, "df") else profile
    if not isinstance(table, pd.DataFrame):
        raise TypeError(
            f"profile must be a pipeswift_lab.Profile or a per-layer DataFrame; got {type(profile).__name__}"
        )
    if len(table) != partition.bounds[-1][1]:
        raise ValueError(
            f"profile has {len(table)} layers but the partition cuts {partition.bounds[-1][1]}; pass the profile it came from"
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


def _rebalanced(profile, current, bounds, m):
    from ..partitioning.balance import Partition

    return Partition.from_bounds(
        profile,
        [tuple(b) for b in bounds],
        v=current.v,
        schedule=current.schedule,
        link=current.link,
        m=m,
        optimizer=current.optimizer,
        mem_per_gpu_bytes=current.mem_per_gpu_bytes,
        method="rebalanced",
    )


def _last_switch_cost(results) -> float | None:
    """The measured cost of the last change of configuration: its save, teardown, the next assembly and restore (None before any)."""
    if len(results) < 2:
        return None
    before, after = results[-2], results[-1]
    return before.jct.cleanup_s + after.jct.assembly_s + after.restore_s  # cleanup: the switch's save and teardown
