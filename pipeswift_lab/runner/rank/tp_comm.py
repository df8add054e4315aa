"""Timing tensor parallelism's collectives inside the actions that run them (``TP_ALL_REDUCE``, ``TP_ALL_GATHER``,
``TP_REDUCE_SCATTER``, ``TP_ALL_TO_ALL`` rows, each with its bytes).

Every collective a DTensor redistribution runs goes through three functions of
``torch.distributed._functional_collectives`` (``funcol``), which DTensor looks up on that module at each call:

* ``funcol.all_reduce`` — a ``Partial`` to ``Replicate`` (``Partial._reduce_value``): RowwiseParallel's output,
  the backward of ColwiseParallel's and SequenceParallel's replicated input;
* ``funcol.all_gather_single`` — a ``Shard`` to ``Replicate`` (``Shard._to_replicate_tensor``): a gathered output
  (``colwise_gather_output``), the backward of a split input, sequence parallelism's gathers; and, on CPU, the
  shard-to-shard all-to-all, which gloo lacks;
* ``funcol.reduce_scatter_single`` — a ``Partial`` to ``Shard`` (``Shard._reduce_shard_tensor``): sequence
  parallelism's exits and the backward of its gathers;

and a ``Shard(i)`` to ``Shard(j)`` runs ``shard_dim_alltoall`` (looked up on ``placement_types``), an all-to-all
(``TP_ALL_TO_ALL``; on CPU it is an all-gather inside, timed as the all-to-all asked for).

That covers the ``ParallelStyle`` hooks (``distribute_module``'s input and output redistributions), hand-written
hooks that call ``DTensor.redistribute`` (sequence parallelism's), the redistributions DTensor's sharding
propagation inserts around an operator, and every backward of them (``Redistribute.backward`` and ``from_local``'s
backward redistribute the gradient through the same functions) — with no special case per style. The collective is
issued by the function and completes in ``funcol.wait_tensor`` (an ``AsyncCollectiveTensor`` waits on first use;
``redistribute`` waits at once unless ``async_op``): a row spans the issue to the end of that wait, matched by the
result's storage (gloo runs the work on its own thread, so on CPU too the time is in the wait). It includes waiting
for the group's slowest process to arrive, as the runtime lives it. A collective left unwaited when its action
returns ends with the action. The
``replicated_with_grad_allreduce`` style sums gradients with ``torch.distributed.all_reduce`` on the
tensor-parallel group: blocking c10d ``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` calls
on that group are timed too (on other groups, e.g. FSDP's, they are not tensor parallelism's).

A row's ``bytes`` is the collective's whole buffer, as :mod:`pipeswift_lab.core.topology` prices it: the input of an
all-reduce, reduce-scatter or all-to-all, the output of an all-gather.

Cost: the functions are replaced once per worker process, and only where its stages hold tensor-parallel DTensors and
the run records its timeline; outside an action, or with no recorder, the replacements pass straight through (a
Python call and one attribute read). Inside an action each collective costs two clock reads (CUDA: two events) and a
storage lookup. A ``TorchDispatchMode`` would see the same ops (``_c10d_functional.all_reduce``, ``wait_tensor``,
forward and backward), but it runs Python on every operator of every action: a no-op mode doubles a small GPT's
forward and backward on CPU (2.0 to 4.3 ms), which would slow the compute it is timing and that calibration reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FUNCTIONAL", "C10D", "TPCommTimer", "install", "tp_group_name", "uninstall"]

#: The functional collectives DTensor calls: the kind each records, and whether its bytes are its input's or its
#: output's (the whole buffer).
FUNCTIONAL: dict[str, tuple[str, str]] = {
    "all_reduce": ("TP_ALL_REDUCE", "input"),
    "all_gather_single": ("TP_ALL_GATHER", "output"),
    "reduce_scatter_single": ("TP_REDUCE_SCATTER", "input"),
}
#: The blocking c10d collectives timed on the tensor-parallel group: the kind each records and the argument holding
#: the whole buffer.
C10D: dict[str, tuple[str, str]] = {
    "all_reduce": ("TP_ALL_REDUCE", "tensor"),
    "all_gather_into_tensor": ("TP_ALL_GATHER", "output_tensor"),
    "reduce_scatter_tensor": ("TP_REDUCE_SCATTER", "input"),
}

#: The timer whose actions run now (one per process: the rank's recorder), or None.
_ACTIVE: list[TPCommTimer] = []
#: The original functions, by ``(module name, function name)``, while they are replaced.
_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}


@dataclass
class _Collective:
    """One collective being timed: where it ran, its issue stamp, its end stamp once waited, its bytes."""

    kind: str
    stage: int
    microbatch: int
    start: Any
    end: Any = None
    nbytes: int = 0


def _storage_key(tensor: Any) -> int:
    """The address of ``tensor``'s storage (its views and an ``AsyncCollectiveTensor``'s ``elem`` share it)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, AttributeError, NotImplementedError):
        return id(tensor)


def _nbytes(tensor: Any) -> int:
    """``tensor``'s bytes (0 for anything else)."""
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, torch.Tensor) else 0


class TPCommTimer:
    """Times the tensor-parallel collectives of the actions a recorder wraps.

    ``stamp()`` reads the recorder's clock (``perf_counter_ns``, or a recorded CUDA event);
    ``emit(kind, stage, microbatch, start, end, nbytes)`` adds a row. The recorder sets :attr:`context` to ``(stage,
    microbatch)`` while an action runs and calls :meth:`finish` when it returns. ``group_name`` is the
    tensor-parallel process group's name (c10d calls on other groups are not timed).
    """

    def __init__(
        self, stamp: Callable[[], Any], emit: Callable[[str, int, int, Any, Any, int], None], group_name: str | None
    ) -> None:
        self.stamp, self.emit, self.group_name = stamp, emit, group_name
        self.context: tuple[int, int] | None = None
        self._pending: dict[int, _Collective] = {}
        self._issuing: _Collective | None = None

    def begin(self, stage: int, microbatch: int) -> None:
        """An action of ``stage`` on ``microbatch`` starts: collectives from now on are its own."""
        self.context = (stage, microbatch)

    def finish(self, end: Any) -> None:
        """The action returned at ``end``: collectives it left unwaited end with it."""
        for collective in self._pending.values():
            collective.end = end
            self._emit(collective)
        self._pending.clear()
        self.context = None

    def _emit(self, c: _Collective) -> None:
        self.emit(c.kind, c.stage, c.microbatch, c.start, c.end, c.nbytes)

    def issue(self, kind: str, bytes_of: str, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the functional collective ``call`` and time it until its result is waited on."""
        if self.context is None or self._issuing is not None:
            return call(*args, **kwargs)
        collective = _Collective(kind, *self.context, start=self.stamp())
        self._issuing = collective
        try:
            out = call(*args, **kwargs)
        finally:
            self._issuing = None
        source = out if bytes_of == "output" else (args[0] if args else kwargs.get("self"))
        collective.nbytes = _nbytes(source)
        elem = getattr(out, "elem", None)
        if collective.end is None and isinstance(elem, torch.Tensor) and not getattr(out, "completed", True):
            self._pending[_storage_key(elem)] = collective  # an AsyncCollectiveTensor: its wait ends the row
            return out
        if collective.end is None:  # already complete (a traced or synchronous result)
            collective.end = self.stamp()
        self._emit(collective)
        return out

    def waited(self, tensor: Any) -> None:
        """``funcol.wait_tensor(tensor)`` just returned: end the collective whose result it was."""
        if self._pending:
            collective = self._pending.pop(_storage_key(tensor), None)
            if collective is not None:
                collective.end = self.stamp()
                self._emit(collective)
                return
        if self._issuing is not None and self._issuing.end is None:
            self._issuing.end = self.stamp()  # waited inside the issuing call (a gather along a later dim)

    def blocking(self, kind: str, buffer: Any, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run ``call``, a collective complete when it returns, timed from its call to its return; collectives it
        runs inside are its own."""
        if self.context is None or self._issuing is not None:
            return call(*args, **kwargs)
        collective = _Collective(kind, *self.context, start=self.stamp(), nbytes=_nbytes(buffer))
        self._issuing = collective
        try:
            out = call(*args, **kwargs)
        finally:
            self._issuing = None
        collective.end = self.stamp()
        self._emit(collective)
        return out


def _functional(kind: str, bytes_of: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return original(*args, **kwargs)
        return _ACTIVE[0].issue(kind, bytes_of, original, args, kwargs)

    return timed


def _wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait_tensor(tensor: Any) -> Any:
        out = original(tensor)
        if _ACTIVE:
            _ACTIVE[0].waited(tensor)
        return out

    return wait_tensor


def _c10d(kind: str, buffer: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE or _ACTIVE[0].context is None:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # not a call this signature takes: let torch say so
            return original(*args, **kwargs)
        group = getattr(bound.get("group"), "group_name", None)
        if bound.get("async_op") or group is None or group != _ACTIVE[0].group_name:
            return original(*args, **kwargs)
        return _ACTIVE[0].blocking(kind, bound.get(buffer), original, args, kwargs)

    return timed


def _all_to_all(original: Callable[..., Any]) -> Callable[..., Any]:
    def shard_dim_alltoall(input: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return original(input, *args, **kwargs)
        return _ACTIVE[0].blocking("TP_ALL_TO_ALL", input, original, (input, *args), kwargs)

    return shard_dim_alltoall


def install(timer: TPCommTimer) -> None:
    """Make ``timer`` the process's active timer, replacing the collective functions on first use."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    if not _ORIGINALS:
        for name, (kind, bytes_of) in FUNCTIONAL.items():
            _ORIGINALS[("funcol", name)] = getattr(funcol, name)
            setattr(funcol, name, _functional(kind, bytes_of, getattr(funcol, name)))
        _ORIGINALS[("funcol", "wait_tensor")] = funcol.wait_tensor
        funcol.wait_tensor = _wait(funcol.wait_tensor)
        for name, (kind, buffer) in C10D.items():
            _ORIGINALS[("dist", name)] = getattr(dist, name)
            setattr(dist, name, _c10d(kind, buffer, getattr(dist, name)))
        if hasattr(placement_types, "shard_dim_alltoall"):
            _ORIGINALS[("placement_types", "shard_dim_alltoall")] = placement_types.shard_dim_alltoall
            placement_types.shard_dim_alltoall = _all_to_all(placement_types.shard_dim_alltoall)
    _ACTIVE[:] = [timer]


def uninstall() -> None:
    """Put the original collective functions back and forget the active timer."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    modules = {"funcol": funcol, "dist": dist, "placement_types": placement_types}
    for (module, name), original in _ORIGINALS.items():
        setattr(modules[module], name, original)
    _ORIGINALS.clear()
    _ACTIVE.clear()


def tp_group_name(modules: list[torch.nn.Module]) -> str | None:
    """The name of the tensor-parallel process group of ``modules``' DTensor parameters (a device mesh dimension named
    ``"tp"`` of more than one rank), or None when they hold none."""
    from torch.distributed.tensor import DTensor

    for module in modules:
        for param in module.parameters():
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or ()
            if "tp" in names:
                tp = mesh["tp"] if mesh.ndim > 1 else mesh
                if tp.size() > 1:
                    return str(tp.get_group().group_name)
    return None
