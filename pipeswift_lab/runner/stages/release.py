"""Freeing, in a worker, the weights of the layers its rank does not run.

Every worker receives the model's structure in its spec (its tensors on the meta device) and
makes only its own stages' tensors. A stage initialized through the original model's modules
(a traced or manual stage: :func:`~pipeswift_lab.core.meta_device.initial_values`) leaves
real tensors there once copied into the stage. Once the stages are built the model is never read
again in the worker (checkpoints, tied-weight sync and the final state use the stage modules), so
:func:`release_unheld` empties those tensors; meta tensors hold nothing and are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...core.live_bytes import local_tensor

__all__ = ["release_unheld"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    local = local_tensor(t)  # a DTensor's storage is its local shard's
    return local.device.type, local.untyped_storage().data_ptr()


def release_unheld(model: nn.Module, held: Iterable[nn.Module]) -> int:
    """Replace every parameter and buffer of ``model`` whose storage none of the ``held`` modules uses by an empty
    tensor of its dtype (in the worker's own copy of the model); returns the bytes released."""
    kept = {_storage_key(t) for module in held for t in (*module.parameters(), *module.buffers())}
    released = 0
    seen: set[tuple[str, int]] = set()
    for t in (*model.parameters(), *model.buffers()):
        key = _storage_key(t)
        if t.is_meta or key in kept or key in seen or t.numel() == 0 or hasattr(t, "to_local"):
            continue
        seen.add(key)
        released += t.untyped_storage().nbytes()
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released
