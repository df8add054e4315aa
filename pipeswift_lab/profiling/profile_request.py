"""What :func:`~pipeswift_lab.profiling.measure.profile` is asked to measure, checked before anything runs.

:class:`ProfileRequest` holds the checked arguments; the checks raise ``TypeError``/``ValueError`` naming the
argument, as everywhere in the toolkit. :func:`check_model`, :func:`check_repeats` and :func:`check_trainable` are
shared with ``profile_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.checks import check_flag, check_int
from .units import decoder_inputs_refusal

__all__ = ["ProfileRequest", "check_model", "check_repeats", "check_trainable"]


@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """The arguments of :func:`~pipeswift_lab.profiling.measure.profile`, checked: what to run, how often, and what
    to add."""

    sample_args: tuple[Any, ...]
    sample_kwargs: dict[str, Any]
    target: Any
    loss_fn: Callable[..., torch.Tensor] | None
    warmup: int
    repeats: int
    progress: bool
    recompute: bool
    precision: str | None

    @classmethod
    def checked(
        cls,
        model: Any,
        sample_args: tuple[Any, ...],
        sample_kwargs: Any,
        target: Any,
        loss_fn: Any,
        warmup: Any,
        repeats: Any,
        progress: Any,
        recompute: Any,
        precision: Any,
    ) -> ProfileRequest:
        """The request, every argument checked (``TypeError``/``ValueError`` naming it) before anything runs."""
        check_model(model)
        warmup, repeats, progress = check_repeats(warmup, repeats, progress)
        sample_kwargs = _check_sample(sample_args, sample_kwargs)
        _check_loss(loss_fn, target)
        check_trainable(model)
        check_flag("recompute", recompute)
        precision = _check_precision(precision)
        refusal = decoder_inputs_refusal(model, given=list(sample_kwargs))
        if refusal is not None:
            raise ValueError(refusal)
        return cls(
            sample_args=sample_args,
            sample_kwargs=sample_kwargs,
            target=target,
            loss_fn=loss_fn,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            recompute=recompute,
            precision=precision,
        )


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")


def check_repeats(warmup: Any, repeats: Any, progress: Any) -> tuple[int, int, bool]:
    """``(warmup, repeats, progress)`` checked (``repeats`` first, as the messages have always come)."""
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=0)
    return warmup, repeats, check_flag("progress", progress)


def _check_sample(sample_args: tuple[Any, ...], sample_kwargs: Any) -> dict[str, Any]:
    """The keyword arguments of the sample (``{}`` for None); refuse a step with no input at all."""
    sample_kwargs = {} if sample_kwargs is None else sample_kwargs
    if not isinstance(sample_kwargs, dict):
        raise TypeError(
            f"sample_kwargs must be a dict of keyword arguments for model.forward; got {type(sample_kwargs).__name__}"
        )
    if not sample_args and not sample_kwargs:
        raise ValueError(
            "profile needs a sample input: profile(model, x) runs model(x); give one representative micro-batch"
        )
    return sample_kwargs


def _check_loss(loss_fn: Any, target: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, e.g. loss_fn(output, target); got {type(loss_fn).__name__}")
    if target is not None and loss_fn is None:
        raise ValueError("target was given without loss_fn; pass loss_fn=... so the loss is loss_fn(output, target)")


def _check_precision(precision: Any) -> str | None:
    if precision is None or precision in ("fp32", "bf16-mixed"):
        return precision
    raise ValueError(
        f"precision={precision!r} is not one of ['fp32', 'bf16-mixed'] (or None: the model's own dtype); profile "
        "a bf16-mixed-zero1 run as 'bf16-mixed' (ZeRO-1 changes the optimizer's state, not the layers)"
    )


def check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) has no trainable parameters (none with requires_grad=True); "
            "there is no backward to profile"
        )
