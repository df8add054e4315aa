"""What one profiled step measured, unit by unit: :class:`StepRecord`, made by
:meth:`~pipeswift_lab.profiling.hooks.LayerRecorder.end_step` and read by
:func:`~pipeswift_lab.profiling.measure.profile` into a Profile's rows."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepRecord"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one step measured: per-unit sums over the unit's calls (lists indexed by unit), and the whole step."""

    step_ms: float
    """The whole step, from :meth:`LayerRecorder.begin_step` to :meth:`LayerRecorder.end_step` (ms)."""
    fwd_ms: list[float]
    """Per unit, the forward time summed over its calls (ms)."""
    bwd_ms: list[float]
    """Per unit, the backward time summed over its calls (ms)."""
    calls: list[int]
    """Per unit, how many forward calls returned."""
    activation_bytes: list[int]
    """Per unit, the bytes of the distinct storages autograd saved during its forward calls."""
    output_bytes: list[int]
    """Per unit, the bytes of the tensors its calls returned."""
    peak_bytes: list[float]
    """Per unit, the highest allocation above the start of a forward or backward (NaN when memory was not
    measured)."""
    transient_bytes: list[float]
    """Per unit, the most a forward or backward allocated beyond what it kept (its forward's saved activations and
    outputs; a backward keeps nothing but the weight gradients it counts); NaN when memory was not measured."""
    first_call_order: list[int]
    """The units in the order of their first call (the layer order of the Profile)."""
    batch_shape: list[int] | None = None
    """The shape of the model's first input tensor, if any."""
    loss_activation_bytes: float = float("nan")
    """The bytes the loss left allocated (what it saved for backward, its value); NaN when not measured."""
    loss_transient_bytes: float = float("nan")
    """The highest allocation of the loss's backward above its start, until the first unit's backward; NaN when not
    measured."""
    loss_retained_bytes: float = float("nan")
    """Of what the loss allocated, the bytes still alive after the backward while the loss tensor is (MSE keeps a
    tensor of its input's size: a pipeline's last stage holds one per micro-batch until its step ends); NaN when
    not measured."""
    held_bytes: list[float] | None = None
    """Per unit, the bytes of the storages allocated from the start of its forward until the next unit's (the first
    unit also gets what the model allocates before it) that are still alive when the forward ends: what a stage
    holding the unit keeps per micro-batch until its backward, each storage once (None when memory was not
    measured)."""
    cut_bytes: list[float] | None = None
    """Per unit, the bytes a pipeline cut just before it would send per micro-batch: every tensor made before the
    unit starts (or given to the model) that the unit or a later one reads, or the model returns (None when memory
    was not measured)."""
    cut_grad_bytes: list[float] | None = None
    """Per unit, the floating-point part of ``cut_bytes``: the gradients sent back across the cut."""
    accumulate_transient_bytes: list[float] | None = None
    """Per unit, ``transient_bytes`` in a backward that adds to the gradients there are (each weight gradient is a
    temporary, added to ``.grad`` and freed): every backward of a pipeline stage but its first of a step (None when
    not measured)."""
    received_held_bytes: list[float] | None = None
    """Per unit, what it holds besides in a stage that receives the floating tensors it reads from an earlier one
    that need no gradient in the model (measured on a traced model's graph; None otherwise)."""
    cut_freed_bytes: list[float] | None = None
    """Per unit, the part of ``cut_bytes`` the forward frees before it ends: a stage that sends it keeps it anyway
    (torch holds a stage's outputs until its backward)."""
    live_peak_bytes: float = float("nan")
    """The most tensor bytes the process held at once during the memory step, everything alive before it included
    (the live-byte counter's peak)."""
