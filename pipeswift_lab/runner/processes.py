"""The worker processes of a run, seen from the process that launched them: find them, signal them, wait them out.

Workers announce themselves with a ``rank{r}.pid`` file in the run directory; ``"subprocess"`` workers also name
the run directory on their command line, and forked workers that have not written their pid file yet are
children of this session's fork server. Everything here reads ``/proc`` (Linux) and tolerates a process ending
between two reads.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["alive", "zombie", "pid_files", "worker_pids", "stop_workers", "wait_gone", "forkserver_pid"]


def alive(pid: int, *, any_user: bool = True) -> bool:
    """Whether a process with this pid exists (a zombie included; see :func:`zombie`).

    ``os.kill(pid, 0)`` sends nothing: it raises ``ProcessLookupError`` when there is no such process and
    ``PermissionError`` when there is one that belongs to another user, which is alive all the same. With
    ``any_user=False`` such a process counts as gone: the pid was one of ours (a worker's caller), and another
    user's process now has it.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, but is another user's
        return any_user
    return True


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (state ``Z`` in ``/proc/PID/stat``; False where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def pid_files(run_dir: Path) -> set[int]:
    """Pids the workers wrote into ``run_dir`` (``rank*.pid``; no liveness check)."""
    pids = set()
    for path in Path(run_dir).glob("rank*.pid"):
        try:
            pids.add(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def _children(parent: int) -> Iterator[tuple[int, bytes]]:
    """``(pid, cmdline)`` of the live (not zombie) children of ``parent``, from ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read()
        except (OSError, IndexError, ValueError):
            continue


def forkserver_pid() -> int | None:
    """The pid of this session's multiprocessing fork server (None before it was started)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # multiprocessing's private state


def worker_pids(run_dir: Path, P: int | None = None) -> list[int]:
    """Live worker processes of the run in ``run_dir``.

    Those that wrote ``rank{r}.pid``, the children of this process whose command line names
    ``run_dir`` (``"subprocess"`` workers), and, when some of the ``P`` ranks wrote no pid file
    yet, the children of this session's fork server (forked workers still starting).
    """
    pids = {pid for pid in pid_files(run_dir) if alive(pid) and not zombie(pid)}
    marker = str(run_dir).encode()
    pids.update(pid for pid, cmdline in _children(os.getpid()) if marker in cmdline)
    server = forkserver_pid()
    if P is not None and server and len(list(Path(run_dir).glob("rank*.pid"))) < P:
        pids.update(pid for pid, _ in _children(server))
    return sorted(pids)


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def stop_workers(run_dir: Path, P: int | None, dump_stacks: bool) -> list[int]:
    """Ask live workers for their stacks (``SIGUSR1``) if ``dump_stacks``, then SIGKILL them; return their pids."""
    pids = worker_pids(run_dir, P)
    if dump_stacks and pids:
        _signal_all(pids, signal.SIGUSR1)
        time.sleep(0.5)
    _signal_all(pids, signal.SIGKILL)
    return pids


def wait_gone(pids: Iterable[int], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every one of ``pids`` to be gone (ended or a zombie)."""
    pids = list(pids)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not [p for p in pids if alive(p) and not zombie(p)]:
            return
        time.sleep(0.05)
