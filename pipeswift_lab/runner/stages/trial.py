"""One micro-batch through a model cut into stages: what the checks before launch run (a leaf: the stage builders
and :mod:`.shapes`, which chooses between them, both import it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Trial"]


@dataclass(frozen=True)
class Trial:
    """What a check before launch runs: ``model``, cut into ``n_stages`` stages by ``partition``, on one micro-batch
    (``inputs``, ``targets``) and its loss, for the ranks' ``device``."""

    model: nn.Module
    partition: Any
    n_stages: int
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    device: torch.device
