"""What a zero-bubble schedule's two backward passes cost per layer: what the input-gradient pass holds until the
weight-gradient pass, and how long each takes.

The zero-bubble schedules (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024) split a stage's
backward in two: ``I`` computes the gradient of the stage's input, ``W`` later the weights'.
torch's ``stage_backward_input`` keeps, for ``W`` to start from, the gradient arriving at every
node where the input's path meets a parameter's (its ``param_groups``' ``"grads"``: the outputs of
the linears and the norms, one tensor of each per micro-batch), on top of the forward's saved
tensors; a checkpointed layer also keeps what ``I`` recomputed and ``W`` reads again (selective
checkpointing's cache holds its results until the graph is freed). :func:`split_backward_columns` runs
torch's own ``stage_backward_input`` on each unit alone, on the input it received in one forward of
the model, and counts what the pass allocated that is still alive when it returns, less the input
gradient it hands back (that is sent, not kept): the unit's ``weight_pass_bytes``, and with
``modes`` the same recomputed (``{mode}_weight_pass_bytes``); and the most the pass held at once while it ran,
``input_pass_peak_bytes`` (``{mode}_input_pass_peak_bytes``): ``I`` retains the forward's graph for ``W``, so
it frees none of the saved tensors as it goes, and what a stage's ``I`` holds grows by each unit's kept
gradients. The gradient the unit is given counts
where ``I`` keeps it (a residual block passes its output's gradient on to its last linear unchanged):
inside a stage it is the next unit's input gradient, at the stage's end its receive buffer, counted
there as well. The same runs time each pass, ``input_pass_ms`` and ``weight_pass_ms`` (medians): split, the
backward costs more than whole (two graph traversals, the second starting from the kept gradients, one
``autograd.grad`` per parameter group), which a share of the whole backward cannot say.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from ..core.live_bytes import LiveTensorBytes, live_tensors
from ..core.recompute import recomputing
from .hooks import iter_tensors

__all__ = ["PEAK", "split_backward_columns"]

_EARLIER, _PASS = "earlier", "pass"  # a tracker's categories: alive before a unit's input pass, made by it
#: The column of the most a unit's input-gradient pass holds at once (``{mode}_`` before it when recomputed).
PEAK = "input_pass_peak_bytes"


def split_backward_columns(
    units: Sequence[tuple[str, nn.Module]],
    run_forward: Callable[[], Any],
    modes: Sequence[str] = (),
    repeats: int = 5,
) -> dict[str, list[float]]:
    """Per unit (in ``units``' order): the bytes torch's ``stage_backward_input`` keeps alive for the unit's weight
    pass, ``weight_pass_bytes``, and ``{mode}_weight_pass_bytes`` for each of ``modes`` (``"full"``,
    ``"selective"``: the unit checkpointed as the runner checkpoints it under a split backward); the most the pass
    held at once, ``input_pass_peak_bytes`` (``{mode}_input_pass_peak_bytes``); the median ms of
    ``repeats`` runs of torch's ``stage_backward_input`` and ``stage_backward_weight`` on it, ``input_pass_ms`` and
    ``weight_pass_ms`` (NaN for a unit without an input that requires grad: in a first stage, which has no ``I``).

    ``run_forward()`` runs the model's forward once (gradients on) so that each unit's first call is captured; the
    units then run alone under the caller's autocast state. A unit without an input that requires grad (the model's
    first, fed the batch) keeps nothing: a pipeline's first stage has no ``I``. A unit that cannot run alone on what
    it received gets NaN.
    """
    received: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def capture(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if index not in received:
                received[index] = pytree.tree_map(_as_received, (args, kwargs))

        return hook

    handles = [module.register_forward_pre_hook(capture(i), with_kwargs=True) for i, (_, module) in enumerate(units)]
    try:
        run_forward()
    finally:
        for handle in handles:
            handle.remove()

    calls = [(module, *received.get(i, ((), {}))) for i, (_, module) in enumerate(units)]
    timed = _timed_passes([call if _needs_input_pass(call[1], call[2]) else None for call in calls], repeats)
    out: dict[str, list[float]] = {
        "input_pass_ms": [t[0] if t else float("nan") for t in timed],
        "weight_pass_ms": [t[1] if t else float("nan") for t in timed],
    }
    # one tracker for every pass: the process's tensors are found once (a walk of every object the collector
    # tracks, a tenth of a second or more in a process that has imported torch), each pass's own are seen made
    with LiveTensorBytes(_EARLIER) as tracker:
        tracker.adopt(live_tensors(), _EARLIER)
        for mode in ("", *modes):
            prefix = f"{mode}_" if mode else ""
            kept, peaks = out.setdefault(f"{prefix}weight_pass_bytes", []), out.setdefault(f"{prefix}{PEAK}", [])
            for i, (_, module) in enumerate(units):
                args, kwargs = received.get(i, ((), {}))
                if not _needs_input_pass(args, kwargs):
                    kept.append(0.0)
                    peaks.append(0.0)
                    continue
                with recomputing([module], mode, split_backward=True) if mode else contextlib.nullcontext():
                    held, most = _input_pass_bytes(module, args, kwargs, tracker)
                kept.append(held)
                peaks.append(most)
    return out


def _input_pass_bytes(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tracker: LiveTensorBytes
) -> tuple[float, float]:
    """``(kept, most)`` of ``stage_backward_input`` on ``module(*args, **kwargs)``: what it allocates that is alive
    when it returns, less the input gradients, and the most it held at once while it ran (the gradient it is
    given included); NaN where the unit cannot run alone. ``tracker`` is on and counts every storage alive before
    the pass under ``_EARLIER`` (views of the weights and of the forward's tensors are not new)."""
    from torch.distributed.pipelining._backward import stage_backward_input

    inputs = [t for t in iter_tensors((list(args), kwargs)) if t.requires_grad]
    for t in inputs:
        t.grad = None
    tracker.category = _EARLIER
    try:
        output = module(*args, **kwargs)
        outputs = [t for t in iter_tensors(output) if t.requires_grad]
        del output
        tracker.category = _PASS
        tracker.reset_peak()
        with _collecting_only_new_objects():
            grads = [torch.ones_like(t) for t in outputs]
            dinputs, groups = stage_backward_input(outputs, grads, inputs, module.parameters())
            most = float(tracker.peak_by.get(_PASS, 0))  # the pass frees nothing earlier: the graph is retained
            del dinputs, grads  # the input gradients are sent (and freed unless the pass keeps them)
            for t in inputs:
                t.grad = None
            gc.collect()  # the cycles the pass made
        kept = float(tracker.live_by.get(_PASS, 0))
        del groups, outputs
    except (RuntimeError, TypeError, ValueError):
        return float("nan"), float("nan")
    finally:
        tracker.recategorize(_PASS, _EARLIER)  # what this pass left is earlier to the next one
        tracker.category = _EARLIER
    return kept, most


@contextlib.contextmanager
def _collecting_only_new_objects() -> Iterator[None]:
    """Inside, :func:`gc.collect` looks only at the objects made since entry: everything older is frozen
    (:func:`gc.freeze`), and thawed into the oldest generation on exit. A full collection of a process that has
    imported torch takes about 0.2 s here, once per layer and mode; the pass's own cycles are all new."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _needs_input_pass(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(t.requires_grad for t in iter_tensors((list(args), kwargs)))


def _timed_passes(
    calls: Sequence[tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None], repeats: int
) -> list[tuple[float, float] | None]:
    """Per call ``(module, args, kwargs)``: the median ms of torch's ``stage_backward_input`` and
    ``stage_backward_weight`` on ``module(*args, **kwargs)`` (a fresh forward, untimed, before each); None for a
    None call and where the unit cannot run alone. The units take turns, one pass each per round, over one
    untimed round and ``repeats`` timed ones: whatever else the machine does for a while falls on one round of
    every unit, which the medians drop, not on every pass of one unit (which would then look slower than its
    whole backward, timed in the profile's steps)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    times: list[list[tuple[float, float]] | None] = [[] if call is not None else None for call in calls]
    saved = {id(p): (p, p.grad) for call in calls if call is not None for p in call[0].parameters() if p.requires_grad}
    try:
        for _ in range(repeats + 1):
            for i, call in enumerate(calls):
                kept = times[i]
                if call is None or kept is None:
                    continue
                try:
                    kept.append(_one_timed_pass(*call, stage_backward_input, stage_backward_weight))
                except (RuntimeError, TypeError, ValueError):
                    times[i] = None
    finally:
        for p, grad in saved.values():
            p.grad = grad
    return [
        (float(np.median([a for a, _ in kept[1:]])), float(np.median([b for _, b in kept[1:]]))) if kept else None
        for kept in times
    ]


def _one_timed_pass(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], backward_input: Any, backward_weight: Any
) -> tuple[float, float]:
    """The ms of one ``stage_backward_input`` and one ``stage_backward_weight`` on a fresh forward of the unit."""
    inputs = [t for t in iter_tensors((list(args), kwargs)) if t.requires_grad]
    device = next((t.device for t in inputs), torch.device("cpu"))

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    outputs = [t for t in iter_tensors(module(*args, **kwargs)) if t.requires_grad]
    grads = [torch.ones_like(t) for t in outputs]
    t0 = now()
    _, groups = backward_input(outputs, grads, inputs, module.parameters())
    t1 = now()
    backward_weight(module.parameters(), groups)
    t2 = now()
    for t in inputs:
        t.grad = None
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _as_received(value: Any) -> Any:
    """A tensor as a stage receives it: detached, requiring grad where the forward's did (a floating result of the
    layers before); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
