"""DeepSpeed: a configuration as its JSON ``ds_config`` and ``PipelineModule``'s arguments, and both read back.

DeepSpeed's pipeline engine (``deepspeed/runtime/pipe``) runs 1F1B (``TrainSchedule``), and DualPipeV from 0.19.8
through a ``DualPipeVModule`` (two stages a rank, ``gradient_accumulation_steps >= 2 * num_stages``). Its micro-batches
are ``gradient_accumulation_steps``; ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* dp`` with ``dp = world / (num_stages * tp)``. ``PipelineModule`` splits its layer list by itself
(``partition_method``: ``"uniform"``, ``"parameters"`` or ``"type:regex"``); it takes no boundaries, so the plan's
split is exported as the method that gives it, or the nearest one, and as ``planned_parts`` for a subclass that sets
``self.parts`` in ``_partition_layers`` (as DeepSpeed's own ``DualPipeVModule`` does). ZeRO-2 and ZeRO-3 are refused
with a pipeline (``PipelineEngine``); FSDP shards are exported as data-parallel ranks with ZeRO-1.

:func:`partition_uniform` and :func:`partition_balanced` are DeepSpeed's own (``deepspeed/runtime/utils.py``,
Apache-2.0), copied so that a split is known without DeepSpeed installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .nearest import common_nearest, single_chunk
from .target import ExportTarget, ImportedConfig

__all__ = ["even_stages", "method_parts", "nearest", "partition_balanced", "partition_uniform", "read", "write"]

SCHEDULES = ("1F1B", "DualPipeV")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: ``num_parts + 1`` boundaries, the first parts one item longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = np.arange(0, (num_parts + 1) * chunk, chunk)
    for i in range(residual):
        parts[i + 1 :] += 1
    return [int(p) for p in parts]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the linear partition whose heaviest and lightest parts differ least,
    by dynamic programming (ties: the last split point found)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k, j - 1], prefix[i] - prefix[k])
                min_sum = min(dp_min[k, j - 1], prefix[i] - prefix[k])
                cost = max_sum - min_sum
                if dp_cost[i, j] >= cost:
                    dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def _block_type(types: Sequence[str]) -> str:
    """The most common layer class: the repeated block a ``"type:"`` partition balances."""
    names = [t for t in types if t]
    return max(set(names), key=names.count) if names else ""


def method_parts(method: str, stages: int, params: Sequence[float], types: Sequence[str]) -> list[int]:
    """The boundaries DeepSpeed's ``partition_method`` gives ``stages`` parts of the layers."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(params), stages)
    if method == "parameters":
        return partition_balanced(params, stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        return partition_balanced([1 if pattern.search(t) else 0 for t in types], stages)
    raise ValueError(f"partition_method={method!r}: DeepSpeed takes 'uniform', 'parameters' or 'type:REGEX'")


def _methods(target: ExportTarget) -> list[str]:
    block = _block_type(target.layer_types)
    return ["type:" + block] * bool(block) + ["parameters", "uniform"]


def nearest(target: ExportTarget) -> tuple[ExportTarget, list[str]]:
    """The nearest configuration DeepSpeed can run and what changed; its ``split_method`` is the
    ``partition_method`` that gives its split: the plan's where one does, else the one whose boundaries lie
    nearest the plan's."""
    changes: list[str] = []
    out = target
    if out.schedule_name not in SCHEDULES or (out.schedule_name == "DualPipeV" and out.v != 2):
        out, change = single_chunk(out, "1F1B", "DeepSpeed's pipeline engine runs 1F1B and DualPipeV only")
        changes.append(change)
    out, more = common_nearest(out)
    changes += more
    planned = [a for a, _ in out.bounds] + [out.bounds[-1][1]]
    stages = out.P * out.v
    splits = {m: method_parts(m, stages, out.layer_params, out.layer_types) for m in _methods(out)}
    method = min(splits, key=lambda m: sum(abs(a - b) for a, b in zip(splits[m], planned)))  # first on a tie
    if splits[method] == planned:
        return replace(out, split_method=method), changes
    bounds = tuple(zip(splits[method][:-1], splits[method][1:]))
    changes.append(
        f"split {' '.join(f'{a}-{e}' for a, e in out.bounds)} -> {' '.join(f'{a}-{e}' for a, e in bounds)} "
        f"(PipelineModule takes no boundaries; partition_method={method!r} splits so; planned_parts holds the plan's)"
    )
    return replace(out, bounds=bounds, split_method=method, planned_bounds=out.bounds), changes


def write(target: ExportTarget) -> dict[str, Any]:
    """``{"ds_config": ..., "pipeline_module": ...}`` for ``target`` (from :func:`nearest`, which names its
    ``partition_method``). Raises ``ValueError`` where DeepSpeed refuses it: DualPipeV with
    ``gradient_accumulation_steps < 2 * num_stages``."""
    P, m = target.P, target.m
    if target.schedule_name == "DualPipeV" and m < 2 * P:
        raise ValueError(
            f"DeepSpeed's DualPipeV needs gradient_accumulation_steps >= 2 * num_stages = {2 * P}; m={m} "
            "(DualPipeVModule refuses it)"
        )
    planned = target.planned_bounds or target.bounds
    ds: dict[str, Any] = {
        "train_batch_size": target.global_batch,
        "train_micro_batch_size_per_gpu": target.microbatch_size,
        "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": 1 if (target.precision or "").endswith("zero1") else 0},
    }
    if target.bf16:
        ds["bf16"] = {"enabled": True}
    if target.recompute:
        ds["pipeline"] = {"activation_checkpoint_interval": 1}
    module: dict[str, Any] = {
        "class": "DualPipeVModule" if target.schedule_name == "DualPipeV" else "PipelineModule",
        "num_stages": P,
        "partition_method": target.split_method or "parameters",
        "layers": list(target.layer_names),
        "planned_parts": [a for a, _ in planned] + [planned[-1][1]],
        "activation_checkpoint_interval": 1 if target.recompute else 0,
    }
    if target.tp > 1:
        module["topology"] = {"num_pp": P, "num_mp": target.tp, "num_dp": target.data_parallel}
    return {"ds_config": ds, "pipeline_module": module}


def _load(source: Any) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    text = str(source)
    if isinstance(source, Path) or ("\n" not in text and Path(text).exists()):
        text = Path(text).read_text(encoding="utf-8")
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the DeepSpeed configuration is not JSON: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError("the DeepSpeed configuration must be a JSON object")
    return loaded


def read(source: Any, world: int | None = None) -> ImportedConfig:
    """A DeepSpeed configuration (what :func:`write` returns, a dict or a JSON path or text; or a bare
    ``ds_config``, one pipeline stage unless its ``pipeline.stages`` says) as an :class:`ImportedConfig`.

    Raises ``ValueError`` where DeepSpeed would refuse it: a batch that is not micro-batch × accumulation × dp, a
    ``world`` the stages and tensor-parallel ranks do not divide, ZeRO-2 or ZeRO-3 with a pipeline, DualPipeV with
    fewer than ``2 * num_stages`` micro-batches."""
    loaded = _load(source)
    ds = dict(loaded.get("ds_config", loaded))
    module = dict(loaded.get("pipeline_module", {}))
    stages = module.get("num_stages") or ds.get("pipeline", {}).get("stages") or 1
    if stages == "auto":
        raise ValueError("pipeline.stages is 'auto': give num_stages (the PipelineModule's) or pipeline.stages")
    P = int(stages)
    topology = module.get("topology") or {}
    tp = int(topology.get("num_mp") or ds.get("tensor_parallel", {}).get("autotp_size") or 1)
    b, gas, tbs = (
        ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    )
    gas = int(gas) if gas not in (None, "auto") else gas
    if b is None or (gas is None and tbs is None):
        raise ValueError(
            "the ds_config needs train_micro_batch_size_per_gpu and one of gradient_accumulation_steps or "
            "train_batch_size (DeepSpeed derives the third)"
        )
    auto = [k for k, value in (("train_micro_batch_size_per_gpu", b), ("gradient_accumulation_steps", gas),
                               ("train_batch_size", tbs)) if value == "auto"]  # fmt: skip
    if auto:
        raise ValueError(f"{auto} are 'auto' (the Hugging Face Trainer fills them in): give their numbers")
    b = int(b)
    if world is not None:
        if world % (P * tp):
            raise ValueError(f"world={world} is not divisible by num_stages x tp = {P} x {tp}")
        dp = world // (P * tp)
    elif topology.get("num_dp"):
        dp = int(topology["num_dp"])
    elif tbs is not None and gas is not None:
        dp = int(tbs) // (b * gas)
    else:
        raise ValueError(
            "the data-parallel size is not in the configuration (DeepSpeed reads it from the world): pass world=, or "
            "give all three of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps"
        )
    gas = gas if gas is not None else int(str(tbs)) // (b * dp)
    if tbs is not None and int(tbs) != b * gas * dp:
        raise ValueError(
            f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {b} x gradient_accumulation_steps {gas} x "
            f"data-parallel size {dp} (world {dp * P * tp} / (stages {P} x tp {tp})): DeepSpeed refuses it"
        )
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if stage >= 2 and P > 1:
        raise ValueError(
            f"zero_optimization.stage {stage}: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
        )
    dualpipe = module.get("class") == "DualPipeVModule"
    if dualpipe and gas < 2 * P:
        raise ValueError(f"DualPipeV needs gradient_accumulation_steps >= 2 * {P}, got {gas}")
    bf16 = bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled")) or bool(
        (ds.get("fp16") or {}).get("enabled")
    )
    precision = ("bf16-mixed-zero1" if stage == 1 else "bf16-mixed") if bf16 else "fp32"  # fp16 priced as bf16
    v = 2 if dualpipe else 1
    interval = int(
        module.get("activation_checkpoint_interval")
        or ds.get("pipeline", {}).get("activation_checkpoint_interval")
        or 0
    )
    return ImportedConfig(
        framework="deepspeed",
        P=P,
        D=dp,
        fsdp=1,
        tp=tp,
        v=v,
        m=gas,
        microbatch_size=b,
        schedule="DualPipeV" if dualpipe else "1F1B",
        recompute=" ".join(f"{s}:full" for s in range(P * v)) if interval > 0 else "",
        precision=precision,
        settings={"partition_method": module.get("partition_method", "parameters"), "zero_stage": stage},
    )


def even_stages(
    config: ImportedConfig, names: Sequence[str], params: Sequence[float] = (), types: Sequence[str] = ()
) -> tuple[tuple[str, ...], ...]:
    """The stages ``PipelineModule`` makes of the profile's layers by its ``partition_method``, as layer names."""
    method = str(config.settings.get("partition_method") or "parameters")
    parts = method_parts(
        method, config.P * config.v, list(params) or [1.0] * len(names), list(types) or [""] * len(names)
    )
    return tuple(tuple(names[a:e]) for a, e in zip(parts[:-1], parts[1:]))
