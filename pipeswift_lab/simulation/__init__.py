"""Simulation: reads a :class:`~pipeswift_lab.partitioning.Partition`, returns a :class:`Timeline` of one step.

Every ``torch.distributed.pipelining`` schedule, with the per-rank orders read from torch itself and each action
lasting what the profile measured::

    tl = psl.simulate(part, m=8, schedule="Interleaved1F1B")
    tl.step_ms, tl.bubble_ratio
    psl.sweep(prof, P=[2, 4], m=[4, 8, 16]).plot()

Modules: :mod:`.schedules` (per-rank orders), :mod:`.simulator` (:func:`simulate`), :mod:`.engine` (the event
loop), :mod:`.timeline` and :mod:`.schema` (the :class:`Timeline` type), :mod:`.sweeps` (:func:`sweep`).
"""

from __future__ import annotations

from .engine import ScheduleDeadlock
from .schedules import compute_orders
from .simulator import simulate, simulate_step_ms
from .sweeps import explore, plot_sweep, sweep
from .timeline import Timeline

__all__ = [
    "ScheduleDeadlock",
    "Timeline",
    "compute_orders",
    "explore",
    "plot_sweep",
    "simulate",
    "simulate_step_ms",
    "sweep",
]
