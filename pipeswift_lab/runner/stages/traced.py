"""Any model torch can split: pipeline stages of a model that is not an ``nn.Sequential``.

A Partition made from a profile taken with ``layers=[...]`` (or ``layers="auto"``) names the
first layer of every stage (``partition.layer_names[s][0]``). Those names become split points
for torch's tracing frontend, ``torch.distributed.pipelining.pipeline(model, (micro_batch,),
split_spec={name: SplitPoint.BEGINNING})``: ``torch.export`` traces one forward and cuts the
graph before each named submodule. Stage ``s`` is the traced submodule
``pipe.get_stage_module(s)``; its ``state_dict`` keys are the original model's FQNs (torch
unflattens the traced hierarchy), so checkpoints and ``RunResult.state_dict()`` are keyed like
``model.state_dict()``.

Hugging Face models run unchanged: the trace and the run turn their KV cache off
(:mod:`pipeswift_lab.profiling.pipeline_settings`); whatever crosses a boundary is what the
tracer cut there (several tensors if need be, each sent contiguous: :mod:`.contiguous`), and
the last stage's output reaches ``loss_fn`` in the model's own structure (:mod:`.outputs`). A
parameter used by two stages (tied embeddings) is held by both and kept in sync (:mod:`.tied`).

Everything that can fail is tried before launch (:func:`check_traceable`): split names that
are not submodules, a forward ``torch.export`` cannot trace (its message, plus what to do:
``split="manual"`` builds the stages without the tracer, :mod:`.manual`), a model output with
no floating tensor, a ``loss_fn`` that cannot read it.

The caller's split travels in the spec (:mod:`.shipped`): each worker unpickles torch's stages
instead of tracing the model again; where the split cannot be pickled or loaded, the workers trace
again from the same model and micro-batch (tracing is deterministic).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from ...core.fake_device import fake_to_meta, faked_on
from ...core.meta_device import shape_pass
from ...profiling.pipeline_settings import training_settings
from .contiguous import contiguous_boundaries
from .outputs import checked_structure
from .shipped import pickled_split, unpickled_split
from .skips import route_skip_connections
from .tied import TiedGroup, tied_groups, unheld_keys

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import Pipe

    from .trial import Trial


@dataclass(frozen=True)
class TracedPlan:
    """What the workers need to re-trace: ``split_names`` (first layer of stages 1..n-1) and an example micro-batch."""

    split_names: tuple[str, ...]
    """The first layer name of stages 1..n-1: where torch's tracer cuts."""
    example: torch.Tensor
    """One micro-batch of inputs (the shapes every step has)."""
    output: TreeSpec | None = None
    """The structure of the model's output (``None``: a tensor), rebuilt for ``loss_fn`` from the last stage's
    tensors."""
    split: bytes | None = None
    """The caller's split of the model at these split points (torch's ``Pipe``, its tensors on the meta device),
    pickled (:mod:`.shipped`): the workers on :attr:`split_device` unpickle it instead of tracing again (``None``:
    they trace)."""
    split_device: str | None = None
    """The device :attr:`split` was traced for (the first rank's): a rank on another (``cuda:1``) traces for its
    own, since a graph keeps the devices it was traced with."""


def split_names(model: nn.Module, partition: Any, n_stages: int) -> tuple[str, ...]:
    """The split points of ``partition``: the first layer name of every stage but the first, checked against ``model``.

    Raises ``ValueError`` when the partition carries no layer names, or a name is not a
    submodule of ``model`` (listing the names that are).
    """
    names = getattr(partition, "layer_names", None)
    if not names or len(names) != n_stages or any(not stage for stage in names):
        raise ValueError(
            f"model is a {type(model).__name__}, not an nn.Sequential: the runner splits it at the first layer of each "
            "stage, "
            "so partition must carry layer names (a Partition made from profile(model, x, layers=[...]))"
        )
    modules = dict(model.named_modules())
    firsts = tuple(str(stage[0]) for stage in names[1:])
    for s, name in enumerate(firsts, start=1):
        if name not in modules or not name:
            nearby = [n for n in modules if n and n.count(".") == name.count(".")][:12]
            listing = f"names at that depth: {nearby}" if nearby else "it has no submodules"
            raise ValueError(
                f"partition stage {s} starts at layer {name!r}, which is not a submodule of the {type(model).__name__} "
                f"({listing}); was the partition made from a profile of another model? A model that is not an "
                "nn.Sequential "
                "is split at the layer names of a profile taken with layers=[...]"
            )
    if len(set(firsts)) != len(firsts):
        raise ValueError(
            f"partition split points {list(firsts)} repeat a layer; every stage must start at its own submodule"
        )
    return firsts


def trace(
    model: nn.Module, example: torch.Tensor, names: tuple[str, ...], device: torch.device, split: bytes | None = None
) -> Pipe:
    """``torch.distributed.pipelining.pipeline(model, (example,), split_spec={name: BEGINNING})`` with every tensor a
    fake one on ``device`` (:func:`~pipeswift_lab.core.fake_device.faked_on`): the graph takes the branches the
    rank's device takes. With ``split`` (:attr:`TracedPlan.split`, the same model, split points and example traced
    by the caller) the caller's ``Pipe`` is unpickled instead, where this process can load it. Returns the
    ``Pipe``, whose stages hold meta tensors (made and filled on the rank).

    Raises ``ValueError`` with the tracer's message, the module it failed in and what to do when the model cannot
    be traced or cut there.
    """
    shipped = unpickled_split(split) if split is not None else None
    return shipped if shipped is not None else _trace(model, example, names, device)


def _trace(model: nn.Module, example: torch.Tensor, names: tuple[str, ...], device: torch.device) -> Pipe:
    """:func:`trace`, tracing ``model`` whatever travelled."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in names}
    modules = dict(model.named_modules())
    saved = {
        name: {k: modules[name].__dict__[k] for k in ("forward", "_orig_forward") if k in modules[name].__dict__}
        for name in names
        if name in modules
    }
    try:
        with warnings.catch_warnings(), training_settings(model), faked_on(model, device) as lift:
            warnings.simplefilter("ignore")
            pipe = pipeline(model, (lift(example),), split_spec=spec)
    except Exception as exc:  # re-raised with what to do
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        where = failing_module(exc, model)
        raise ValueError(
            f"torch's pipeline tracer cannot split the {type(model).__name__} at {list(names)}"
            f"{f' (it failed in {where})' if where else ''}, traced for {device}: {type(exc).__name__}: "
            f"{first}. The tracer (torch.export) needs a forward without data-dependent Python control flow "
            "(an `if` on a tensor's value) or unsupported ops, and each split name must be a submodule called once "
            "in forward (a Hugging Face model's KV cache is already off for the trace). Either make the forward "
            'export-friendly, or pass split="manual" to run(): each stage is then a copy of the model without the '
            "layers of the other stages, run eagerly (see pipeswift_lab.runner.stages.manual)"
        ) from exc
    finally:
        _restore_forwards(modules, saved)
    for s in range(pipe.num_stages):
        fake_to_meta(pipe.get_stage_module(s))
        _run_generated_code(pipe.get_stage_module(s))
    route_skip_connections(pipe)
    contiguous_boundaries(pipe)
    if pipe.num_stages != len(names) + 1:
        raise ValueError(
            f"torch's pipeline tracer made {pipe.num_stages} stages from the split points {list(names)}, not "
            f"{len(names) + 1}: "
            "a split name is not called in forward, or is called more than once"
        )
    return pipe


def _run_generated_code(stage: nn.Module) -> None:
    """Have the submodules torch's split rebuilt (``torch.export.unflatten``'s ``InterpreterModule``) run their
    graph's generated Python code, as a ``GraphModule`` does, instead of ``torch.fx.Interpreter``, which dispatches
    every node in Python: a small Hugging Face stage's forward and backward took 2.5-3 times as long interpreted here.
    Both run the same graph (torch takes the generated code under ``torch.compile``).

    Not where a node is named ``self`` (BERT's ``attention.self``): the generated ``forward(self, ...)`` would assign
    the submodule's output to its own ``self`` and read the next submodule from that tensor."""
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not getattr(module, "_run_with_interpreter", False) or not isinstance(graph, torch.fx.Graph):
            continue
        if all(node.name != "self" for node in graph.nodes):
            module.__dict__["_run_with_interpreter"] = False


def _restore_forwards(modules: dict[str, nn.Module], saved: dict[str, dict[str, Any]]) -> None:
    """Undo torch's ``annotate_split_points``, which wraps each split module's ``forward`` in place (a second trace
    would recurse)."""
    for name, attrs in saved.items():
        mod = modules[name]
        for key in ("forward", "_orig_forward"):
            mod.__dict__.pop(key, None)
        mod.__dict__.update(attrs)


def failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The innermost submodule of ``model`` whose code was running when ``exc`` (or an exception it chains) was
    raised, as ``'name (Class)'``; ``None`` when no frame belongs to one."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                name = names[id(owner)]
                found = f"{name or '(the model)'} ({type(owner).__name__})"
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return found


def check_traceable(trial: Trial) -> tuple[TracedPlan, tuple[TiedGroup, ...]]:
    """Trace the ``trial``'s model at the partition's split points on its micro-batch for the ranks' device, as the
    ranks will, before launch; return the :class:`TracedPlan` and the tied parameters the stages share.

    Also checks that the traced stages hold every key of ``model.state_dict()`` and that
    ``loss_fn`` takes the model's output. Raises ``ValueError`` naming what is wrong.
    """
    model, device = trial.model, trial.device
    names = split_names(model, trial.partition, trial.n_stages)
    example = trial.inputs.detach().clone()
    tied, missing, split = traced_stage_state(model, example, names, device)
    if missing:
        raise ValueError(
            f"the traced stages do not hold {missing[:8]} of model.state_dict(); the runner cannot return or "
            "checkpoint them"
        )
    with torch.no_grad(), training_settings(model), torch.random.fork_rng(), shape_pass(model, device) as lift:
        out = model(lift(example))
        structure = checked_structure(trial.loss_fn, out, lift(trial.targets))
    return TracedPlan(names, example, structure, split, str(device)), tied


#: What a trace told about a model's stages, by model and then by (split names, example shape and dtype, structure,
#: forward settings): a notebook runs one model and partition again and again, and a trace takes a second or two.
_TRACES: weakref.WeakKeyDictionary[
    nn.Module, dict[tuple[Any, ...], tuple[tuple[TiedGroup, ...], list[str], bytes | None]]
] = weakref.WeakKeyDictionary()


def traced_stage_state(
    model: nn.Module, example: torch.Tensor, names: tuple[str, ...], device: torch.device
) -> tuple[tuple[TiedGroup, ...], list[str], bytes | None]:
    """Trace ``model`` at ``names`` and return the tied parameters its stages share, the ``state_dict`` keys no
    stage holds and the split, pickled for the ranks (:attr:`TracedPlan.split`); remembered for the same model,
    split, example shape, module structure and forward settings."""
    structure = tuple((k, tuple(t.shape), t.dtype) for k, t in model.state_dict().items())
    key = (names, tuple(example.shape), example.dtype, structure, forward_settings(model), str(device))
    known = _TRACES.setdefault(model, {})
    if key not in known:
        pipe = _trace(model, example, names, device)
        split = pickled_split(pipe)
        stage_tensors = [pipe.get_stage_module(s).state_dict() for s in range(pipe.num_stages)]
        known.clear()  # one entry per model: the latest split
        known[key] = (tied_groups(model, stage_tensors), unheld_keys(model, stage_tensors), split)
    return known[key]


_SETTING = (bool, int, float, str, type(None))


def forward_settings(model: nn.Module) -> tuple[Any, ...]:
    """What a traced graph depends on besides tensor shapes, as one hashable value: every module by identity with
    its plain settings (``p``, ``eps``, ``training``, ``is_causal``, a ``forward`` set on the instance) and those of
    the configuration objects its modules hold (a Hugging Face ``config``: its attention implementation, flags).

    A graph traced for one value is not the graph of another: the cache of :func:`traced_stage_state`, whose split
    the ranks run, is keyed by it, so a setting changed between two runs is traced again."""
    out: list[Any] = []
    configs: dict[int, Any] = {}
    for module in model.modules():
        plain = []
        for name, value in vars(module).items():
            if isinstance(value, _SETTING):
                plain.append((name, value))
            elif callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
                plain.append((name, id(value)))
            elif hasattr(value, "to_dict") and not isinstance(value, (nn.Module, torch.Tensor, dict)):
                configs.setdefault(id(value), value)
        out.append((id(module), tuple(plain)))
    for config in configs.values():
        out.append(tuple((k, v if isinstance(v, _SETTING) else repr(v)) for k, v in vars(config).items()))
    return tuple(out)


def _traced_ddp(submod: nn.Module, replica_group: ProcessGroup, device: torch.device) -> nn.Module:
    """``DistributedDataParallel`` around a traced stage module, still showing its ``graph`` (torch's traced stage
    reads it)."""
    from torch.nn.parallel import DistributedDataParallel

    class TracedDDP(DistributedDataParallel):
        @property
        def graph(self) -> Any:
            return self.module.graph

    return TracedDDP(
        submod, process_group=replica_group, device_ids=[device] if torch.device(device).type == "cuda" else None
    )


def _skip_self_warmup(stage: Any) -> None:
    """Drop the warm-up sends and receives a traced stage would make to its own rank.

    torch's traced ``_PipelineStage`` warms its neighbours up with dummy send/recv pairs to the
    ranks of stages ``s-1`` and ``s+1``; under a V placement (ZBVZeroBubble, DualPipeV) one of
    them is the stage's own rank, and gloo cannot send to itself ("Pair is not connected").
    The real transfers between two stages of one rank are local and never use those pairs.
    """
    warmup = stage._get_init_p2p_neighbors_ops

    def neighbours_but_self() -> list[Any]:
        return [op for op in warmup() if getattr(op, "group_peer", None) != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = neighbours_but_self


def merged_module(submods: Iterable[nn.Module]) -> nn.Module:
    """One module holding the parameters and buffers of ``submods`` under their own FQNs (shared, not copied).

    Traced stages of one rank share top-level names (``blocks`` in stage 0 and stage 1); the
    merge builds fresh containers so that ``state_dict()`` keys are the original model's.
    """
    root = nn.Module()
    for sub in submods:
        _merge(root, sub)
    return root


def _merge(dst: nn.Module, src: nn.Module) -> None:
    for name, p in src._parameters.items():
        if p is not None:
            dst.register_parameter(name, p)
    for name, b in src._buffers.items():
        if b is not None:
            dst.register_buffer(name, b, persistent=name not in src._non_persistent_buffers_set)
    for name, child in src._modules.items():
        if child is None:
            continue
        if name not in dst._modules:
            dst.add_module(name, nn.Module())
        target = dst._modules[name]
        if target is not None:
            _merge(target, child)


__all__ = [
    "check_traceable",
    "failing_module",
    "forward_settings",
    "merged_module",
    "split_names",
    "trace",
    "traced_stage_state",
    "TracedPlan",
]
