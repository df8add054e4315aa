"""A ``torch.profiler`` trace of one rank's training steps: ``run(..., profiler_trace=DIR)``.

Every rank profiles its step loop (CPU activity, and CUDA on a GPU rank) and, when the loop ends, writes one
Chrome trace into ``DIR`` through ``torch.profiler.tensorboard_trace_handler(DIR, worker_name=f"rank{r}")``
(``r`` the global rank): ``rank{r}.{time_ns}.pt.trace.json``, which Perfetto, TensorBoard and
``Timeline.from_profiler(DIR)`` open. The trace holds

* ``ProfilerStep#N`` — one span per training step, ``N`` the run's own step number (a resumed run's first span is
  its checkpoint's step, not 0). A span runs from the top of step ``N`` to the top of step ``N + 1`` (the last one
  to the end of the loop): the schedule's step, the ranks' agreement, the optimizer update and any save due then;
* torch's own spans inside them: ``PP:{stage}{kind}{microbatch}`` for each action of the runtime schedules
  (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; their communication and bookkeeping
  actions too: ``PP:1SEND_F0``, ``PP:2RECV_B1``, ``PP:0REDUCE_GRAD``...), ``Forward i``/``Backward i`` for GPipe.
  torch's ``Schedule1F1B``, which ``"1F1B"`` runs, emits no span per action (torch 2.13): its trace has the steps,
  the operators and the ``c10d`` sends and receives only;
* ``distributedInfo`` (backend, rank, world size) in the trace's metadata.

An instrumented run's memory probe (:mod:`.memory_probe`) runs on its second step under a dispatch mode: that step
is slower and its operators sit under ``PythonDispatchMode`` events in the trace.

Each attempt (an elastic restart) and each segment (a resize, a rebalance) is its own profiler: it writes its own
file per rank, told apart by the timestamp in the name. A rank that raises writes the steps it ran before
re-raising; a rank killed writes nothing. The trace is written after the last step, so its export counts in the
run's cleanup. A run without ``profiler_trace`` builds no profiler: its step loop is untouched.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepTrace"]


class StepTrace:
    """One rank's profiler over its step loop: ``with StepTrace(...) as trace:`` around the loop, ``trace.begin(step)``
    at the top of every step; the trace is written on leaving the ``with``.

    Entering starts the profiler in its warm-up (``ProfilerAction.WARMUP``: the one-time start-up of the profiler's
    backend, seconds on a CPU, but nothing recorded), so a caller can enter it before the ranks line up; the first
    ``begin`` starts the recording. The schedule is this object's own, not ``torch.profiler.schedule``: that counts
    its window from step 0 and would never record a resumed run, whose first step is ``first_step``.
    """

    def __init__(self, directory: str, rank: int, device: torch.device, first_step: int) -> None:
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        Path(directory).mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            activities.append(ProfilerActivity.CUDA)
        self.recording = False
        self.profiler = profile(
            activities=activities,
            schedule=self._action,  # a schedule at all is what makes the profiler mark ProfilerStep#N
            on_trace_ready=tensorboard_trace_handler(directory, worker_name=f"rank{rank}"),
        )
        self.profiler.step_num = first_step

    def _action(self, step: int) -> Any:
        """The profiler's schedule: warm up until the first step begins, then record every step."""
        from torch.profiler import ProfilerAction

        return ProfilerAction.RECORD if self.recording else ProfilerAction.WARMUP

    def __enter__(self) -> StepTrace:
        self.profiler.start()
        return self

    def begin(self, step: int) -> None:
        """Step ``step`` starts: close the previous step's span and open ``ProfilerStep#step``."""
        self.recording = True
        self.profiler.step_num = step - 1  # ``step()`` counts on from here: the span is named after the run's step
        self.profiler.step()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        self.profiler.stop()  # the last span ends, the trace is written
