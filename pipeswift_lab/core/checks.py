"""Argument validation shared by every module: the one place numbers, flags and choices are checked.

Every check raises ``ValueError``/``TypeError`` whose message names the argument,
the bad value and what is valid (the project convention). Nothing is clamped.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = [
    "check_choice",
    "check_flag",
    "check_fraction",
    "check_int",
    "check_table",
    "check_time",
    "moved_keywords",
    "state_mismatch",
    "nonnegative_column",
]


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int, refusing bools, floats and values out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is invalid; it must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} is invalid; it must be <= {maximum}")
    return value


def check_time(name: str, value: Any, allow_zero: bool = True) -> float:
    """Return ``value`` as a finite float that is ``>= 0`` (``> 0`` if not ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"{name}={number} is invalid; it must be a finite number")
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={number} is invalid; it must be {bound}")
    return number


def check_fraction(
    name: str, value: Any, *, allow_zero: bool = True, allow_one: bool = True, what: str = "a fraction"
) -> float:
    """Return ``value`` as a float in ``[0, 1]`` (``(0, ...`` without ``allow_zero``, ``..., 1)`` without
    ``allow_one``); ``what`` names the share in the message (``"a share of the backward"``)."""
    number = check_time(name, value, allow_zero=allow_zero)
    if number > 1 or (number == 1 and not allow_one):
        bound = "<= 1" if allow_one else "< 1"
        raise ValueError(f"{name}={number} is invalid; it is {what} and must be {bound}")
    return number


def check_flag(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool; refuse ``0``/``1``/strings, which read as flags but hide typos."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    return value


def check_choice(
    name: str, value: Any, choices: Iterable[str] | type[Enum], *, noun: str = "values", hint: str = ""
) -> str:
    """Return ``value`` if it is one of ``choices`` (strings, or a ``StrEnum`` class whose values are the choices).

    The one check of every argument that names an option (``on_nonfinite``, ``objective``, ``method``,
    ``start_method``, a policy name, ...): ``TypeError`` for a non-string, ``ValueError`` listing the valid spellings
    (``"x='y' is not known; valid {noun} are [...]{hint}"``; ``hint`` also ends the ``TypeError``). A ``StrEnum``
    member is accepted as its value.
    """
    valid = [str(c.value) for c in choices] if isinstance(choices, type) else [str(c) for c in choices]
    if isinstance(value, Enum):
        value = value.value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {valid}{hint}; got {type(value).__name__} {value!r}")
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not known; valid {noun} are {valid}{hint}")
    return value


def check_table(what: str, df: pd.DataFrame, required: Iterable[str], *, needs: str = "", rows: str = "") -> None:
    """Raise ``ValueError`` naming ``what`` when the DataFrame ``df`` lacks one of the ``required`` columns (the
    message lists the columns it has, then ``needs``) or has no rows (then ``rows``)."""
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"{what} is missing the columns {missing}; it has {list(df.columns)}{needs}")
    if len(df) == 0:
        raise ValueError(f"{what} has no rows{rows}")


def nonnegative_column(column: pd.Series, allow_missing: bool = False) -> tuple[np.ndarray, tuple[int, Any] | None]:
    """``(values, first_bad)`` of a pandas Series of per-layer or per-stage numbers.

    ``values`` is the column as a float array; ``first_bad = (position, given value)`` names the first entry that is
    not a finite number >= 0 (with ``allow_missing``, an empty entry, NaN or None, is allowed), else it is None. The
    caller names the table in its message.
    """
    import numpy as np
    import pandas as pd

    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=float)
    missing_ok = column.isna().to_numpy() if allow_missing else np.zeros(len(values), bool)
    bad = np.flatnonzero((np.isnan(values) & ~missing_ok) | np.isinf(values) | (values < 0))
    if not len(bad):
        return values, None
    given = column.iloc[int(bad[0])]
    return values, (int(bad[0]), given.item() if hasattr(given, "item") else given)


def state_mismatch(
    missing: Sequence[str],
    extra: Sequence[str],
    shapes: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    where: str,
    named: int = 8,
) -> list[str]:
    """The parts of a message saying how a model's ``state_dict`` and the tensors stored in ``where`` differ: the
    model's names not stored, the stored names not in the model, and ``{name: (model shape, stored shape)}``; the
    first ``named`` of each, with their counts. Empty when nothing differs."""

    def first(items: Sequence[str]) -> str:
        return f"{list(items[:named])}{' ...' if len(items) > named else ''}"

    parts = []
    if missing:
        parts.append(f"not in {where} ({len(missing)}): {first(missing)}")
    if extra:
        parts.append(f"only in {where} ({len(extra)}): {first(extra)}")
    if shapes:
        wrong = [f"{k} {list(a)} in the model vs {list(b)} in {where}" for k, (a, b) in shapes.items()]
        parts.append(
            f"shapes differ ({len(wrong)}): " + ", ".join(wrong[:named]) + (" ..." if len(wrong) > named else "")
        )
    return parts


_P = ParamSpec("_P")
_R = TypeVar("_R")


def moved_keywords(moves: Mapping[str, str]) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator: a call passing a keyword that has moved raises ``TypeError`` naming its new home.

    ``moves`` maps each old keyword to where it lives now, as the user writes it
    (``"launch=psl.Launch(timeout_s=...)"``).
    The wrapped function keeps its signature (``inspect.signature`` follows ``__wrapped__``), and a warning it
    addresses to its caller (``stacklevel``) still points at the caller's line, not at this wrapper.
    """

    def decorate(func: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(func)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            moved = [name for name in kwargs if name in moves]
            if moved:
                homes = "; ".join(f"{name}= is now {moves[name]}" for name in moved)
                raise TypeError(f"{func.__name__}() got the keyword{'s' * (len(moved) > 1)} {moved}: {homes}")
            caught: list[warnings.WarningMessage] = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return func(*args, **kwargs)
            finally:
                _reissue(caught)

        return checked

    return decorate


def _reissue(caught: list[warnings.WarningMessage]) -> None:
    """Warn again what :func:`moved_keywords`' wrapper recorded, through the filters in force: a warning that landed
    on the wrapper's line (its ``stacklevel`` counted the caller's frame) at the caller's line instead."""
    for w in caught:
        if w.filename == __file__:
            warnings.warn(w.message, w.category, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
