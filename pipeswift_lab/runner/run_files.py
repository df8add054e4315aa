"""The run directory's protocol: the files the ranks write there, the columns of their tables, the kinds they record.

The ranks (:mod:`.rank`) write these files and the caller (:mod:`.launcher`, :mod:`.assembly`,
:mod:`.result_files`) reads them back. Both sides import the names from here, and this module imports nothing of
the runner, so neither side imports the other for a file name::

    DIR/spec.pkl           the run's spec (written by the caller, or copied there under torchrun)
    DIR/rank{r}.pid        rank r started (its pid); also rank{r}.done, .error, .stacks, .sigterm (rank_file)
    DIR/attempt{n}.json    rank 0: where attempt n resumed from, and when it was ready (attempt_file)
    DIR/steps.log          the last rank: one ``attempt step start_ns end_ns`` line per step
    DIR/checkpoints.log    rank 0: one JSON line per checkpoint committed or skipped (CHECKPOINT_COLUMNS)
    DIR/progress           steps done, from the rank holding the last stage, when asked
    DIR/preempt            the caller asks every rank to save and stop
    DIR/result.pt          rank 0: what every rank measured (RESULT_FORMAT), its actions coded by KINDS
"""

from __future__ import annotations

from ..core.vocabulary import COMPUTE_KINDS, REDUCE_KINDS, SHARD_KINDS, TP_KINDS

__all__ = [
    "ATTEMPT_GLOB",
    "CHECKPOINTS_LOG",
    "CHECKPOINT_COLUMNS",
    "KINDS",
    "PREEMPT_FILE",
    "PROGRESS_FILE",
    "RESULT_FILE",
    "RESULT_FORMAT",
    "SPEC_FILE",
    "STEPS_LOG",
    "TIMELINE_COLUMNS",
    "attempt_file",
    "rank_file",
]

#: The copy of the run's spec.
SPEC_FILE = "spec.pkl"
#: Rank 0's gathered measurements of every rank (``torch.save`` of a dict; its ``format`` is :data:`RESULT_FORMAT`).
RESULT_FILE = "result.pt"
#: The ``format`` value of :data:`RESULT_FILE`.
RESULT_FORMAT = "pipeswift_lab.run"
#: The last rank's log: one ``attempt step start_ns end_ns`` line per step, across attempts.
STEPS_LOG = "steps.log"
#: Rank 0's log of checkpoints: one JSON line per checkpoint committed or skipped.
CHECKPOINTS_LOG = "checkpoints.log"
#: Steps done, written by the rank holding the last stage when the caller shows progress.
PROGRESS_FILE = "progress"
#: Made by the caller to ask every rank to finish the step, save and stop.
PREEMPT_FILE = "preempt"
#: Every attempt's ``attempt{n}.json``.
ATTEMPT_GLOB = "attempt*.json"

#: Columns of ``RunResult.checkpoints`` and of each ``checkpoints.log`` record: one row per checkpoint committed or
#: skipped (``status``).
CHECKPOINT_COLUMNS = (
    "step",
    "path",
    "bytes",
    "largest_rank_bytes",
    "largest_rank_state_bytes",
    "save_ms",
    "blocking_ms",
    "staging_ms",
    "write_ms",
    "kind",
    "status",
    "mode",
    "attempt",
    "interval_steps",
)
#: Timeline columns, in the simulator's order.
TIMELINE_COLUMNS = ("step", "rank", "stage", "microbatch", "kind", "start_ms", "end_ms")
#: Action kinds recorded, by code (the row's kind column): the compute kinds, the gradient reduction, FSDP's
#: all-gather, then tensor parallelism's collectives (new kinds go last: a code never changes meaning).
KINDS = COMPUTE_KINDS + REDUCE_KINDS + SHARD_KINDS + TP_KINDS


def rank_file(rank: int, marker: str) -> str:
    """The name of rank ``rank``'s ``marker`` file: ``rank{r}.pid`` (started), ``.done`` (finished: the threads left
    after teardown), ``.error`` (its traceback), ``.stacks`` (every thread's stack on ``SIGUSR1``) or ``.sigterm``
    (it was sent SIGTERM). Returns the file name."""
    return f"rank{rank}.{marker}"


def attempt_file(attempt: int) -> str:
    """The name of the file rank 0 writes when attempt ``attempt`` is ready: ``attempt{n}.json``."""
    return f"attempt{attempt}.json"
