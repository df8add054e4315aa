"""Planning: reads a Profile, the GPUs, the steps to train and their availability; returns a :class:`Plan`.

Every configuration ``(P, D, m, schedule)`` ranked by job completion time: queue, assembly, training, cleanup and
what preemption costs, with branch-and-bound over the configurations (with a ``topology``, ``tp=`` or ``fsdp=``,
every 3-D layout ``P × D × fsdp × tp``, :mod:`.layouts`)::

    p = psl.plan(prof, gpus=16, steps=20_000, global_batch=64)
    p.best, p.table.head()       # the shortest JCT, and every configuration ranked
    p.run_arguments(p.best)      # {partition, m, schedule, D, fsdp, tp}: psl.run(model, data, loss_fn, **these, ...)

Modules: :mod:`.planner` (:func:`plan`, the steps in order), :mod:`.inputs` (:class:`PlanInputs`, the arguments
checked once), :mod:`.steps` (enumerate, bound, branch and bound, rank), :mod:`.search` (per-micro-batch costs and
partitions), :mod:`.peaks` (each rank's peak memory of the splits searched), :mod:`.strategies` (grow, shrink),
:mod:`.quantiles` (JCT quantiles under failures), :mod:`.result` (:class:`Plan`, :class:`PlannedConfig`); the 3-D
search: :mod:`.degrees` (the tp and fsdp weighed, the topology), :mod:`.sharding` (what one tensor-parallel or FSDP
rank computes and holds), :mod:`.placement` (each group's link and collectives), :mod:`.layouts` (enumerate, bound
in closed form, branch and bound), :mod:`.step_bounds` and :mod:`.memory_bound` (the closed-form bounds it prunes
with).
"""

from __future__ import annotations

from .planner import Plan, PlannedConfig, plan

__all__ = ["Plan", "PlannedConfig", "plan"]
