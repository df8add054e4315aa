"""Faces: where a person meets the toolkit. The only room that loads IPython and ipywidgets.

:mod:`.magics` (``%pipeswift_profile``), :mod:`.widgets` (the explorers, one module each), :mod:`.cli`
(``pipeswift-lab report``) and :mod:`.report` (the HTML report). Nothing is imported here, so
``import pipeswift_lab`` stays light::

    %load_ext pipeswift_lab                      # registers %pipeswift_profile (magics)
    import pipeswift_lab as psl
    prof = psl.profile(model, x)
    psl.widgets.pipeline_explorer(prof)          # P, m, schedule and partition controls over the Profile
    psl.report.build_report("pipeswift-report")  # writes pipeswift-report/report.html and its CSV tables
"""

from __future__ import annotations

__all__: list[str] = []
