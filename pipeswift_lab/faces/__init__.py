"""Faces: where a person meets the toolkit. The only room that loads IPython and ipywidgets.

:mod:`.magics` (``%pipeswift_profile``), :mod:`.widgets` (the explorers), :mod:`.cli` (``pipeswift-lab report``)
and :mod:`.report` (the HTML report). Nothing is imported here, so ``import pipeswift_lab`` stays light::

    %load_ext pipeswift_lab
    psl.widgets.explore_partition(prof)
    psl.report.build_report("report.html")
"""

from __future__ import annotations

__all__: list[str] = []
