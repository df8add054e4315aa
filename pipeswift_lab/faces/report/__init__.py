"""The HTML report: reads nothing but the lab itself, returns a self-contained page of every capability on one job.

``pipeswift-lab report`` and ``psl.report.build_report`` profile the reference model, partition, simulate, run,
checkpoint and plan it, and replay the shipped cluster trace; every table is written beside the page as CSV::

    import pipeswift_lab as psl
    result = psl.report.build_report("pipeswift-report", quick=True)
    result.path   # the page: <absolute path>/pipeswift-report/report.html; result.csv_paths: its tables

Modules: :mod:`.builder` (:func:`build_report`), :mod:`.base` (the shared context), and the sections of
:mod:`.model`, :mod:`.runs` and :mod:`.cluster`.
"""

from __future__ import annotations

from .base import ReportContext, Section, reference_profile, reference_setup
from .builder import SECTIONS, ReportResult, SectionFunction, build_report
from .cluster import CLUSTER_GPUS, CLUSTER_WINDOW_DAYS

__all__ = [
    "CLUSTER_GPUS",
    "CLUSTER_WINDOW_DAYS",
    "SECTIONS",
    "ReportContext",
    "ReportResult",
    "Section",
    "SectionFunction",
    "build_report",
    "reference_profile",
    "reference_setup",
]
