"""A run as data: :class:`RunSpec`, checked before launch and saved by value with cloudpickle.

Everything a worker needs (model, loss, data, optimizer factory, stage plan, boundary shapes,
devices) travels in one file, so a run started from a notebook cell and the same run under
``torchrun ... -m pipeswift_lab.runner SPEC`` execute the same code on the same inputs.

Objects defined in a notebook (``__main__``), in a test, in a dynamically created module or
in any module that is not an installed package are pickled *by value*
(``cloudpickle.register_pickle_by_value``), so workers never need to import the caller's code;
torch, pipeswift_lab and other installed packages are pickled by reference.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.checks import check_int, check_time
from .stages.sequential import StagePlan, TensorSpec, boundary_specs, check_shared_parameters, plan_stages

#: Learning rate of the default optimizer factory (plain SGD, no momentum).
DEFAULT_LR = 0.01
#: CPU ranks allowed per available core: gloo ranks block (not spin) while they wait, so
#: 2x oversubscription still runs; beyond that time-slicing makes measured timelines meaningless.
CPU_RANKS_PER_CORE = 2
_FORMAT = "pipeswift_lab.RunSpec"
_VERSION = 2
#: The first bytes of a spec file: a header line (JSON) before the pickle, read without unpickling anything.
SPEC_MAGIC = b"PIPESWIFT-SPEC "
_HEADER_MAX_BYTES = 4096


def default_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer ``run`` uses when given none: ``torch.optim.SGD(params, lr=DEFAULT_LR)``."""
    return torch.optim.SGD(params, lr=DEFAULT_LR)


def available_cores() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS/Windows
        return os.cpu_count() or 1


@dataclass(frozen=True)
class DataSource:
    """Where each step's ``(inputs, targets)`` come from.

    ``kind`` is ``"batch"`` (the same batch every step), ``"callable"`` (``value(step)``) or
    ``"batches"`` (a list materialized from an iterable, one per step). A callable is called
    on every rank that needs the batch with torch's RNG seeded to ``seed + step``, so batches
    drawn with ``torch.randn`` agree across ranks.
    """

    kind: str
    value: Any
    seed: int = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of ``step``."""
        if self.kind == "batch":
            return self.value
        if self.kind == "batches":
            return self.value[step]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + step)
            try:
                batch = self.value(step)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the argument
                raise ValueError(
                    f"data({step}) raised {type(exc).__name__}: {exc} (data, a callable, is called as "
                    f"data(step) -> (inputs, targets) on every rank)"
                ) from exc
            return _check_batch(batch, f"data({step})")


def _check_batch(batch, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where} must be an (inputs, targets) pair of tensors; got {type(batch).__name__}")
    inputs, targets = batch
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{where}: {name} is a 0-d tensor; it needs a batch dimension to split into micro-batches")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"{where}: inputs have batch size {inputs.shape[0]} but targets {targets.shape[0]}; they must match"
        )
    return inputs, targets


def make_data_source(data, steps: int, seed: int) -> DataSource:
    """Normalize ``data`` (a batch, a ``callable(step)`` or an iterable of batches) into a :class:`DataSource` (one as is)."""
    if isinstance(data, DataSource):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return DataSource("batch", _check_batch(tuple(data), "data"), seed)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        raise TypeError(
            f"data holds {len(data)} tensor{'s' if len(data) != 1 else ''}; give one (inputs, targets) pair, "
            f"a callable(step) -> (inputs, targets) or an iterable of such pairs"
        )
    if callable(data):
        return DataSource("callable", data, seed)
    if isinstance(data, torch.Tensor) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"data must be an (inputs, targets) batch, a callable(step) -> (inputs, targets) or an iterable of batches; got {type(data).__name__}"
        )
    batches = list(itertools.islice(iter(data), steps))
    if len(batches) < steps:
        raise ValueError(f"data yielded {len(batches)} batches but steps={steps} need {steps}")
    return DataSource("batches", [_check_batch(b, f"data batch {i}") for i, b in enumerate(batches)], seed)


#: What ``run(..., on_nonfinite=...)`` may do at a NaN/inf loss.
ON_NONFINITE = ("raise", "skip", "ignore")


@dataclass(frozen=True)
class JobOptions:
    """How a run lives through a shared cluster: checkpoints, resume, preemption, non-finite losses.

    Checked and resolved by :func:`pipeswift_lab.runner.job.job_options` before launch.
    """

    checkpoint_dir: str | None = None  # checkpoint root; None: no checkpoints
    checkpoint_every: int | str | None = None  # N steps, "auto" (Young/Daly from measured save time and mtbf_s) or None
    keep: int = 2  # newest complete checkpoints kept
    resume_from: str | None = None  # one step-* directory (resolved from a root before launch)
    mtbf_s: float | None = None  # mean time between failures of the job, for "auto"
    on_nonfinite: str = "raise"  # "raise", "skip" or "ignore" (see ON_NONFINITE)
    preempt_grace_s: float = 30.0  # after SIGTERM, seconds to finish the step and save before being killed
    run_id: str | None = None  # written into every manifest: restarts and retention see only this run's checkpoints
    final_kind: str | None = (
        "final"  # the save at the last step: "final", "resize" before a reconfiguration, None: none
    )
    rebalance: Any = None  # a runner.rebalance.RebalancePlan: decide every N steps whether to move stage boundaries
    launch_ns: int | None = None  # wall clock when this segment's launch began (the measured assembly starts there)
    write_fault: dict | None = (
        None  # a runner.faults.write_fault in force when run() was called: the writer fails as asked
    )


@dataclass(frozen=True)
class RunSpec:
    """One pipeline run, complete: what each worker loads. Build it with :func:`make_spec`."""

    model: nn.Module  # the full model (nn.Sequential, or split by torch's tracer); each rank keeps its own stages
    loss_fn: Callable  # loss_fn(last_stage_output, targets) -> scalar, mean over the micro-batch
    data: DataSource
    optimizer: Callable  # factory: optimizer(params) -> torch.optim.Optimizer, called per rank on its stages
    plan: StagePlan  # bounds, P, v, schedule, stage_to_rank
    m: int  # micro-batches per step
    steps: int  # training steps
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    device_type: str  # "cpu" or "cuda"
    devices: tuple[int, ...] | None  # CUDA device index per local rank; None on CPU
    threads_per_rank: int | None  # torch.set_num_threads per CPU rank; None on CUDA
    boundaries: tuple[tuple[TensorSpec, TensorSpec], ...]  # (input, output) of every stage, one micro-batch
    state_keys: tuple[str, ...]  # model.state_dict() keys, in order
    instrument: bool = True  # record every F/B/I/W action; False for the overhead baseline
    seed: int = 0  # torch.manual_seed on every rank before the first step; data callables get seed + step
    timeout_s: float = 300.0  # the whole run, and every collective's timeout in the workers
    job: JobOptions = JobOptions()  # checkpoints, resume, non-finite losses
    meta: dict = field(default_factory=dict, compare=False)
    traced: Any = (
        None  # a runner.tracer.TracedPlan for a model that is not an nn.Sequential; None: children are the layers
    )
    D: int = 1  # data-parallel replicas of the pipeline; world size P * D, global rank = replica * P + pipeline rank

    @property
    def P(self) -> int:
        """Ranks of one pipeline (stages are spread over them)."""
        return self.plan.P

    @property
    def world_size(self) -> int:
        """Processes: ``P * D`` (replica ``d`` holds the global ranks ``d*P .. d*P+P-1``, one node's worth)."""
        return self.plan.P * self.D

    def save(self, path) -> Path:
        """Write the spec to ``path``; return the path.

        The file is a header line (``SPEC_MAGIC`` + JSON: format, version, the toolkit's version,
        the payload's SHA-256 and size) and then the pickle (cloudpickle, by value for code that
        is not an installed package). A pickle runs code when loaded: load only specs you wrote.
        """
        import cloudpickle

        from .. import __version__

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _pickled_by_value(self._code_objects()):
            payload = cloudpickle.dumps(self)
        header = {
            "format": _FORMAT,
            "version": _VERSION,
            "pipeswift_lab": __version__,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "bytes": len(payload),
        }
        path.write_bytes(SPEC_MAGIC + json.dumps(header).encode() + b"\n" + payload)
        return path

    def _code_objects(self) -> list:
        objs = [self.model, self.loss_fn, self.optimizer]
        objs += list(self.model.modules())
        if self.data.kind == "callable":
            objs.append(self.data.value)
        return objs


def load_spec(path) -> RunSpec:
    """Read a spec written by :meth:`RunSpec.save` (``run(..., save_spec=path)``); returns the :class:`RunSpec`.

    The header is checked before anything is unpickled: a file without it, of another format or
    toolkit version, or whose payload does not match its checksum raises ``ValueError`` naming
    the file. The payload is a pickle and runs code as it loads: load only specs you wrote.
    """
    import pickle

    import cloudpickle  # noqa: F401 - the payload needs cloudpickle's reducers importable

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"spec file {str(path)!r} does not exist")
    data = path.read_bytes()
    header = spec_header(path, data)
    payload = data[data.index(b"\n") + 1 :]
    if len(payload) != header["bytes"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise ValueError(
            f"spec file {str(path)!r}: its payload ({len(payload)} bytes) does not match the checksum in its header "
            f"({header['bytes']} bytes): it was changed or cut short after it was written; nothing was unpickled"
        )
    return pickle.loads(payload)


def spec_header(path, data: bytes | None = None) -> dict:
    """The header of the spec file at ``path`` (format, version, toolkit version, payload SHA-256 and size), checked.

    Raises ``ValueError`` naming the file when the header is missing, unreadable or written for
    another format or version. Nothing is unpickled.
    """
    from .. import __version__

    if data is None:
        with open(path, "rb") as f:
            data = f.read(_HEADER_MAX_BYTES)
    line = data[:_HEADER_MAX_BYTES].split(b"\n", 1)[0]
    where = f"spec file {str(path)!r}"
    if not line.startswith(SPEC_MAGIC):
        raise ValueError(
            f"{where} has no pipeswift_lab spec header: it is not a spec written by run(..., save_spec=path) "
            "by this version of pipeswift_lab; nothing was unpickled (a spec is a pickle and runs code when loaded: "
            "load only specs you wrote)"
        )
    try:
        header = json.loads(line[len(SPEC_MAGIC) :])
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ValueError(f"{where}: its header line is not valid JSON ({exc}); nothing was unpickled") from None
    want = {"format": _FORMAT, "version": _VERSION, "pipeswift_lab": __version__}
    wrong = {key: header.get(key) for key, value in want.items() if header.get(key) != value}
    if wrong:
        raise ValueError(
            f"{where}: its header says {wrong}, this pipeswift_lab reads {want}; save the spec again with this "
            "version; nothing was unpickled"
        )
    if not isinstance(header.get("sha256"), str) or not isinstance(header.get("bytes"), int):
        raise ValueError(f"{where}: its header has no payload checksum (sha256, bytes); nothing was unpickled")
    return header


def _is_installed(module) -> bool:
    name = getattr(module, "__name__", "") or ""
    if name.split(".")[0] in ("pipeswift_lab", "torch", "builtins"):
        return True
    file = getattr(module, "__file__", None)
    if not file:
        return name in sys.builtin_module_names
    file = os.path.realpath(file)
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return any(file.startswith(root + os.sep) for root in roots)


def _modules_of(obj) -> set[str]:
    names = set()
    while isinstance(obj, functools.partial):
        obj = obj.func
    for candidate in (obj, type(obj)):
        name = getattr(candidate, "__module__", None)
        if isinstance(name, str):
            names.add(name)
    return names


@contextmanager
def _pickled_by_value(objs):
    """Register the modules of ``objs`` that are not installed packages for by-value pickling, then unregister."""
    import cloudpickle

    registered = []
    names = set().union(*(_modules_of(o) for o in objs)) if objs else set()
    for name in sorted(names):
        if name == "__main__":
            continue  # cloudpickle pickles __main__ by value already
        module = sys.modules.get(name)
        if module is None or _is_installed(module):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # already registered by the caller
            continue
        registered.append(module)
    try:
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


#: Schedules whose split backward (I then W) does not go through DDP's synchronized backward.
DP_UNSUPPORTED = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def resolve_devices(P: int, backend, devices, what: str | None = None) -> tuple[str, str, tuple[int, ...] | None]:
    """Pick ``(backend, device_type, cuda_device_per_rank)`` and refuse what this machine cannot run.

    ``devices``: ``None`` (one GPU per rank when there are GPUs, CPU processes otherwise),
    ``"cpu"``, ``"cuda"`` (GPUs ``0..P-1``) or a list of ``P`` CUDA device indices.
    ``backend``: ``None`` (``nccl`` on CUDA, ``gloo`` on CPU), ``"gloo"`` or ``"nccl"``.
    """
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; use None, 'gloo' (CPU) or 'nccl' (CUDA)")
    if devices is None:
        device_type = "cuda" if n_gpus and backend != "gloo" else "cpu"
        indices = tuple(range(P)) if device_type == "cuda" else None
    elif isinstance(devices, str) and devices in ("cpu", "cuda"):
        device_type = devices
        indices = tuple(range(P)) if devices == "cuda" else None
    elif isinstance(devices, (list, tuple)):
        indices = []
        for d in devices:
            dev = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
            if dev.type != "cuda" or dev.index is None:
                raise ValueError(
                    f"devices={list(devices)!r}: every entry must be a CUDA device index or 'cuda:i'; got {d!r}"
                )
            indices.append(dev.index)
        if len(indices) != P:
            raise ValueError(
                f"devices={list(devices)!r} lists {len(indices)} devices but the partition has P={P} ranks"
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"devices={list(devices)!r} repeats a GPU; each rank needs its own")
        device_type, indices = "cuda", tuple(indices)
    else:
        raise TypeError(f"devices must be None, 'cpu', 'cuda' or a list of CUDA device indices; got {devices!r}")

    if device_type == "cuda":
        if n_gpus == 0:
            raise ValueError(f"devices={devices!r} asks for CUDA but torch sees no GPU here; use devices='cpu'")
        if max(indices) >= n_gpus:
            raise ValueError(
                f"P={P} ranks need GPUs {list(indices)} but this machine has {n_gpus} (cuda device_count); "
                "use fewer ranks or devices='cpu'"
            )
        backend = backend or "nccl"
        if backend != "nccl":
            raise ValueError(
                f"backend={backend!r} cannot send CUDA tensors between stages; use backend='nccl' with GPUs"
            )
        return backend, "cuda", indices
    backend = backend or "gloo"
    if backend != "gloo":
        raise ValueError(f"backend={backend!r} needs GPUs; CPU ranks use backend='gloo'")
    cores = available_cores()
    if P > CPU_RANKS_PER_CORE * cores:
        raise ValueError(
            f"{what or f'P={P}'} CPU ranks is more than this machine can run: it has {cores} cores and the runner allows "
            f"{CPU_RANKS_PER_CORE} ranks per core ({CPU_RANKS_PER_CORE * cores})"
        )
    return backend, "cpu", None


#: The longest ``timeout_s`` a run takes (seconds): torch's process groups and stores overflow far above it.
MAX_TIMEOUT_S = 1e9


def make_spec(
    model,
    data,
    loss_fn,
    partition,
    m,
    *,
    schedule=None,
    steps=10,
    optimizer=None,
    nprocs=None,
    backend=None,
    devices=None,
    timeout_s=300.0,
    instrument=True,
    seed=0,
    job: JobOptions | None = None,
    D=1,
) -> RunSpec:
    """Check every argument of :func:`pipeswift_lab.run` and build the :class:`RunSpec` (no process is started).

    Raises ``TypeError``/``ValueError`` for anything that would fail in the workers and can be
    known here: schedule rules, ``m`` not dividing the batch, too many ranks for the machine,
    stages whose shapes do not chain, a loss that does not take the last stage's output.
    """
    from ..simulation import schedules as _schedules

    plan = plan_stages(model, partition, schedule)
    D = check_int("D", D, minimum=1)
    m = check_int("m", m, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    seed = check_int("seed", seed)
    timeout_s = check_time("timeout_s", timeout_s, allow_zero=False)
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout_s={timeout_s:g} is more than the {MAX_TIMEOUT_S:g} s (about 31 years) the workers' process groups "
            f"and stores can wait (a longer timeout overflows torch's clock); give timeout_s <= {MAX_TIMEOUT_S:g}"
        )
    if not isinstance(instrument, bool):
        raise TypeError(f"instrument must be a bool; got {type(instrument).__name__} {instrument!r}")
    if nprocs is not None:
        nprocs = check_int("nprocs", nprocs, minimum=1)
        if nprocs != plan.P * D:
            what = f"the partition's P={plan.P}" if D == 1 else f"P*D={plan.P}*{D}"
            raise ValueError(
                f"nprocs={nprocs} differs from {what}; one process runs each rank, so nprocs must be {plan.P * D} (or None)"
            )
    _schedules.validate(plan.P, m, plan.schedule, plan.v)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, targets); got {type(loss_fn).__name__}")
    optimizer = default_optimizer if optimizer is None else optimizer
    if not callable(optimizer):
        raise TypeError(
            f"optimizer must be a factory such as `lambda params: torch.optim.SGD(params, lr=0.1)`; got {type(optimizer).__name__}"
        )
    try:
        probe = optimizer([p for p in model.parameters()])
    except Exception as exc:  # noqa: BLE001 - re-raised naming the argument
        raise ValueError(
            f"optimizer(params) raised {type(exc).__name__}: {exc} (optimizer is a factory called with each rank's "
            f"parameters, e.g. `lambda params: torch.optim.SGD(params, lr=0.1)`)"
        ) from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer; it returned {type(probe).__name__}")
    del probe
    sequential = isinstance(model, nn.Sequential)
    if sequential:
        check_shared_parameters(model, plan)
    if D > 1 and plan.schedule in DP_UNSUPPORTED:
        raise ValueError(
            f"D={D} replicas with schedule={plan.schedule!r} is not supported: its split input/weight backward "
            f"bypasses DDP's gradient sync; use one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS with D > 1"
        )

    backend, device_type, indices = resolve_devices(
        plan.P * D, backend, devices, what=f"P*D={plan.P}*{D}" if D > 1 else None
    )

    source = make_data_source(data, steps, seed)
    inputs, targets = source.batch(0)
    global_batch = inputs.shape[0]
    if global_batch % D:
        divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise ValueError(
            f"D={D} does not divide the global batch size {global_batch} of data (each replica reads an equal slice); "
            f"use a D in {divisors}"
        )
    batch_size = global_batch // D
    if batch_size % m:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        where = (
            f"the batch size {batch_size} of data"
            if D == 1
            else f"each replica's batch {batch_size} (global batch {global_batch} / D={D})"
        )
        raise ValueError(f"m={m} does not divide {where}; use an m in {divisors}")
    inputs_mb, targets_mb = inputs[: batch_size // m], targets[: batch_size // m]
    if sequential:
        boundaries, traced = boundary_specs(model, plan, inputs_mb, targets_mb, loss_fn), None
        layer_names = [name for name, _ in model.named_children()]
    else:
        from .stages.traced import check_traceable

        boundaries = ()  # torch's traced stages know their boundary shapes from the graph
        traced = check_traceable(model, partition, plan.n_stages, inputs_mb, targets_mb, loss_fn)
        layer_names = [str(name) for stage in partition.layer_names for name in stage]
    threads = max(1, available_cores() // (plan.P * D)) if device_type == "cpu" else None
    meta = {
        "torch_version": torch.__version__,
        "batch_size": int(global_batch),
        "replica_batch_size": int(batch_size),
        "D": D,
        "microbatch_size": int(batch_size // m),
        "placement": [list(range(d * plan.P, (d + 1) * plan.P)) for d in range(D)],
        "n_layers": len(layer_names),
        "cores": available_cores(),
        "layer_names": layer_names,
    }
    return RunSpec(
        model=model,
        loss_fn=loss_fn,
        data=source,
        optimizer=optimizer,
        plan=plan,
        m=m,
        steps=steps,
        backend=backend,
        device_type=device_type,
        devices=indices,
        threads_per_rank=threads,
        boundaries=boundaries,
        state_keys=tuple(model.state_dict().keys()),
        instrument=instrument,
        seed=seed,
        timeout_s=timeout_s,
        job=job if job is not None else JobOptions(),
        meta=meta,
        traced=traced,
        D=D,
    )
