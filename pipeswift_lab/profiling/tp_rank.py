"""The per-layer table one of ``tp`` tensor-parallel ranks computes and holds: the profile's layers under its
tensor-parallel plan, priced on a link. The planner (:mod:`pipeswift_lab.planning.sharding`, which says what is
priced and why) and the check against published runs (:mod:`pipeswift_lab.fidelity.published`) both read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import pandas as pd

from ..core.layout import state_bytes_per_rank
from ..core.link import Link
from ..core.topology import all_gather_ms, all_reduce_ms, reduce_scatter_ms

__all__ = ["TIME_COLUMNS", "tp_table"]

#: The per-layer times that follow the micro-batch size (the recomputation's among them, ``recomputed_ms`` of a
#: profile costed recomputed too); under tensor parallelism they divide where the plan shards.
TIME_COLUMNS = (
    "fwd_ms",
    "bwd_ms",
    "wgrad_ms",
    "recompute_ms",
    "selective_recompute_ms",
    "recompute_forward_ms",
    "selective_recompute_forward_ms",
    "input_pass_ms",
    "weight_pass_ms",
    "recomputed_ms",
)
#: Per-layer bytes of one micro-batch that shrink as the activations do under tensor parallelism.
_ACTIVATION_LIKE = ("selective_activation_bytes", "weight_pass_bytes", "input_pass_peak_bytes")


def _column(df: pd.DataFrame, name: str) -> np.ndarray:
    """Column ``name`` as floats, NaN as 0; zeros where it is absent."""
    if name not in df.columns:
        return np.zeros(len(df))
    return np.nan_to_num(pd.to_numeric(df[name], errors="coerce").to_numpy(float))


def _ratio(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new / old`` per layer, 1 where ``old`` is 0."""
    return np.divide(new, old, out=np.ones_like(new), where=old > 0)


def _collective_ms(nbytes: np.ndarray, tp: int, link: Link, price: Callable[[float, int, Link], float]) -> np.ndarray:
    return np.array([price(x, tp, link) if x > 0 else 0.0 for x in nbytes])


def tp_table(df: pd.DataFrame, tp: int, link: Link, sequence_parallel: bool = False) -> pd.DataFrame:
    """The per-layer table ``df`` (at its profiled micro-batch size) as one of ``tp`` tensor-parallel ranks computes
    and holds it, its collectives on ``link`` (the module docs say how), with ``sequence_parallel`` or without.
    Returns a new DataFrame (``df`` itself when ``tp == 1``)."""
    if tp == 1:
        return df
    df = df.copy()
    fraction = np.clip(_column(df, "tp_flop_fraction"), 0.0, 1.0)
    compute = (1.0 - fraction) + fraction / tp
    exits, entries = _column(df, "tp_forward_bytes"), _column(df, "tp_backward_bytes")
    if sequence_parallel:  # entries all-gather forward, reduce-scatter backward; exits the other way round
        ag, rs = all_gather_ms, reduce_scatter_ms
        forward_ms = _collective_ms(entries, tp, link, ag) + _collective_ms(exits, tp, link, rs)
        backward_ms = _collective_ms(entries, tp, link, rs) + _collective_ms(exits, tp, link, ag)
    else:
        forward_ms = _collective_ms(exits, tp, link, all_reduce_ms)
        backward_ms = _collective_ms(entries, tp, link, all_reduce_ms)
    for col in TIME_COLUMNS:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce") * compute
    df["fwd_ms"] = df["fwd_ms"] + forward_ms
    df["bwd_ms"] = df["bwd_ms"] + backward_ms
    for col, added in (("input_pass_ms", backward_ms), ("recompute_ms", forward_ms)):
        if col in df.columns:
            df[col] = df[col] + added
    if "total_ms" in df.columns:
        df["total_ms"] = df["fwd_ms"] + df["bwd_ms"]
    param_bytes = _column(df, "param_bytes")
    sharded_params = np.minimum(_column(df, "tp_param_bytes"), param_bytes)
    # state_bytes_per_rank's arithmetic holds elementwise: one rank's bytes of every layer at once
    held = np.asarray(state_bytes_per_rank(cast(float, param_bytes), cast(float, sharded_params), tp=tp)["grads"])
    params_kept = _ratio(held, param_bytes)
    activations = _column(df, "activation_bytes")
    sliced = "sp_activation_bytes" if sequence_parallel and "sp_activation_bytes" in df.columns else ""
    sharded = np.minimum(_column(df, sliced or "tp_activation_bytes"), activations)
    kept_activations = activations - sharded + sharded / tp + _column(df, "tp_duplicated_bytes")
    activations_kept = _ratio(kept_activations, activations)
    # a recomputing backward allocates its weight gradients' temporaries (as the parameters shrink) and the
    # activations it recomputes (as they shrink): the two parts of the recomputation transients, scaled apart
    accumulate = _column(df, "accumulate_transient_bytes")
    for col in ("full_transient_bytes", "selective_transient_bytes"):
        if col in df.columns:
            recomputed = np.maximum(_column(df, col) - accumulate, 0.0)
            df[col] = accumulate * params_kept + recomputed * activations_kept
    if "full_activation_bytes" in df.columns:  # the layer's input: whole on every rank unless the sequence is sliced
        df["full_activation_bytes"] = _column(df, "full_activation_bytes") / (tp if sequence_parallel else 1)
    if "param_bytes" in df.columns:
        df["param_bytes"] = held
    for col in ("params", "largest_param_bytes"):
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce") * params_kept
    for col in ("transient_bytes", "accumulate_transient_bytes"):  # a layer's backward: mostly its weight gradients
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce") * params_kept
    if "activation_bytes" in df.columns:
        df["activation_bytes"] = kept_activations
    for col in _ACTIVATION_LIKE:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce") * activations_kept
    return df
