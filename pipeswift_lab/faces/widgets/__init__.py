"""Interactive explorers for notebooks, built on ipywidgets: read a profile (or nothing), return a live widget.

Each explorer keeps its state readable (``.P``, ``.m``, ``.schedule``, ``.result``) so a test drives it headlessly by
setting slider values, exactly as a user drags them. ipywidgets and matplotlib are imported when an explorer is
built, not at package import::

    explorer = psl.widgets.bubble_explorer(P=4, m=8)   # sliders for P, m, v and a schedule dropdown
    psl.widgets.pipeline_explorer(prof)                # P, m, schedule, partition method: Gantt chart and metrics
    psl.widgets.planner_explorer(prof, gpus=16)        # the JCT plan, re-ranked as GPUs, batch or steps change

Modules: :mod:`.bubbles` (the closed-form bubble), :mod:`.pipeline` (partition and simulate a profile),
:mod:`.planner` (the JCT plan) and :mod:`.base` (what every explorer shares).
"""

from __future__ import annotations

from .bubbles import BUBBLE_CONVENTIONS, BubbleExplorer, bubble_explorer, plot_bubble_curve
from .pipeline import M_MAX, PipelineExplorer, pipeline_explorer, valid_microbatches
from .planner import PlannerExplorer, parse_availability, planner_explorer

__all__ = [
    "BUBBLE_CONVENTIONS",
    "M_MAX",
    "BubbleExplorer",
    "PipelineExplorer",
    "PlannerExplorer",
    "bubble_explorer",
    "parse_availability",
    "pipeline_explorer",
    "planner_explorer",
    "plot_bubble_curve",
    "valid_microbatches",
]
