"""Data that waits for the periodic checkpoints a test aims at, so that no aimed save is skipped for being due while
the one before it is still written.

A periodic save that falls due while the last one is still being written is skipped
(:meth:`~pipeswift_lab.runner.rank.checkpointer.Checkpointer.holding`), and the writer thread runs at nice 19: on a
busy machine it starves, and a save a test aimed a crash, a write fault or an exact list of saved steps at was
skipped (the tests paced their steps by 50 ms and hoped the write would end first). ``AwaitSaves(data, root, every)``
makes it deterministic: it hands out the batch of step ``s`` only once the newest periodic save due by then,
``N = (s // every) * every`` (taken after steps ``0..N-1``, before step ``N`` runs), is settled:

* this process's writer thread for it (``checkpoint-writer-N``) has ended, so this rank is not busy, and a write that
  failed on this rank is raised at the step loop's next check (step ``N + 1``);
* it is committed on disk: ``ROOT/step-0000000N`` (or a newer checkpoint) exists. A save is written into a hidden
  ``ROOT/.tmp-step-...`` that rank 0 renames to the final name once every rank's file and the manifest are on disk,
  so the final name's existence is the commit.

So the save before each due save has ended on every rank that reads data before the step that makes the next one
due begins, and the next one is never skipped for a write in flight; a rank killed at step ``s`` finds every save due
before ``s`` committed. Every caller waits (with ``P = 2`` both ranks read data); the run's caller, which reads step
0 before launch, never does. A save aimed at by a :func:`~pipeswift_lab.runner.write_fault` in force when the wrapper
is made is not waited for on disk (it never commits): the faulty rank and ranks other than 0 wait for their own
writer only (rank 0's waits for the faulty rank's part).

The other reason a save is skipped is not a write in flight, and no data can prevent it: in the background mode a
save due when the steps left (rank 0's median step, data not counted) take less time than a background write (rank
0's median, slow when its nice-19 thread starves) is skipped too. A test aiming at a save leaves many steps after it
where it can (a run that fails at its aimed save ends there anyway); the first save of an attempt is never skipped.

A save that was skipped anyway (neither committed nor being written) is not waited for: the test's own checks name
the save that is missing, and a run in which it is not aimed at goes on. One that is not settled after ``timeout_s``
(stalled) raises ``TimeoutError`` naming it, which the run reports as ``data(s) raised ...``. The wrapper is a
module-level class with plain state (the root as ``str``), so it is cloudpickled into the workers.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from pipeswift_lab.runner.faults import active_write_fault

__all__ = ["AwaitSaves", "committed_steps"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")  # a committed checkpoint (pipeswift_lab.runner.checkpoint.step_dir_name)
_POLL_S = 0.01


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the committed checkpoints (``step-*`` directories) under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _STEP_DIR.match(name)))


class AwaitSaves:
    """``data(step)``, handed out in a worker only once the newest periodic save due by then is settled (see the
    module's docstring). ``root``: the run's ``checkpoint_dir``; ``every``: its ``checkpoint_every``; made inside a
    ``write_fault`` block, the faulty save is not waited for on disk."""

    def __init__(self, data: Any, root: str | os.PathLike[str], every: int, timeout_s: float = 60.0) -> None:
        if not callable(data):
            raise TypeError(f"data must be a callable(step); got {type(data).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be checkpoint_every, an int >= 1; got {every!r}")
        self.data, self.root, self.every, self.timeout_s = data, str(root), every, float(timeout_s)
        fault = active_write_fault()
        self.fault = dict(fault) if fault else None

    def __call__(self, step: int) -> Any:
        due = (step // self.every) * self.every
        if due >= 1 and "RANK" in os.environ:  # a worker (the caller reads step 0 before launch)
            self.settle(due, step)
        return self.data(step)

    def settle(self, due: int, step: int) -> None:
        """Wait until the save of ``due`` steps is settled in this process and committed on disk (see the module)."""
        deadline = time.monotonic() + self.timeout_s
        rank = int(os.environ["RANK"])
        faulty = self.fault is not None and self.fault["step"] == due
        if not (faulty and rank == 0 and self.fault["rank"] != 0):  # rank 0's writer waits for every rank's part
            for thread in threading.enumerate():
                if thread.name == f"checkpoint-writer-{due}":
                    thread.join(max(0.0, deadline - time.monotonic()))
                    if thread.is_alive():
                        self._timeout(due, step, f"rank {rank}'s writer thread is still writing it")
        if faulty:
            return  # it never commits; the faulty rank raises its error at the step loop's next check
        while not self._committed(due):
            if not self._begun(due, rank) and not self._committed(due):
                return  # skipped (see the module): nothing will commit; the test's own checks name the missing save
            if time.monotonic() > deadline:
                self._timeout(due, step, "it is not committed on disk")
            time.sleep(_POLL_S)

    def _committed(self, due: int) -> bool:
        return any(s >= due for s in committed_steps(self.root))

    def _begun(self, due: int, rank: int) -> bool:
        """Whether the save of ``due`` steps may still commit (``False``: skipped, or failed). Its writer threads start
        on every rank before this batch is asked for, or on none (the ranks agree on a skip). Rank 0 commits in its
        own thread: once that has ended uncommitted, the save never commits. Another rank's thread ends when its part
        is in the save's hidden directory, which rank 0 renames at the commit: neither a thread nor that directory,
        and no commit, and the save was skipped."""
        if any(t.name == f"checkpoint-writer-{due}" for t in threading.enumerate()):
            return True
        if rank == 0:
            return False
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return False
        return any(name.startswith(f".tmp-step-{due:08d}-") for name in names)

    def _timeout(self, due: int, step: int, why: str) -> None:
        raise TimeoutError(
            f"AwaitSaves: the checkpoint of step {due} under {self.root!r} is not settled after {self.timeout_s:g} s: "
            f"{why}; data({step}) was held back for it so that the next save is not skipped"
        )
