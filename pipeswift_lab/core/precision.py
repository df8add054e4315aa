"""Bytes of training state per parameter: weights, gradients, master weights and optimizer state.

Memory that does not depend on the micro-batches is, per parameter (Rajbhandari et al.,
*ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, SC 2020, §3.1;
``k`` optimizer states of 4 bytes each: Adam/AdamW ``k = 2``, SGD with momentum ``k = 1``,
plain SGD ``k = 0``):

=====================  =======  =====  ======  ==========  ===============  ==================
precision              weights  grads  master  optimizer   Adam (k=2)       Adam, D replicas
=====================  =======  =====  ======  ==========  ===============  ==================
``"fp32"``             4        4      0       4k          16               16
``"bf16-mixed"``       2        2      4       4k          16               16
``"bf16-mixed-zero1"`` 2        2      4/D     4k/D        16 at D=1        4 + 12/D
=====================  =======  =====  ======  ==========  ===============  ==================

* ``"fp32"`` — everything in fp32.
* ``"bf16-mixed"`` — bf16 weights and gradients for compute, an fp32 master copy and fp32
  moments for the update (Megatron-LM, DeepSpeed). Mixed precision does **not** halve the
  state: Adam still takes 16 bytes per parameter. (torch's autocast keeps fp32 weights and
  gradients and fp32 moments: 4 + 4 + 8, also 16.)
* ``"bf16-mixed-zero1"`` — as ``"bf16-mixed"``, with the fp32 master and the moments sharded
  over the ``D`` data-parallel replicas of a stage (ZeRO stage 1, ``torch``'s
  ``ZeroRedundancyOptimizer``): ``2 + 2 + (4 + 4k) / D``.

``None`` (the default of :func:`~pipeswift_lab.partitioning.balance.partition` and
:func:`~pipeswift_lab.plan`) keeps the profile's own bytes: ``param_bytes * (2 + k)``, exact
when training runs in the dtype the model was profiled in with moments of that dtype (an fp32
profile gives 16 bytes per parameter with Adam; a bf16 profile only 8, which is not how bf16
is trained — name a precision for those).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .checks import check_choice, check_int

#: Optimizer states kept per parameter: Adam/AdamW keep ``exp_avg`` and ``exp_avg_sq``,
#: SGD with momentum one buffer, plain SGD nothing.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True, kw_only=True)
class PrecisionBytes:
    """Bytes per parameter of one precision's training state (one row of the table in the module docstring)."""

    weight_bytes: int
    """Bytes of the weights the forward and backward compute with."""
    grad_bytes: int
    """Bytes of a gradient, what the data-parallel replicas reduce."""
    master_bytes: int
    """Bytes of the fp32 master copy of the weights (0 when the weights are fp32 already)."""
    state_bytes: int
    """Bytes of one optimizer state (Adam keeps two, see :data:`OPTIMIZER_STATES`)."""
    sharded: bool
    """Whether the master weights and optimizer states are sharded over the ``D`` replicas (ZeRO-1)."""


#: Per precision: bytes per parameter of weights, gradients, fp32 master weights, one
#: optimizer state, and whether master and states are sharded over the replicas (ZeRO-1).
PRECISIONS: dict[str, PrecisionBytes] = {
    "fp32": PrecisionBytes(weight_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4, sharded=False),
    "bf16-mixed": PrecisionBytes(weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4, sharded=False),
    "bf16-mixed-zero1": PrecisionBytes(weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4, sharded=True),
}


def check_precision(precision: str | None) -> str | None:
    """Return ``precision`` if it is ``None`` or a name in :data:`PRECISIONS`; raise ``ValueError`` otherwise."""
    if precision is None:
        return None
    return check_choice(
        "precision", precision, PRECISIONS, noun="precisions", hint=" or None (the profile's own param_bytes)"
    )


def check_optimizer(optimizer: str) -> str:
    """Return ``optimizer`` if it is one of :data:`OPTIMIZER_STATES` (the one table of optimizer state per
    parameter)."""
    return check_choice("optimizer", optimizer, OPTIMIZER_STATES)


def bytes_per_param(precision: str | None, optimizer: str = "adam", D: int = 1) -> float:
    """Bytes of weights + gradients + master weights + optimizer state per parameter on one GPU.

    ``D`` is the number of data-parallel replicas the ``"bf16-mixed-zero1"`` optimizer state
    is sharded over (ignored by the others). Returns a float: 16.0 for ``("fp32", "adam")``
    and ``("bf16-mixed", "adam")``, ``4 + 12 / D`` for ``("bf16-mixed-zero1", "adam")``.
    """
    row = _parts(precision, optimizer, D)
    return row["weight_bytes"] + row["grad_bytes"] + row["master_bytes"] + row["optimizer_bytes"]


def checkpoint_bytes_per_param(precision: str | None, optimizer: str = "adam", D: int = 1) -> float:
    """Bytes per parameter a checkpoint of one GPU holds: everything but the gradients. Returns a float."""
    row = _parts(precision, optimizer, D)
    return row["weight_bytes"] + row["master_bytes"] + row["optimizer_bytes"]


def grad_bytes_per_param(precision: str | None) -> float:
    """Bytes per parameter of the gradients the data-parallel replicas reduce. Returns a float."""
    precision = check_precision(precision)
    if precision is None:
        raise ValueError("precision=None has no fixed gradient size; it is the profile's param_bytes")
    return float(PRECISIONS[precision].grad_bytes)


def _parts(precision: str | None, optimizer: str, D: int) -> dict[str, float]:
    """Bytes per parameter of weights, gradients, master weights and optimizer state of a named ``precision``."""
    precision = check_precision(precision)
    if precision is None:
        raise ValueError(
            "precision=None counts the profile's param_bytes, not a fixed size per parameter; name one of "
            f"{list(PRECISIONS)}"
        )
    k = OPTIMIZER_STATES[check_optimizer(optimizer)]
    D = check_int("D", D, minimum=1)
    spec = PRECISIONS[precision]
    shards = D if spec.sharded else 1
    return {
        "weight_bytes": float(spec.weight_bytes),
        "grad_bytes": float(spec.grad_bytes),
        "master_bytes": spec.master_bytes / shards,
        "optimizer_bytes": k * spec.state_bytes / shards,
    }


def precision_table(optimizer: str = "adam", D: int = 1) -> pd.DataFrame:
    """One row per precision: ``weight_bytes``, ``grad_bytes``, ``master_bytes``, ``optimizer_bytes`` and
    ``total_bytes`` per parameter.

    ``D`` is the replica count the ZeRO-1 option shards over. Returns a DataFrame indexed by precision.
    """
    rows = {p: _parts(p, optimizer, D) for p in PRECISIONS}
    df = pd.DataFrame(rows).T
    df["total_bytes"] = df.sum(axis=1)
    df.index.name = "precision"
    return df


def state_bytes(
    params: Sequence[float] | np.ndarray | None,
    param_bytes: Sequence[float] | np.ndarray | None,
    precision: str | None,
    optimizer: str = "adam",
    D: int = 1,
) -> np.ndarray | None:
    """Per layer, bytes of weights, gradients and optimizer state; returns a numpy array, or None if unknown.

    With ``precision=None`` it is ``param_bytes * (2 + k)``; with a named precision it is
    ``params * bytes_per_param(precision, optimizer, D)`` and the profile needs a ``params`` column.
    """
    k = OPTIMIZER_STATES[check_optimizer(optimizer)]
    if check_precision(precision) is None:
        return None if param_bytes is None else np.asarray(param_bytes, dtype=float) * (2.0 + k)
    if params is None:
        raise ValueError(f"precision={precision!r} counts bytes per parameter, but the profile has no 'params' column")
    counts = np.asarray(params, dtype=float)
    if param_bytes is not None:
        given = np.asarray(param_bytes, dtype=float)
        missing = np.flatnonzero((counts == 0) & (given > 0))
        if len(missing):
            raise ValueError(
                f"precision={precision!r} counts bytes per parameter, but layer {int(missing[0])} has params=0 and "
                "param_bytes > 0; give the 'params' column"
            )
        check_profile_dtype(str(precision), counts, given)
    return counts * bytes_per_param(precision, optimizer, D)


_DTYPE_OF_BYTES = {4: "float32", 2: "bfloat16 or float16", 8: "float64", 1: "an 8-bit type"}


def check_profile_dtype(precision: str, params: np.ndarray, param_bytes: np.ndarray) -> None:
    """Refuse a named ``precision`` whose weights are not the profile's: its activations and times were measured
    with weights of ``param_bytes / params`` bytes, the precision computes with ``weight_bytes``."""
    want = PRECISIONS[precision].weight_bytes
    held = params > 0
    if not held.any():
        return
    per_param = param_bytes[held] / params[held]
    bad = np.flatnonzero(np.abs(per_param - want) > 1e-9 * want)
    if len(bad):
        got = float(per_param[bad[0]])
        dtype = _DTYPE_OF_BYTES.get(int(got), f"{got:g}-byte") if got == int(got) else f"{got:g}-byte"
        layer = int(np.flatnonzero(held)[bad[0]])
        raise ValueError(
            f"precision={precision!r} computes with {want}-byte weights ({_DTYPE_OF_BYTES[want]}), but the profile "
            f"holds {got:g} bytes per parameter (layer {layer}: {dtype}); its times and activations were measured in "
            "that dtype. Profile the model in the precision's dtype, or name the precision that matches"
        )


__all__ = [
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "PrecisionBytes",
    "bytes_per_param",
    "check_optimizer",
    "check_precision",
    "check_profile_dtype",
    "checkpoint_bytes_per_param",
    "grad_bytes_per_param",
    "precision_table",
    "state_bytes",
]
