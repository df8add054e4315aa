"""A stage split over its tensor-parallel ranks (DTensor) and sharded over its FSDP2 ranks.

Tensor parallelism applies the run's plan (:mod:`~pipeswift_lab.core.tp_plan`) to the stage's modules with torch's
``parallelize_module``, each Hugging Face style as the torch ``ParallelStyle`` that computes the same thing
(:func:`parallel_style`); the module names are the full model's, so one plan serves every stage.

FSDP2 (``fully_shard``) wraps each of the stage's layers that holds parameters, then the stage module as its root
(torchtitan's ``apply_fsdp``). Under a pipeline schedule the parameters stay unsharded for the whole step
(``reshard_after_forward=False``, torchtitan's choice under PP): with ``True``, FSDP2 gives wrong gradients under the
schedules that split the backward (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: some ``grad is None``, others
off by ~3e-3 in torch 2.13), so :func:`check_reshard` refuses it there. ``precision="bf16-mixed"`` becomes FSDP2's
``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction, fp32 outputs to send).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_fsdp", "apply_tensor_parallel", "check_reshard", "parallel_style", "stage_targets", "unshard"]


def check_reshard(reshard_after_forward: bool, schedule: Any, P: int) -> None:
    """Raise ``ValueError`` for ``reshard_after_forward=True`` under a pipeline schedule (a name or a ``Schedule``)
    that splits the backward."""
    from ...core.vocabulary import splits_backward

    if reshard_after_forward and P > 1 and splits_backward(schedule):
        raise ValueError(
            f"FSDP reshard_after_forward=True with schedule={schedule!r} gives wrong gradients in torch's pipelining: "
            "the split input/weight backward runs on parameters FSDP has resharded (some gradients come back None, "
            "others off by ~3e-3). Keep reshard_after_forward=False (the default under a pipeline, as torchtitan "
            "does) or use GPipe, 1F1B or Interleaved1F1B"
        )


class GradientAllReduce:
    """``replicated_with_grad_allreduce``: the parameters stay whole on every tensor-parallel rank, and each
    micro-batch's gradient is summed over the ranks before it accumulates (a norm over this rank's heads only sees
    their share of the gradient).

    The hooks go on the parameters the module computes with, found at each forward: FSDP2 swaps a module's
    parameters for the unsharded ones it gathers, so a hook set once, before sharding, would be on a tensor the
    backward never reaches."""

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Hook ``module`` so that its parameters' gradients are summed over ``mesh``; return it."""
        import torch.distributed as dist

        group = mesh.get_group()

        def summed(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        def hook_parameters(mod: nn.Module, _args: Any) -> None:
            for param in mod.parameters(recurse=False):
                if param.requires_grad and not getattr(param, "_grad_summed_over_tp", False):
                    param.register_hook(summed)
                    param._grad_summed_over_tp = True  # type: ignore[attr-defined]

        module.register_forward_pre_hook(hook_parameters)
        return module


def parallel_style(style: str) -> Any:
    """The torch ``ParallelStyle`` (or :class:`GradientAllReduce`) that computes what Hugging Face's ``style`` does."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles: dict[str, Any] = {
        "colwise": ColwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel(),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "sequence_parallel": SequenceParallel(),
        "replicated_with_grad_allreduce": GradientAllReduce(),
    }
    return styles[style]


def stage_targets(stage: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``{module name inside stage: style}`` of the stage's modules the plan's globs match (the stage keeps the
    model's module names; a layer another stage runs, left in a stage copy as a placeholder, is not matched)."""
    from ...core.tp_plan import STYLES

    targets = {}
    for name, module in stage.named_modules():
        for glob, style in plan.items():
            kind = STYLES[style]
            if name and fnmatch.fnmatchcase(name, glob) and (kind is None or isinstance(module, kind)):
                targets[name] = style
    return targets


def apply_tensor_parallel(
    stage: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> dict[str, str]:
    """Split ``stage``'s planned modules over the tensor-parallel ``mesh``, in place; return ``{module: style}``.

    With ``sequence_parallel`` the stage's layers run between their regions on a slice of the sequence
    (:mod:`~pipeswift_lab.core.sequence_parallel`): the exits reduce-scatter along the sequence, each region's
    input is all-gathered, the norms run on the slice (torch's ``SequenceParallel``), and each run of consecutive
    layers slices its input and gathers its output, so that the stage's boundaries carry the whole sequence."""
    from torch.distributed.tensor.parallel import parallelize_module

    targets = stage_targets(stage, plan)
    torch_plan = {}
    for name, style in targets.items():
        applied = parallel_style(style)
        if isinstance(applied, GradientAllReduce):
            applied.apply(stage.get_submodule(name), mesh)
        else:
            torch_plan[name] = applied
    if sequence_parallel:
        torch_plan.update(_sequence_parallel(stage, targets, mesh))
    if torch_plan:
        parallelize_module(stage, mesh, torch_plan)
    return targets


def _sequence_parallel(stage: nn.Module, targets: Mapping[str, str], mesh: DeviceMesh) -> dict[str, Any]:
    """The torch styles that replace ``targets``' under sequence parallelism, with the gathering and slicing hooks
    installed on the stage's regions and layer runs; returns ``{module: style}``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    from ...core.sequence_parallel import SEQUENCE_DIM, sequence_parallel_plan

    sp = sequence_parallel_plan(stage, targets)
    seq = Shard(SEQUENCE_DIM)
    styles: dict[str, Any] = {}
    for name in sp.exits:
        whole_input = targets[name] in ("rowwise_split_input", "rowwise_rep")
        styles[name] = RowwiseParallel(input_layouts=Replicate() if whole_input else Shard(-1), output_layouts=seq)
    for name in sp.gathered_inputs:
        # a region's projections take the gathered input as a Replicate DTensor: the backward sums their partial
        # input gradients and reduce-scatters them once (Megatron's volume), where a local tensor would all-reduce
        # them and slice
        gather = _redistributing(mesh, seq, Replicate(), local=False)
        stage.get_submodule(name).register_forward_pre_hook(gather, with_kwargs=True)
    for name in sp.norms:
        styles[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True)
    for run in sp.runs():
        stage.get_submodule(run[0]).register_forward_pre_hook(_redistributing(mesh, Replicate(), seq), with_kwargs=True)
        stage.get_submodule(run[-1]).register_forward_hook(_redistributing_output(mesh, seq, Replicate()))
    return styles


def _redistribute(x: torch.Tensor, mesh: DeviceMesh, src: Any, dst: Any, *, local: bool = True) -> torch.Tensor:
    """``x``, this rank's part of a tensor laid out as ``src`` over ``mesh``, as its part laid out as ``dst``
    (DTensor's collectives, differentiable: a gather's backward slices, a slice's backward gathers)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(dst, Shard) and x.shape[dst.dim] % mesh.size():
        raise ValueError(
            f"sequence parallelism over tp={mesh.size()} needs the sequence length to divide evenly; a hidden state of "
            f"shape {tuple(x.shape)} has {x.shape[dst.dim]} positions"
        )
    out = DTensor.from_local(x, mesh, [src], run_check=False).redistribute(mesh, [dst])
    return out.to_local() if local else out


def _redistributing(mesh: DeviceMesh, src: Any, dst: Any, *, local: bool = True) -> Any:
    """A forward pre-hook (``with_kwargs``) redistributing a module's hidden-state input: its first positional
    tensor, else its ``hidden_states`` keyword (Hugging Face passes attention's so); as a local tensor, or as the
    DTensor (``local=False``)."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (_redistribute(args[0], mesh, src, dst, local=local), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            hidden = _redistribute(kwargs["hidden_states"], mesh, src, dst, local=local)
            return args, {**kwargs, "hidden_states": hidden}
        raise TypeError(
            f"sequence parallelism: {type(module).__name__} was called with no tensor as its first argument or "
            "hidden_states=, so its hidden states cannot be found"
        )

    return hook


def _redistributing_output(mesh: DeviceMesh, src: Any, dst: Any) -> Any:
    """A forward hook redistributing a module's output: the tensor, or the first item of a tuple (a Hugging Face
    decoder layer's)."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _redistribute(output, mesh, src, dst)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (_redistribute(output[0], mesh, src, dst), *output[1:])
        raise TypeError(f"sequence parallelism: {type(module).__name__} returned no tensor to gather")

    return hook


def apply_fsdp(
    stage: nn.Module,
    layers: Sequence[str],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = False,
    mixed_precision: bool = False,
) -> nn.Module:
    """Shard ``stage`` with FSDP2 over ``mesh`` (1-D: FSDP; 2-D ``(dp, fsdp)``: HSDP), each of its ``layers``
    (module names inside it) holding parameters as a unit and the stage as the root; return the stage."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for name in layers:
        layer = stage.get_submodule(name)
        if layer is not stage and any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return stage


def unshard(module: nn.Module) -> bool:
    """All-gather the parameters of every FSDP2 unit in ``module`` now, at the start of a step (with
    ``reshard_after_forward=False`` they stay gathered until the step's reduce-scatter, so gathering them at once
    holds no more than gathering them layer by layer in the first forward, and the gather is one action to time).
    Returns whether ``module`` is sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return False
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
    return True
