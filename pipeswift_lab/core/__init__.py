"""The leaves every room builds on: the schedule vocabulary, argument checks, closed forms and cost models.

Reads plain numbers; returns numbers, small value types (:class:`JCT`, :class:`Link`) and the cost models of a job
(:class:`AssemblyModel`, :class:`CheckpointModel`, :class:`Availability`). Nothing here imports another room::

    from pipeswift_lab.core import JCT, bubble_ratio
    bubble_ratio(P=4, m=8)                      # 3 / 11 of a GPipe/1F1B step is bubble
    JCT(queue_s=600, training_s=7200).total_s   # 7800.0

Modules: :mod:`.vocabulary` (schedule names, action kinds, stage placement), :mod:`.checks` (the one place
arguments are checked), :mod:`.analytic` (bubble and memory closed forms), :mod:`.jct`, :mod:`.costs`, :mod:`.link`,
:mod:`.precision` (bytes per parameter), :mod:`.display` (cards), :mod:`.plot`, :mod:`.progress`.
"""

from __future__ import annotations

from .analytic import activation_memory_bytes, bubble_overhead, bubble_ratio, inflight_microbatches, step_ms
from .costs import AssemblyModel, Availability, CheckpointModel
from .jct import JCT
from .link import Link

__all__ = [
    "JCT",
    "AssemblyModel",
    "Availability",
    "CheckpointModel",
    "Link",
    "activation_memory_bytes",
    "bubble_overhead",
    "bubble_ratio",
    "inflight_microbatches",
    "step_ms",
]
