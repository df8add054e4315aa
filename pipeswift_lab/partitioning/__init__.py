"""Partitioning: reads a :class:`~pipeswift_lab.profiling.Profile`, returns a :class:`Partition` into ``P * v`` stages.

Stages are balanced by measured time (the exact min-max split) within each GPU's memory, with the activations a
schedule keeps in flight counted per stage::

    part = psl.partition(prof, P=4, schedule="1F1B", m=8, mem_per_gpu_bytes=16 * 2**30)
    part.df              # one row per stage: layers, time, memory
    part.bottleneck_ms   # the slowest stage; part.bottleneck_rank_ms the busiest rank (its v stages summed)

Modules: :mod:`.balance` (:func:`partition`), :mod:`.stages` (the :class:`Partition` type), :mod:`.layers` (the
split by method), :mod:`.layer_arrays` (the per-layer arrays, :class:`~.layer_arrays.Layers`), :mod:`.memory` (memory
per stage and the cap), :mod:`.bottleneck` (the exact min-max contiguous split).
"""

from __future__ import annotations

from .balance import METHODS, partition
from .memory import memory_cap
from .stages import Partition

__all__ = ["METHODS", "Partition", "memory_cap", "partition"]
