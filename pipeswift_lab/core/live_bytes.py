"""Counting the tensor memory a process holds, the same way on CPU and CUDA.

CUDA's caching allocator counts its allocations (``torch.cuda.memory_allocated`` and
``max_memory_allocated``); the CPU allocator counts nothing. :class:`LiveTensorBytes` gives the
CPU the same count: a ``TorchDispatchMode`` that sees every storage an operator returns and
drops it when the storage is freed (a weak finalizer on the storage, which torch keeps as one
Python object for as long as the storage lives). Storages that existed before it started are
counted through :meth:`LiveTensorBytes.adopt`. It costs a Python call per operator, tens of
percent of a step, so it runs for one step at a time. :func:`memory_meter` wraps either count
behind one interface (``reset_peak``, ``allocated``, ``peak``).

Two things happen out of an operator's sight, and the count follows both, so that a peak does not
depend on the machine's load or on where the allocator puts a buffer:

* **A storage resized in place.** FSDP2 frees its unsharded parameters with
  ``UntypedStorage.resize_(0)`` and allocates them again the same way. While the mode is on it
  wraps ``resize_``, as torch's ``MemTracker`` does, and counts the storage at its new size.
  Unseen, a freed storage stayed in the count, and a new one given its address went uncounted.
* **A collective's buffer freed by another thread.** gloo's worker thread holds a collective's
  input and output (and, for an emulated reduce-scatter, a copy that the count first sees through
  a view) until a moment after the rank's own thread has seen the work finish and gone on. The
  storage's finalizer then runs on the worker, when it gets the GIL. Such a storage counts as freed
  right after the last operator of the counting thread that read it: what the rank's own code
  holds, not when another thread lets go (:class:`LiveTensorBytes` lowers the levels passed since).
  Point-to-point sends are left as they are: they hold their tensor until the schedule waits on the
  send, which no operator shows.

torch's ``torch.distributed._tools.mem_tracker.MemTracker`` is the same dispatch-mode count
with categories, but it refuses a module that runs more than once per iteration ("does not
support memory tracking for multiple iterative calls"), which is what a pipeline stage does
once per micro-batch, and what a model that reuses a block does.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveTensorBytes", "MemoryMeter", "live_tensors", "memory_meter"]

#: The operator namespaces of torch's collectives (``torch.distributed`` and its functional collectives).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})
#: c10d's point-to-point operators: the schedule waits on them through their work, later (see the module's doc).
_POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})


class _Level:
    """The bytes alive, by category, after operator number ``op`` (``label`` what was running)."""

    __slots__ = ("by", "bytes", "label", "op")

    def __init__(self, op: int, nbytes: int, by: dict[str, int], label: str) -> None:
        self.op, self.bytes, self.by, self.label = op, nbytes, by, label


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

    The count is the thread's that entered the mode: a collective's storage that another thread frees
    counts as freed after this thread's last operator that read it, and storages resized in place
    count at their new size (the module's doc says why).
    """

    def __init__(self, category: str = "other") -> None:
        super().__init__()
        self.category = category
        self.label = ""
        self.on_op: Callable[[Any, Any, Any], None] | None = None
        self._live = 0
        self._live_by: dict[str, int] = {}
        self._sizes: dict[int, tuple[int, str]] = {}
        self._serials: dict[int, int] = {}
        self._next_serial = 0
        self._owner = threading.get_ident()
        self._ops = 0  # operators run on the owner's thread
        self._last_read: dict[int, int] = {}  # a collective's storage: the last operator that read or made it
        self._freed_elsewhere: deque[tuple[int, int]] = deque()  # (key, serial) another thread freed, to count
        self._resize: Any = None  # UntypedStorage.resize_ as it was when the mode was entered
        self._peak = _Level(0, 0, {}, "")  # the most at once, final
        self._unsettled: list[_Level] = []  # levels a freed collective storage may lower: the highest per span of reads

    def __enter__(self) -> LiveTensorBytes:
        self._owner = threading.get_ident()
        self._track_resizes()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def _track_resizes(self) -> None:
        """See storages resized in place, which no operator shows: FSDP2 frees and allocates its unsharded
        parameters so (``free_storage``, ``alloc_storage``). torch's ``MemTracker`` patches ``resize_`` the same way."""
        self._resize = resize = torch.UntypedStorage.resize_

        @functools.wraps(resize)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            old_key = storage.data_ptr()
            out = resize(storage, size)
            if threading.get_ident() == self._owner:
                self._resized(storage, old_key)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]

    def _resized(self, storage: torch.UntypedStorage, old_key: int) -> None:
        """Count ``storage`` at its new address and size (none when resized to 0), under the category it had."""
        self._take_frees_elsewhere()
        size, category = self._sizes.get(old_key, (0, self.category))
        if size:
            self._release(old_key)
        key = storage.data_ptr()
        if key and storage.nbytes() and key not in self._sizes:
            self._count(storage, key, storage.nbytes(), category)

    @property
    def live_bytes(self) -> int:
        """The bytes alive now."""
        self._take_frees_elsewhere()
        return self._live

    @property
    def live_by(self) -> dict[str, int]:
        """The bytes alive now per category."""
        self._take_frees_elsewhere()
        return self._live_by

    @property
    def peak_bytes(self) -> int:
        """The most bytes alive at once since the mode started or :meth:`reset_peak`."""
        return self._peak_level().bytes

    @property
    def peak_by(self) -> dict[str, int]:
        """The bytes per category at the peak."""
        return self._peak_level().by

    @property
    def peak_label(self) -> str:
        """What ``label`` said when the peak came."""
        return self._peak_level().label

    def adopt(self, tensors: Iterable[torch.Tensor], category: str | None = None, *, own_bytes: bool = False) -> None:
        """Count the storages of ``tensors`` (those alive before the mode started) under ``category`` (default: the
        current one); their release is seen too. With ``own_bytes`` a tensor counts its own elements' bytes, not its
        whole storage's (a slice of a larger batch, as a device would hold a copy of it)."""
        for t in tensors:
            self._add(t, category, own_bytes=own_bytes)

    def tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Move the storages of ``tensors`` that are counted to ``category`` (those not counted are left alone)."""
        self._take_frees_elsewhere()
        for t in tensors:
            key = _key(t)
            if key is None or key not in self._sizes:
                continue
            size, old = self._sizes[key]
            if old != category:
                self._sizes[key] = (size, category)
                self._live_by[old] -= size
                self._live_by[category] = self._live_by.get(category, 0) + size

    def recategorize(self, old: str, new: str) -> None:
        """Move every storage counted under ``old`` to ``new``."""
        self._take_frees_elsewhere()
        moved = 0
        for key, (size, category) in self._sizes.items():
            if category == old:
                self._sizes[key] = (size, new)
                moved += size
        if moved:
            self._live_by[old] -= moved
            self._live_by[new] = self._live_by.get(new, 0) + moved

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category ``t``'s storage is counted under, or None when it is not counted."""
        self._take_frees_elsewhere()
        key = _key(t)
        entry = self._sizes.get(key) if key is not None else None
        return entry[1] if entry is not None else None

    def serial(self, t: torch.Tensor) -> int | None:
        """The number of ``t``'s storage, counted from 0 in the order the storages were first counted (None when it
        is not counted): unlike its address, which a later storage may reuse, it names one storage."""
        self._take_frees_elsewhere()
        key = _key(t)
        return self._serials.get(key) if key is not None else None

    def live_serials(self) -> set[int]:
        """The numbers (:meth:`serial`) of the storages alive now."""
        self._take_frees_elsewhere()
        return set(self._serials.values())

    def reset_peak(self) -> None:
        """Start a new peak at what is alive now."""
        self._take_frees_elsewhere()
        self._peak = _Level(self._ops, self._live, dict(self._live_by), self.label)
        self._unsettled.clear()

    def _freed(self, key: int, serial: int) -> None:
        """A counted storage's finalizer: on the owner's thread it is freed now, on another one when the owner next
        looks (its address cannot be reused before: the finalizer runs before the memory is freed)."""
        if threading.get_ident() == self._owner:
            self._release(key, serial)
        else:
            self._freed_elsewhere.append((key, serial))

    def _release(self, key: int, serial: int | None = None) -> None:
        """Stop counting the storage at ``key`` (only if it is still storage number ``serial``, when given: a resized
        storage's finalizer comes after its old address may have been reused)."""
        if serial is not None and self._serials.get(key) != serial:
            return
        size, category = self._sizes.pop(key, (0, ""))
        self._serials.pop(key, None)
        self._last_read.pop(key, None)
        if size:
            self._live -= size
            self._live_by[category] -= size

    def _take_frees_elsewhere(self) -> None:
        """Count the storages other threads freed; a collective's counts as freed after the owner's last operator
        that read it, so each level reached since then is lowered by its bytes."""
        if not self._freed_elsewhere or threading.get_ident() != self._owner:
            return
        while self._freed_elsewhere:
            key, serial = self._freed_elsewhere.popleft()
            if self._serials.get(key) != serial:
                continue
            size, category = self._sizes.get(key, (0, ""))
            last_read = self._last_read.get(key)
            self._release(key)
            if last_read is None or not size:
                continue
            for level in self._unsettled:
                if level.op > last_read:
                    level.bytes -= size
                    level.by[category] = level.by.get(category, 0) - size
        self._settle()

    def _settle(self) -> None:
        """Fold into the peak the levels no collective's storage alive now can lower: those reached by the oldest
        last read among them."""
        horizon = min(self._last_read.values(), default=self._ops)
        while self._unsettled and self._unsettled[0].op <= horizon:
            level = self._unsettled.pop(0)
            if level.bytes > self._peak.bytes:
                self._peak = level

    def _peak_level(self) -> _Level:
        self._take_frees_elsewhere()
        return max([self._peak, *self._unsettled], key=lambda level: level.bytes)

    def _rise(self) -> None:
        """Record the level just reached where it may be the peak."""
        if self._live <= self._peak.bytes:
            return
        if not self._last_read:  # nothing alive can lower a level now: every one is final
            self._settle()
            if self._live > self._peak.bytes:
                self._peak = _Level(self._ops, self._live, dict(self._live_by), self.label)
            return
        level = _Level(self._ops, self._live, dict(self._live_by), self.label)
        last = self._unsettled[-1] if self._unsettled else None
        if last is not None and not any(last.op <= read < self._ops for read in self._last_read.values()):
            if level.bytes > last.bytes:  # no storage read between them: any later free lowers both alike
                self._unsettled[-1] = level
            return
        self._unsettled.append(level)

    def _add(self, t: torch.Tensor, category: str | None = None, *, own_bytes: bool = False) -> int | None:
        """Count ``t``'s storage if it is not counted yet; returns its key when it was not."""
        self._take_frees_elsewhere()
        key = _key(t)
        if key is None or key == 0 or key in self._sizes:
            return None
        t = local_tensor(t)
        storage = t.untyped_storage()
        self._count(storage, key, t.numel() * t.element_size() if own_bytes else storage.nbytes(), category)
        return key

    def _count(self, storage: torch.UntypedStorage, key: int, size: int, category: str | None) -> None:
        category = category or self.category
        serial = self._next_serial
        self._next_serial += 1
        self._sizes[key] = (size, category)
        self._serials[key] = serial
        self._live += size
        self._live_by[category] = self._live_by.get(category, 0) + size
        weakref.finalize(storage, self._freed, key, serial).atexit = False  # nothing to count once the process ends
        self._rise()

    def _note_reads(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor]) -> None:
        """Remember this operator as the last that read or made each collective's storage among its tensors."""
        collective = func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _POINT_TO_POINT
        if not collective and not self._last_read:
            return
        for t in (*_tensors_in(args), *_tensors_in((kwargs or {}).values()), *outs):
            key = _key(t)
            if key is not None and key in self._sizes and (collective or key in self._last_read):
                self._last_read[key] = self._ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._ops += 1
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors_in(out if isinstance(out, (tuple, list)) else (out,)))
        for t in outs:
            key = self._add(t)
            if key is not None and func.is_view:  # first seen through a view: allocated out of the count's sight,
                self._last_read[key] = self._ops  # as gloo's emulated reduce-scatter allocates its copy
        self._note_reads(func, args, kwargs, outs)
        if self._unsettled:
            self._settle()
        if self.on_op is not None:
            self.on_op(args, kwargs, out)
        return out


def _tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and in the lists and tuples among them (an operator's arguments)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


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
