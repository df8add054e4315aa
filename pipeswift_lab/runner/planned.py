"""A planned configuration as the arguments of :func:`~pipeswift_lab.runner.job.run`.

The planner ranks configurations ``P x D`` with ``m`` micro-batches of ``microbatch_size``
samples under a schedule; :func:`run_arguments` turns one of them into what ``run()`` takes,
so a ranked row runs as is: ``run(model, data, loss_fn, **run_arguments(plan, plan.config(i)), steps=...)``.
The global batch of ``data`` must be ``microbatch_size * m * D * fsdp`` (the FSDP shards of a replica read
different samples; the tensor-parallel ranks of a group the same).
"""

from __future__ import annotations

from typing import Any


def run_arguments(plan: Any, config: Any) -> dict[str, Any]:
    """``{"partition", "m", "schedule", "D", "fsdp", "tp"}`` for ``config`` (a ``PlannedConfig`` or a row of
    ``plan.table``) of ``plan``.

    The partition is the plan's balanced one for that configuration (``plan.partition_of``).
    Raises ``ValueError`` for a row the planner did not simulate, ``TypeError`` for anything
    else than a configuration or a row.
    """
    return plan.run_arguments(config)


def global_batch_of(config: Any) -> int:
    """Samples per step the configuration trains on: ``microbatch_size * m * D * fsdp``."""
    return int(config.microbatch_size) * int(config.m) * int(config.D) * int(getattr(config, "fsdp", 1))


__all__ = ["global_batch_of", "run_arguments"]
