"""Counting the tensor memory a process holds, the same way on CPU and CUDA.

CUDA's caching allocator counts its allocations (``torch.cuda.memory_allocated`` and
``max_memory_allocated``); the CPU allocator counts nothing. :class:`LiveTensorBytes` gives the
CPU the same count: a ``TorchDispatchMode`` that sees every storage an operator returns and
drops it when the storage is freed (a weak finalizer on the storage, which torch keeps as one
Python object for as long as the storage lives). Storages that existed before it started are
counted through :meth:`LiveTensorBytes.adopt`. It costs a Python call per operator, tens of
percent of a step, so it runs for one step at a time. :func:`memory_meter` wraps either count
behind one interface (``reset_peak``, ``allocated``, ``peak``).

torch's ``torch.distributed._tools.mem_tracker.MemTracker`` is the same dispatch-mode count
with categories, but it refuses a module that runs more than once per iteration ("does not
support memory tracking for multiple iterative calls"), which is what a pipeline stage does
once per micro-batch, and what a model that reuses a block does.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveTensorBytes", "MemoryMeter", "live_tensors", "memory_meter"]


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive while the mode is on; ``peak_bytes`` is their most at once.

    Storages are told apart by their data pointer, so views and in-place results add nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (those alive before the mode started); their release is seen too."""
        for t in tensors:
            self._add(t)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.layout != torch.strided:
            return
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage: a fake tensor left by tracing, a subclass
            return
        if key == 0 or key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.live_bytes += size
        weakref.finalize(storage, self._release, key).atexit = False  # nothing to count once the process ends
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._add(t)
        return out


def live_tensors() -> Iterator[torch.Tensor]:
    """Every tensor the garbage collector reaches (parameters, their gradients, optimizer state, buffers, batches)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): isinstance would read __class__, which proxies may warn on
            yield obj
            grad = obj.grad if obj.is_leaf else None
            if grad is not None:
                yield grad


class MemoryMeter(Protocol):
    """The bytes allocated now and the most since the last :meth:`reset_peak`."""

    def reset_peak(self) -> None:
        """Start a new peak at what is allocated now."""
        ...

    def allocated(self) -> int:
        """Bytes allocated now."""
        ...

    def peak(self) -> int:
        """The most bytes allocated at once since :meth:`reset_peak`."""
        ...


class _CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class _LiveMeter:
    def __init__(self, tracker: LiveTensorBytes) -> None:
        self.tracker = tracker

    def reset_peak(self) -> None:
        self.tracker.peak_bytes = self.tracker.live_bytes

    def allocated(self) -> int:
        return self.tracker.live_bytes

    def peak(self) -> int:
        return self.tracker.peak_bytes


def memory_meter(device: torch.device, tracker: LiveTensorBytes | None = None) -> MemoryMeter:
    """The meter of ``device``: CUDA's allocator statistics, or on CPU the count of ``tracker`` (which must be
    on while the meter is read)."""
    if device.type == "cuda":
        return _CudaMeter(device)
    if tracker is None:
        raise ValueError("a CPU memory meter needs a LiveTensorBytes tracker, entered while it is read")
    return _LiveMeter(tracker)
