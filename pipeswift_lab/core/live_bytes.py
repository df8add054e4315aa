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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveTensorBytes", "MemoryMeter", "live_tensors", "memory_meter"]


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive while the mode is on; ``peak_bytes`` is their most at once.

    Storages are told apart by their data pointer, so views and in-place results add nothing.
    Every storage carries a category: the one it was adopted under, or ``category`` (settable)
    when an operator allocated it; :meth:`tag` moves storages to another category (a gradient
    allocated during a backward becomes ``"grads"``). ``live_by`` gives the bytes alive per
    category now and ``peak_by`` as they stood at the peak, so a peak can be told apart term
    by term; ``peak_label`` is what ``label`` (settable: what is running) said when it came.
    ``on_op``, when set, is called with every operator's arguments and result after it runs (what it
    read and made). A storage's :meth:`serial` tells it apart from a later one at the same address.
    """

    def __init__(self, category: str = "other") -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.category = category
        self.live_by: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}
        self.label = ""
        self.peak_label = ""
        self.on_op: Callable[[Any, Any, Any], None] | None = None
        self._sizes: dict[int, tuple[int, str]] = {}
        self._serials: dict[int, int] = {}
        self._next_serial = 0

    def adopt(self, tensors: Iterable[torch.Tensor], category: str | None = None, *, own_bytes: bool = False) -> None:
        """Count the storages of ``tensors`` (those alive before the mode started) under ``category`` (default: the
        current one); their release is seen too. With ``own_bytes`` a tensor counts its own elements' bytes, not its
        whole storage's (a slice of a larger batch, as a device would hold a copy of it)."""
        for t in tensors:
            self._add(t, category, own_bytes=own_bytes)

    def tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Move the storages of ``tensors`` that are counted to ``category`` (those not counted are left alone)."""
        for t in tensors:
            key = _key(t)
            if key is None or key not in self._sizes:
                continue
            size, old = self._sizes[key]
            if old != category:
                self._sizes[key] = (size, category)
                self.live_by[old] -= size
                self.live_by[category] = self.live_by.get(category, 0) + size

    def recategorize(self, old: str, new: str) -> None:
        """Move every storage counted under ``old`` to ``new``."""
        moved = 0
        for key, (size, category) in self._sizes.items():
            if category == old:
                self._sizes[key] = (size, new)
                moved += size
        if moved:
            self.live_by[old] -= moved
            self.live_by[new] = self.live_by.get(new, 0) + moved

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category ``t``'s storage is counted under, or None when it is not counted."""
        key = _key(t)
        entry = self._sizes.get(key) if key is not None else None
        return entry[1] if entry is not None else None

    def serial(self, t: torch.Tensor) -> int | None:
        """The number of ``t``'s storage, counted from 0 in the order the storages were first counted (None when it
        is not counted): unlike its address, which a later storage may reuse, it names one storage."""
        key = _key(t)
        return self._serials.get(key) if key is not None else None

    def live_serials(self) -> set[int]:
        """The numbers (:meth:`serial`) of the storages alive now."""
        return set(self._serials.values())

    def _release(self, key: int) -> None:
        size, category = self._sizes.pop(key, (0, ""))
        self._serials.pop(key, None)
        if size:
            self.live_bytes -= size
            self.live_by[category] -= size

    def _add(self, t: torch.Tensor, category: str | None = None, *, own_bytes: bool = False) -> None:
        key = _key(t)
        if key is None or key == 0 or key in self._sizes:
            return
        t = local_tensor(t)
        storage = t.untyped_storage()
        size = t.numel() * t.element_size() if own_bytes else storage.nbytes()
        category = category or self.category
        self._sizes[key] = (size, category)
        self._serials[key] = self._next_serial
        self._next_serial += 1
        self.live_bytes += size
        self.live_by[category] = self.live_by.get(category, 0) + size
        weakref.finalize(storage, self._release, key).atexit = False  # nothing to count once the process ends
        if self.live_bytes > self.peak_bytes:
            self.reset_peak()

    def reset_peak(self) -> None:
        """Start a new peak at what is alive now."""
        self.peak_bytes = self.live_bytes
        self.peak_by = dict(self.live_by)
        self.peak_label = self.label

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._add(t)
        if self.on_op is not None:
            self.on_op(args, kwargs, out)
        return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s storage on this process: a DTensor's local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _key(t: torch.Tensor) -> int | None:
    """The data pointer that tells ``t``'s storage apart (a DTensor's local shard's), or None for a tensor without a
    plain storage."""
    t = local_tensor(t)
    if t.device.type == "meta" or t.layout != torch.strided or isinstance(t, FakeTensor):
        return None  # a fake tensor (left by tracing) has no memory: torch only warns when its pointer is read
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no real storage: a subclass
        return None


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
        self.tracker.reset_peak()

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
