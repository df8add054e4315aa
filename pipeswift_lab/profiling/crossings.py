"""Which unit each storage of a profiled forward belongs to, and what a pipeline cut before each unit would send.

:func:`~pipeswift_lab.profiling.measure.profile`'s memory step runs the model under
:class:`~pipeswift_lab.core.live_bytes.LiveTensorBytes`; :class:`StorageAttribution` counts every
storage under the unit whose *stretch* allocated it: from the unit's forward start until the next
unit's, so code between units belongs to the unit before it, as a pipeline split there puts it
(what the model makes before its first unit is that unit's). It also watches every operator of
the forward: a tensor made in one stretch and read in a later one (or returned by the model)
crosses every cut between them. At the end of the forward it knows, per unit, what the unit holds
until the backward (its storages still alive) and, per cut, the bytes sent, their floating part
(whose gradients come back) and the part the forward frees before it ends (which only the sending
stage keeps, torch holding a stage's outputs for its backward).

Tensors are told apart by their storage's number (:meth:`LiveTensorBytes.serial`, unlike its
address, which a later storage may reuse), offset, shape and strides; a view counts where it is
taken, not where its storage was made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..core.live_bytes import LiveTensorBytes

__all__ = ["BEFORE", "StorageAttribution"]

#: The categories storages are counted under: alive before the step (adopted), made before the first unit, made in
#: unit ``i``'s stretch (``u{i}``), by the loss, during the backward.
BEFORE, _BEFORE_FIRST, _UNIT, _LOSS, _BACKWARD = "before", "before first unit", "u", "loss", "backward"
#: The reader that stands for the model's output (a tensor it returns is read after every unit).
_MODEL_OUTPUT = 1 << 30


class StorageAttribution:
    """Counts a memory step's storages by unit and the tensors that cross each cut (see the module docs).

    ``tracker`` is the step's :class:`LiveTensorBytes` (the storages alive before the step adopted under
    :data:`BEFORE`); ``is_state(t)`` says whether ``t`` is a parameter or buffer (never sent).
    """

    def __init__(self, tracker: LiveTensorBytes, is_state: Callable[[torch.Tensor], bool]) -> None:
        self.tracker, self.is_state = tracker, is_state
        self.held: dict[int, float] | None = None
        self.reads: dict[tuple[Any, ...], list[Any]] = {}  # tensor -> [maker, last reader, bytes, float, serial]
        self.made: dict[tuple[Any, ...], int] = {}  # tensor -> the unit whose stretch made it
        self.alive_at_end: set[int] = set()
        self.loss_kept = self.loss_retained = float("nan")
        tracker.category = _BEFORE_FIRST
        tracker.on_op = self._op

    def enter_unit(self, index: int) -> None:
        """Unit ``index``'s forward starts: its stretch begins."""
        self.tracker.category = f"{_UNIT}{index}"

    def forward_done(self, output: Any) -> None:
        """The model's forward returned ``output``: note what each unit holds and what the model returns; the loss
        starts."""
        self._note_reads(_MODEL_OUTPUT, (t for t in tree_leaves(output) if isinstance(t, torch.Tensor)))
        self.held = {
            (int(c[len(_UNIT) :]) if c.startswith(_UNIT) else -1): float(b)
            for c, b in self.tracker.live_by.items()
            if c.startswith(_UNIT) or c == _BEFORE_FIRST
        }
        self.alive_at_end = self.tracker.live_serials()
        self.tracker.category = _LOSS
        self.tracker.on_op = None  # the loss and the backward run where the model's output is

    def backward_starts(self) -> None:
        """Note what the loss keeps for its backward."""
        self.loss_kept = float(self.tracker.live_by.get(_LOSS, 0))
        self.tracker.category = _BACKWARD

    def backward_done(self) -> None:
        """Note what the loss still holds after the backward, while the loss tensor lives."""
        self.loss_retained = float(self.tracker.live_by.get(_LOSS, 0))

    def result(self, order: list[int], n: int) -> tuple[list[float], tuple[list[float], list[float], list[float]]]:
        """Per unit (``n`` of them, first called in ``order``): the bytes held until the backward, and ``(cut, its
        floating part, its freed part)`` of the cut just before it."""
        held = [(self.held or {}).get(u, 0.0) for u in range(n)]
        held[order[0]] += (self.held or {}).get(-1, 0.0)  # what the model makes before its first unit
        rank = {u: i for i, u in enumerate(order)}
        cut, grad, freed = [0.0] * n, [0.0] * n, [0.0] * n
        for maker, last, nbytes, floating, serial in self.reads.values():
            first = rank.get(maker, -1) + 1  # the first cut the tensor crosses, in call order
            end = len(order) - 1 if last == _MODEL_OUTPUT else rank.get(last, -1)
            for i in range(max(first, 1), end + 1):
                u = order[i]
                cut[u] += nbytes
                grad[u] += nbytes if floating else 0.0
                freed[u] += nbytes if serial not in self.alive_at_end else 0.0
        return held, (cut, grad, freed)

    def _op(self, args: Any, kwargs: Any, out: Any) -> None:
        """An operator of the forward reads its tensor arguments, and makes its results, in the current stretch."""
        category = self.tracker.category
        if not category.startswith(_UNIT):
            return
        here = int(category[len(_UNIT) :])
        self._note_reads(here, (t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ident = self._ident(t)
                if ident is not None:
                    self.made.setdefault(ident, here)  # a view is made where it is taken, not with its storage

    def _ident(self, t: torch.Tensor) -> tuple[Any, ...] | None:
        """``t`` as one tensor of one storage (its number, offset, shape, strides); None for one not counted."""
        serial = self.tracker.serial(t)
        if serial is None:
            return None
        return serial, t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def _note_reads(self, reader: int, tensors: Iterable[torch.Tensor]) -> None:
        """Record that unit ``reader``'s stretch, or the model's output (:data:`_MODEL_OUTPUT`), reads ``tensors``:
        where each was made (the stretch that took it, else the unit its storage was allocated under, -1 before any)
        and the last stretch that reads it."""
        for t in tensors:
            if self.is_state(t):
                continue
            ident = self._ident(t)
            if ident is None:
                continue
            if ident not in self.reads:
                made = self.made.get(ident)
                if made is None:
                    category = self.tracker.category_of(t) or ""
                    made = int(category[len(_UNIT) :]) if category.startswith(_UNIT) else -1
                self.reads[ident] = [made, reader, t.numel() * t.element_size(), t.is_floating_point(), ident[0]]
            else:
                self.reads[ident][1] = reader  # readers come in the order they run: the latest is the last
