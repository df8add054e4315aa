"""The Profile a measurement makes: per-layer medians and spreads in the order the units first ran, the memory
the memory step measured (with a traced model's, and with recomputation's, columns where they were taken), and the
profile's meta."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from .clocks import make_clock
from .pipeline_settings import model_config_of
from .step_record import StepRecord
from .table import COLUMNS, MEMORY_COLUMNS, Profile
from .traced_memory import TracedMemory

__all__ = ["build_profile", "run_meta", "with_traced"]

_Units = list[tuple[str, nn.Module]]


def run_meta(source: str, device: torch.device, *, loss: str, warmup: int, repeats: int) -> dict[str, Any]:
    """What a profile records about how it was measured."""
    return {
        "source": source,
        "device": str(device),
        "timer": make_clock(device).kind,
        "loss": loss,
        "repeats": repeats,
        "warmup": warmup,
    }


def build_profile(
    model: nn.Module,
    units: _Units,
    records: tuple[list[StepRecord], StepRecord | None],
    meta: dict[str, Any],
    extra: dict[str, list[float]] | None = None,
) -> Profile:
    """The Profile of the kept steps (the memory step last): per-layer medians and spreads, in the order the units
    first ran, the memory the memory step measured, and ``extra`` columns (``{column: [value per unit]}``, in unit
    order, after the others)."""
    kept, memory = records
    rows = _layer_rows(units, kept, memory)
    for row, u in zip(rows, kept[0].first_call_order):
        row.update({column: values[u] for column, values in (extra or {}).items()})
    first_float = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    shape = kept[0].batch_shape
    meta = {
        "model": type(model).__name__,
        "dtype": str(first_float).removeprefix("torch.") if first_float is not None else "-",
        "batch_shape": shape,
        "batch_size": shape[0] if shape else None,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "model_params": int(sum(p.numel() for p in model.parameters())),
        "model_config": model_config_of(model),
        **meta,
        "loss_activation_bytes": memory.loss_activation_bytes if memory else float("nan"),
        "loss_transient_bytes": memory.loss_transient_bytes if memory else float("nan"),
        "loss_retained_bytes": memory.loss_retained_bytes if memory else float("nan"),
        "live_peak_bytes": memory.live_peak_bytes if memory else float("nan"),
        "step_ms_samples": [float(r.step_ms) for r in kept],
    }
    return Profile(pd.DataFrame(rows, columns=[*COLUMNS, *MEMORY_COLUMNS, *(extra or {})]), meta)


def _layer_rows(units: _Units, records: list[StepRecord], memory: StepRecord | None) -> list[dict[str, Any]]:
    """One row of :data:`COLUMNS` and :data:`MEMORY_COLUMNS` per unit, in first-call order."""
    fwd = np.array([r.fwd_ms for r in records])
    bwd = np.array([r.bwd_ms for r in records])
    fwd_med, bwd_med = np.median(fwd, axis=0), np.median(bwd, axis=0)
    fwd_iqr = np.percentile(fwd, 75, axis=0) - np.percentile(fwd, 25, axis=0)
    bwd_iqr = np.percentile(bwd, 75, axis=0) - np.percentile(bwd, 25, axis=0)
    rows = []
    for layer, u in enumerate(records[0].first_call_order):
        name, module = units[u]
        params = list(module.parameters())
        rows.append(
            {
                "layer": layer,
                "name": name,
                "type": type(module).__name__,
                "calls": int(max(r.calls[u] for r in records)),
                "fwd_ms": float(fwd_med[u]),
                "bwd_ms": float(bwd_med[u]),
                "total_ms": float(fwd_med[u] + bwd_med[u]),
                "fwd_ms_iqr": float(fwd_iqr[u]),
                "bwd_ms_iqr": float(bwd_iqr[u]),
                "params": int(sum(p.numel() for p in params)),
                "param_bytes": int(sum(p.numel() * p.element_size() for p in params)),
                "activation_bytes": _activation_bytes(u, records, memory),
                "output_bytes": int(max(r.output_bytes[u] for r in records)),
                "peak_bytes": float(memory.peak_bytes[u]) if memory else float("nan"),
                "transient_bytes": float(memory.transient_bytes[u]) if memory else float("nan"),
                "accumulate_transient_bytes": _cut(memory, "accumulate_transient_bytes", u),
                "largest_param_bytes": int(max((p.numel() * p.element_size() for p in params), default=0)),
                **{
                    col: _cut(memory, col, u)
                    for col in ("cut_bytes", "cut_grad_bytes", "cut_freed_bytes", "received_held_bytes")
                },
            }
        )
    return rows


def with_traced(memory: StepRecord, traced: TracedMemory) -> StepRecord:
    """``memory`` with what it says of held and crossing bytes, and of the loss, taken from the exported graph."""
    return replace(
        memory,
        held_bytes=traced.held_bytes,
        cut_bytes=traced.cut_bytes,
        cut_grad_bytes=traced.cut_grad_bytes,
        cut_freed_bytes=traced.cut_freed_bytes,
        loss_activation_bytes=traced.loss_activation_bytes,
        loss_retained_bytes=traced.loss_retained_bytes,
        received_held_bytes=traced.received_held_bytes,
    )


def _activation_bytes(u: int, records: list[StepRecord], memory: StepRecord | None) -> int:
    """What unit ``u`` holds per micro-batch until its backward: measured storage by storage in the memory step
    (:attr:`StepRecord.held_bytes`), else the distinct storages autograd saved in its forward calls."""
    if memory is not None and memory.held_bytes is not None:
        return int(memory.held_bytes[u])
    return int(max(r.activation_bytes[u] for r in records))


def _cut(memory: StepRecord | None, column: str, u: int) -> float:
    """Unit ``u``'s value of a per-unit list of the memory step (NaN where it was not measured)."""
    values = getattr(memory, column, None) if memory is not None else None
    return float(values[u]) if values is not None else float("nan")
