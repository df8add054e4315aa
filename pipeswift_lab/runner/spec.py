"""A run as data: :class:`RunSpec`, checked before launch and saved by value with cloudpickle.

Everything a worker needs (model, loss, data, optimizer factory, stage plan, boundary shapes,
devices) travels in one file, so a run started from a notebook cell and the same run under
``torchrun ... -m pipeswift_lab.runner SPEC`` execute the same code on the same inputs.

Code defined in a notebook or a test is pickled by value and the model as its structure, every tensor on the meta
device (:mod:`.spec_pickle`); the weights travel apart, once (:mod:`.weights`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..core.checks import check_choice, check_int
from ..core.fake_device import trace_device
from ..core.meta_device import InitFn
from ..core.recompute import RecomputePlan, plan_recompute
from ..core.schedule import ScheduleLike
from ..core.version import __version__
from .devices import CPU_RANKS_PER_CORE, available_cores, resolve_devices
from .hf_conversion import hf_class
from .layout import REPLICA_UNSUPPORTED, RunLayout, check_layout, layout_placement, reader_batch
from .layout_memory import layer_shares, whole_gradient_bytes
from .memory_report import predicted_memory
from .options import FSDP, ON_NONFINITE, JobOptions, Launch, check_record, check_trace_dir
from .sources import DataSource, make_data_source
from .spec_pickle import dumps_structure, pickled_by_value
from .stages.precision import check_run_precision
from .stages.sequential import StagePlan, TensorSpec, plan_stages
from .stages.shapes import stage_shapes
from .stages.tied import TiedGroup, alias_map, canonical_state
from .weights import WeightSource, check_run_weights, check_weights, hf_config, open_weights, write_weights

if TYPE_CHECKING:
    from .stages.manual import ManualPlan
    from .stages.traced import TracedPlan

__all__ = [
    "DEFAULT_LR",
    "SPEC_MAGIC",
    "REPLICA_UNSUPPORTED",
    "RunSpec",
    "default_optimizer",
    "make_spec",
    "load_spec",
    "spec_header",
    "SPLITS",
    # defined in devices, sources and options; importable from here as before
    "CPU_RANKS_PER_CORE",
    "available_cores",
    "resolve_devices",
    "DataSource",
    "make_data_source",
    "JobOptions",
    "ON_NONFINITE",
]

#: Learning rate of the default optimizer factory (plain SGD, no momentum).
DEFAULT_LR = 0.01
_FORMAT = "pipeswift_lab.RunSpec"
_VERSION = 3
#: The first bytes of a spec file: a header line (JSON) before the pickle, read without unpickling anything.
SPEC_MAGIC = b"PIPESWIFT-SPEC "
_HEADER_MAX_BYTES = 4096
#: How a model that is not an ``nn.Sequential`` is cut into stages: torch's tracer, or stage copies of the model.
SPLITS = ("trace", "manual")


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer ``run`` uses when given none: ``torch.optim.SGD(params, lr=DEFAULT_LR)``."""
    return torch.optim.SGD(params, lr=DEFAULT_LR)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One pipeline run, complete: what each worker loads. Build it with :func:`make_spec`."""

    model: nn.Module
    """The full model (an ``nn.Sequential``, or one split by torch's tracer); each rank keeps its own stages."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(last_stage_output, targets)`` -> a scalar, the mean over the micro-batch."""
    data: DataSource
    """Each step's ``(inputs, targets)``."""
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    """The factory ``optimizer(params)``, called on every rank with its stages' parameters."""
    plan: StagePlan
    """The stages: bounds, ``P``, ``v``, schedule, ``stage_to_rank``."""
    m: int
    """Micro-batches per step."""
    steps: int
    """Training steps (the job's total; a resumed run starts at its checkpoint's step)."""
    backend: str
    """``"gloo"`` (CPU) or ``"nccl"`` (CUDA)."""
    device_type: str
    """``"cpu"`` or ``"cuda"``."""
    devices: tuple[int, ...] | None
    """The CUDA device index of every local rank; ``None`` on CPU."""
    threads_per_rank: int | None
    """``torch.set_num_threads`` of every CPU rank; ``None`` on CUDA."""
    boundaries: tuple[tuple[TensorSpec, TensorSpec | None], ...]
    """``(input, output)`` of every stage for one micro-batch (empty for traced stages; the output of a manual last
    stage is ``None``: it goes to the loss)."""
    state_keys: tuple[str, ...]
    """``model.state_dict()`` keys, in order."""
    instrument: bool = True
    """Record every F/B/I/W action; False for the overhead baseline."""
    profiler_trace: str | None = None
    """Every rank writes a ``torch.profiler`` trace of its steps into this directory; ``None``: no profiler."""
    seed: int = 0
    """``torch.manual_seed`` on every rank before the first step; data callables get ``seed + step``."""
    timeout_s: float = 300.0
    """The whole run, and every collective's timeout in the workers."""
    job: JobOptions = field(default_factory=JobOptions)
    """Checkpoints, resume, preemption, non-finite losses."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """What the result reports about the run: batch sizes, placement, layer names, torch version, cores."""
    traced: TracedPlan | None = None
    """How to re-trace a model that is not an ``nn.Sequential``; ``None``: its children are the layers."""
    manual: ManualPlan | None = None
    """How to build stage copies without the tracer (``split="manual"``); ``None``: not that way."""
    tied: tuple[TiedGroup, ...] = ()
    """Parameters held by several stages, their gradients summed every step (tied embeddings)."""
    D: int = 1
    """Data-parallel replicas of the pipeline."""
    fsdp: int = 1
    """FSDP2 shard degree inside a replica (HSDP with ``D > 1``)."""
    tp: int = 1
    """Tensor-parallel degree; the world is ``P * D * fsdp * tp`` processes meshed ``(pp, dp, fsdp, tp)``
    (:mod:`~pipeswift_lab.core.layout`)."""
    tp_plan: dict[str, str] | None = None
    """The tensor-parallel plan applied with ``tp > 1`` (``{module glob: style}``,
    :mod:`~pipeswift_lab.core.tp_plan`)."""
    sequence_parallel: bool = False
    """Sequence parallelism between the tensor-parallel regions (:class:`~pipeswift_lab.runner.options.TP`)."""
    reshard_after_forward: bool = False
    """FSDP2 frees the all-gathered parameters after each forward (ZeRO-3) instead of keeping them for the step."""
    recompute: RecomputePlan | None = None
    """Which layers of each stage recompute their activations in the backward; ``None``: none."""
    precision: str | None = None
    """The precision the stages compute in (:mod:`~pipeswift_lab.runner.stages.precision`); ``None``: the model's."""
    weights: WeightSource | None = None
    """Where each rank reads its stages' starting tensors (``None``: initialized, :attr:`init`). A spec saved from a
    model holding real tensors names a safetensors file written beside it."""
    init: InitFn | None = None
    """``init(module)``, which fills the tensors a submodule holds when no weights hold them; ``None``: a Hugging Face
    model's ``_init_weights``, else ``reset_parameters``."""

    @property
    def P(self) -> int:
        """Ranks of one pipeline (stages are spread over them)."""
        return self.plan.P

    @property
    def world_size(self) -> int:
        """Processes: ``P * D * fsdp * tp`` (global rank ``((pp * D + dp) * fsdp + f) * tp + t``)."""
        return self.plan.P * self.D * self.fsdp * self.tp

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the spec to ``path``; return the path.

        The file is a header line (``SPEC_MAGIC`` + JSON: format, version, the toolkit's version,
        the payload's SHA-256 and size) and then the pickle (cloudpickle, by value for code that
        is not an installed package). The model travels as its structure: every tensor of its
        ``state_dict`` is pickled as an empty meta tensor. The real ones the caller's model holds are
        written once beside the spec, as ``<path stem>.safetensors``, and the spec names that file as
        its weights (not for a spec that restores a checkpoint, which fills every tensor). A pickle
        runs code when loaded: load only specs you wrote.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = self.with_weights_beside(path)
        folder = path.parent.resolve()
        if spec.weights is not None and Path(spec.weights.path).resolve().is_relative_to(folder):
            spec = dataclasses.replace(spec, weights=spec.weights.relative_to(folder))  # the folder may move
        with pickled_by_value(self._code_objects()):
            payload = dumps_structure(spec, self.model)
        header = {
            "format": _FORMAT,
            "version": _VERSION,
            "pipeswift_lab": __version__,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "bytes": len(payload),
        }
        path.write_bytes(SPEC_MAGIC + json.dumps(header).encode() + b"\n" + payload)
        return path

    def with_weights_beside(self, path: str | os.PathLike[str]) -> RunSpec:
        """This spec, its model's real tensors written to ``<path stem>.safetensors`` and named as its weights, when it
        has no weights and restores no checkpoint; else this spec. :meth:`save` calls it, and a spec it returns saves
        without writing them again."""
        if self.weights is not None or self.job.resume_from is not None:
            return self
        aliases = alias_map(self.model)
        state = self.model.state_dict(keep_vars=True)
        real = {k: t for k, t in canonical_state(state, aliases).items() if not t.is_meta}
        if not real:
            return self
        file = Path(path).resolve().with_name(Path(path).stem + ".safetensors")
        write_weights(real, file)
        held = {k: t for k, t in state.items() if not t.is_meta}
        source = check_weights(open_weights(file), held, {a: c for a, c in aliases.items() if a in held})
        return dataclasses.replace(self, weights=source)

    def _code_objects(self) -> list[Any]:
        objs = [self.model, self.loss_fn, self.optimizer, self.init]
        objs += list(self.model.modules())
        if self.data.kind == "callable":
            objs.append(self.data.value)
        return objs


def load_spec(path: str | os.PathLike[str]) -> RunSpec:
    """Read a spec written by :meth:`RunSpec.save` (``run(..., launch=Launch(save_spec=path))``); returns the
    :class:`RunSpec`.

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
    spec = cast(RunSpec, pickle.loads(payload))
    if spec.weights is not None:
        spec = dataclasses.replace(spec, weights=spec.weights.resolved(path.parent))
    return spec


def spec_header(path: str | os.PathLike[str], data: bytes | None = None) -> dict[str, Any]:
    """The header of the spec file at ``path`` (format, version, toolkit version, payload SHA-256 and size), checked.

    Raises ``ValueError`` naming the file when the header is missing, unreadable or written for
    another format or version. Nothing is unpickled.
    """
    if data is None:
        with open(path, "rb") as f:
            data = f.read(_HEADER_MAX_BYTES)
    line = data[:_HEADER_MAX_BYTES].split(b"\n", 1)[0]
    where = f"spec file {str(path)!r}"
    if not line.startswith(SPEC_MAGIC):
        raise ValueError(
            f"{where} has no pipeswift_lab spec header: it is not a spec written by "
            "run(..., launch=Launch(save_spec=path)) by this version of pipeswift_lab; nothing was unpickled (a spec "
            "is a pickle and runs code when loaded: load only specs you wrote)"
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


def make_spec(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    partition: Any,
    m: int,
    *,
    schedule: ScheduleLike | None = None,
    steps: int = 10,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    D: int = 1,
    fsdp: int | FSDP = 1,
    tp: int = 1,
    tp_plan: dict[str, str] | None = None,
    split: str | None = None,
    recompute: Any = None,
    precision: str | None = None,
    weights: Any = None,
    init: InitFn | None = None,
    profiler_trace: str | os.PathLike[str] | None = None,
    launch: Launch | None = None,
    job: JobOptions | None = None,
) -> RunSpec:
    """Check every argument of :func:`pipeswift_lab.run` and build the :class:`RunSpec` (no process is started).

    Raises ``TypeError``/``ValueError`` for anything that would fail in the workers and can be
    known here: schedule rules, ``m`` not dividing the batch, too many ranks for the machine,
    stages whose shapes do not chain, a loss that does not take the last stage's output.
    ``split`` is how a model that is not an ``nn.Sequential`` is cut: ``None``/``"trace"`` (torch's
    tracer) or ``"manual"`` (stage copies of the model, :mod:`~pipeswift_lab.runner.stages.manual`).
    ``recompute`` is checked against the stages' layers (:func:`~pipeswift_lab.core.recompute.plan_recompute`).
    ``weights`` (a checkpoint, :func:`~pipeswift_lab.runner.weights.open_weights`) is checked against the model's
    names and shapes; a model on the meta device without them must be initializable
    (:func:`~pipeswift_lab.core.meta_device.check_initializable`). ``launch`` (a
    :class:`~pipeswift_lab.runner.options.Launch`) says where the ranks run and ``job`` what they do with
    checkpoints, preemption and non-finite losses. ``fsdp`` (a degree or :class:`~pipeswift_lab.runner.options.FSDP`),
    ``tp`` and ``tp_plan`` lay each stage out over ``fsdp * tp`` processes (:func:`check_layout`).
    """
    launch = check_record("launch", launch, Launch)
    job = job if job is not None else JobOptions()
    split = None if split is None else check_choice("split", split, SPLITS)
    plan = plan_stages(model, partition, schedule)
    source = check_run_weights(model, weights, init)
    D, m, steps = (check_int(name, value, minimum=1) for name, value in (("D", D), ("m", m), ("steps", steps)))
    seed = check_int("seed", seed)
    layout = check_layout(model, plan, D, fsdp, tp, tp_plan, split)
    split = layout.split
    placement = layout_placement(plan, D, m, launch, layout)
    optimizer = _check_training(model, plan, loss_fn, optimizer)
    data_source = make_data_source(data, steps, seed)
    global_batch, batch_size = reader_batch(data_source, D * layout.fsdp, m, D)
    shapes = stage_shapes(
        model, partition, plan, data_source, batch_size // m, loss_fn, split, trace_device(*placement[1:])
    )
    precision = check_run_precision(precision, checkpoints=bool(job.checkpoint_dir or job.resume_from))
    layout.check_zero1(precision)
    layout.check_sequence(shapes.boundaries)
    layers = shapes.layer_names
    recomputed = plan_recompute(recompute, [tuple(layers[a:b]) for a, b in plan.bounds])
    meta = {
        **_spec_meta(plan, D, m, global_batch, batch_size, layers, layout),
        **_model_meta(model, recompute, recomputed, precision),
        "profiler_trace": check_trace_dir(profiler_trace),
    }
    if launch.instrument:
        meta["memory_predicted"] = predicted_memory(
            partition,
            m=m,
            schedule=plan.schedule,
            micro_batch_size=batch_size // m,
            optimizer=optimizer,
            device_type=placement[1],
            staging=job.checkpoint_dir is not None,
            recompute=meta["recompute_layers"],
            precision=precision,
            D=D,
            fsdp=layout.fsdp,
            tp=layout.tp,
            shares=layer_shares(partition.layers, layout.sequence_parallel)
            if getattr(partition, "layers", None) is not None
            else None,
            whole_grads=whole_gradient_bytes(model, layers, layout.tp_plan),
        )
    backend, device_type, indices = placement
    return RunSpec(
        model=model,
        loss_fn=loss_fn,
        data=data_source,
        optimizer=optimizer,
        plan=plan,
        m=m,
        steps=steps,
        backend=backend,
        device_type=device_type,
        devices=indices,
        threads_per_rank=max(1, available_cores() // layout.world(plan.P, D)) if device_type == "cpu" else None,
        boundaries=shapes.boundaries,
        state_keys=tuple(model.state_dict().keys()),
        instrument=launch.instrument,
        profiler_trace=meta["profiler_trace"],
        seed=seed,
        timeout_s=launch.timeout_s,
        job=job,
        meta=meta,
        traced=shapes.traced,
        manual=shapes.manual,
        tied=shapes.tied,
        D=D,
        fsdp=layout.fsdp,
        tp=layout.tp,
        tp_plan=layout.tp_plan,
        sequence_parallel=layout.sequence_parallel,
        reshard_after_forward=layout.reshard_after_forward,
        recompute=recomputed,
        precision=precision,
        weights=source,
        init=init,
    )


def _model_meta(
    model: nn.Module, recompute: Any, recomputed: RecomputePlan | None, precision: str | None
) -> dict[str, Any]:
    """What the result and the checkpoints report about the model: recomputation asked for and per layer, precision,
    tied-weight aliases and the Hugging Face config and class (``None`` for other models)."""
    return {
        "recompute": (
            recompute
            if not isinstance(recompute, dict)
            else {int(k): v if isinstance(v, str) else list(v) for k, v in recompute.items()}
        ),
        "recompute_layers": recomputed.layer_modes() if recomputed is not None else None,
        "precision": precision,
        "aliases": alias_map(model),
        "hf_config": hf_config(model),
        "hf_class": hf_class(model),
    }


def _check_training(
    model: nn.Module,
    plan: StagePlan,
    loss_fn: object,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """Check ``loss_fn`` and the optimizer factory (by making one optimizer of the model's parameters); return the
    factory (:func:`default_optimizer` for None)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, targets); got {type(loss_fn).__name__}")
    optimizer = default_optimizer if optimizer is None else optimizer
    if not callable(optimizer):
        raise TypeError(
            "optimizer must be a factory such as `lambda params: torch.optim.SGD(params, lr=0.1)`; got "
            f"{type(optimizer).__name__}"
        )
    try:
        probe = optimizer([p for p in model.parameters()])
    except Exception as exc:  # re-raised naming the argument
        raise ValueError(
            f"optimizer(params) raised {type(exc).__name__}: {exc} (optimizer is a factory called with each rank's "
            f"parameters, e.g. `lambda params: torch.optim.SGD(params, lr=0.1)`)"
        ) from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer; it returned {type(probe).__name__}")
    return optimizer


def _spec_meta(
    plan: StagePlan,
    D: int,
    m: int,
    global_batch: int,
    batch_size: int,
    layer_names: list[str],
    layout: RunLayout,
) -> dict[str, Any]:
    """What the result reports about the run beyond the spec's fields."""
    from ..core.layout import global_rank

    fsdp, tp = layout.fsdp, layout.tp
    return {
        "torch_version": torch.__version__,
        "batch_size": global_batch,
        "replica_batch_size": global_batch // D,
        "D": D,
        "fsdp": fsdp,
        "tp": tp,
        "tp_plan": layout.tp_plan,
        "sequence_parallel": layout.sequence_parallel,
        "reshard_after_forward": layout.reshard_after_forward if fsdp > 1 else None,
        "microbatch_size": batch_size // m,
        "placement": [[global_rank(p, d, D=D, fsdp=fsdp, tp=tp) for p in range(plan.P)] for d in range(D)],
        "n_layers": len(layer_names),
        "cores": available_cores(),
        "layer_names": layer_names,
    }
