"""Memory of a run, predicted and measured: :attr:`RunResult.memory`, one row per process: (replica, rank) and,
under FSDP or tensor parallelism, its (fsdp, tp) coordinates.

Before launch, :func:`predicted_memory` replays each rank's actions over its partition
(:meth:`~pipeswift_lab.partitioning.stages.Partition.memory`) at the run's micro-batch size and
with the run's own optimizer, whose state and step temporaries are measured on small tensors
(:mod:`~pipeswift_lab.runner.optimizer_memory`). The workers measure their peaks
(:mod:`~pipeswift_lab.runner.rank.memory_probe`); :func:`memory_frame` puts the two side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.memory_model import MEMORY_TERMS
from ..core.schedule import ScheduleLike

if TYPE_CHECKING:
    from ..partitioning.stages import Partition

__all__ = ["MEMORY_COLUMNS", "memory_frame", "memory_terms", "predicted_memory"]

#: The leading columns of :attr:`RunResult.memory`; the predicted terms and the measure's details follow.
MEMORY_COLUMNS = (
    "replica",
    "rank",
    "pp",
    "dp",
    "fsdp",
    "tp",
    "measured_peak_bytes",
    "predicted_peak_bytes",
    "error",
    "resident_peak_bytes",
    "reserved_peak_bytes",
)


#: Why a run has no predicted memory when its partition's profile carries no bytes (a synthetic profile of times).
NO_BYTE_COLUMNS = "the profile has no byte columns (param_bytes, activation_bytes)"


def predicted_memory(
    partition: Partition,
    *,
    m: int,
    schedule: ScheduleLike,
    micro_batch_size: int,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    device_type: str,
    staging: bool = False,
    recompute: dict[str, str] | None = None,
    precision: str | None = None,
    D: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    shares: tuple[Any, ...] | None = None,
    whole_grads: Any = None,
) -> dict[str, Any]:
    """The predicted peak of every pipeline rank: ``{"rows": [...], "optimizer": name}``, or ``{"rows": [],
    "note": why}`` when the partition's profile has no memory columns or the prediction fails.

    ``staging`` (a run with checkpoints) adds ``checkpoint_staging_bytes`` on CPU ranks: the buffer a rank copies its
    weights and optimizer state into before a background write, allocated before the first step. On a GPU it is
    pinned host memory and costs the device nothing. ``recompute`` (``{layer: mode}``) replays the layers as they
    cost recomputed (the profile's recompute columns); ``precision`` ``"bf16-mixed-zero1"`` shards the optimizer's
    state over the ``D`` replicas (autocast keeps fp32 weights, gradients and state: the profile's own bytes).
    With ``fsdp`` or ``tp`` above 1 the rows are the processes'
    (:func:`~pipeswift_lab.runner.layout_memory.layout_rows`, ``shares`` the layers' ``(tp_param_bytes,
    tp_activation_bytes, tp_duplicated_bytes)``, ``whole_grads`` their weights whose gradient stays whole)."""
    from .optimizer_memory import measure_optimizer_memory

    layers = partition.layers
    if layers is None or layers.param_bytes is None or layers.activation_bytes is None or not layers.has_bytes:
        return {"rows": [], "note": NO_BYTE_COLUMNS}
    notes = []
    profiled = layers.meta.get("precision", "fp32")
    if (precision or "fp32").startswith("bf16") != (profiled or "fp32").startswith("bf16"):
        notes.append(f"the profile was measured in {profiled}, the run computes in {precision or 'fp32'}")
    try:
        measured = measure_optimizer_memory(optimizer, "cuda" if device_type == "cuda" else "cpu")
        if precision == "bf16-mixed-zero1" and D > 1:
            measured = replace(measured, states=measured.states / D, name=f"{measured.name}, ZeRO-1 over {D}")
        if recompute:
            partition = _recomputed(partition, recompute)
        table = partition.memory(m=m, schedule=schedule, micro_batch_size=micro_batch_size, optimizer=measured)
    except Exception as exc:  # a prediction never stops a run
        return {"rows": [], "note": f"no prediction: {type(exc).__name__}: {exc}"}
    if fsdp * tp > 1:
        from .layout_memory import layout_rows

        table = layout_rows(
            table,
            param_bytes=layers.param_bytes,
            activation_bytes=layers.activation_bytes,
            shares=shares if tp > 1 else None,
            bounds=partition.bounds,
            stage_to_rank=partition.stage_to_rank,
            D=D,
            fsdp=fsdp,
            tp=tp,
            staging=staging and device_type != "cuda",
            last_transient=_last_transient(layers, micro_batch_size),
            whole_grads=whole_grads,
        )
    elif staging and device_type != "cuda":
        table["checkpoint_staging_bytes"] = table["weights_bytes"] + table["optimizer_bytes"]
        table["predicted_peak_bytes"] = table["predicted_peak_bytes"] + table["checkpoint_staging_bytes"]
    out: dict[str, Any] = {"rows": table.to_dict("records"), "optimizer": measured.name}
    if notes:
        out["note"] = "; ".join(notes)
    return out


def _last_transient(layers: Any, micro_batch_size: int) -> float:
    """The loss's backward and the model output's gradient of one micro-batch of ``micro_batch_size`` (bytes), from
    the profile (0 where it did not measure them)."""
    meta, outputs = layers.meta, layers.output_bytes
    try:
        scale = micro_batch_size / float(meta["batch_size"])
        loss = float(meta.get("loss_transient_bytes") or 0.0)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    output = float(outputs[-1]) if outputs is not None and len(outputs) else 0.0
    total = (loss if loss == loss else 0.0) + (output if output == output else 0.0)
    return total * scale


def _recomputed(partition: Partition, recompute: dict[str, str]) -> Partition:
    """``partition`` with its layers as they cost recomputed (``{layer: mode}``); raises ``ValueError`` when its
    profile has no recompute columns."""
    from ..partitioning.layers import Layers
    from ..partitioning.stages import Partition as PartitionType
    from ..profiling.recompute_costs import recomputed
    from ..profiling.table import Profile

    layers = partition.layers
    if layers is None:
        raise ValueError("the partition has no profile to recompute")
    profile = Profile(layers.df, dict(layers.meta))
    table = Layers(recomputed(profile, recompute))
    return PartitionType.from_bounds(table, partition.bounds, v=partition.v, schedule=partition.schedule, m=partition.m)


def memory_frame(measured: list[dict[str, Any]], predicted: dict[str, Any] | None) -> pd.DataFrame:
    """One row per (replica, rank): the measured peaks beside the prediction for that pipeline rank (every replica
    of a rank holds the same), ``error`` = predicted / measured - 1, then the predicted terms and ``peak_at``, then
    what was measured besides (the peak's terms ``measured_{term}_bytes`` and ``measured_peak_at``, the training
    state ``state_*_bytes`` at the probed step, ``probed_step``, ``measure``) and ``term_off``, the term whose
    prediction is furthest from its measure."""
    rows = pd.DataFrame(measured)
    if rows.empty:
        return pd.DataFrame(columns=list(MEMORY_COLUMNS))
    pred = pd.DataFrame((predicted or {}).get("rows", []))
    if not pred.empty:
        pred = pred.drop(columns=["stages"], errors="ignore")
        keys = [k for k in ("replica", "rank", "fsdp", "tp") if k in pred and k in rows]
        rows = rows.merge(pred, on=keys, how="left")
    for coordinate, column in (("pp", "rank"), ("dp", "replica"), ("fsdp", None), ("tp", None)):
        rows[coordinate] = rows[column] if column is not None else rows.get(coordinate, 0)
    for col in ("predicted_peak_bytes", "resident_peak_bytes", "reserved_peak_bytes"):
        if col not in rows:
            rows[col] = float("nan")
    rows["error"] = rows["predicted_peak_bytes"] / rows["measured_peak_bytes"] - 1
    rows = _term_off(rows)
    terms = [f"{t}_bytes" for t in MEMORY_TERMS if f"{t}_bytes" in rows] + (["peak_at"] if "peak_at" in rows else [])
    rest = [c for c in rows.columns if c not in MEMORY_COLUMNS and c not in terms]
    order = ["replica", "rank", "fsdp", "tp"]
    return rows[list(MEMORY_COLUMNS) + terms + rest].sort_values(order).reset_index(drop=True)


def _term_off(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with ``term_off``: the term whose prediction is furthest from its measure at the peak (bytes), where
    the peak was measured term by term (CPU) and predicted."""
    pairs = [t for t in MEMORY_TERMS if f"{t}_bytes" in rows and f"measured_{t}_bytes" in rows]
    if not pairs:
        return rows
    gaps = pd.DataFrame({t: rows[f"{t}_bytes"] - rows[f"measured_{t}_bytes"] for t in pairs})
    rows = rows.copy()
    rows["term_off"] = gaps.abs().fillna(-1.0).idxmax(axis=1).where(gaps.notna().any(axis=1))
    return rows


def memory_terms(memory: pd.DataFrame) -> pd.DataFrame:
    """:meth:`RunResult.memory_terms` of a :attr:`RunResult.memory` table: one row per replica, rank, moment and
    term, measured beside predicted."""
    moments = (("peak", "{t}_bytes", "measured_{t}_bytes"), ("before backward", "{t}_before_backward_bytes",
               "measured_{t}_before_backward_bytes"))  # fmt: skip
    rows = []
    for _, r in memory.iterrows():
        for moment, predicted, measured in moments:
            for t in MEMORY_TERMS:
                p, m = predicted.format(t=t), measured.format(t=t)
                if p not in r or m not in r or pd.isna(r[m]):
                    continue
                rows.append(
                    {
                        "replica": r["replica"],
                        "rank": r["rank"],
                        "moment": moment,
                        "term": t,
                        "measured_bytes": r[m],
                        "predicted_bytes": r[p],
                        "error": r[p] / r[m] - 1 if r[m] else (0.0 if r[p] == r[m] else float("inf")),
                    }
                )
    columns = ["replica", "rank", "moment", "term", "measured_bytes", "predicted_bytes", "error"]
    return pd.DataFrame(rows, columns=columns)
