"""A lower bound on the fullest rank's peak memory over every split, in closed form: what lets the 3-D search
reject a configuration that no split fits before it splits it (:mod:`.layouts`).

Every moment of a rank's replayed step (:mod:`pipeswift_lab.core.peak_forms`) holds its stages' weights and
optimizer state, and ``held_j`` saved activations of each of its stages ``j`` (the micro-batches forwarded and not
yet released by their ``B`` or ``W``). So with ``c_k`` the most micro-batches every stage of rank ``k`` holds at
once (:func:`held_counts`, from torch's order of the rank's actions), the rank's peak is at least
``X_k = state_k + c_k · activations_k`` (each a sum over the rank's layers; all other terms are ``>= 0``). For any
weights ``λ_k >= 0`` that sum to 1, the fullest rank holds ``max_k X_k >= Σ_k λ_k X_k >= Σ_i min_k λ_k (s_i + c_k
a_i)``, a sum over the layers ``i`` that holds for every split (a layer is on some rank), contiguous or not
(:func:`min_fullest_rank_bytes`; ``λ_k`` in proportion to ``1 / (s̄ + c_k ā)``, exact for equal layers).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..core.order_arrays import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, order_arrays
from ..core.schedule import ScheduleLike
from ..core.vocabulary import stage_to_rank

__all__ = ["held_counts", "min_fullest_rank_bytes"]


@lru_cache(maxsize=4096)
def held_counts(P: int, m: int, schedule: ScheduleLike, v: int) -> tuple[int, ...]:
    """Per rank, the most micro-batches every one of its stages holds saved activations of at once (a forward's
    own micro-batch counted from its forward, released by its ``B`` or ``W``). Returns a tuple, one per rank."""
    orders = order_arrays(P, m, schedule, v, check=False)
    placement = np.asarray(stage_to_rank(P, v, schedule))
    local = np.zeros(len(placement), dtype=np.int64)  # each stage's index among its rank's stages, ascending
    for rank in range(P):
        local[placement == rank] = np.arange(int(np.sum(placement == rank)))
    onehot = np.eye(v, dtype=np.int64)[local[orders.stage]]  # (P, actions, v)
    forward = (orders.kind == FORWARD)[..., None]
    release = ((orders.kind == FULL_BACKWARD) | (orders.kind == BACKWARD_WEIGHT))[..., None]
    # at an action: its rank's forwards so far (its own included) less the releases before it
    held = np.cumsum(onehot * forward, axis=1) - np.cumsum(onehot * release, axis=1) + onehot * release
    return tuple(int(x) for x in held.min(axis=2).max(axis=1))


def min_fullest_rank_bytes(state: np.ndarray, activations: np.ndarray, counts: tuple[int, ...]) -> float:
    """A lower bound on the fullest rank's peak over every split of layers whose ``state`` (weights and optimizer
    state, held at every moment) and saved ``activations`` (one micro-batch) are given per layer, on ranks whose
    stages hold ``counts`` micro-batches at once (:func:`held_counts`): the module docs derive it. Returns bytes."""
    c = np.asarray(counts, dtype=float)
    weights = 1.0 / np.maximum(float(np.mean(state)) + c * float(np.mean(activations)), 1e-300)
    weights /= weights.sum()
    per_layer = weights[None, :] * state[:, None] + (weights * c)[None, :] * activations[:, None]
    return float(per_layer.min(axis=1).sum())
