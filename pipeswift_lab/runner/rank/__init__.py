"""What one process runs: reads a run spec, returns its measured actions and losses as files in the run directory.

:mod:`.worker` (process group, stages, teardown), :mod:`.train_loop` (the steps, checkpoints and preemption),
:mod:`.instrument` (the action recorder). Started by :mod:`pipeswift_lab.runner.launcher` or by ``torchrun``.
"""

from __future__ import annotations

__all__: list[str] = []
