"""A rank's pipeline stages, built from the spec's model structure: only this rank's tensors are ever made.

The spec's model holds meta tensors (:mod:`~pipeswift_lab.core.meta_device`). For each stage
this rank runs, the stage module is cut from the structure (an ``nn.Sequential``'s children, a
``split="manual"`` copy, or torch's traced submodule), made on the rank's device with ``to_empty``
and filled (:func:`stage_fill`): from ``spec.weights`` (only the stage's keys are read), by
initialization (``spec.init``, a Hugging Face model's ``_init_weights``, or ``reset_parameters``,
seeded by name), or, for the ``state_dict``'s tensors of a run that restores a checkpoint, by the restore.
Recomputation, precision and the layout (tensor parallelism, FSDP2 or DDP: :func:`distribute`) wrap it
afterwards, as for any stage.

With tensor parallelism and safetensors weights (:func:`reads_tp_slices`) the
stage is split over its tensor-parallel ranks first, on meta, and each rank reads only its slice of every tensor the
plan shards (:mod:`~pipeswift_lab.runner.tp_slices`); then recomputation, then FSDP2, as torchtitan orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...core.meta_device import Box, initial_values, materialize
from ..tp_slices import ReadTally, log_reads, stage_slices

if TYPE_CHECKING:
    from ..spec import RunSpec
    from .inputs import RankMesh

__all__ = ["build_stages", "stage_fill"]

Fill = Callable[[list[str]], Mapping[str, torch.Tensor]]
"""Given the names of a stage's tensors, their values (those it leaves out stay empty)."""


def stage_fill(
    spec: RunSpec,
    device: torch.device,
    travelled: Mapping[str, torch.Tensor] | None = None,
    *,
    slices: Mapping[str, Box] | None = None,
    tally: ReadTally | None = None,
) -> Fill:
    """How this rank fills a stage's tensors, given their names: from ``travelled`` (buffers the spec carried by
    value), from ``spec.weights``, else initialized. A run that restores a checkpoint leaves the model's
    ``state_dict`` tensors to the restore and fills only the others (a rotary table). ``slices`` ``{key: part}``:
    the keys of which only a part is read (a tensor-parallel rank's, :mod:`~pipeswift_lab.runner.tp_slices`);
    ``tally`` counts what is read from the weights. Returns the fill."""
    weights = spec.weights
    travelled = travelled or {}
    restored = set(spec.state_keys) if spec.job.resume_from is not None else set()
    slices = slices or {}

    def fill(keys: list[str]) -> Mapping[str, torch.Tensor]:
        keys = [k for k in keys if k not in restored]
        out: dict[str, torch.Tensor] = {k: travelled[k].to(device) for k in keys if k in travelled}
        stored = [k for k in keys if k not in out and weights is not None and k in weights]
        if stored and weights is not None:
            parts = {k: slices[k] for k in stored if k in slices}
            out.update(weights.read(stored, device, spec.model, slices=parts, tally=tally))
        rest = [k for k in keys if k not in out]
        if rest:
            out.update(initial_values(spec.model, rest, device, spec.seed, spec.init))
        return out

    return fill


def _stage_modules(spec: RunSpec, stages: list[int]) -> dict[int, nn.Module]:
    from ..stages.sequential import stage_module

    if spec.manual is not None:
        from ..stages.manual import build_manual_modules

        return build_manual_modules(spec.model, spec.manual, stages)
    if isinstance(spec.model, nn.Sequential):
        return {s: stage_module(spec.model, spec.plan.bounds[s]) for s in stages}
    raise TypeError(f"a model that is not an nn.Sequential needs traced stages; got {type(spec.model).__name__}")


def reads_tp_slices(spec: RunSpec, topo: RankMesh) -> bool:
    """Whether this rank splits its stages on meta and reads each sharded tensor's slice: tensor parallelism
    (``topo.tp_mesh`` and a plan), safetensors weights, and no checkpoint to resume from."""
    weights = spec.weights
    return (
        topo.tp_mesh is not None
        and spec.tp_plan is not None
        and weights is not None
        and weights.kind == "safetensors"
        and spec.job.resume_from is None
    )


def build_stages(spec: RunSpec, topo: RankMesh, device: torch.device) -> list[Any]:
    """This rank's ``PipelineStage`` objects (traced stages: torch's ``_PipelineStage``), made and filled on
    ``device``; with ``D > 1`` each stage module is wrapped in ``DistributedDataParallel`` over the replicas."""
    from torch.distributed.pipelining import PipelineStage

    from ...core.recompute import apply_recompute, recompute_weight_pass_once, schedule_splits_backward
    from ..stages.contiguous import send_contiguous

    if spec.traced is not None:
        return build_traced_stages(spec, topo, device)
    plan = spec.plan
    sliced = reads_tp_slices(spec, topo)
    tally = ReadTally()
    stages = []
    for s, module in _stage_modules(spec, plan.stages_of(topo.pp_rank)).items():
        if sliced:
            split_tensor_parallel(module, spec, topo)  # on meta: each rank then reads its slices
        before = tally.copy()
        fill = stage_fill(spec, device, slices=stage_slices(module) if sliced else None, tally=tally)
        filled = materialize(module, device, fill)
        if spec.weights is not None and spec.weights.read_log is not None:
            where = {**topo.coordinates, "rank": topo.rank, "stage": s, "filled_bytes": filled, "sliced_tp": sliced}
            log_reads(spec.weights.read_log, where, tally.since(before))
        if spec.recompute is not None:
            split_backward = schedule_splits_backward(spec.plan.schedule)
            apply_recompute(
                module, spec.recompute.stage_layers(s), spec.recompute.stage_mode(s), split_backward=split_backward
            )
        module = distribute(module, stage_layers(spec, s, module), spec, topo, device, tensor_parallel=not sliced)
        in_spec, out_spec = spec.boundaries[s]
        stage = PipelineStage(
            module,
            s,
            plan.n_stages,
            device,
            input_args=in_spec.empty(device),
            output_args=out_spec.empty(device) if out_spec is not None else None,
            group=topo.pp_group,
        )
        if spec.recompute is not None and schedule_splits_backward(spec.plan.schedule):
            recompute_weight_pass_once(stage)
        stages.append(send_contiguous(stage))
    return stages


def stage_layers(spec: RunSpec, s: int, module: nn.Module) -> list[str]:
    """The profiled layers of stage ``s``, as module names inside its module (FSDP's units)."""
    if spec.manual is not None:
        return list(spec.manual.stage_layers[s])
    return [name for name, _ in module.named_children()]


def split_tensor_parallel(module: nn.Module, spec: RunSpec, topo: RankMesh) -> bool:
    """Split ``module`` over ``topo``'s tensor-parallel ranks by the run's plan, in place (its tensors may still be on
    meta); returns whether it was split (``False`` without tensor parallelism)."""
    if topo.tp_mesh is None or spec.tp_plan is None:
        return False
    from ..stages.sharding import apply_tensor_parallel

    apply_tensor_parallel(module, spec.tp_plan, topo.tp_mesh, sequence_parallel=spec.sequence_parallel)
    return True


def distribute(
    module: nn.Module,
    layers: list[str],
    spec: RunSpec,
    topo: RankMesh,
    device: torch.device,
    *,
    tensor_parallel: bool = True,
) -> nn.Module:
    """A stage module made ready for its layout: split over the tensor-parallel ranks (unless ``tensor_parallel`` is
    False: it was split on meta already), then sharded with FSDP2 over ``topo.shard_mesh`` (or, with replicas only,
    wrapped in ``DistributedDataParallel``); precision as the run asks (FSDP2's ``MixedPrecisionPolicy``, else
    autocast). Returns the module the ``PipelineStage`` runs."""
    from ..stages.precision import autocast_forward, mixed

    if tensor_parallel:
        split_tensor_parallel(module, spec, topo)
    if topo.shard_mesh is not None:
        from ..stages.sharding import apply_fsdp

        return apply_fsdp(
            module,
            layers,
            topo.shard_mesh,
            reshard_after_forward=spec.reshard_after_forward,
            mixed_precision=mixed(spec.precision),
        )
    if mixed(spec.precision):
        autocast_forward(module, device.type)
    if topo.replica_group is not None:
        from torch.nn.parallel import DistributedDataParallel

        # PipelineStage runs the micro-batches' backwards under no_sync() and all-reduces at the last one
        module = DistributedDataParallel(
            module, process_group=topo.replica_group, device_ids=[device] if device.type == "cuda" else None
        )
    return module


def _real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model`` holds for real (they travelled in the spec by value: a rotary table), by name: the
    traced stages are filled with them."""
    return {name: b for name, b in model.named_buffers(remove_duplicate=False) if not b.is_meta}


def build_traced_stages(spec: RunSpec, topo: RankMesh, device: torch.device) -> list[Any]:
    """This pipeline rank's ``_PipelineStage`` objects, from the split the caller traced (or traced again from the
    spec's model and example micro-batch where none travelled) with fake tensors on ``device`` (the graph takes the
    branches ``device`` takes), each stage module made and filled on ``device`` before torch builds its stage."""
    from ...core.recompute import apply_recompute, recompute_weight_pass_once, schedule_splits_backward
    from ..stages.contiguous import send_contiguous
    from ..stages.precision import autocast_forward, mixed
    from ..stages.tied import unify_copies
    from ..stages.traced import _skip_self_warmup, _traced_ddp, trace

    traced = spec.traced
    if traced is None:
        raise ValueError("build_traced_stages needs a spec whose model was traced (spec.traced)")
    travelled = _real_buffers(spec.model)
    shipped = traced.split if traced.split_device == str(torch.device(device)) else None
    pipe = trace(spec.model, traced.example, traced.split_names, device, shipped)
    fill = stage_fill(spec, device, travelled)
    stages = []
    for s in spec.plan.stages_of(topo.pp_rank):
        submod = pipe.get_stage_module(s)
        unify_copies(submod, spec.tied)
        materialize(submod, device, fill)
        stage = send_contiguous(pipe.build_stage(s, device, topo.pp_group))
        if spec.recompute is not None:
            split = schedule_splits_backward(spec.plan.schedule)
            apply_recompute(
                stage.submod, spec.recompute.stage_layers(s), spec.recompute.stage_mode(s), split_backward=split
            )
            if split:
                recompute_weight_pass_once(stage)
        if mixed(spec.precision):
            autocast_forward(stage.submod, torch.device(device).type)
        if topo.replica_group is not None:
            stage.submod = _traced_ddp(stage.submod, topo.replica_group, device)
        _skip_self_warmup(stage)
        stages.append(stage)
    return stages
