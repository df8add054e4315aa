"""Fidelity: reads measured runs (:class:`~pipeswift_lab.runner.RunResult` values), returns how far predictions are.

:func:`compare` puts a simulated Timeline beside a measured one; :func:`calibrate` fits the simulator's free terms
(compute scale with co-running ranks, per-action and per-step overheads, transfers) on measured runs of one model and
returns a :class:`Calibration` to pass back::

    cal = psl.calibrate([run_a, run_b, run_c], prof)   # RunResults and the Profile their partitions came from
    cal.error([run_d])                                  # measured vs predicted step, before and after
    psl.compare(psl.simulate(part, m=8, calibration=cal), run_d).step_rel_error

A job the toolkit did not launch comes in as a :class:`MeasuredRun` (a Timeline from its profiler traces and the
partition it ran), which both read as a RunResult.

A configuration someone else trained and timed comes in as a :class:`PublishedRun` (a spec, a GPU, a layout and its
published iteration time, teraFLOP/s or tokens/s per GPU); :func:`predict_iteration` prices it from an analytic
profile, ``calibrate`` fits one compute scale on a few of them, and :func:`published_check` measures the error on
the rest (:func:`load_published`: the shipped runs)::

    runs = psl.fidelity.load_published()
    cal = psl.calibrate(runs[:3])                       # one scale on three published runs
    cal.error(runs[3:])                                 # predicted against published, before and after

Modules: :mod:`.comparison`, :mod:`.measured_run`, :mod:`.replays` (a measured step re-run through the simulator),
:mod:`.published` (published runs and their prediction), :mod:`.published_errors` (their errors),
:mod:`.calibrator`, :mod:`.measurements` (what calibration reads from the runs), :mod:`.fitting` (its fits) and
:mod:`.collectives` (the link of the backend that ran the runs' collectives, fitted apart from compute:
:func:`calibrate_links`). This room never imports the runner: runs are values.
"""

from __future__ import annotations

from .calibrator import Calibration, CalibrationWarning, calibrate
from .collectives import calibrate_links
from .comparison import Comparison, compare
from .measured_run import MeasuredRun
from .published import PublishedRun, load_published, predict_iteration
from .published_errors import PublishedCheck, mape, pick_regret, published_check, spearman
from .replays import replay

__all__ = [
    "Calibration",
    "CalibrationWarning",
    "Comparison",
    "MeasuredRun",
    "PublishedCheck",
    "PublishedRun",
    "calibrate",
    "calibrate_links",
    "compare",
    "load_published",
    "mape",
    "pick_regret",
    "predict_iteration",
    "published_check",
    "replay",
    "spearman",
]
