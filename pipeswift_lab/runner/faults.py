"""Rehearse what a cluster does to a job: real signals sent to real workers at a chosen step, a full disk.

``run(model, signal_at(data, step=7, rank=1, sig="SIGKILL"), ...)`` behaves like ``data`` except
that the worker holding ``rank`` sends itself ``sig`` when it fetches the batch of ``step``, in
the first attempt only (a restarted attempt is not hit again). SIGTERM is a preemption notice;
SIGKILL is the OOM killer or a lost node. Only the ranks that read data (the first and the last
stage's) can be hit.

``with write_fault(step=4, rank=1, error="ENOSPC"): run(..., checkpoint=...)`` makes that
rank's checkpoint writer fail as a full (``ENOSPC``) or read-only (``EROFS``, ``EACCES``) disk
does, when it saves the checkpoint of ``step`` steps done. Permissions cannot stage this where
tests run as root, so the fault is injected in the writer: the run's spec carries it to the
workers (``JobOptions.write_fault``) and the writer raises the ``OSError`` before it writes a byte.

``with slow_disk(seconds=0.5): run(..., checkpoint=...)`` spreads every rank file's write
over ``seconds`` (in pieces, with pauses between), as a slow or busy shared file system does:
saves then outlast steps, so a background write is in flight long enough to be preempted,
killed or skipped over.
"""

from __future__ import annotations

import errno as _errno
import os
import signal as _signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import check_choice, check_int


@dataclass(frozen=True)
class SignalAt:
    """A data source that signals one worker at one step (see :func:`signal_at`)."""

    data: Any
    step: int
    rank: int
    sig: int

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            step == self.step
            and os.environ.get("RANK") == str(self.rank)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ):
            os.kill(os.getpid(), self.sig)
        if callable(self.data):
            return self.data(step)
        if len(self.data) == 2 and all(isinstance(t, torch.Tensor) for t in self.data):
            return tuple(self.data)
        return self.data[step]


def signal_at(data: Any, step: int, rank: int = 0, sig: str | int = "SIGTERM") -> SignalAt:
    """``data`` (a batch, a ``callable(step)`` or a list of batches) whose worker ``rank`` gets ``sig`` at ``step``.

    ``sig`` is a name (``"SIGTERM"``, ``"SIGKILL"``) or a ``signal.Signals``. Returns a callable
    data source for :func:`~pipeswift_lab.runner.run`. ``rank`` must hold the first or the last
    stage, the ranks that read data.
    """
    step = check_int("step", step, minimum=0)
    rank = check_int("rank", rank, minimum=0)
    if isinstance(sig, str):
        sig = _signal.Signals[check_choice("sig", sig, _signal.Signals.__members__)]
    if not isinstance(sig, int):
        raise TypeError(f"sig must be a signal name or signal.Signals; got {type(sig).__name__}")
    if not (callable(data) or isinstance(data, (tuple, list))):
        raise TypeError(
            f"data must be an (inputs, targets) batch, a callable(step) or a list of batches; got {type(data).__name__}"
        )
    return SignalAt(data, step, rank, int(sig))


_WRITE_FAULT: dict[str, Any] | None = None
#: The errors :func:`write_fault` can stage: a full disk, a read-only one, no permission.
WRITE_ERRORS = ("ENOSPC", "EROFS", "EACCES")


@contextmanager
def write_fault(step: int, rank: int = 0, error: str = "ENOSPC") -> Iterator[None]:
    """Within the block, runs' checkpoint writer on ``rank`` fails with ``error`` when saving after ``step`` steps."""
    global _WRITE_FAULT
    step = check_int("step", step, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    check_choice("error", error, WRITE_ERRORS)
    before, _WRITE_FAULT = _WRITE_FAULT, {"step": step, "rank": rank, "error": error}
    try:
        yield
    finally:
        _WRITE_FAULT = before


_SLOW_DISK_S = 0.0


@contextmanager
def slow_disk(seconds: float) -> Iterator[None]:
    """Within the block, runs' checkpoint writers take at least ``seconds`` per rank file (written in pieces)."""
    global _SLOW_DISK_S
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 60:
        raise ValueError(f"seconds must be a number in (0, 60]; got {seconds!r}")
    before, _SLOW_DISK_S = _SLOW_DISK_S, float(seconds)
    try:
        yield
    finally:
        _SLOW_DISK_S = before


def active_slow_disk_s() -> float:
    """The :func:`slow_disk` seconds in force in this process (0 outside one)."""
    return _SLOW_DISK_S


def active_write_fault() -> dict[str, Any] | None:
    """The :func:`write_fault` in force in this process (``None`` outside one); a run's spec carries it to the
    workers."""
    return _WRITE_FAULT


def raise_write_fault(fault: dict[str, Any] | None, step: int | None, rank: int, path: str | os.PathLike[str]) -> None:
    """Raise the ``OSError`` that ``fault`` asks for at this ``step`` and ``rank`` (nothing otherwise)."""
    if fault and fault["step"] == step and fault["rank"] == rank:
        code = getattr(_errno, fault["error"])
        raise OSError(code, f"{os.strerror(code)} (injected by pipeswift_lab.runner.faults.write_fault)", str(path))


__all__ = [
    "active_slow_disk_s",
    "active_write_fault",
    "raise_write_fault",
    "signal_at",
    "SignalAt",
    "slow_disk",
    "WRITE_ERRORS",
    "write_fault",
]
