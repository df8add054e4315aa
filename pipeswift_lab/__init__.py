"""pipeswift_lab: a Jupyter-native lab for pipeline-parallel training that optimizes job completion time.

``%load_ext pipeswift_lab`` registers the IPython magics. Heavy optional libraries
(IPython, ipywidgets, matplotlib, seaborn) are imported only by the functions that use them.
"""
from __future__ import annotations

import importlib

from . import cluster, costs, data, models, precision
from ._checks import SCHEDULES
from .cluster import ClusterResult
from .calibrate import Calibration, calibrate
from .analytic import activation_memory_bytes, bubble_overhead, bubble_ratio, inflight_microbatches, step_ms
from .jct import JCT
from .link import Link
from .magics import load_ipython_extension  # noqa: F401 - the hook %load_ext calls, not an API
from .partition import Partition, partition
from .planner import Plan, plan
from .profile import Profile, profile, profile_step
from .runner import Checkpoint, RunError, RunResult, compare, latest_checkpoint, load_checkpoint, run
from .runner.compare import Comparison
from .schedules import compute_orders  # noqa: F401 - importable, but not part of the advertised surface
from .simulate import ScheduleDeadlock, simulate
from .sweep import explore, plot_sweep, sweep  # noqa: F401 - explore: importable, superseded by widgets
from .timeline import Timeline

__version__ = "0.1.0"

#: Submodules loaded on first attribute access (``psl.widgets``), so that ``import pipeswift_lab`` stays light.
_LAZY_SUBMODULES = ("widgets", "report")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import also sets the attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "SCHEDULES",
    "Checkpoint",
    "Comparison",
    "ClusterResult",
    "JCT",
    "Link",
    "Partition",
    "Plan",
    "Profile",
    "RunError",
    "RunResult",
    "ScheduleDeadlock",
    "Timeline",
    "Calibration",
    "activation_memory_bytes",
    "bubble_overhead",
    "bubble_ratio",
    "cluster",
    "calibrate",
    "compare",
    "costs",
    "data",
    "inflight_microbatches",
    "latest_checkpoint",
    "load_checkpoint",
    "models",
    "precision",
    "partition",
    "plan",
    "plot_sweep",
    "profile",
    "profile_step",
    "run",
    "simulate",
    "step_ms",
    "sweep",
    "widgets",
]
