"""Real pipeline runs on ``torch.distributed.pipelining``, from a notebook cell or ``torchrun``.

* :func:`run` — launch a partitioned model on one process per rank and measure it;
* :class:`RunResult` — the measured timeline, step times, losses, JCT and final parameters; ``result.save(path)``
  keeps it and :func:`load_result` reads it back (:mod:`.result_files`; :class:`ResultFileError` when it cannot);
* :class:`RunSpec`, :func:`load_spec`, :func:`load_result` — the same run under ``torchrun``;
* :func:`available_cores` — the CPU cores this process may use (what CPU runs share out among their ranks);
* :class:`RunError` — why a run failed, naming the rank;
* :func:`load_checkpoint`, :func:`latest_checkpoint`, :class:`Checkpoint` — the run's DCP checkpoints;
* :func:`run_arguments` — a planned configuration (``plan.config(row)``, ``D > 1`` included) as ``run()`` arguments;
* :func:`signal_at` — rehearse a preemption or a crash: a real signal to a worker at a chosen step;
  :func:`write_fault` — a checkpoint writer failing as a full or read-only disk does;
  :func:`slow_disk` — checkpoint writes as slow as a busy shared file system's.

Reads a model and a Partition, returns a :class:`RunResult`::

    result = run(model, (x, y), loss_fn, partition, m=4, steps=20)
    result.steady_step_ms, result.jct, result.timeline

Modules: :mod:`.job` (``run``: options -> preflight -> segments -> result), :mod:`.options` (the run's
keyword-only option records), :mod:`.preflight` (the job checked before launch), :mod:`.spec` (the run as data),
:mod:`.sources` (where each step's batch comes from), :mod:`.devices`, :mod:`.segments`, :mod:`.rebalance`,
:mod:`.launcher` (one segment's workers), :mod:`.processes` (finding and stopping them), :mod:`.loopback`,
:mod:`.assembly` (the run directory -> ``RunResult``), :mod:`.result`, :mod:`.result_files` (a result saved and
loaded), :mod:`.errors`, :mod:`.faults`, :mod:`.checkpoint`, :mod:`.planned`; :mod:`.stages` (how a model is cut),
:mod:`.rank` (what one process runs).
"""

from __future__ import annotations

from ..core.tp_plan import TP
from .checkpoint import Checkpoint, CheckpointError, latest_checkpoint, load_checkpoint
from .devices import available_cores
from .errors import RunError
from .faults import signal_at, slow_disk, write_fault
from .job import run
from .options import FSDP, Checkpointing, Elastic, Faults, Launch
from .planned import global_batch_of, run_arguments
from .result import RunResult
from .result_files import ResultFileError, load_result
from .spec import DEFAULT_LR, RunSpec, default_optimizer, load_spec, make_spec

__all__ = [
    "Checkpointing",
    "Elastic",
    "FSDP",
    "TP",
    "Faults",
    "Launch",
    "available_cores",
    "Checkpoint",
    "CheckpointError",
    "DEFAULT_LR",
    "default_optimizer",
    "global_batch_of",
    "latest_checkpoint",
    "load_checkpoint",
    "load_result",
    "load_spec",
    "make_spec",
    "ResultFileError",
    "run",
    "run_arguments",
    "RunError",
    "RunResult",
    "RunSpec",
    "signal_at",
    "slow_disk",
    "write_fault",
]
