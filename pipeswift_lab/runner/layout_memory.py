"""A pipeline rank's predicted memory spread over its processes: tensor parallelism and FSDP2 (``run(..., fsdp=,
tp=)``).

:meth:`~pipeswift_lab.partitioning.stages.Partition.memory` predicts each pipeline rank's peak, term by term, as
if one process held its stages. Under a layout each of its ``D * fsdp * tp`` processes holds
(:func:`~pipeswift_lab.core.layout.state_bytes_per_rank`, checked against the live-byte counter on CPU):

* **weights** — the parameters the tensor-parallel plan shards divide by ``tp`` (the profile's ``tp_param_bytes``);
  under FSDP2 the unsharded parameters it gathers at the first forward stay for the whole step
  (``reshard_after_forward=False``) beside the sharded ones it owns, ``1 + 1 / fsdp`` of them;
* **gradients** — unsharded (``/ tp`` only): torch's schedule turns FSDP2's gradient sync off until the last
  micro-batch, so they accumulate whole and are reduce-scattered once, at the end of the step; a vocabulary-parallel
  embedding's (``embedding_rowwise``) is whole on every tensor-parallel rank (:data:`WHOLE_GRADIENT_STYLES`);
* **optimizer state** — ``/ (tp * fsdp)``: FSDP2 updates its shard;
* **activations** — the saved tensors the plan leaves sharded (``tp_activation_bytes``) divide by ``tp``, the
  rest (what enters a column-parallel module, norms, the residual stream) is whole on every rank; with sequence
  parallelism the norms' and the residual stream's are slices too (``sp_activation_bytes``), and only the gathered
  inputs of the column-parallel regions stay whole; a whole input that a ``rowwise_split_input`` module slices into
  a new tensor while another operator saves it too is held twice (``tp_duplicated_bytes``: 10% low on a tp=4 GPT
  without it);
* **buffers** (what crosses a stage boundary) stay as they are; a backward's transients (mostly weight gradients)
  divide as the gradients do, but on the last stage never below the loss's backward and the gradient of the model's
  output, which are whole on every rank (``last_transient``: dividing those too was 29% low on a tp=4 GPT whose
  head is its largest layer);
* **the reduce-scatter** — after the last backward FSDP2 copies the unsharded gradients into its collective's input,
  and gloo emulates a reduce-scatter with an all-reduce whose output is as large again: with the weights and
  optimizer state still there, that moment can be the process's peak (:func:`_reduce_scatter_moment`).

A run that checkpoints gathers a sharded stage whole on its first process (FSDP rank 0, tensor-parallel rank 0 of
replica 0), which stages and writes it (:mod:`~pipeswift_lab.runner.rank.checkpointer`): only that process holds a
staging buffer, of the whole stage's weights and optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..core.layout import state_bytes_per_rank

__all__ = ["layer_shares", "layout_rows", "whole_gradient_bytes"]

#: Styles whose sharded weight's gradient is held whole on every tensor-parallel rank: torch's vocabulary-parallel
#: embedding returns its gradient as a ``Partial`` DTensor, of the whole table (measured, torch 2.13).
WHOLE_GRADIENT_STYLES = ("embedding_rowwise",)


def layer_shares(layers: Any, sequence_parallel: bool = False) -> tuple[np.ndarray, ...] | None:
    """``(tp_param_bytes, tp_activation_bytes, tp_duplicated_bytes)`` per layer of a profile table (a ``Layers`` or
    ``Profile``), the activations ``sp_activation_bytes`` under ``sequence_parallel`` (where the profile has them),
    or ``None`` when it has no tensor-parallel columns."""
    df = getattr(layers, "df", layers)
    if not isinstance(df, pd.DataFrame) or "tp_param_bytes" not in df or "tp_activation_bytes" not in df:
        return None
    activations = "sp_activation_bytes" if sequence_parallel and "sp_activation_bytes" in df else "tp_activation_bytes"
    duplicated = df["tp_duplicated_bytes"] if "tp_duplicated_bytes" in df else df["tp_activation_bytes"] * 0
    return df["tp_param_bytes"].to_numpy(float), df[activations].to_numpy(float), duplicated.to_numpy(float)


def _reduce_scatter_moment(terms: dict[str, Any], unsharded_grads: float) -> float:
    """A process's bytes as FSDP2 reduce-scatters the step's gradients, after the last backward: its weights,
    optimizer state and boundary buffers, and twice the unsharded gradients (they are copied into the collective's
    input; gloo emulates the reduce-scatter with an all-reduce, whose output is as large again) while the
    activations are gone."""
    return terms["weights_bytes"] + terms["optimizer_bytes"] + terms.get("buffers_bytes", 0.0) + 2 * unsharded_grads


def whole_gradient_bytes(model: Any, layer_names: Sequence[str], tp_plan: dict[str, str] | None) -> np.ndarray:
    """Per profiled layer (``layer_names``, module names of ``model``), the bytes of the weights whose gradient the
    plan leaves whole on every tensor-parallel rank (:data:`WHOLE_GRADIENT_STYLES`); zeros without a plan."""
    out = np.zeros(len(layer_names))
    if not tp_plan:
        return out
    from ..core.tp_plan import tp_targets

    modules = dict(model.named_modules())
    whole = [name for name, style in tp_targets(model, tp_plan, strict=False).items() if style in WHOLE_GRADIENT_STYLES]
    for i, layer in enumerate(layer_names):
        for name in whole:
            if name == layer or name.startswith(layer + "."):
                out[i] += sum(p.numel() * p.element_size() for p in modules[name].parameters(recurse=False))
    return out


def layout_rows(
    table: pd.DataFrame,
    *,
    param_bytes: Sequence[float] | np.ndarray,
    activation_bytes: Sequence[float] | np.ndarray,
    shares: tuple[Any, ...] | None,
    bounds: Sequence[tuple[int, int]],
    stage_to_rank: Sequence[int],
    D: int,
    fsdp: int,
    tp: int,
    staging: bool = False,
    last_transient: float = 0.0,
    whole_grads: Sequence[float] | np.ndarray | None = None,
) -> pd.DataFrame:
    """Every process's predicted memory: ``table`` (one row per pipeline ``rank``, :meth:`Partition.memory`'s terms)
    spread over the ``(replica, fsdp, tp)`` processes of each rank, one row per process with those coordinates.

    ``param_bytes`` and ``activation_bytes`` are the profile's per layer, ``shares`` its ``(tp_param_bytes,
    tp_activation_bytes, tp_duplicated_bytes)`` (``None``: nothing shards, as with ``tp == 1``); ``staging``: the
    run checkpoints from a CPU rank (the staging buffer of the process that writes,
    :data:`checkpoint_staging_bytes`); ``last_transient`` the bytes of the loss's backward and the output's gradient
    of one micro-batch, whole on every process; ``whole_grads`` per layer the weights whose gradient is held whole
    (:func:`whole_gradient_bytes`)."""
    params, acts = np.asarray(param_bytes, float), np.asarray(activation_bytes, float)
    zeros = acts * 0
    tp_params, tp_acts, duplicated = (
        (np.asarray(x, float) for x in (*shares, zeros)[:3]) if shares is not None else (params * 0, zeros, zeros)
    )
    whole = np.asarray(whole_grads, float) if whole_grads is not None and tp > 1 else params * 0
    if whole.shape != params.shape:  # not the profile's layers: nothing known
        whole = params * 0
    rows = []
    for row in table.to_dict("records"):
        layers = [i for s, r in enumerate(stage_to_rank) if r == row["rank"] for i in range(*bounds[s])]
        w, w_tp = float(params[layers].sum()), float(tp_params[layers].sum())
        a, a_tp = float(acts[layers].sum()), float(tp_acts[layers].sum())
        a_whole_too = float(duplicated[layers].sum()) if tp > 1 else 0.0
        state = state_bytes_per_rank(1.0, w_tp / w if w else 0.0, tp=tp, fsdp=fsdp)  # shares of the whole stage
        scaled = dict(row)
        scaled["weights_bytes"] = row["weights_bytes"] * state["weights"]
        per_param_byte = row["grads_bytes"] / w if w else 0.0
        scaled["grads_bytes"] = row["grads_bytes"] * state["grads"] + per_param_byte * float(whole[layers].sum()) * (
            1 - 1 / tp
        )
        scaled["optimizer_bytes"] = row["optimizer_bytes"] * state["optimizer"] / 2.0  # per optimizer byte
        scaled["activations_bytes"] = row["activations_bytes"] * (
            (1 - a_tp / a) + a_tp / a / tp + a_whole_too / a if a else 1.0
        )
        holds_last = stage_to_rank[len(bounds) - 1] == row["rank"]
        floor = last_transient if holds_last else 0.0
        scaled["transient_bytes"] = max(row["transient_bytes"] * state["grads"], min(floor, row["transient_bytes"]))
        terms = ("weights", "grads", "optimizer", "activations", "transient")
        change = sum(scaled[f"{t}_bytes"] - row[f"{t}_bytes"] for t in terms)
        scaled["predicted_peak_bytes"] = row["predicted_peak_bytes"] + change
        if fsdp > 1:
            reduce_scatter = _reduce_scatter_moment(scaled, row["weights_bytes"] * state["grads"])
            if reduce_scatter > scaled["predicted_peak_bytes"]:
                scaled.update(predicted_peak_bytes=reduce_scatter, peak_at="reduce-scatter")
        whole_state = row["weights_bytes"] + row["optimizer_bytes"]
        for replica in range(D):
            for f in range(fsdp):
                for t in range(tp):
                    out = {**scaled, "replica": replica, "fsdp": f, "tp": t}
                    if staging:
                        writes = replica == 0 and f == 0 and t == 0
                        out["checkpoint_staging_bytes"] = whole_state if writes else 0.0
                        out["predicted_peak_bytes"] += out["checkpoint_staging_bytes"]
                    rows.append(out)
    return pd.DataFrame(rows)
