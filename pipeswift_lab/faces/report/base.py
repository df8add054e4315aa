"""The report's building blocks: a :class:`Section` of it, and the :class:`ReportContext` shared by the section
functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ...models import ReferenceSetup
    from ...profiling.table import Profile

__all__ = ["ReportContext", "Section", "figure_of", "measure_setup", "reference_profile", "reference_setup"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Section:
    """One report section: a title, explanatory HTML, figures and named tables."""

    title: str
    """The section's heading."""
    intro_html: str
    """The HTML paragraphs under the heading, which say what the figures and tables show."""
    figures: list[Figure] = field(default_factory=list)
    """matplotlib Figures, embedded in the page as PNG and closed once written."""
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    """name -> DataFrame, shown on the page and also written as ``<name>.csv``."""
    summary: list[str] = field(default_factory=list)
    """Short text lines for the terminal."""


@dataclass(kw_only=True)
class ReportContext:
    """Inputs shared by sections; ``quick`` shrinks work for tests and CI."""

    quick: bool = False
    """Smaller measurements (fewer repeats, steps and days), for tests and CI."""
    progress: bool = True
    """Show progress bars."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Values computed once and shared by sections (the reference setup, its profile, the measured run)."""

    def get(self, key: str, build: Callable[[], T]) -> T:
        """Return the cached value for ``key``, building it with ``build()`` the first time."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def figure_of(ax: Axes) -> Figure:
    """The Figure ``ax`` draws on (matplotlib types it as possibly a SubFigure; the report's plots never are)."""
    return cast("Figure", ax.figure)


def reference_setup(ctx: ReportContext) -> ReferenceSetup:
    """The report's default job: the reference GPT on the CPU, micro-batch of 8 sequences (4 when quick)."""
    from ... import models

    return ctx.get("setup", lambda: models.reference("gpt", batch_size=4 if ctx.quick else 8))


def reference_profile(ctx: ReportContext) -> Profile:
    """The default job's measured per-layer profile (computed once per report; 3 repeats when quick, else 10)."""
    return ctx.get("profile", lambda: measure_setup(reference_setup(ctx), quick=ctx.quick))


def measure_setup(setup: ReferenceSetup, *, quick: bool, samples: int | None = None) -> Profile:
    """``setup``'s per-layer profile on its first ``samples`` samples (default: the whole batch), with no progress
    bar: 3 measured steps after 1 warm-up when ``quick``, else 10 after 3."""
    from ...profiling.measure import profile

    repeats, warmup = (3, 1) if quick else (10, 3)
    return profile(
        setup.model,
        setup.inputs[:samples],
        target=setup.targets[:samples],
        loss_fn=setup.loss_fn,
        warmup=warmup,
        repeats=repeats,
        progress=False,
    )
