"""Schedule generators: callables ``(P, m)`` or ``(P, m, v)`` that make a :class:`~pipeswift_lab.core.schedule.Schedule`
for each pipeline the sweep and the planner weigh (:mod:`pipeswift_lab.schedules`' ``zb_h2``, ``v_half``, a user's
``lambda``)."""

from __future__ import annotations

import inspect
from typing import Any

from .schedule import Schedule

__all__ = ["generate", "generator_name", "is_generator", "takes_v"]


def is_generator(source: Any) -> bool:
    """Whether ``source`` is a schedule generator: a callable ``(P, m)`` or ``(P, m, v)`` returning a
    :class:`Schedule` (:mod:`pipeswift_lab.schedules`' ``zb_h2``, ``v_half``, a ``lambda``)."""
    return callable(source) and not isinstance(source, (str, Schedule))


def takes_v(source: Any) -> bool:
    """Whether the generator ``source`` takes ``v`` (three positional parameters, or ``*args``)."""
    try:
        params = list(inspect.signature(source).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def generate(source: Any, P: int, m: int, v: int = 1) -> Schedule:
    """The :class:`Schedule` the generator ``source`` makes for ``P`` ranks and ``m`` micro-batches (and ``v`` stages
    per rank where it takes them). Raises ``ValueError`` where it makes none (its own refusal), ``TypeError`` where
    it returns something else."""
    made = source(P, m, v) if takes_v(source) else source(P, m)
    if not isinstance(made, Schedule):
        raise TypeError(
            f"the schedule generator {generator_name(source)} returned {type(made).__name__}, not a Schedule"
        )
    if made.P != P or made.m != m:
        raise ValueError(
            f"the schedule generator {generator_name(source)} made P={made.P}, m={made.m} for P={P}, m={m}"
        )
    return made


def generator_name(source: Any) -> str:
    """A generator's name for tables: its ``__name__`` (``zb_h2``), else its repr."""
    return str(getattr(source, "__name__", repr(source)))
