"""Each tensor-parallel rank reading only its slice of the weights its plan shards.

With ``tp > 1`` and ``weights=`` a safetensors checkpoint, a rank splits each stage over its tensor-parallel ranks
while the stage is still on the meta device (:func:`~pipeswift_lab.runner.stages.sharding.apply_tensor_parallel`:
each planned parameter becomes a meta DTensor), then makes it and fills every DTensor's local part from its slice of
the stored tensor (:func:`stage_slices`, :meth:`~pipeswift_lab.runner.weights.WeightSource.read` with ``slices=``:
``safe_open(...).get_slice(name)[box]`` reads that slice alone). A colwise ``Linear`` reads its rows of the weight
and of the bias, a rowwise one its columns of the weight (its bias whole), ``embedding_rowwise`` its rows of the
table, ``embedding_colwise`` its columns: DTensor's ``Shard(d)``, ``torch.chunk``'s piece along ``d``. What the
plan leaves whole (norms, the experts) is read whole.

A tensor a Hugging Face checkpoint stores as several (a mixture of experts' fused tensors, made by transformers'
conversion) is read whole and cut, as is every tensor of a DCP or toolkit checkpoint; a run that resumes from a
checkpoint, and ``tp == 1``, build their stages as before (made whole, then split). A :class:`ReadTally` counts
what a rank read; with ``WeightSource.read_log`` set, each rank appends one JSON line per stage it fills to that file
(:func:`log_reads`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.meta_device import Box, local_box

__all__ = ["ReadTally", "log_reads", "stage_slices"]


@dataclass
class ReadTally:
    """What a loader read from disk: bytes, and tensors read as a slice or whole."""

    bytes: int = 0
    """Bytes of the tensors read (a slice's own bytes when read as a slice)."""
    sliced: int = 0
    """Tensors read as a slice alone."""
    whole: int = 0
    """Tensors read whole (some then cut to a slice)."""
    keys: list[str] = field(default_factory=list)
    """The stored names read, in order (a name read twice, as two slices, twice)."""

    def add(self, name: str, tensor: torch.Tensor, *, sliced: bool) -> None:
        """Count ``tensor``, read from disk under ``name`` as a slice (``sliced``) or whole."""
        self.bytes += tensor.numel() * tensor.element_size()
        self.sliced += int(sliced)
        self.whole += int(not sliced)
        self.keys.append(name)

    def since(self, before: ReadTally) -> ReadTally:
        """What was read after ``before`` (an earlier copy of this tally); returns a new tally."""
        return ReadTally(
            self.bytes - before.bytes,
            self.sliced - before.sliced,
            self.whole - before.whole,
            self.keys[len(before.keys) :],
        )

    def copy(self) -> ReadTally:
        """A copy of this tally as it stands."""
        return ReadTally(self.bytes, self.sliced, self.whole, list(self.keys))


def stage_slices(module: nn.Module) -> dict[str, Box]:
    """``{state_dict key: this rank's part}`` of every DTensor ``module`` holds that is not whole on this rank (split
    over the tensor-parallel ranks on meta): what to read of each stored tensor."""
    out: dict[str, Box] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        box = local_box(tensor)
        if box is not None and tuple(b.stop - b.start for b in box) != tuple(tensor.shape):
            out[key] = box
    return out


def log_reads(path: str | os.PathLike[str], record: dict[str, Any], tally: ReadTally) -> None:
    """Append one JSON line to ``path``: ``record`` (where: rank, stage) with ``tally``'s counts (``bytes``,
    ``sliced``, ``whole``, ``keys``). Each rank appends its own lines (one ``write`` each)."""
    line = json.dumps({**record, **asdict(tally)}) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
