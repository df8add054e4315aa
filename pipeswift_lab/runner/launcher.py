"""Launch one segment of a run: start the worker processes and watch them until they end.

The launch uses torch's elastic API (``LaunchConfig`` + ``elastic_launch``) with a standalone
c10d rendezvous whose stores listen on ``127.0.0.1`` only (port chosen by the OS), so nothing of a
local run accepts connections from another machine (:mod:`~pipeswift_lab.runner.loopback`).
The agent runs in a background thread while the calling thread shows progress and enforces
``timeout_s``. Two ways to start the worker processes (``start_method``):

* ``"forkserver"`` (default): workers are forked from multiprocessing's fork server, started
  once per Python session with torch, ``torch.distributed.pipelining`` and the toolkit's worker module preloaded, so
  after the first run a launch costs well under a second instead of one interpreter start and
  torch import per rank. Workers run :func:`pipeswift_lab.runner.rank.worker.main`. The fork
  server stays up with the session (like multiprocessing's resource tracker); it is not a
  worker and holds no run state. It is restarted when pipeswift_lab's files change, so code edits
  reach the next run; an upgrade of torch itself needs a new session. Its children re-import a script's
  ``__main__`` module, as
  with ``spawn``: guard scripts with ``if __name__ == "__main__":`` (notebooks need nothing).
* ``"subprocess"``: every rank is a fresh ``python -m pipeswift_lab.runner SPEC --out DIR``,
  the very command ``torchrun`` runs on a cluster, so ``jct.assembly_s`` includes a cold
  interpreter start and torch import on every rank, as a real job launch does.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .assembly import read_gathered
from .errors import RunError, diagnose, failed_step
from .loopback import LOOPBACK, loopback_rendezvous, loopback_store
from .processes import forkserver_pid, pid_files, stop_workers, wait_gone
from .rank.worker import DISTRIBUTED_MODULES
from .run_files import PREEMPT_FILE, PROGRESS_FILE, RESULT_FILE

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

#: Seconds the elastic agent waits after SIGTERM before it SIGKILLs the other workers of a failed run.
SHUTDOWN_TIMEOUT_S = 3
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
#: Modules the fork server imports once, so forked workers start with them loaded (and :data:`WORKER_MODULE`, the
#: toolkit's own, while its files are unchanged: :func:`_preload_forkserver`).
#: Libraries of models whose modeling modules the fork server also preloads when the calling session has imported
#: them (:func:`model_library_modules`): a worker unpickling a Hugging Face model imports its modeling module, about
#: 1,500 modules and 4-5 s here, once per fork server instead of once per worker.
MODEL_LIBRARIES = ("transformers",)
FORKSERVER_PRELOAD = (
    "numpy",
    "pandas",
    "torch",
    "torch.distributed.elastic.multiprocessing.errors",
    "cloudpickle",
    # what a rank imports on first use otherwise: torch.export's tracer (a traced stage, half a second a rank here),
    # dynamo (an optimizer's first step) and the sharded optimizer
    "torch._dynamo",
    "torch.export._trace",
    "torch.distributed.optim",
) + DISTRIBUTED_MODULES


#: The one-line cause when a script calls run() outside ``if __name__ == "__main__":``.
MAIN_GUARD_MESSAGE = (
    "pipeswift_lab.run() is called at the top level of the script {path} (line {line}), outside "
    '`if __name__ == "__main__":`. Its workers re-import the script\'s __main__ module as they start '
    "(multiprocessing's forkserver, like spawn), which would launch again; put the call under that guard."
)


def check_main_guard(start_method: str) -> None:
    """Raise ``RuntimeError`` before anything starts if a script calls ``run()`` at import time without the
    ``__main__`` guard.

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
    frame: FrameType | None = sys._getframe(1)
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
    """Whether ``line`` of the script at ``path`` lies inside an ``if __name__ == "__main__":`` block (True if
    unreadable)."""
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


def _is_main_test(test: ast.expr) -> bool:
    """Whether an ``if`` test holds ``__name__ == "__main__"`` (alone, or within ``and``/``or``)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            sides = [node.left, node.comparators[0]]
            if any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
                isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
            ):
                return True
    return False


@contextmanager
def _quiet_elastic() -> Iterator[None]:
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
def _worker_environment() -> Iterator[None]:
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


def _read_progress(run_dir: Path) -> int:
    try:
        return int((run_dir / PROGRESS_FILE).read_text() or 0)
    except (OSError, ValueError):
        return 0


#: The toolkit's own module a worker starts in: preloaded too, while the package's files are as the server saw them.
WORKER_MODULE = "pipeswift_lab.runner.rank.worker"
_server_code: list[tuple[tuple[str, int], ...]] = []  # the package's files when this session's server started


def package_fingerprint() -> tuple[tuple[str, int], ...]:
    """Each of the toolkit's ``.py`` files with its modification time (ns): what changes when its code is edited."""
    root = Path(__file__).resolve().parents[1]
    out = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out.append((path, os.stat(path).st_mtime_ns))
    return tuple(sorted(out))


def _preload_forkserver() -> None:
    """Have the fork server preload torch, the runner's torch modules, the model libraries this session has
    imported (:func:`model_library_modules`) and the toolkit's worker module.

    A server started before the session imported a model library (a first run of an ``nn.Sequential``, then a
    Hugging Face model) is stopped, and the next launch starts one that preloads it: once, instead of every worker
    of every later run importing it again. A model family's own module (``modeling_llama``, a fraction of a second
    once its library is loaded) does not restart a server. Nor does anything else, unless the toolkit's own files
    changed since the server started (:func:`package_fingerprint`): then it is restarted, so an edit reaches the next
    run as it would without the preload, and a worker does not import the toolkit again (half a second a rank).
    """
    import multiprocessing
    from multiprocessing import forkserver

    libraries, families = model_library_modules()
    code = package_fingerprint()
    if forkserver_pid() is not None:
        server = forkserver._forkserver  # multiprocessing's private state: a Python without it keeps its server
        stop = getattr(server, "_stop", None)
        preloaded = set(getattr(server, "_preload_modules", None) or ())
        fresh = WORKER_MODULE not in preloaded or _server_code == [code]
        if (set(FORKSERVER_PRELOAD) | set(libraries) <= preloaded and fresh) or stop is None:
            return
        stop()
    modules = [*FORKSERVER_PRELOAD, *libraries, *families, WORKER_MODULE]
    multiprocessing.get_context("forkserver").set_forkserver_preload(modules)
    _server_code[:] = [code]


def model_library_modules() -> tuple[list[str], list[str]]:
    """The modules of :data:`MODEL_LIBRARIES` this session has imported that a worker imports when it unpickles one
    of their models: ``(libraries, families)``, the libraries with their shared modeling code (``transformers``,
    ``transformers.modeling_utils``: seconds to import) and the model families' modules (``transformers.models.
    llama.modeling_llama``)."""
    libraries, families = [], []
    for name in sorted(sys.modules):
        library = name.split(".")[0]
        if library not in MODEL_LIBRARIES:
            continue
        if name == library or name == f"{library}.modeling_utils":
            libraries.append(name)
        elif ".modeling_" in name:
            families.append(name)
    return libraries, families


class Preemption:
    """A preemption notice for a running launch, set by SIGTERM to the process that called ``run()``.

    ``grace_s`` is how long the workers get, once notified, to finish their step and save;
    after that they are killed and the previous checkpoint stands.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested_at: float | None = None

    def request(self) -> None:
        """Note a preemption notice now (idempotent; safe from a signal handler)."""
        if self.requested_at is None:
            self.requested_at = time.monotonic()


@dataclass(frozen=True, kw_only=True)
class Watched:
    """How a launch ended, as the calling thread saw it while it watched the agent."""

    timed_out: bool = False
    """The run passed its deadline: the workers were asked for their stacks and killed."""
    preempt_killed: bool = False
    """A preemption notice went unanswered past its grace: the workers were killed."""
    pids: tuple[int, ...] = ()
    """Every worker pid seen during the launch (all gone by now)."""
    error: BaseException | None = None
    """What the elastic agent raised (None when it returned)."""


def launch(
    spec_path: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    nprocs: int,
    deadline: float | None,
    timeout_s: float,
    steps: int,
    progress: bool,
    desc: str,
    start_method: str = "forkserver",
    max_restarts: int = 0,
    preemption: Preemption | None = None,
) -> dict[str, Any]:
    """Start ``nprocs`` workers on ``spec_path`` with torch's elastic agent; return what rank 0 gathered.

    ``deadline`` is a ``time.monotonic()`` value; a grace of ``min(2 s, 10%)`` is kept before it
    to collect the stacks of hung ranks and stop them. ``max_restarts`` lets the agent restart
    every worker after a failure (they resume from the newest checkpoint). ``preemption``, when
    notified, is passed on to the workers (the run directory's ``preempt`` file), which stop
    after their current step and save; past its grace they are killed and
    ``RunError(reason="preempted")`` is raised. Raises :class:`RunError` on any failure, after
    every worker process is gone.
    """
    run_dir = Path(run_dir)
    deadline = deadline if deadline is not None else time.monotonic() + timeout_s
    store = loopback_store(timeout_s)
    config = _launch_config(run_dir, nprocs, store.port, timeout_s, max_restarts, start_method)
    entrypoint, args = _entrypoint(spec_path, run_dir, progress, start_method)
    with _quiet_elastic(), _worker_environment():
        agent = _start_agent(config, entrypoint, args)
        watched = _watch(
            agent, run_dir, nprocs, deadline - min(2.0, 0.1 * timeout_s), steps, progress, desc, preemption
        )
        del store  # the rendezvous store's server closes with its last reference
    _raise_if_failed(watched, run_dir, nprocs, timeout_s, preemption)
    return read_gathered(run_dir)


def _launch_config(
    run_dir: Path, nprocs: int, port: int, timeout_s: float, max_restarts: int, start_method: str
) -> LaunchConfig:
    """torch's ``LaunchConfig`` of a local run: one node, loopback rendezvous on ``port``, logs in ``run_dir``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"pipeswift-{uuid.uuid4().hex[:12]}",
        local_addr=LOOPBACK,
        rdzv_backend=loopback_rendezvous(),
        rdzv_endpoint=f"{LOOPBACK}:{port}",
        rdzv_configs={"timeout": max(1, int(timeout_s)), "is_host": False},
        max_restarts=max_restarts,
        monitor_interval=0.05,
        start_method="forkserver" if start_method == "forkserver" else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def _entrypoint(
    spec_path: str | os.PathLike[str], run_dir: Path, progress: bool, start_method: str
) -> tuple[Callable[..., Any] | str, tuple[Any, ...]]:
    """What the agent starts per rank: :func:`~pipeswift_lab.runner.rank.worker.main` in a forked process, or the
    ``python -m pipeswift_lab.runner`` command line; and its arguments."""
    if start_method == "forkserver":
        from .rank.worker import main

        _preload_forkserver()
        return main, (str(spec_path), str(run_dir), bool(progress), os.getpid())
    command: tuple[str, ...] = ("-m", "pipeswift_lab.runner", str(spec_path), "--out", str(run_dir), "--from-run")
    command += ("--caller-pid", str(os.getpid())) + (("--progress",) if progress else ())
    return sys.executable, command


class _Agent(threading.Thread):
    """torch's elastic agent, run in a daemon thread; ``error`` holds what it raised."""

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]) -> None:
        super().__init__(name="pipeswift-elastic-agent", daemon=True)
        self.config, self.entrypoint, self.args = config, entrypoint, args
        self.error: BaseException | None = None

    def run(self) -> None:
        from torch.distributed.launcher.api import elastic_launch

        try:
            elastic_launch(self.config, self.entrypoint)(*self.args)
        except BaseException as exc:  # reported by the calling thread
            self.error = exc


def _start_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]) -> _Agent:
    agent = _Agent(config, entrypoint, args)
    agent.start()
    return agent


def _watch(
    agent: _Agent,
    run_dir: Path,
    nprocs: int,
    trigger: float,
    steps: int,
    progress: bool,
    desc: str,
    preemption: Preemption | None,
) -> Watched:
    """Poll the agent until it ends: show progress, pass a preemption notice on, stop workers at ``trigger`` or
    past the preemption's grace; then make sure every worker process is gone."""
    from tqdm.auto import tqdm

    timed_out, preempt_killed, seen = False, False, set()
    bar = tqdm(total=steps, desc=f"{desc}: starting {nprocs} workers", unit="step", disable=not progress, leave=False)
    try:
        while agent.is_alive():
            agent.join(0.1)  # cheap polling: the workers get the CPU
            seen.update(pid_files(run_dir))
            if progress:
                _show_progress(bar, run_dir, desc)
            if _preemption_expired(preemption, run_dir) and agent.is_alive():
                preempt_killed = True
                seen.update(stop_workers(run_dir, nprocs, dump_stacks=False))
                break
            if time.monotonic() >= trigger and agent.is_alive():
                timed_out = True
                seen.update(stop_workers(run_dir, nprocs, dump_stacks=True))
                break
    except BaseException:  # KeyboardInterrupt in a notebook: no orphans
        stop_workers(run_dir, nprocs, dump_stacks=False)
        agent.join(10)
        raise
    finally:
        bar.close()
    agent.join(10)
    seen.update(stop_workers(run_dir, None, dump_stacks=False))  # none unless the agent itself misbehaved
    wait_gone(seen, 5.0)
    return Watched(timed_out=timed_out, preempt_killed=preempt_killed, pids=tuple(sorted(seen)), error=agent.error)


def _show_progress(bar: Any, run_dir: Path, desc: str) -> None:
    done = _read_progress(run_dir)
    if done > bar.n:
        if bar.n == 0:
            bar.set_description(desc, refresh=False)
        bar.update(done - bar.n)


def _preemption_expired(preemption: Preemption | None, run_dir: Path) -> bool:
    """Pass a preemption notice on to the workers (the ``preempt`` file); True once its grace is over."""
    if preemption is None or preemption.requested_at is None:
        return False
    if not (run_dir / PREEMPT_FILE).exists():
        (run_dir / PREEMPT_FILE).touch()
    return time.monotonic() - preemption.requested_at > preemption.grace_s


def _raise_if_failed(
    watched: Watched, run_dir: Path, nprocs: int, timeout_s: float, preemption: Preemption | None
) -> None:
    """Raise the :class:`RunError` that explains a launch that did not leave a result (nothing otherwise)."""
    if watched.preempt_killed:
        grace_s = preemption.grace_s if preemption is not None else float("nan")
        raise RunError(
            f"preempted: the workers did not finish a clean save within preempt_grace_s={grace_s:g} s "
            "and were killed; the previous checkpoint stands",
            reason="preempted",
            pids=watched.pids,
            step=failed_step(run_dir),
        )
    if watched.timed_out or watched.error is not None or not (run_dir / RESULT_FILE).exists():
        raise diagnose(run_dir, nprocs, timeout_s, watched.timed_out, watched.error, watched.pids)


__all__ = [
    "check_main_guard",
    "FORKSERVER_PRELOAD",
    "MODEL_LIBRARIES",
    "model_library_modules",
    "launch",
    "MAIN_GUARD_MESSAGE",
    "Preemption",
    "SHUTDOWN_TIMEOUT_S",
    "Watched",
]
