"""The one progress bar: ``tqdm.auto``, off with ``progress=False`` or the ``TQDM_DISABLE`` environment variable.

Every long operation (profile, sweep, plan, report, cluster simulation) shows its bar through
:func:`progress_bar`, so the two switches mean the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm.auto import tqdm


def progress_off() -> bool:
    """True when the ``TQDM_DISABLE`` environment variable turns bars off (any value but empty, 0, false, no)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def progress_bar(iterable: Iterable[Any] | None = None, *, desc: str, progress: bool = True, **kwargs: Any) -> tqdm:
    """A ``tqdm.auto`` bar over ``iterable`` (or with ``total=``), shown unless ``progress`` is False or
    ``TQDM_DISABLE`` is set."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, disable=not progress or progress_off(), **kwargs)


__all__ = ["progress_bar", "progress_off"]
