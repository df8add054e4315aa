"""Schedules from the papers, as :class:`~pipeswift_lab.Schedule` action lists to simulate, run and plan with.

* :func:`zb_h2` and :func:`zero_bubble` (ZB-1p with ``max_inflight=P``, ZB-2p with ``2P``): Qi et al., *Zero Bubble
  Pipeline Parallelism*, ICLR 2024 (:mod:`.zero_bubble_paper`);
* :func:`v_half` and :func:`v_min`: Qi et al., *Pipeline Parallelism with Controllable Memory*, NeurIPS 2024
  (:mod:`.controllable_memory`).

Each returns a :class:`~pipeswift_lab.Schedule`; ``plan(..., schedules=[...])`` and ``sweep`` also take these
functions (and any callable ``(P, m, v) -> Schedule``) and search them beside the named schedules::

    psl.simulate(part, 8, psl.schedules.zb_h2(4, 8))
    psl.plan(prof, gpus=8, schedules=["1F1B", "ZBVZeroBubble", psl.schedules.zb_h2, psl.schedules.v_half])
"""

from __future__ import annotations

from .controllable_memory import v_half, v_min
from .zero_bubble_paper import stage_times, zb_h2, zero_bubble

__all__ = ["stage_times", "v_half", "v_min", "zb_h2", "zero_bubble"]
