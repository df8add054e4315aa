"""What a zero-bubble schedule's input-gradient pass (``I``) holds while it runs, per layer and per stage.

torch's ``stage_backward_input`` (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024, as torch splits the
backward) keeps the stage's graph for the weight-gradient pass ``W``: it frees none of the forward's saved tensors
as it goes back through the stage, and each layer's pass leaves the gradients ``W`` starts from
(``weight_pass_bytes``). So a layer's pass runs beside what every later layer of the stage kept, unlike a whole
backward, whose layers run after the later ones freed what they saved. The profile measures each layer's pass alone
(``input_pass_peak_bytes``: the most it held at once, the gradient it is given included,
:mod:`pipeswift_lab.profiling.weight_pass`); a stage's ``I`` holds the most of those sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .layer_arrays import Layers

__all__ = ["InputPassBytes", "input_pass_peak", "weight_pass_held"]


def weight_pass_held(layers: Layers) -> np.ndarray:
    """Per layer, what a zero-bubble ``I`` pass of one micro-batch holds until its ``W`` (``weight_pass_bytes``: the
    gradients torch keeps for ``W``, and what a checkpointed layer's ``I`` recomputed that ``W`` reads again); 0
    where the profile has no such column."""
    if "weight_pass_bytes" not in layers.df:
        return np.zeros(layers.n)
    return np.nan_to_num(layers.df["weight_pass_bytes"].to_numpy(float))


def input_pass_peak(layers: Layers) -> np.ndarray:
    """Per layer, the most its ``I`` pass holds at once (the profile's ``input_pass_peak_bytes``); where the profile
    did not measure it, what the pass keeps for ``W`` and the gradient it is given (the layer's output's)."""
    out = layers.output_bytes if layers.output_bytes is not None else np.zeros(layers.n)
    estimate = weight_pass_held(layers) + out
    if "input_pass_peak_bytes" not in layers.df:
        return estimate
    measured = layers.df["input_pass_peak_bytes"].to_numpy(float)
    return np.where(np.isfinite(measured), measured, estimate)


@dataclass(frozen=True)
class InputPassBytes:
    """Per layer, what an ``I`` of one micro-batch keeps for ``W`` and the most it holds, and the loss's backward's
    transient, all at the run's micro-batch size."""

    kept: np.ndarray
    peak: np.ndarray
    loss: float

    @classmethod
    def of(cls, layers: Layers, scale: float, loss_transient: float) -> InputPassBytes:
        """The bytes of ``layers`` times ``scale`` (the run's micro-batch size over the profiled one). Returns an
        :class:`InputPassBytes`."""
        return cls(weight_pass_held(layers) * scale, input_pass_peak(layers) * scale, loss_transient * scale)

    def stage(self, a: int, b: int, *, last: bool, grad_recv: float, transient: float) -> float:
        """The most an ``I`` on the stage of layers ``a`` to ``b`` (excluded) allocates: over its layers, a layer's
        peak beside what the later ones kept. Its last layer is given the receive buffer's gradient ``grad_recv``
        (counted there), or on the last stage the loss's, whose backward runs first. Never below ``transient`` (a
        whole backward's)."""
        kept = self.kept[a:b]
        held = self.peak[a:b] + np.cumsum(kept[::-1])[::-1] - kept
        held[-1] -= grad_recv
        most = float(np.max(held))
        if last:
            most = max(most, self.loss)
        return max(transient, most)

    def stages(
        self, starts: np.ndarray, ends: np.ndarray, *, grad_recv: np.ndarray, transient: np.ndarray
    ) -> np.ndarray:
        """:meth:`stage` of every stage ``[starts, ends)`` of a split of all the layers, from prefix sums: the
        running maximum over a stage's layers but its last (the even entries of one ``reduceat`` over ``[a, b - 1)``
        and ``[b - 1, b)``), and its last apart. Returns an array."""
        prefix = np.concatenate([[0.0], np.cumsum(self.kept)])
        term = self.peak - prefix[1:]  # + prefix[b]: what the stage's later layers kept
        lasts = ends - 1
        maxima = np.maximum.reduceat(term, np.stack([starts, lasts], axis=1).ravel())
        inner = np.where(lasts > starts, maxima[0::2] + prefix[ends], -np.inf)
        most = np.maximum(inner, self.peak[lasts] - grad_recv)
        most = np.where(ends == len(self.peak), np.maximum(most, self.loss), most)
        return np.maximum(transient, most)
