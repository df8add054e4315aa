"""Launch one segment of a run: start the worker processes and watch them until they end.

The launch uses torch's elastic API (``LaunchConfig`` + ``elastic_launch``) with a standalone
c10d rendezvous whose stores listen on ``127.0.0.1`` only (port chosen by the OS), so nothing of a
local run accepts connections from another machine (:mod:`~pipeswift_lab.runner.loopback`).
The agent runs in a background thread while the calling thread shows progress and enforces
``timeout_s``. Two ways to start the worker processes (``start_method``):

* ``"forkserver"`` (default): workers are forked from multiprocessing's fork server, started
  once per Python session with torch and ``torch.distributed.pipelining`` preloaded, so
  after the first run a launch costs well under a second instead of one interpreter start and
  torch import per rank. Workers run :func:`pipeswift_lab.runner.rank.worker.entry`. The fork
  server stays up with the session (like multiprocessing's resource tracker); it is not a
  worker and holds no run state. It preloads third-party modules only, so code edits to
  pipeswift_lab reach the next run; an upgrade of torch itself needs a new session. Its children re-import a script's ``__main__`` module, as
  with ``spawn``: guard scripts with ``if __name__ == "__main__":`` (notebooks need nothing).
* ``"subprocess"``: every rank is a fresh ``python -m pipeswift_lab.runner SPEC --out DIR``,
  the very command ``torchrun`` runs on a cluster, so ``jct.assembly_s`` includes a cold
  interpreter start and torch import on every rank, as a real job launch does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from .errors import RunError, diagnose, failed_step
from .loopback import LOOPBACK, loopback_rendezvous, loopback_store
from .rank.train_loop import PREEMPT_FILE, PROGRESS_FILE
from .rank.worker import DISTRIBUTED_MODULES, RESULT_FILE
from .result import read_gathered

#: Seconds the elastic agent waits after SIGTERM before it SIGKILLs the other workers of a failed run.
SHUTDOWN_TIMEOUT_S = 3
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
#: Ways to start the workers (see the module docstring).
START_METHODS = ("forkserver", "subprocess")
#: Modules the fork server imports once, so forked workers start with them loaded. Third-party only:
#: pipeswift_lab itself is imported afresh by every worker (~0.15 s), so edits to it are never stale.
FORKSERVER_PRELOAD = (
    "numpy",
    "pandas",
    "torch",
    "torch.distributed.elastic.multiprocessing.errors",
    "cloudpickle",
) + DISTRIBUTED_MODULES


#: The one-line cause when a script calls run() outside ``if __name__ == "__main__":``.
MAIN_GUARD_MESSAGE = (
    "pipeswift_lab.run() is called at the top level of the script {path} (line {line}), outside "
    '`if __name__ == "__main__":`. Its workers re-import the script\'s __main__ module as they start '
    "(multiprocessing's forkserver, like spawn), which would launch again; put the call under that guard."
)


def check_main_guard(start_method: str) -> None:
    """Raise ``RuntimeError`` before anything starts if a script calls ``run()`` at import time without the ``__main__`` guard.

    With ``"forkserver"`` every worker re-imports the script that is ``__main__``; an unguarded
    ``run()`` there would start a run inside each worker's start-up and fail deep in torch's
    launcher. The frame of ``__main__``'s module code on the stack tells where the call is; the
    script's syntax tree tells whether that line is inside ``if __name__ == "__main__":``.
    Inside a worker's start-up (a forgotten guard that this check could not see) the worker
    exits with the same one line instead of a traceback.
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a worker re-importing the script
        raise SystemExit(MAIN_GUARD_MESSAGE.format(path="being re-imported by a worker", line="?"))
    if start_method != "forkserver":
        return
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return  # `python -m package`: multiprocessing does not re-import a package's __main__
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return  # an interactive session, a notebook or python -c: nothing is re-imported
    path = os.path.abspath(path)
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and os.path.abspath(frame.f_code.co_filename) == path
    ):
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    if not _line_is_guarded(path, line):
        raise RuntimeError(MAIN_GUARD_MESSAGE.format(path=path, line=line))


def _line_is_guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script at ``path`` lies inside an ``if __name__ == "__main__":`` block (True if unreadable)."""
    import ast

    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            last = max(getattr(n, "end_lineno", node.lineno) or node.lineno for n in node.body)
            if node.body[0].lineno <= line <= last:
                return True
    return False


def _is_main_test(test) -> bool:
    """Whether an ``if`` test holds ``__name__ == "__main__"`` (alone, or within ``and``/``or``)."""
    import ast

    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            sides = [node.left, node.comparators[0]]
            if any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
                isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
            ):
                return True
    return False


@contextmanager
def _quiet_elastic():
    """Silence torch elastic's warnings (e.g. about running in a thread) for the launch; restore after."""
    saved = {}
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(_ELASTIC_LOGGERS):
            logger = logging.getLogger(name)
            saved[name] = logger.level
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def _worker_environment():
    """Make this pipeswift_lab importable in the workers and undo the agent's changes to ``os.environ`` afterwards."""
    saved = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in saved.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def _pid_files(run_dir: Path) -> set[int]:
    """Pids the workers wrote into ``run_dir`` (no liveness check)."""
    pids = set()
    for path in Path(run_dir).glob("rank*.pid"):
        try:
            pids.add(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def _children(parent: int):
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


def _forkserver_pid():
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def worker_pids(run_dir: Path, P: int | None = None) -> list[int]:
    """Live worker processes of the run in ``run_dir``.

    Those that wrote ``rank{r}.pid``, the children of this process whose command line names
    ``run_dir`` (``"subprocess"`` workers), and, when some of the ``P`` ranks wrote no pid file
    yet, the children of this session's fork server (forked workers still starting).
    """
    pids = {pid for pid in _pid_files(run_dir) if _alive(pid) and not _zombie(pid)}
    marker = str(run_dir).encode()
    pids.update(pid for pid, cmdline in _children(os.getpid()) if marker in cmdline)
    server = _forkserver_pid()
    if P is not None and server and len(list(Path(run_dir).glob("rank*.pid"))) < P:
        pids.update(pid for pid, _ in _children(server))
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _stop_workers(run_dir: Path, P: int, dump_stacks: bool) -> list[int]:
    """Ask live workers for their stacks (``SIGUSR1``) if ``dump_stacks``, then SIGKILL them; return their pids."""
    pids = worker_pids(run_dir, P)
    if dump_stacks and pids:
        _signal_all(pids, signal.SIGUSR1)
        time.sleep(0.5)
    _signal_all(pids, signal.SIGKILL)
    return pids


def _read_progress(run_dir: Path) -> int:
    try:
        return int((run_dir / PROGRESS_FILE).read_text() or 0)
    except (OSError, ValueError):
        return 0


def _preload_forkserver() -> None:
    """Have the fork server (if this session has not started it yet) preload torch and the runner."""
    import multiprocessing

    if _forkserver_pid() is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))


class Preemption:
    """A preemption notice for a running launch, set by SIGTERM to the process that called ``run()``.

    ``grace_s`` is how long the workers get, once notified, to finish their step and save;
    after that they are killed and the previous checkpoint stands.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested_at = None

    def request(self) -> None:
        """Note a preemption notice now (idempotent; safe from a signal handler)."""
        if self.requested_at is None:
            self.requested_at = time.monotonic()


def launch(
    spec_path,
    run_dir,
    P: int,
    deadline,
    timeout_s: float,
    steps: int,
    progress: bool,
    desc: str,
    start_method: str = "forkserver",
    max_restarts: int = 0,
    preemption: Preemption | None = None,
) -> dict:
    """Start ``P`` workers on ``spec_path`` with torch's elastic agent; return what rank 0 gathered.

    ``deadline`` is a ``time.monotonic()`` value; a grace of ``min(2 s, 10%)`` is kept before it
    to collect the stacks of hung ranks and stop them. ``max_restarts`` lets the agent restart
    every worker after a failure (they resume from the newest checkpoint). ``preemption``, when
    notified, is passed on to the workers (the run directory's ``preempt`` file), which stop
    after their current step and save; past its grace they are killed and
    ``RunError(reason="preempted")`` is raised. Raises :class:`RunError` on any failure, after
    every worker process is gone.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    deadline = deadline if deadline is not None else time.monotonic() + timeout_s
    trigger = deadline - min(2.0, 0.1 * timeout_s)
    store = loopback_store(timeout_s)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=P,
        run_id=f"pipeswift-{uuid.uuid4().hex[:12]}",
        local_addr=LOOPBACK,
        rdzv_backend=loopback_rendezvous(),
        rdzv_endpoint=f"{LOOPBACK}:{store.port}",
        rdzv_configs={"timeout": max(1, int(timeout_s)), "is_host": False},
        max_restarts=max_restarts,
        monitor_interval=0.05,
        start_method="forkserver" if start_method == "forkserver" else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    if start_method == "forkserver":
        from .rank.worker import entry

        _preload_forkserver()
        entrypoint, args = entry, (str(spec_path), str(run_dir), bool(progress), os.getpid())
    else:
        entrypoint = sys.executable
        args = (
            "-m",
            "pipeswift_lab.runner",
            str(spec_path),
            "--out",
            str(run_dir),
            "--from-run",
            "--caller-pid",
            str(os.getpid()),
        ) + (("--progress",) if progress else ())
    outcome: dict = {}

    def agent():
        try:
            outcome["value"] = elastic_launch(config, entrypoint)(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the calling thread
            outcome["error"] = exc

    timed_out, preempt_killed, seen_pids = False, False, set()
    bar = tqdm(total=steps, desc=f"{desc}: starting {P} workers", unit="step", disable=not progress, leave=False)
    with _quiet_elastic(), _worker_environment():
        thread = threading.Thread(target=agent, name="pipeswift-elastic-agent", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.1)  # cheap polling: the workers get the CPU
                seen_pids.update(_pid_files(run_dir))
                if progress:
                    done = _read_progress(run_dir)
                    if done > bar.n:
                        if bar.n == 0:
                            bar.set_description(desc, refresh=False)
                        bar.update(done - bar.n)
                if preemption is not None and preemption.requested_at is not None:
                    if not (run_dir / PREEMPT_FILE).exists():
                        (run_dir / PREEMPT_FILE).touch()
                    if time.monotonic() - preemption.requested_at > preemption.grace_s and thread.is_alive():
                        preempt_killed = True
                        seen_pids.update(_stop_workers(run_dir, P, dump_stacks=False))
                        break
                if time.monotonic() >= trigger and thread.is_alive():
                    timed_out = True
                    seen_pids.update(_stop_workers(run_dir, P, dump_stacks=True))
                    break
        except BaseException:  # KeyboardInterrupt in a notebook: no orphans
            _stop_workers(run_dir, P, dump_stacks=False)
            thread.join(10)
            raise
        finally:
            bar.close()
        thread.join(10)
        leftovers = _stop_workers(run_dir, None, dump_stacks=False)  # none unless the agent itself misbehaved
        seen_pids.update(leftovers)
        _wait_gone(seen_pids, 5.0)
        del store  # the rendezvous store's server closes with its last reference
    if preempt_killed:
        raise RunError(
            f"preempted: the workers did not finish a clean save within preempt_grace_s={preemption.grace_s:g} s "
            "and were killed; the previous checkpoint stands",
            reason="preempted",
            pids=sorted(seen_pids),
            step=failed_step(run_dir),
        )
    if timed_out or "error" in outcome or not (run_dir / RESULT_FILE).exists():
        raise diagnose(run_dir, P, timeout_s, timed_out, outcome.get("error"), sorted(seen_pids))
    return read_gathered(run_dir)


def _wait_gone(pids, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        live = [p for p in pids if _alive(p) and not _zombie(p)]
        if not live:
            return
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
