"""Where the shipped data files are: :func:`data_path`, through :mod:`importlib.resources`.

The files load from an installed wheel as well as from a source checkout. Every loader of this package
(:func:`~pipeswift_lab.data.philly_jobs`, :func:`~pipeswift_lab.data.spot.spot_instances`) opens its file here.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; the annotation only
    from importlib.resources.abc import Traversable

__all__ = ["PHILLY_FILE", "data_path"]

#: The package the data files ship in (this module's).
_PACKAGE = __name__.rpartition(".")[0]
#: File name of the trace inside this package.
PHILLY_FILE: str = "philly_jobs.csv"


def data_path(name: str = PHILLY_FILE) -> Traversable:
    """The :mod:`importlib.resources` Traversable of a shipped data file (``philly_jobs.csv``, ``README.md``)."""
    path = resources.files(_PACKAGE).joinpath(name)
    if not path.is_file():
        available = sorted(
            p.name for p in resources.files(_PACKAGE).iterdir() if p.is_file() and not p.name.endswith((".py", ".pyc"))
        )
        raise FileNotFoundError(f"{name!r} is not shipped in {_PACKAGE}; available: {available}")
    return path
