"""How a model is profiled one unit at a time: the :class:`UnitByUnit` record of ``profile(..., unit_by_unit=...)``.

A model built on the meta device is always profiled this way (:mod:`pipeswift_lab.profiling.unit_by_unit`); any
other model with ``unit_by_unit=True`` or a :class:`UnitByUnit`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.checks import check_int

__all__ = ["REPEATED", "UnitByUnit", "unit_by_unit_options"]

#: How repeated identical blocks are timed: every one, or the first of each class.
REPEATED = ("all", "once")


@dataclass(frozen=True, kw_only=True)
class UnitByUnit:
    """The options of profiling one unit at a time, checked on creation:
    ``profile(meta_model, x, layers="auto", unit_by_unit=psl.UnitByUnit(repeated="once", memory_cap=40 * 2**30))``.
    """

    repeated: str = "all"
    """``"all"`` times every unit; ``"once"`` only the first of each class of identical blocks (same type, same
    tensor names, shapes and dtypes), whose row the others take."""
    init: Callable[[nn.Module], None] | None = None
    """Fills each unit's tensors as ``run(..., init=)`` does (``None``: a Hugging Face model's ``_init_weights``,
    else each submodule's ``reset_parameters()``)."""
    seed: int = 0
    """Seeds the initialization with the submodule's name, so a unit starts as it does in ``run``."""
    memory_cap: int | None = None
    """The most tensor memory (bytes) a unit may take: on CUDA ``torch.cuda.set_per_process_memory_fraction``, on
    CPU checked by the live-byte counter after each unit's memory step (``MemoryError`` naming the unit)."""

    def __post_init__(self) -> None:
        if self.repeated not in REPEATED:
            raise ValueError(f"repeated={self.repeated!r} is not one of {list(REPEATED)}")
        object.__setattr__(self, "seed", check_int("seed", self.seed))
        if self.memory_cap is not None:
            object.__setattr__(self, "memory_cap", check_int("memory_cap", self.memory_cap, minimum=1))
        if self.init is not None and not callable(self.init):
            raise TypeError(f"init must be callable as init(module); got {type(self.init).__name__}")


def unit_by_unit_options(unit_by_unit: Any, on_meta: bool) -> UnitByUnit | None:
    """``profile``'s ``unit_by_unit=`` resolved: the :class:`UnitByUnit` to profile with, or ``None`` to profile the
    whole model in place. ``None`` profiles a meta model unit by unit and any other in place; ``True`` or a record
    profiles unit by unit; ``False`` refuses a meta model (it holds no tensors to run whole)."""
    if isinstance(unit_by_unit, UnitByUnit):
        return unit_by_unit
    if unit_by_unit is None:
        return UnitByUnit() if on_meta else None
    if not isinstance(unit_by_unit, bool):
        raise TypeError(
            f"unit_by_unit must be None, True, False or a pipeswift_lab.UnitByUnit; got {type(unit_by_unit).__name__}"
        )
    if on_meta and not unit_by_unit:
        raise ValueError(
            "the model is on the meta device, so it is profiled one unit at a time; leave unit_by_unit=None"
        )
    return UnitByUnit() if unit_by_unit else None
