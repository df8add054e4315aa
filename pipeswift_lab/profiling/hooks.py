"""The timing and memory hooks behind :func:`pipeswift_lab.profiling.measure.profile` and ``%%pipeswift_profile``.

Units (the layers a pipeline may cut between) are measured **in place**, during a real
forward and backward of the whole model, so residual connections, shared blocks, tied
weights, keyword-argument calls and in-place activations all behave as in training.

Forward
    A forward pre-hook and a forward hook on each unit take a timestamp just before and
    just after its ``forward``. A unit called several times in one step adds up its calls.

Backward
    Autograd numbers every graph node it creates with a per-thread sequence number, and the
    engine runs the ready nodes of a device highest number first (``engine.cpp``,
    ``CompareNodeTaskTime``). A node's backward inputs come from nodes created after it, so
    the nodes run in decreasing number and the nodes created during one call of a unit
    (numbers in ``[lo, hi)``, read with ``torch._C._autograd._get_sequence_nr`` in the two
    forward hooks) run back to back. Right after a call returns, the hooks walk the graph
    from the call's outputs through the nodes numbered ``[lo, hi)`` and put a node *pre*-hook
    on the nodes that produced the outputs (it fires when the gradient has arrived at the
    unit's output) and a node *post*-hook on the nodes with no successor inside the unit, plus
    the gradient accumulation of parameters only this unit holds (they fire as the gradient
    leaves at the unit's input and its weight gradients are stored). The backward time of a
    call is first pre-hook to last post-hook. Node hooks are graph hooks, which keep working
    with in-place ops, unlike module backward hooks. Gradient accumulation of a parameter
    shared by several units (tied weights) runs once, after its last use, and is not part of
    any unit.

Memory
    While a unit's forward runs, ``torch.autograd.graph.saved_tensors_hooks`` sees every
    tensor autograd saves for backward; a unit's ``activation_bytes`` is the size of the
    distinct storages saved, parameters and buffers excluded. ``output_bytes`` is the size of
    the tensors a unit returns. On CUDA, ``peak_bytes`` is the highest transient allocation
    (``torch.cuda.max_memory_allocated`` over the allocation at the start) during the unit's
    forward or backward; the hooks reset CUDA's peak-memory statistics to measure it.
    With saved-tensor hooks set, autograd no longer checks that a saved tensor was not
    modified in place before backward; the unpack hook checks the version counter itself and
    raises autograd's usual error.

Clocks
    On CPU, ``time.perf_counter_ns``. On CUDA, ``torch.cuda.Event`` records on the current
    stream, read after ``torch.cuda.synchronize``, so the times are GPU times
    (:mod:`pipeswift_lab.profiling.clocks`).

The whole step is measured from the step start to the end of the backward; on CPU the
time spent walking the graph (the profiler's own bookkeeping) is taken out of it.

Limits: units inside a ``torch.compile``d region run no module hooks and are not seen;
with activation checkpointing the checkpoint's own saved-tensor hooks take precedence, so
a checkpointed unit reports only what is saved outside the checkpoint (its recomputation
does run inside its backward window); a model spread over several devices is refused.

The helpers that pick the units and give the model back as it was are in
:mod:`pipeswift_lab.profiling.units`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..core.live_bytes import LiveTensorBytes, MemoryMeter
from .clocks import Clock
from .crossings import StorageAttribution
from .step_record import StepRecord

try:  # the engine's next sequence number; a throw-away node is the fallback probe
    _peek_sequence_nr = torch._C._autograd._get_sequence_nr
except AttributeError:  # pragma: no cover - older or newer torch without the binding
    _PROBE = torch.zeros((), requires_grad=True)

    def _peek_sequence_nr() -> int:
        with torch.enable_grad():
            node: Any = _PROBE.view(()).grad_fn  # a view of a leaf that requires grad always has a node
            return node._sequence_nr() + 1


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors in ``obj``: a tensor, or tuples, lists and dicts of them (nested)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth < 8 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item, _depth + 1)
    elif _depth < 8 and isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, _depth + 1)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (what sending it to another stage moves)."""
    return t.numel() * t.element_size()


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple[Any, ...], int]:
    """``(key, bytes)`` of the storage behind ``t``: tensors that share a storage share the key."""
    try:
        storage = t.untyped_storage()
        return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a plain storage
        return ("id", id(t)), tensor_bytes(t)


class _Call:
    """One call of one unit in one step."""

    __slots__ = (
        "unit",
        "lo",
        "hi",
        "f0",
        "f1",
        "b0",
        "b1",
        "out_bytes",
        "mem_base",
        "fwd_peak",
        "bwd_base",
        "bwd_peak",
        "fwd_kept",
    )

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.lo: int | None = None  # the autograd sequence numbers of the call's own graph nodes: [lo, hi)
        self.hi: int | None = None
        self.f0: Any = None  # clock stamps: forward start and end, backward start and end
        self.f1: Any = None
        self.b0: Any = None
        self.b1: Any = None
        self.out_bytes = 0
        self.mem_base: int | None = None  # bytes allocated at the forward's start, and the peaks above it
        self.fwd_peak: int | None = None
        self.fwd_kept: int | None = None  # bytes the forward left allocated (saved activations, outputs)
        self.bwd_base: int | None = None
        self.bwd_peak: int | None = None


class LayerRecorder:
    """Context manager that installs the unit hooks on ``model`` and measures steps.

    ``units`` is a list of ``(name, module)``; call :meth:`begin_step` before a step and
    :meth:`end_step` after its backward, which returns a :class:`StepRecord`. Every hook
    is removed on exit.
    """

    def __init__(
        self, model: nn.Module, units: Sequence[tuple[str, nn.Module]], clock: Clock, meter: MemoryMeter | None = None
    ) -> None:
        self.model, self.units, self.clock = model, list(units), clock
        self.meter = meter  # set for a step whose memory is measured (not timed: reading it costs time)
        self.tracker: LiveTensorBytes | None = None  # with the meter: which unit allocated each storage
        self.handles: list[Any] = []
        self.active = False
        owners: dict[int, int] = {}
        for index, (_, module) in enumerate(self.units):
            for p in module.parameters():
                owners[id(p)] = -1 if owners.get(id(p), index) != index else index
        self._exclusive = [{pid for pid, owner in owners.items() if owner == index} for index in range(len(self.units))]
        self._reset()

    # -- lifecycle --------------------------------------------------------------------
    def _reset(self) -> None:
        self.calls: list[_Call] = []
        self.stack: list[_Call] = []
        self.walk_spans: list[tuple[Any, Any]] = []
        self.saved: list[dict[tuple[Any, ...], int]] = [dict() for _ in self.units]
        self.batch_shape: list[int] | None = None
        self.node_handles: list[Any] = []
        self.loss_base: int | None = None  # bytes allocated before the loss ran, then before its backward
        self.loss_activation: float = float("nan")
        self.loss_transient: float = float("nan")
        self.loss_retained: float = float("nan")
        self.attribution = (
            StorageAttribution(self.tracker, lambda t: _storage_key_and_bytes(t)[0] in self._state_keys)
            if self.tracker is not None
            else None
        )

    def __enter__(self) -> LayerRecorder:
        self._state_keys = set()
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            self._state_keys.add(_storage_key_and_bytes(t)[0])
        for index, (_, module) in enumerate(self.units):
            self.handles.append(module.register_forward_pre_hook(self._make_pre(index), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._make_post(index), prepend=True))
        self.handles.append(self.model.register_forward_pre_hook(self._root_pre))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        self._saved_hooks.__exit__(*exc)
        self._remove_node_hooks()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _remove_node_hooks(self) -> None:
        for handle in self.node_handles:
            handle.remove()
        self.node_handles = []

    def begin_step(self) -> None:
        """Start a step: clear the per-step state and stamp the step start."""
        self._remove_node_hooks()
        self._reset()
        self.active = True
        self.clock.synchronize()
        self.t_begin = self.clock.stamp()

    def end_step(self) -> StepRecord:
        """Stamp the step end, wait for the device, and return the step's :class:`StepRecord`."""
        t_end = self.clock.stamp()
        self.active = False
        self.clock.synchronize()
        ms = self.clock.ms
        step_ms = ms(self.t_begin, t_end)
        if not self.clock.cuda:  # walking the graph is the profiler's own time; on CUDA it overlaps queued kernels
            step_ms -= sum(ms(a, b) for a, b in self.walk_spans)
        n = len(self.units)
        fwd, bwd, calls = [0.0] * n, [0.0] * n, [0] * n
        out_bytes, peaks, transients = [0] * n, [float("nan")] * n, [float("nan")] * n
        order: list[int] = []
        for call in self.calls:
            u = call.unit
            if call.f1 is None:  # the forward of this call never returned (an exception)
                continue
            if u not in order:
                order.append(u)
            calls[u] += 1
            fwd[u] += ms(call.f0, call.f1)
            if call.b0 is not None and call.b1 is not None:
                bwd[u] += ms(call.b0, call.b1)
            out_bytes[u] += call.out_bytes
            for peak in (call.fwd_peak, call.bwd_peak):
                if peak is not None:
                    peaks[u] = peak if peaks[u] != peaks[u] else max(peaks[u], peak)
            beyond = [
                x
                for x in (
                    None if call.fwd_peak is None or call.fwd_kept is None else call.fwd_peak - call.fwd_kept,
                    call.bwd_peak,
                )
                if x is not None
            ]
            if beyond:
                transients[u] = max(beyond) if transients[u] != transients[u] else max(transients[u], *beyond)
        act = [sum(saved.values()) for saved in self.saved]
        self._remove_node_hooks()
        attribution = self.attribution if order else None
        held, cuts = attribution.result(order, n) if attribution is not None else (None, None)
        return StepRecord(
            step_ms=step_ms,
            fwd_ms=fwd,
            bwd_ms=bwd,
            calls=calls,
            activation_bytes=act,
            output_bytes=out_bytes,
            peak_bytes=peaks,
            transient_bytes=transients,
            first_call_order=order,
            batch_shape=self.batch_shape,
            loss_activation_bytes=self.loss_activation,
            loss_transient_bytes=self.loss_transient,
            loss_retained_bytes=self.loss_retained,
            held_bytes=held,
            cut_bytes=cuts[0] if cuts else None,
            cut_grad_bytes=cuts[1] if cuts else None,
            cut_freed_bytes=cuts[2] if cuts else None,
        )

    # -- the loss (a memory step only) --------------------------------------------------
    def before_loss(self, output: Any = None) -> None:
        """Note the bytes allocated before the loss runs, what each unit holds until the backward, and what the
        model returns (``output``: tensors a cut before their maker's successors sends on)."""
        if self.meter is not None:
            self.loss_base = self.meter.allocated()
        if self.attribution is not None:
            self.attribution.forward_done(output)

    def before_backward(self) -> None:
        """Note what the loss kept, and start the peak of its backward."""
        if self.attribution is not None:
            self.attribution.backward_starts()
            self.loss_activation = self.attribution.loss_kept
        elif self.meter is not None and self.loss_base is not None:
            self.loss_activation = float(self.meter.allocated() - self.loss_base)
        if self.meter is not None and self.loss_base is not None:
            self.meter.reset_peak()
            self.loss_base = self.meter.allocated()

    def after_backward(self) -> None:
        """Note what the loss still holds after the backward, while the loss tensor lives."""
        if self.attribution is not None:
            self.attribution.backward_done()
            self.loss_retained = self.attribution.loss_retained

    # -- forward hooks ----------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active and self.batch_shape is None:
            first = next(iter_tensors(args), None)
            if first is not None:
                self.batch_shape = list(first.shape)

    def _make_pre(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.active:
                return None
            if self.attribution is not None:
                self.attribution.enter_unit(index)
            call = _Call(index)
            self.calls.append(call)
            self.stack.append(call)
            call.lo = _peek_sequence_nr()
            if self.meter is not None:
                self.meter.reset_peak()
                call.mem_base = self.meter.allocated()
            call.f0 = self.clock.stamp()
            return None

        return pre_hook

    def _make_post(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self.active or not self.stack or self.stack[-1].unit != index:
                return None
            f1 = self.clock.stamp()
            call = self.stack.pop()
            call.f1, call.hi = f1, _peek_sequence_nr()
            if self.meter is not None:
                call.fwd_peak = self.meter.peak() - (call.mem_base or 0)
                call.fwd_kept = self.meter.allocated() - (call.mem_base or 0)
            walk_start = self.clock.stamp() if not self.clock.cuda else None
            outputs: list[torch.Tensor] = []
            seen: set[int] = set()
            for t in iter_tensors(output):
                if id(t) not in seen:
                    seen.add(id(t))
                    outputs.append(t)
                    call.out_bytes += tensor_bytes(t)
            self._hook_backward(call, outputs)
            if walk_start is not None:
                self.walk_spans.append((walk_start, self.clock.stamp()))
            return None

        return post_hook

    # -- backward hooks ---------------------------------------------------------------
    def _hook_backward(self, call: _Call, outputs: list[torch.Tensor]) -> None:
        """Walk the call's own graph nodes and hook its entry and exit nodes (see module docs)."""
        lo, hi = call.lo, call.hi
        if lo is None or hi is None or hi <= lo:
            return
        exclusive = self._exclusive[call.unit]
        entries: list[Any] = []
        stack: list[Any] = []
        seen: set[Any] = set()
        exits: list[Any] = []
        for t in outputs:
            node = t.grad_fn
            if node is not None and lo <= node._sequence_nr() < hi and node not in seen:
                seen.add(node)
                entries.append(node)
                stack.append(node)
        while stack:
            node = stack.pop()
            inside_successor = False
            accumulators = []
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if type(nxt).__name__ == "AccumulateGrad":
                    if id(nxt.variable) in exclusive:
                        accumulators.append(nxt)
                    continue
                if lo <= nxt._sequence_nr() < hi:
                    inside_successor = True
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            if not inside_successor:
                exits.append(node)
                exits.extend(accumulators)
        for node in entries:
            self.node_handles.append(node.register_prehook(self._make_entry_hook(call)))
        for node in exits:
            self.node_handles.append(node.register_hook(self._make_exit_hook(call)))

    def _make_entry_hook(self, call: _Call) -> Callable[[Any], None]:
        def entry_hook(grad_outputs: Any) -> None:
            if call.b0 is None:
                if self.meter is not None:
                    if self.loss_base is not None and self.loss_transient != self.loss_transient:
                        self.loss_transient = float(self.meter.peak() - self.loss_base)
                    self.meter.reset_peak()
                    call.bwd_base = self.meter.allocated()
                call.b0 = self.clock.stamp()
            return None

        return entry_hook

    def _make_exit_hook(self, call: _Call) -> Callable[[Any, Any], None]:
        def exit_hook(grad_inputs: Any, grad_outputs: Any) -> None:
            call.b1 = self.clock.stamp()
            if self.meter is not None and call.bwd_base is not None:
                call.bwd_peak = self.meter.peak() - call.bwd_base
            return None

        return exit_hook

    # -- saved tensors ----------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.active and self.stack:
            key, nbytes = _storage_key_and_bytes(t)
            if key not in self._state_keys:
                self.saved[self.stack[-1].unit].setdefault(key, nbytes)
        # with saved-tensor hooks autograd no longer checks the version counter; check it here
        return t, t._version

    @staticmethod
    def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a saved {t.dtype} tensor of shape {tuple(t.shape)} is at version {t._version}; "
                f"expected version {version} "
                "(checked by pipeswift_lab's saved-tensor hook)"
            )
        return t


def current_unit(recorder: LayerRecorder) -> int | None:
    """Index of the unit whose forward is running (after an exception: where it failed)."""
    return recorder.stack[-1].unit if recorder.stack else None


def shapes(obj: Any) -> list[list[int]]:
    """Shapes of the tensors in ``obj``, as lists of ints."""
    return [list(t.shape) for t in iter_tensors(obj)]


__all__ = [
    "current_unit",
    "iter_tensors",
    "LayerRecorder",
    "shapes",
    "StepRecord",
    "tensor_bytes",
]
