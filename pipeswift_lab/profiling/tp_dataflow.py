"""One forward under a tensor-parallel plan, on fake tensors: what each unit saves, computes and communicates, and
which part of it is a local shard.

:func:`trace_tp_dataflow` runs the whole model once, every parameter and input a fake tensor
(:func:`~pipeswift_lab.core.fake_device.faked_on`: no memory, no process group, any model size, a meta model too),
in training mode with the runner's training settings, and follows the plan's shards through the data flow. A
``TorchDispatchMode`` sees every aten operator (those inside ``F.linear`` and attention included) and tags a
storage *sharded* when an operator writes it from a sharded input. The sources are the sharded weights (the weights
of ``colwise*``, ``rowwise*`` and ``embedding_*`` modules; a colwise bias too), so a colwise module's output is
sharded, and so is everything computed from it (rotary, attention on its heads, an activation), until an exit point:

* the output of ``rowwise``, ``rowwise_split_input`` and ``embedding_rowwise`` modules is all-reduced, that of
  ``colwise_gather_output`` and ``embedding_colwise`` modules all-gathered: it is replicated again, and its bytes
  are what the forward communicates there;
* a ``rowwise*`` module takes its local slice of the input: a whole (replicated) input is replaced, for the
  module, by a sharded copy, as torch's ``RowwiseParallel(input_layouts=Replicate())`` splits it into a new tensor;
* in the backward, the gradient of a colwise module's input is all-reduced (one tensor feeding several colwise
  modules, a Llama's q, k and v projections, once), and that of a ``rowwise_split_input`` module's whole input is
  all-gathered from the slices (measured with torch's DTensor styles; see docs/profiling.md).

What a unit saves for its backward is counted as the profiler's hooks count ``activation_bytes`` where memory is not
measured (:mod:`.hooks`): ``saved_tensors_hooks``, each storage once per unit, parameters and buffers left out; a
saved storage tagged sharded is a local shard under TP. Forward FLOPs are counted with the formulas of
``torch.utils.flop_counter`` (matrix products, convolutions, attention); an operator with a sharded input is
sharded. ``replicated_with_grad_allreduce`` modules shard no tensor (their weight gradients are summed over ``tp``
once a step, not per micro-batch). ``sequence_parallel`` styles in a plan are not followed.

Sequence parallelism (:mod:`~pipeswift_lab.core.sequence_parallel`) is followed too, when the plan allows it: inside
its layers and outside their regions every storage an operator writes is a *sequence slice* (the norms, the
residual sums, a row-parallel exit's output, which is reduce-scattered), and so is a layer's input. A slice saved
there counts in ``sliced_saved_bytes``; saved inside a region (a column-parallel projection saves its input), it
counts whole, because the region all-gathers its input into a new, whole tensor. That whole copy is torch's (and
more than Megatron's formula assumes, which counts a sliced norm output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from ..core.fake_device import faked_on
from .hooks import iter_tensors, tensor_bytes
from .pipeline_settings import training_settings

__all__ = ["COLWISE_STYLES", "ROWWISE_STYLES", "UnitDataflow", "sharded_parameters", "trace_tp_dataflow"]

#: Styles that cut a linear layer's output features (their input is whole, its gradient all-reduced).
COLWISE_STYLES = ("colwise", "colwise_gather_output", "colwise_rep")
#: Styles that cut a linear layer's input features (their output is all-reduced).
ROWWISE_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep")
_GATHERED = ("colwise_gather_output", "colwise_rep", "embedding_colwise")
_REDUCED = ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise")
_SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")
_EMBEDDING = ("embedding_rowwise", "embedding_colwise")
#: The attention kernel a CPU runs, counted as torch's counter counts the others.
_CPU_ATTENTION_FLOPS = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]


def _grouped_mm_flops(input: torch.Tensor, weight: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """A grouped matrix product's FLOPs (each row of ``input`` multiplied by its group's matrix): two per
    multiply-add, from the output's size and the reduced dimension."""
    if not isinstance(out_val, torch.Tensor):
        return 0
    if input.dim() == 2 and weight.dim() == 2:  # groups along the reduced dimension: (m, k) @ (k, n) -> (g, m, n)
        return 2 * input.shape[0] * input.shape[1] * weight.shape[1]
    return 2 * out_val.numel() * input.shape[-1]


#: Operators ``torch.utils.flop_counter`` does not know: the attention kernel a CPU runs, grouped matrix products
#: (a mixture of experts: torch's, and the fallback transformers registers).
_EXTRA_FLOPS: dict[str, Callable[..., Any]] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": _CPU_ATTENTION_FLOPS,
    "aten::_grouped_mm": _grouped_mm_flops,
    "transformers::grouped_mm_fallback": _grouped_mm_flops,
}


@dataclass(kw_only=True)
class UnitDataflow:
    """What one unit's forward saves, computes and communicates under the plan (bytes and FLOPs at the full,
    ``tp = 1``, size)."""

    saved_bytes: int = 0
    """The storages autograd saves for the backward, each once, parameters and buffers left out."""
    sharded_saved_bytes: int = 0
    """The part of ``saved_bytes`` that is a local shard under TP."""
    duplicated_bytes: int = 0
    """Bytes saved whole beside a slice: the whole input of a ``rowwise_split_input`` module that another operator
    saves too (an attention's output). One process saves them once, as one tensor; under TP the module saves its
    slice, a new tensor, and the whole stays."""
    sliced_saved_bytes: int = 0
    """The part of ``saved_bytes`` that, not sharded, is a slice of the sequence under sequence parallelism (0 when
    the plan does not allow it)."""
    flops: int = 0
    """Forward FLOPs (``torch.utils.flop_counter``'s formulas)."""
    sharded_flops: int = 0
    """The part of ``flops`` computed on sharded tensors or with sharded weights."""
    forward_bytes: int = 0
    """Bytes the forward all-reduces or all-gathers at the plan's exit points."""
    backward_bytes: int = 0
    """Bytes of input gradients the backward all-reduces (colwise inputs) or all-gathers (split inputs)."""
    _saved: dict[Any, bool] = field(default_factory=dict, repr=False)
    _reduced_inputs: set[Any] = field(default_factory=set, repr=False)
    _gathered_inputs: set[Any] = field(default_factory=set, repr=False)
    _replaced: dict[Any, int] = field(default_factory=dict, repr=False)


def sharded_parameters(module: nn.Module, style: str) -> list[torch.Tensor]:
    """The parameters of ``module`` that ``style`` cuts: a linear layer's weight (and its bias when the output
    features are cut), an embedding's weight; none for the other styles."""
    names: tuple[str, ...] = ()
    if style in COLWISE_STYLES:
        names = ("weight", "bias")
    elif style in ROWWISE_STYLES or style in _EMBEDDING:
        names = ("weight",)
    return [p for n in names if (p := module._parameters.get(n)) is not None]


def _storage_key(t: torch.Tensor) -> Any:
    """The storage behind ``t`` (views share it), for a fake tensor too (whose storage has no address)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a plain storage
        return ("id", id(t))


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return _int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return _int(tensor_bytes(t))


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """``t`` as one tensor of one storage: a view elsewhere in the storage is another tensor."""
    return _storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _int(value: Any) -> int:
    """A count as an int (one that depends on a value the fake pass does not know, a symbol, counts 0)."""
    try:
        return int(value)
    except (TypeError, RuntimeError, ValueError):
        return 0


class _ShardFlow(TorchDispatchMode):
    """Tags the storages each operator writes from a sharded input, and counts the FLOPs and saved storages of the
    unit that runs (see the module docs)."""

    def __init__(self, n_units: int, sharded: set[Any], state: set[Any]) -> None:
        super().__init__()
        self.units = [UnitDataflow() for _ in range(n_units)]
        self.stack: list[int] = []
        self.sharded, self.state = sharded, state
        self.sliced: set[Any] = set()  # storages that are sequence slices under sequence parallelism
        self.in_layer = 0  # depth inside the sequence-parallel layers
        self.in_region = 0  # depth inside their regions (whose input is gathered whole)
        self.kept: list[torch.Tensor] = []  # tagged and saved storages stay alive: a key is never another storage's

    # -- tags --------------------------------------------------------------------------------
    def is_sharded(self, t: torch.Tensor) -> bool:
        return _storage_key(t) in self.sharded

    def tag(self, t: torch.Tensor, sharded: bool = True) -> None:
        key = _storage_key(t)
        if sharded:
            self.sharded.add(key)
            self.kept.append(t)
        else:
            self.sharded.discard(key)

    def slice(self, t: torch.Tensor) -> None:
        self.sliced.add(_storage_key(t))
        self.kept.append(t)

    @property
    def unit(self) -> UnitDataflow | None:
        return self.units[self.stack[-1]] if self.stack else None

    # -- operators ----------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sharded = any(self.is_sharded(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if sharded:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tag(t)
        elif self.in_layer and not self.in_region:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.slice(t)
        unit = self.unit
        if unit is not None:
            formula = flop_registry.get(getattr(func, "_overloadpacket", func)) or _EXTRA_FLOPS.get(
                getattr(getattr(func, "_schema", None), "name", "")
            )
            if formula is not None:
                flops = _int(formula(*args, **kwargs, out_val=out))
                unit.flops += flops
                unit.sharded_flops += flops if sharded else 0
        return out

    # -- saved tensors --------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> None:
        """Count a tensor autograd saves; keep nothing (the pass runs no backward, and a saved output kept here
        would hold its own graph alive through C++, out of the garbage collector's reach)."""
        unit = self.unit
        key = _storage_key(t)
        if unit is not None and key not in self.state and key not in unit._saved:
            sharded = key in self.sharded
            unit._saved[key] = sharded
            self.kept.append(t)  # alive until the pass ends: a freed storage's key could name a later one
            nbytes = _storage_nbytes(t)
            unit.saved_bytes += nbytes
            unit.sharded_saved_bytes += nbytes if sharded else 0
            unit.duplicated_bytes += unit._replaced.pop(key, 0)  # a whole input a split replaced, saved after it
            sliced = not sharded and self.in_layer and not self.in_region and key in self.sliced
            unit.sliced_saved_bytes += nbytes if sliced else 0

    # -- the plan's modules ------------------------------------------------------------------------
    def entering(self, style: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before a planned module's forward: note the input gradients its backward communicates; give a rowwise
        module its local slice of a whole input."""
        unit = self.unit
        inputs = [t for t in iter_tensors((args, kwargs)) if t.requires_grad and t.is_floating_point()]
        if unit is not None and (style in COLWISE_STYLES or style in _SPLIT_INPUT):
            seen = unit._reduced_inputs if style in COLWISE_STYLES else unit._gathered_inputs
            for t in inputs:
                if _tensor_key(t) not in seen:
                    seen.add(_tensor_key(t))
                    self.kept.append(t)
                    unit.backward_bytes += _int(tensor_bytes(t))
        if style not in ROWWISE_STYLES or not args or not isinstance(args[0], torch.Tensor):
            return None
        if self.is_sharded(args[0]):
            return None
        local = args[0].clone()  # a new tensor, as the split makes one: the whole input is not what the module keeps
        self.tag(local)
        if unit is not None:
            key, nbytes = _storage_key(args[0]), _storage_nbytes(args[0])
            if key in unit._saved:  # saved already by another operator: it stays whole beside the slice
                unit.duplicated_bytes += nbytes
            else:
                unit._replaced[key] = nbytes
        return (local, *args[1:]), kwargs

    def leaving(self, style: str, output: Any) -> None:
        """After a planned module's forward: an exit point's output is communicated and replicated again."""
        if style not in _GATHERED and style not in _REDUCED:
            return
        unit = self.unit
        for t in iter_tensors(output):
            self.tag(t, sharded=False)
            if self.in_layer:
                self.slice(t)  # under sequence parallelism an exit reduce-scatters along the sequence
            if unit is not None and t.is_floating_point():
                unit.forward_bytes += _int(tensor_bytes(t))


def _sequence_hooks(flow: _ShardFlow, layers: Sequence[nn.Module], regions: Sequence[nn.Module]) -> list[Any]:
    """Forward hooks that tell ``flow`` when it runs inside a sequence-parallel layer (whose input is a slice) and
    inside one of its regions."""
    handles = []

    def enter_layer(module: nn.Module, args: Any, kwargs: Any) -> None:
        flow.in_layer += 1
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and not flow.is_sharded(hidden):
            flow.slice(hidden)

    def leave_layer(module: nn.Module, args: Any, output: Any) -> None:
        flow.in_layer -= 1

    def enter_region(module: nn.Module, args: Any) -> None:
        flow.in_region += 1

    def leave_region(module: nn.Module, args: Any, output: Any) -> None:
        flow.in_region -= 1

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(enter_layer, with_kwargs=True))
        handles.append(layer.register_forward_hook(leave_layer))
    for region in regions:
        handles.append(region.register_forward_pre_hook(enter_region))
        handles.append(region.register_forward_hook(leave_region))
    return handles


def _hooks(
    flow: _ShardFlow, units: Sequence[tuple[str, nn.Module]], styled: Sequence[tuple[nn.Module, str]]
) -> list[Any]:
    """Forward hooks: each unit says it runs; each planned module (a unit itself too) reports its entry and exit
    while its unit runs."""
    handles = []
    for module, style in styled:

        def enter(module: nn.Module, args: Any, kwargs: Any, style: str = style) -> Any:
            return flow.entering(style, args, kwargs)

        def leave(module: nn.Module, args: Any, output: Any, style: str = style) -> None:
            flow.leaving(style, output)

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave))
    for index, (_, module) in enumerate(units):

        def enter_unit(module: nn.Module, args: Any, index: int = index) -> None:
            flow.stack.append(index)

        def leave_unit(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
            if flow.stack and flow.stack[-1] == index:
                flow.stack.pop()

        handles.append(module.register_forward_pre_hook(enter_unit, prepend=True))
        handles.append(module.register_forward_hook(leave_unit))
    return handles


def trace_tp_dataflow(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    targets: Mapping[str, str],
    sample: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> list[UnitDataflow]:
    """Run ``model(*args, **kwargs)`` (``sample``) once on fake tensors on ``device`` (under autocast to
    ``autocast_dtype`` when given) with the plan's matched modules ``targets`` (``{module name: style}``,
    :func:`~pipeswift_lab.core.tp_plan.tp_targets`) and return a :class:`UnitDataflow` per unit of ``units``, in
    their order. The model comes back as it was (its tensors, training flags, config and the random state)."""
    from ..core.sequence_parallel import sequence_parallel_plan

    modules = dict(model.named_modules())
    styled = [(modules[name], style) for name, style in targets.items()]
    sp = sequence_parallel_plan(model, targets)
    follows_sequence = not sp.refused and bool(sp.layers)
    training = [(m, m.training) for m in model.modules()]
    args, kwargs = sample
    with faked_on(model, device, run=True) as lift, training_settings(model), torch.random.fork_rng(devices=[]):
        state = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        sharded = {_storage_key(p) for module, style in styled for p in sharded_parameters(module, style)}
        flow = _ShardFlow(len(units), sharded, state)
        handles = _hooks(flow, units, styled)
        if follows_sequence:
            layers, regions = [modules[n] for n in sp.layers], [modules[n] for n in sp.gathered_inputs]
            handles += _sequence_hooks(flow, layers, regions)
        fake = _lifted(lift)
        try:
            model.train()
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(flow.pack, _no_backward),
                torch.autocast(device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext(),
                flow,
            ):
                output = model(*fake(args), **fake(kwargs))
            del output
        finally:
            flow.kept.clear()  # the tagged tensors' graph holds this pass's saved-tensor hook: a cycle through C++
            for handle in handles:
                handle.remove()
            for module, flag in training:
                module.training = flag
    return flow.units


def _no_backward(packed: None) -> torch.Tensor:
    raise RuntimeError("the tensor-parallel dataflow pass runs no backward")


def _lifted(lift: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], Any]:
    """``lift`` applied to every tensor of a nested sample (a tensor that wants a gradient keeps wanting one)."""

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return lift(x).requires_grad_(x.requires_grad) if x.is_floating_point() else lift(x)

    return lambda obj: tree_map(one, obj)
