"""What one process runs: reads a run spec, returns its measured actions and losses as files in the run directory.

:mod:`.worker` (process group, stages, teardown), :mod:`.inputs` (what one rank is given, :class:`RankInputs`),
:mod:`.train_loop` (the steps, the per-step agreement, preemption), :mod:`.checkpointer` (one rank's side of the
checkpoints), :mod:`.instrument` (the action recorder), :mod:`.profiler_trace` (``run(..., profiler_trace=DIR)``).
Started by :mod:`pipeswift_lab.runner.launcher` or by ``torchrun``::

    torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC   # each process: worker.main -> train_loop.train
"""

from __future__ import annotations

__all__: list[str] = []
