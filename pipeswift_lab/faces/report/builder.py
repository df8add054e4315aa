"""The HTML report of ``pipeswift-lab report``: every capability of the lab on one default job.

The report is self-contained (plots embedded as PNG data URIs) and every table is also
written next to it as CSV. Each capability contributes one section function taking the
shared :class:`ReportContext` and returning a :class:`Section`; the context computes
shared inputs (the reference model, its profile) once, on first use. The sections live in
:mod:`.model` (the model alone), :mod:`.runs` (real runs) and :mod:`.cluster`.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .base import ReportContext, Section
from .cluster import section_cluster
from .model import (
    section_bubbles,
    section_jct_example,
    section_partition,
    section_plan,
    section_profile,
    section_timeline,
)
from .runs import section_checkpoints, section_elastic, section_run

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SECTIONS", "ReportResult", "SectionFunction", "build_report"]

#: A section function: it reads the shared context and returns its :class:`Section`.
SectionFunction = Callable[[ReportContext], Section]

#: Sections in report order. Later capabilities append theirs.
SECTIONS: list[SectionFunction] = [
    section_bubbles,
    section_jct_example,
    section_profile,
    section_partition,
    section_timeline,
    section_run,
    section_checkpoints,
    section_elastic,
    section_plan,
    section_cluster,
]


@dataclass(frozen=True, kw_only=True)
class ReportResult:
    """Where the report was written, what it holds and how long it took."""

    path: Path
    """The page, ``<out>/report.html`` (an absolute path)."""
    csv_paths: tuple[Path, ...]
    """Every table of the page as a CSV file beside it, in page order."""
    summary: tuple[str, ...]
    """The sections' short text lines, as printed by ``pipeswift-lab report``."""
    seconds: float
    """How long the build took, in seconds."""

    def __str__(self) -> str:
        lines = [f"report: {self.path}", f"tables: {len(self.csv_paths)} CSV files in {self.path.parent}"]
        return "\n".join(lines + [f"  {line}" for line in self.summary] + [f"built in {self.seconds:.1f} s"])


def build_report(
    out: str | os.PathLike[str] = "pipeswift-report",
    sections: Sequence[SectionFunction] | None = None,
    quick: bool = False,
    progress: bool = True,
) -> ReportResult:
    """Build the HTML report under directory ``out``; return a :class:`ReportResult`.

    ``sections`` is a list of section functions (default :data:`SECTIONS`); ``quick``
    shrinks the measured work for tests and CI. The page is ``<out>/report.html`` and
    every table is written beside it as ``<out>/<name>.csv``.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)

    from ...core.progress import progress_bar

    start = time.perf_counter()
    chosen = _check_sections(sections)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(quick=quick, progress=progress)
    parts: list[str] = []
    csv_paths: list[Path] = []
    summary: list[str] = []
    for make in progress_bar(chosen, desc="report", progress=progress):
        section = make(ctx)
        parts.append(_section_html(section, folder, csv_paths))
        summary.extend(section.summary)
    path = _write_page(folder, parts)
    return ReportResult(
        path=path.resolve(),
        csv_paths=tuple(csv_paths),
        summary=tuple(summary),
        seconds=time.perf_counter() - start,
    )


def _check_sections(sections: Sequence[SectionFunction] | None) -> list[SectionFunction]:
    """The section functions to run: :data:`SECTIONS` by default; anything not callable is refused up front."""
    if sections is None:
        return list(SECTIONS)
    chosen = list(sections)
    for i, make in enumerate(chosen):
        if not callable(make):
            raise TypeError(
                f"sections[{i}] must be a section function, f(ctx: ReportContext) -> Section (e.g. one of SECTIONS); "
                f"got {type(make).__name__} {make!r}"
            )
    return chosen or list(SECTIONS)


def _section_html(section: Section, folder: Path, csv_paths: list[Path]) -> str:
    """One section as HTML: heading, intro, figures (then closed) and tables (each also written as CSV into
    ``folder``, its path appended to ``csv_paths``)."""
    import matplotlib.pyplot as plt

    from ...core.plot import figure_to_data_uri

    body = [f"<h2>{html.escape(section.title)}</h2>", section.intro_html]
    for fig in section.figures:
        body.append(f"<img alt='{html.escape(section.title)}' src='{figure_to_data_uri(fig)}'/>")
        plt.close(fig)
    for name, table in section.tables.items():
        path = folder / f"{name}.csv"
        table.to_csv(path, index=False)
        csv_paths.append(path)
        body.append(f"<h3>{html.escape(name)} <small>(<a href='{path.name}'>{path.name}</a>)</small></h3>")
        body.append(_table_html(table))
    return "<section>" + "\n".join(body) + "</section>"


def _write_page(folder: Path, parts: list[str]) -> Path:
    """Write the sections' HTML into ``folder/report.html``; return its path."""
    page = _PAGE.format(body="\n".join(parts), generated=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = folder / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _table_html(table: pd.DataFrame) -> str:
    """A table for the page: columns with no value at all left out (the CSV keeps them), rounding noise
    around zero printed as 0, inside a box that scrolls sideways instead of cutting wide tables off."""
    shown = table.loc[:, [c for c in table.columns if not table[c].isna().all()]] if len(table) else table
    dropped = [c for c in table.columns if c not in shown.columns]
    note = (
        f"<p class='note'>No values here for {', '.join(map(html.escape, map(str, dropped)))} (see the CSV).</p>"
        if dropped
        else ""
    )
    return f"<div class='wide'>{shown.to_html(index=False, float_format=_number, border=0)}</div>{note}"


def _number(x: float) -> str:
    return "0" if abs(x) < 1e-12 else f"{x:.4g}"  # -2.22e-16 is a zero computed in floating point


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pipeswift_lab report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }}
td, th {{ padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }}
img {{ max-width: 100%; }}
.wide {{ overflow-x: auto; max-width: 100%; }}
.note {{ font-size: 0.85em; color: #666; margin-top: -1em; }}
section {{ margin-bottom: 2.5em; }}
</style></head><body>
<h1>pipeswift_lab report</h1>
<p>Job completion time for pipeline-parallel training: queue + assembly + training + cleanup (+ preemption loss).
Generated {generated}.</p>
{body}
</body></html>
"""
