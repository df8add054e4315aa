"""Simulation: reads a :class:`~pipeswift_lab.partitioning.Partition`, returns a :class:`Timeline` of one step.

Every ``torch.distributed.pipelining`` schedule, with the per-rank orders read from torch itself and each action
lasting what the profile measured::

    tl = psl.simulate(part, m=8, schedule="Interleaved1F1B")
    tl.step_ms, tl.bubble_ratio
    psl.sweep(prof, P=[2, 4], m=[4, 8, 16]).plot()

Modules: :mod:`.schedules` (per-rank orders), :mod:`.reconciliation` (:func:`reconcile`: which schedule, ``v`` and
placement a partition runs under), :mod:`.simulator` (:func:`simulate`), :mod:`.engine` (the event loop),
:mod:`.timeline` and :mod:`.schema` (the :class:`Timeline` type), :mod:`.gantt` and :mod:`.chrome_trace` (its chart
and trace export, which read it as a :mod:`.timeline_view`), :mod:`.trace_files`, :mod:`.trace_actions` and
:mod:`.trace_import` (the rows :meth:`Timeline.from_profiler` wraps: the ``torch.profiler`` traces of any pipeline
job), :mod:`.sweeps` (:func:`sweep` and its :class:`Sweep`),
:mod:`.calibration` (the calibration value the simulator applies) and :mod:`.steady` (which measured step is "the
measured step": :data:`MEASURED_STEP` says it in words, as ``RunResult.steady_step_ms``, ``compare`` and
``calibrate`` take it).
"""

from __future__ import annotations

from ..core.schedule import ScheduleDeadlock
from ..core.schedule_orders import compute_orders
from .reconciliation import Reconciled, reconcile
from .simulator import simulate, simulate_step_ms
from .steady import MEASURED_STEP
from .sweeps import Sweep, explore, sweep
from .timeline import Timeline

__all__ = [
    "MEASURED_STEP",
    "Reconciled",
    "ScheduleDeadlock",
    "Sweep",
    "Timeline",
    "compute_orders",
    "explore",
    "reconcile",
    "simulate",
    "simulate_step_ms",
    "sweep",
]
