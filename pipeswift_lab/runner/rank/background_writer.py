"""One rank's checkpoint writes, in a background thread: the file, its fsync and checksum, and on rank 0 the commit.

The step loop hands over a staged copy of the state (:class:`SaveJob`) and goes on training. The writer puts the
rank's file into the save's hidden directory and then, on ranks other than 0, a small record of it
(``rank-NNNNN.json``: size, SHA-256, where each key lies), written atomically. Rank 0 writes its own file, waits
for every other rank's record, and commits (:func:`~pipeswift_lab.runner.checkpoint.commit`: ``.metadata``,
manifest last, rename). The ranks agree through the files alone: no collective runs in the background, so the
training's process groups are never used by two threads.

A writer that fails (a full or read-only disk) keeps the error; the step loop raises it at its next check
(:meth:`RankWriter.raise_if_failed`), naming the checkpoint and the path. It also leaves ``rank-NNNNN.failed``
so that rank 0 stops waiting for it. Nothing is committed, and the previous checkpoint stands.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint_files import StagedState, rank_file_name, write_rank_file

__all__ = ["CheckpointWriteError", "RankWriter", "SaveJob"]

#: Rank 0's first and longest pause between looks for the other ranks' records (it doubles in between): rare
#: looks, so that the writer thread seldom takes the interpreter from the training loop.
_POLL_S, _MAX_POLL_S = 0.002, 0.05
#: The writer thread's nice value: the lowest priority.
WRITER_NICE = 19


class CheckpointWriteError(RuntimeError):
    """A rank could not write its part of a checkpoint; the message names the checkpoint's step and the path."""


@dataclass(kw_only=True)
class SaveJob:
    """One save handed to the writer: what was staged, where it goes, and what the log line needs."""

    step: int
    """Training steps done when the state was staged."""
    kind: str
    """``"periodic"``, ``"auto"``, ``"final"``, ``"preempt"``, ``"rebalance"`` or ``"resize"``."""
    tmp_dir: Path
    """The save's hidden directory (the same name on every rank)."""
    staged: StagedState
    """The staged copy of the rank's state."""
    started_ns: int
    """Wall clock when the step loop began the save."""
    staging_ms: float
    """How long staging stalled the step loop."""
    waited: bool
    """Whether the step loop waits for the write (a final, preemption or rebalance save, or synchronous mode)."""
    interval_steps: int | None = None
    """The ``"auto"`` interval in force when the save began."""


def _record_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _failed_name(rank: int) -> str:
    return f"rank-{rank:05d}.failed"


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (Linux: a thread is a task with its own nice value), so that the
    write takes the cores the step loop leaves idle (pipeline bubbles, waits for peers) rather than slowing steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the write competes as it is
        pass


class RankWriter:
    """Writes one rank's staged checkpoints in a background thread, one at a time; on rank 0 it also commits.

    ``commit(job, records)`` (rank 0 only) is called with every rank's record, in rank order, once all are on disk.
    ``fault`` is a :func:`~pipeswift_lab.runner.faults.write_fault` carried by the run, ``pace_s`` a
    :func:`~pipeswift_lab.runner.faults.slow_disk`'s seconds per file.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        where: dict[str, int],
        commit: Callable[[SaveJob, list[dict[str, Any]]], None] | None,
        fault: dict[str, Any] | None = None,
        pace_s: float = 0.0,
    ) -> None:
        self.rank, self.world, self.where = rank, world, where
        self._commit, self._fault, self._pace_s = commit, fault, pace_s
        self._thread: threading.Thread | None = None
        self._failure: tuple[SaveJob, BaseException] | None = None
        self.write_s: list[float] = []
        """Seconds each write of this rank took (file, fsync, checksum)."""

    def busy(self) -> bool:
        """Whether a save handed over is still being written (on rank 0: not yet committed)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: SaveJob, yield_cores: bool = True) -> None:
        """Start writing ``job`` in the background (after the previous write has ended); ``yield_cores`` at the
        lowest priority, so that training goes first."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job, yield_cores), name=f"checkpoint-writer-{job.step}")
        self._thread.daemon = True
        self._thread.start()

    def write_now(self, job: SaveJob) -> None:
        """Write ``job`` in this thread, at its priority, after the write in flight (a save the step loop waits for
        gains nothing from a background thread); raise if it failed."""
        self.wait()
        self._run(job, yield_cores=False)
        self.raise_if_failed()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckpointWriteError` when a write of this rank failed."""
        if self._failure is not None:
            job, exc = self._failure
            raise CheckpointWriteError(
                f"rank {self.rank} could not write its part of the checkpoint of step {job.step} into "
                f"{str(job.tmp_dir)!r}: {type(exc).__name__}: {exc}. Nothing was committed; the previous checkpoint "
                "stands"
            ) from exc

    def _run(self, job: SaveJob, yield_cores: bool = True) -> None:
        from ..faults import raise_write_fault

        if yield_cores:
            _yield_to_training()
        try:
            raise_write_fault(self._fault, job.step, self.rank, job.tmp_dir)
            job.tmp_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            name = rank_file_name(self.rank)
            record = write_rank_file(job.tmp_dir / name, job.staged, self._pace_s)
            write_s = time.perf_counter() - t0
            self.write_s.append(write_s)
            record.update(
                self.where,
                rank=self.rank,
                file=name,
                write_ms=write_s * 1e3,
                staging_ms=job.staging_ms,
                state_bytes=job.staged.state_bytes,
            )
            if self._commit is None:
                _write_atomic(job.tmp_dir / _record_name(self.rank), json.dumps(record))
                return
            others = self._others(job.tmp_dir)
            if others is not None:  # else a rank failed: it reports the error, and nothing is committed
                self._commit(job, [record] + others)
        except BaseException as exc:  # kept, and raised in the step loop
            self._failure = (job, exc)
            try:
                (job.tmp_dir / _failed_name(self.rank)).write_text(f"{type(exc).__name__}: {exc}")
            except OSError:
                pass

    def _others(self, tmp_dir: Path) -> list[dict[str, Any]] | None:
        """Rank 0: every other rank's record, once each is on disk (they are removed before the commit lists the
        directory); ``None`` when a rank failed to write its part."""
        records = []
        pause = _POLL_S
        for rank in range(1, self.world):
            path, failed = tmp_dir / _record_name(rank), tmp_dir / _failed_name(rank)
            while not path.exists():
                if failed.exists():
                    return None
                time.sleep(pause)
                pause = min(2 * pause, _MAX_POLL_S)
            records.append(json.loads(path.read_text()))
            path.unlink()
        return records
