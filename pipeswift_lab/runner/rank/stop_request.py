"""A rank's stop request: SIGTERM (a cluster's preemption notice) or the launcher's ``preempt`` file.

The step loop asks :meth:`StopRequest.requested` once per step and, when any rank was asked, every rank finishes
the step, waits for the checkpoint in flight, saves at that step and exits (:mod:`.train_loop`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType

from ..run_files import PREEMPT_FILE, rank_file

__all__ = ["StopRequest"]


class StopRequest:
    """Set by SIGTERM (a preemption notice) or by the launcher's ``preempt`` file in the run directory.

    A SIGTERM also starts ``grace_s``: a rank that has not exited by then kills itself, and the
    previous checkpoint stands (a save never half-commits).
    """

    def __init__(self, out_dir: Path, rank: int, grace_s: float) -> None:
        self.flag = False
        self.grace_s = grace_s
        self._file = out_dir / PREEMPT_FILE
        self._marker = out_dir / rank_file(rank, "sigterm")

    def install(self) -> None:
        """Take SIGTERM: note it (in ``rank{r}.sigterm`` too) instead of dying mid-step."""
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: leave SIGTERM as it is
            pass

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.flag:
            import threading

            timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        self.flag = True
        try:
            self._marker.write_text(str(time.time_ns()))
        except OSError:
            pass

    def requested(self) -> bool:
        """Whether this rank has been asked to stop."""
        return self.flag or self._file.exists()
