"""What a zero-bubble schedule's input-gradient pass holds, per layer, until its weight-gradient pass.

The zero-bubble schedules (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024) split a stage's
backward in two: ``I`` computes the gradient of the stage's input, ``W`` later the weights'.
torch's ``stage_backward_input`` keeps, for ``W`` to start from, the gradient arriving at every
node where the input's path meets a parameter's (its ``param_groups``' ``"grads"``: the outputs of
the linears and the norms, one tensor of each per micro-batch), on top of the forward's saved
tensors; a checkpointed layer also keeps what ``I`` recomputed and ``W`` reads again (selective
checkpointing's cache holds its results until the graph is freed). :func:`weight_pass_bytes` runs
torch's own ``stage_backward_input`` on each unit alone, on the input it received in one forward of
the model, and counts what the pass allocated that is still alive when it returns, less the input
gradient it hands back (that is sent, not kept): the unit's ``weight_pass_bytes``, and with
``modes`` the same recomputed (``{mode}_weight_pass_bytes``). The gradient the unit is given counts
where ``I`` keeps it (a residual block passes its output's gradient on to its last linear unchanged):
inside a stage it is the next unit's input gradient, at the stage's end its receive buffer, counted
there as well.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..core.live_bytes import LiveTensorBytes, live_tensors
from ..core.recompute import recomputing
from .hooks import iter_tensors

__all__ = ["weight_pass_bytes"]


def weight_pass_bytes(
    units: Sequence[tuple[str, nn.Module]],
    run_forward: Callable[[], Any],
    modes: Sequence[str] = (),
) -> dict[str, list[float]]:
    """Per unit (in ``units``' order), the bytes torch's ``stage_backward_input`` keeps alive for the unit's weight
    pass: ``{"weight_pass_bytes": [...]}``, and ``{mode}_weight_pass_bytes`` for each of ``modes`` (``"full"``,
    ``"selective"``: the unit checkpointed as the runner checkpoints it under a split backward).

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

    out: dict[str, list[float]] = {}
    for mode in ("", *modes):
        column = f"{mode}_weight_pass_bytes" if mode else "weight_pass_bytes"
        out[column] = []
        for i, (_, module) in enumerate(units):
            args, kwargs = received.get(i, ((), {}))
            if not any(t.requires_grad for t in iter_tensors((list(args), kwargs))):
                out[column].append(0.0)
                continue
            if mode:
                with recomputing([module], mode, split_backward=True):
                    out[column].append(_kept_by_input_pass(module, args, kwargs))
            else:
                out[column].append(_kept_by_input_pass(module, args, kwargs))
    return out


def _kept_by_input_pass(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """What ``stage_backward_input`` on ``module(*args, **kwargs)`` allocates that is alive when it returns, less the
    input gradients; NaN where the unit cannot run alone."""
    from torch.distributed.pipelining._backward import stage_backward_input

    inputs = [t for t in iter_tensors((list(args), kwargs)) if t.requires_grad]
    for t in inputs:
        t.grad = None
    try:
        output = module(*args, **kwargs)
        outputs = [t for t in iter_tensors(output) if t.requires_grad]
        del output
        with LiveTensorBytes("allocated") as tracker:
            tracker.adopt(live_tensors(), "before")  # views of the weights and the forward's tensors are not new
            grads = [torch.ones_like(t) for t in outputs]
            dinputs, groups = stage_backward_input(outputs, grads, inputs, module.parameters())
            del dinputs, grads  # the input gradients are sent (and freed unless the pass keeps them)
            for t in inputs:
                t.grad = None
            gc.collect()
            kept = float(tracker.live_by.get("allocated", 0))
        del groups, outputs
    except (RuntimeError, TypeError, ValueError):
        return float("nan")
    return kept


def _as_received(value: Any) -> Any:
    """A tensor as a stage receives it: detached, requiring grad where the forward's did (a floating result of the
    layers before); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
