"""``run()``: start a real pipeline run from a notebook cell and watch it until it ends.

The launch uses torch's elastic API (``LaunchConfig`` + ``elastic_launch``) with a standalone
c10d rendezvous on ``localhost`` (port chosen by the OS, as ``torchrun --standalone`` does).
The agent runs in a background thread while the calling thread shows progress and enforces
``timeout_s``. Two ways to start the worker processes (``start_method``):

* ``"forkserver"`` (default): workers are forked from multiprocessing's fork server, started
  once per Python session with torch and ``torch.distributed.pipelining`` preloaded, so
  after the first run a launch costs well under a second instead of one interpreter start and
  torch import per rank. Workers run :func:`pipeswift_lab.runner.worker.entry`. The fork
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
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from .errors import RunError, diagnose
from .result import RunResult, build_result, read_gathered
from .spec import make_spec
from .worker import PROGRESS_FILE, RESULT_FILE

#: Seconds the elastic agent waits after SIGTERM before it SIGKILLs the other workers of a failed run.
SHUTDOWN_TIMEOUT_S = 3
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
#: Ways to start the workers (see the module docstring).
START_METHODS = ("forkserver", "subprocess")
#: Modules the fork server imports once, so forked workers start with them loaded. Third-party only:
#: pipeswift_lab itself is imported afresh by every worker (~0.15 s), so edits to it are never stale.
FORKSERVER_PRELOAD = ("numpy", "pandas", "torch", "torch.distributed.pipelining", "torch.distributed.elastic.multiprocessing.errors",
                      "cloudpickle")


def run(model, data, loss_fn, partition, m, schedule=None, steps=10, optimizer=None, nprocs=None, backend=None, devices=None,
        timeout_s=300, progress=True, save_spec=None, instrument=True, seed=0, start_method="forkserver") -> RunResult:
    """Train ``model`` for ``steps`` steps as a real pipeline on ``torch.distributed.pipelining`` and measure it.

    * ``model`` — an ``nn.Sequential``; stage ``s`` is its children ``partition.bounds[s]``.
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
    * ``optimizer`` — a factory ``lambda params: torch.optim.X(params, ...)`` called on every rank
      with its stages' parameters; ``None`` is SGD with ``lr=0.01`` (``spec.DEFAULT_LR``).
    * ``nprocs`` — worker processes; one per rank, so ``None`` or ``partition.P``.
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
      as under torchrun); see the module docstring.

    Objects defined in a notebook cell or a test are serialized by value (cloudpickle).
    Returns a :class:`RunResult`. Raises ``TypeError``/``ValueError`` before any process starts
    for what can be checked in advance (see :func:`~pipeswift_lab.runner.spec.make_spec`).
    """
    launch_ns = time.time_ns()
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not valid; use one of {list(START_METHODS)}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False; got {progress!r}")
    deadline = time.monotonic() + float(timeout_s) if isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) else None
    spec = make_spec(model, data, loss_fn, partition, m, schedule=schedule, steps=steps, optimizer=optimizer, nprocs=nprocs,
                     backend=backend, devices=devices, timeout_s=timeout_s, instrument=instrument, seed=seed)
    if save_spec is not None:
        spec.save(save_spec)
    with tempfile.TemporaryDirectory(prefix="pipeswift_run_") as tmp:
        run_dir = Path(tmp)
        spec_path = spec.save(run_dir / "spec.pkl")
        desc = f"{spec.plan.schedule} P={spec.P} m={spec.m}"
        gathered = launch(spec_path, run_dir, spec.P, deadline, spec.timeout_s, spec.steps, progress, desc, start_method)
        end_ns = time.time_ns()
    return build_result(spec, gathered, launch_ns, end_ns)


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


def launch(spec_path, run_dir, P: int, deadline, timeout_s: float, steps: int, progress: bool, desc: str,
           start_method: str = "forkserver") -> dict:
    """Start ``P`` workers on ``spec_path`` with torch's elastic agent; return what rank 0 gathered.

    ``deadline`` is a ``time.monotonic()`` value; a grace of ``min(2 s, 10%)`` is kept before it
    to collect the stacks of hung ranks and stop them. Raises :class:`RunError` on any failure,
    after every worker process is gone.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    deadline = deadline if deadline is not None else time.monotonic() + timeout_s
    trigger = deadline - min(2.0, 0.1 * timeout_s)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=P, run_id=f"pipeswift-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"timeout": max(1, int(timeout_s))},
        max_restarts=0, monitor_interval=0.05, start_method="forkserver" if start_method == "forkserver" else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL), shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    if start_method == "forkserver":
        from .worker import entry

        _preload_forkserver()
        entrypoint, args = entry, (str(spec_path), str(run_dir), bool(progress))
    else:
        entrypoint = sys.executable
        args = ("-m", "pipeswift_lab.runner", str(spec_path), "--out", str(run_dir), "--from-run") + (("--progress",) if progress else ())
    outcome: dict = {}

    def agent():
        try:
            outcome["value"] = elastic_launch(config, entrypoint)(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the calling thread
            outcome["error"] = exc

    timed_out, seen_pids = False, set()
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
