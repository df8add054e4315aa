"""pipeswift_lab: a Jupyter-native lab for pipeline-parallel training that optimizes job completion time.

``%load_ext pipeswift_lab`` registers the IPython magics. Heavy optional libraries
(IPython, ipywidgets, matplotlib, seaborn) are imported only by the functions that use them.
"""
from __future__ import annotations

from . import cluster, data, models, precision
from ._checks import SCHEDULES
from .cluster import ClusterResult
from .calibrate import Calibration, calibrate
from .analytic import activation_memory_bytes, bubble_overhead, bubble_ratio, inflight_microbatches, step_ms
from .jct import JCT
from .link import Link
from .magics import load_ipython_extension
from .partition import Partition, partition
from .planner import Plan, plan
from .profile import Profile, profile, profile_step
from .runner import Checkpoint, RunError, RunResult, compare, latest_checkpoint, load_checkpoint, run
from .schedules import compute_orders
from .simulate import ScheduleDeadlock, simulate
from .sweep import explore, plot_sweep, sweep
from .timeline import Timeline

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "Checkpoint",
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
    "compute_orders",
    "data",
    "explore",
    "inflight_microbatches",
    "latest_checkpoint",
    "load_checkpoint",
    "load_ipython_extension",
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
]
