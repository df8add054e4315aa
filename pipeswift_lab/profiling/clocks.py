"""The profiler's clocks: host ``perf_counter_ns`` stamps on CPU, ``torch.cuda.Event`` stamps on CUDA."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CpuClock", "CudaClock", "make_clock"]


class Clock(Protocol):
    """What the recorder needs of a clock: stamps, a wait for the device, and the ms between two stamps."""

    kind: str
    """The timer's name, recorded in ``Profile.meta["timer"]``."""
    cuda: bool
    """Whether stamps are CUDA events (the recorder then also tracks CUDA memory)."""

    def stamp(self) -> Any:
        """A timestamp now (on the device's stream for CUDA)."""
        ...

    def synchronize(self) -> None:
        """Wait until every stamp taken so far can be read."""
        ...

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from stamp ``start`` to stamp ``end``."""
        ...


class CpuClock:
    """Host clock: ``time.perf_counter_ns`` stamps, differences in ms."""

    kind = "perf_counter_ns"
    cuda = False

    def stamp(self) -> int:
        """``time.perf_counter_ns()`` now."""
        return time.perf_counter_ns()

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    @staticmethod
    def ms(start: int, end: int) -> float:
        """Milliseconds between two ``perf_counter_ns`` stamps."""
        return (end - start) / 1e6


class CudaClock:
    """GPU clock: ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream.

    Differences are read with ``Event.elapsed_time`` after :meth:`synchronize`.
    """

    kind = "cuda_events"
    cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stamp(self) -> torch.cuda.Event:
        """A timing event recorded on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        """Wait for the device, so that every recorded event can be read."""
        torch.cuda.synchronize(self.device)

    @staticmethod
    def ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Milliseconds between two recorded events (after :meth:`synchronize`)."""
        return float(start.elapsed_time(end))


def make_clock(device: torch.device) -> CpuClock | CudaClock:
    """The clock for ``device``: CUDA events on ``cuda``, ``perf_counter_ns`` on ``cpu``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} needs CUDA, which this torch build or machine does not have")
        return CudaClock(device)
    if device.type == "cpu":
        return CpuClock()
    raise ValueError(f"device={str(device)!r} is not supported by the profiler; use a 'cpu' or 'cuda' device")
