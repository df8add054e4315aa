"""What a model returns, as the loss sees it: any structure (a ``ModelOutput``, a dict, a tuple, a tensor).

torch's traced last stage returns the flat list of the model's output tensors; the runner
gives ``loss_fn`` the model's own structure back (:class:`StructuredLoss`, from the pytree
spec of one eager forward). The checks here run before launch, so a model with no floating
tensor to take a loss of, or a ``loss_fn`` that cannot read the output, is a ``ValueError``
naming what the model returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ...profiling.unit_copies import describe


def output_structure(output: Any) -> TreeSpec:
    """The pytree spec of ``output``; raises ``ValueError`` when it holds no floating tensor a loss could use."""
    leaves, spec = tree_flatten(output)
    if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
        raise ValueError(
            f"the model returned {describe(output)}: no floating-point tensor for loss_fn(output, target) to take a "
            "loss of; return the logits (or a ModelOutput / dict / tuple holding them)"
        )
    return spec


class StructuredLoss:
    """``loss_fn(output, target)`` with the output rebuilt in the model's own structure from a flat list of tensors.

    torch's traced stages hand the last stage's output to the loss as the flat tuple of the
    model's output leaves; this puts them back into the ``ModelOutput`` (dict, tuple ...) that
    ``model(x)`` returns, so the same ``loss_fn`` serves the model, ``profile`` and ``run``.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], structure: TreeSpec) -> None:
        self.loss_fn = loss_fn
        self.structure = structure

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        if len(leaves) != self.structure.num_leaves:
            raise RuntimeError(
                f"the traced last stage returned {len(leaves)} tensors, the model's output has "
                f"{self.structure.num_leaves} leaves ({self.structure})"
            )
        return self.loss_fn(tree_unflatten(leaves, self.structure), target)


def check_loss(loss_fn: Callable[[Any, Any], Any], output: Any, target: torch.Tensor) -> None:
    """Call ``loss_fn(output, target)`` once; raise ``ValueError`` saying what it received when it fails or does not
    return a scalar tensor."""
    try:
        loss = loss_fn(output, target)
    except Exception as exc:  # re-raised naming what the loss received
        raise ValueError(
            f"loss_fn(output, target) raised {type(exc).__name__}: {exc}. It received the model's output, "
            f"{describe(output)}, and targets {list(target.shape)} {str(target.dtype).removeprefix('torch.')}"
        ) from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned {type(loss).__name__} {list(getattr(loss, 'shape', []))}, not a scalar tensor "
            f"(it received {describe(output)})"
        )


def checked_structure(loss_fn: Callable[[Any, Any], Any], output: Any, target: torch.Tensor) -> TreeSpec | None:
    """The structure the loss rebuilds from a stage's flat tensors (``None`` for a plain tensor), after checking that
    ``output`` holds a floating tensor and that ``loss_fn`` takes it (:func:`output_structure`, :func:`check_loss`)."""
    structure = output_structure(output)
    check_loss(loss_fn, output, target)
    return None if isinstance(output, torch.Tensor) else structure


__all__ = ["check_loss", "checked_structure", "describe", "output_structure", "StructuredLoss"]
