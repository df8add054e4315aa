"""Where each step's ``(inputs, targets)`` come from: :class:`DataSource`, made once from ``run(data=...)``.

``data`` is a batch used every step, a ``callable(step) -> (inputs, targets)`` or an iterable of batches (the
first ``steps`` are taken). A callable is called on every rank that needs the batch with torch's RNG seeded to
``seed + step``, so batches drawn with ``torch.randn`` agree across ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import check_choice

__all__ = ["DataSource", "make_data_source", "check_batch", "SOURCE_KINDS"]

#: The kinds of :class:`DataSource`.
SOURCE_KINDS = ("batch", "callable", "batches")


@dataclass(frozen=True)
class DataSource:
    """Where each step's ``(inputs, targets)`` come from.

    ``kind`` is ``"batch"`` (the same batch every step), ``"callable"`` (``value(step)``) or
    ``"batches"`` (a list materialized from an iterable, one per step). A callable is called
    on every rank that needs the batch with torch's RNG seeded to ``seed + step``, so batches
    drawn with ``torch.randn`` agree across ranks.
    """

    kind: str
    value: Any
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, SOURCE_KINDS)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of ``step``."""
        if self.kind == "batch":
            return self.value
        if self.kind == "batches":
            return self.value[step]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + step)
            try:
                batch = self.value(step)
            except Exception as exc:  # re-raised naming the argument
                raise ValueError(
                    f"data({step}) raised {type(exc).__name__}: {exc} (data, a callable, is called as "
                    f"data(step) -> (inputs, targets) on every rank)"
                ) from exc
            return check_batch(batch, f"data({step})")


def check_batch(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``batch`` as an ``(inputs, targets)`` pair of tensors with one batch size; raise naming ``where``."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where} must be an (inputs, targets) pair of tensors; got {type(batch).__name__}")
    inputs, targets = batch
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{where}: {name} is a 0-d tensor; it needs a batch dimension to split into micro-batches")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"{where}: inputs have batch size {inputs.shape[0]} but targets {targets.shape[0]}; they must match"
        )
    return inputs, targets


def make_data_source(data: Any, steps: int, seed: int) -> DataSource:
    """Normalize ``data`` (a batch, a ``callable(step)`` or an iterable of batches) into a :class:`DataSource`.

    A :class:`DataSource` is returned as it is. Raises ``TypeError``/``ValueError`` for anything else, or for an
    iterable that yields fewer than ``steps`` batches.
    """
    if isinstance(data, DataSource):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return DataSource("batch", check_batch(tuple(data), "data"), seed)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        raise TypeError(
            f"data holds {len(data)} tensor{'s' if len(data) != 1 else ''}; give one (inputs, targets) pair, "
            f"a callable(step) -> (inputs, targets) or an iterable of such pairs"
        )
    if callable(data):
        return DataSource("callable", data, seed)
    if isinstance(data, torch.Tensor) or not hasattr(data, "__iter__"):
        raise TypeError(
            "data must be an (inputs, targets) batch, a callable(step) -> (inputs, targets) or an iterable of "
            f"batches; got {type(data).__name__}"
        )
    batches = list(itertools.islice(iter(data), steps))
    if len(batches) < steps:
        raise ValueError(f"data yielded {len(batches)} batches but steps={steps} need {steps}")
    return DataSource("batches", [check_batch(b, f"data batch {i}") for i, b in enumerate(batches)], seed)
