"""Price one configuration, as written, with a plan's own inputs: what :meth:`Plan.price
<pipeswift_lab.planning.result.Plan.price>`, :meth:`Plan.compare <pipeswift_lab.planning.result.Plan.compare>` and
:meth:`Plan.export <pipeswift_lab.planning.result.Plan.export>` use.

A configuration is priced as the planner prices the rows of its table (:func:`~.steps.bound_config`, then
:func:`~.steps.evaluate`), with three differences: its split is the one it names (``stage_bounds``; none: the split
the planner would take), it is priced whether or not it fits the memory cap (``fits`` says), and a configuration whose
global batch differs from the plan's runs as many steps as it takes to train on the same samples.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import pandas as pd

from ..core.vocabulary import validate
from .inputs import PlanInputs
from .placement import pipeline_link_of
from .search import Evaluator
from .splits import Bounds
from .steps import Row, _fixed_terms, evaluate

__all__ = ["Configuration", "bounds_of", "price_row"]

#: Whole-stage recomputation a forced evaluator applies to every layer.
_UNIFORM_MODES = ("full", "selective")


class Configuration(Protocol):
    """What :func:`price_row` reads: a :class:`~pipeswift_lab.planning.result.PlannedConfig` or an imported one."""

    @property
    def P(self) -> int: ...
    @property
    def D(self) -> int: ...
    @property
    def fsdp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def m(self) -> int: ...
    @property
    def microbatch_size(self) -> int: ...
    @property
    def v(self) -> int: ...
    @property
    def schedule(self) -> Any: ...
    @property
    def recompute(self) -> str: ...
    @property
    def stage_bounds(self) -> str: ...


def bounds_of(stage_bounds: str) -> Bounds:
    """``"0-3 3-7"`` as ``((0, 3), (3, 7))``."""
    return tuple((int(a), int(e)) for a, e in (item.split("-") for item in stage_bounds.split()))


def _uniform_recompute(config: Configuration) -> str | None:
    """The one mode every stage recomputes with (None: none recomputes); ``ValueError`` for stages that differ."""
    if not config.recompute:
        return None
    modes = {item.split(":")[1] for item in config.recompute.split()}
    stages = {int(item.split(":")[0]) for item in config.recompute.split()}
    if len(modes) == 1 and len(stages) == config.P * config.v and modes <= set(_UNIFORM_MODES):
        return modes.pop()
    raise ValueError(
        f"recompute={config.recompute!r}: a configuration whose stages recompute differently is priced by the plan "
        "that found it (its row of Plan.table); price one that recomputes every stage alike, or none"
    )


def price_row(inputs: PlanInputs, evaluator: Evaluator, config: Configuration, precision: str | None = None) -> Row:
    """The row :attr:`Plan.table <pipeswift_lab.planning.result.Plan.table>` would hold for ``config`` priced as
    written: its JCT terms, step, bubble and each rank's peak, with ``stage_bounds`` always filled, ``fits`` (its
    peak within the memory cap), ``steps`` (the steps it trains: the plan's, scaled to the same samples where its
    global batch differs) and ``global_batch``.

    ``precision`` is the configuration's own (a framework's ``--bf16``, ZeRO-1 or fp32), priced in the plan's stead
    where the plan names one; None, or a plan that prices the profile's own bytes (``precision=None``): the plan's.

    Raises ``ValueError`` where the configuration cannot run at all (``m`` and the schedule, stages past the layers,
    bounds that do not cover the model's layers in order).
    """
    P, D, fsdp, tp, v = int(config.P), int(config.D), int(config.fsdp), int(config.tp), int(config.v)
    m, b, schedule = int(config.m), int(config.microbatch_size), config.schedule
    if P * v > inputs.n_layers:
        raise ValueError(f"P*v={P * v} stages exceed the {inputs.n_layers} layers of the plan's profile")
    validate(P, m, schedule, v)
    global_batch = m * b * D * fsdp
    steps = inputs.steps
    if global_batch != inputs.global_batch:  # the same samples: more or fewer steps
        steps = max(1, round(inputs.steps * inputs.global_batch / global_batch))
    mode = _uniform_recompute(config)
    searched = mode is None and inputs.recompute == "search"  # no stage recomputes: the plan's own search may
    own = precision if precision is not None and inputs.precision is not None else inputs.precision
    priced = dataclasses.replace(
        inputs,
        steps=steps,
        global_batch=global_batch,
        recompute=inputs.recompute if searched else mode,
        precision=own,
    )
    if priced.recompute != inputs.recompute or priced.precision != inputs.precision:
        evaluator = Evaluator(priced)
    at = evaluator.at(tp, pipeline_link_of(priced, (P, D, fsdp, tp)))
    if config.stage_bounds:
        bounds = bounds_of(config.stage_bounds)
        _check_bounds(bounds, P * v, inputs.n_layers)
        split = at.split_at(P, m, b, schedule, v, D, fsdp, bounds)
    else:
        try:
            split = at.split(P, m, b, schedule, v, D, fsdp)
        except ValueError:  # no split fits the cap: price the time-balanced one, which does not fit either
            split = at.split_at(P, m, b, schedule, v, D, fsdp, at._balanced_bounds(P, m, schedule, v, b))
    gpus = P * D * fsdp * tp
    queue = priced.availability.wait_s(gpus)
    row: Row = {"strategy": "now" if queue == 0 else "wait", "change": "", "P": P, "D": D, "fsdp": fsdp, "tp": tp}
    row.update(gpus=gpus, m=m, microbatch_size=b, schedule=schedule, v=v)
    row.update(_fixed_terms(priced, split, (P, D, m, b, schedule, v, fsdp, tp), queue))
    row["jct_lower_bound_s"] = math.nan
    row = evaluate(priced, at, row, split)
    row["stage_bounds"] = " ".join(f"{a}-{e}" for a, e in split.bounds)
    limit = priced.mem_per_gpu_bytes
    row.update(fits=limit is None or row["peak_mem_bytes"] <= limit, steps=steps, global_batch=global_batch)
    row["total_s"] = sum(row[t] for t in ("queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"))
    return row


def _check_bounds(bounds: Bounds, stages: int, n_layers: int) -> None:
    """``ValueError`` unless ``bounds`` are ``stages`` non-empty, consecutive ranges over every layer."""
    ends = [0, *(e for _, e in bounds)]
    starts = [a for a, _ in bounds]
    if len(bounds) != stages or starts != ends[:-1] or ends[-1] != n_layers or any(a >= e for a, e in bounds):
        raise ValueError(
            f"stage_bounds={' '.join(f'{a}-{e}' for a, e in bounds)!r} must be {stages} consecutive, non-empty "
            f"ranges covering the {n_layers} layers of the plan's profile"
        )


def as_series(row: Row) -> pd.Series:
    """A priced row as a Series (what :meth:`PlannedConfig.from_row` reads)."""
    return pd.Series({k: v for k, v in row.items() if not k.startswith("_")}, dtype=object)
