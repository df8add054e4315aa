"""Partitioning: reads a :class:`~pipeswift_lab.profiling.Profile`, returns a :class:`Partition` into ``P * v`` stages.

Stages are balanced by measured time (the exact min-max split) within each GPU's memory, with the activations a
schedule keeps in flight counted per stage::

    part = psl.partition(prof, P=4, schedule="1F1B", m=8, mem_per_gpu_bytes=16 * 2**30)
    part.stages          # one row per stage: layers, time, memory
    part.bottleneck_ms   # the slowest stage

Modules: :mod:`.balance` (:func:`partition`, :class:`Partition`), :mod:`.layers` (per-layer costs and memory
per stage), :mod:`.bottleneck` (the exact min-max contiguous split).
"""

from __future__ import annotations

from .balance import METHODS, Partition, memory_cap, partition

__all__ = ["METHODS", "Partition", "memory_cap", "partition"]
