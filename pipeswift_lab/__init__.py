"""pipeswift_lab: a Jupyter-native lab for pipeline-parallel training that optimizes job completion time.

The package has one room per stage of the flow ``profile -> partition -> simulate -> run -> calibrate -> plan``:
:mod:`.core`, :mod:`.profiling`, :mod:`.partitioning`, :mod:`.simulation`, :mod:`.fidelity`, :mod:`.planning`,
:mod:`.runner`, :mod:`.cluster` and :mod:`.faces`. The verbs and result types are re-exported here.

``%load_ext pipeswift_lab`` registers the IPython magics. Heavy optional libraries
(IPython, ipywidgets, matplotlib, seaborn) are imported only by the functions that use them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from . import cluster, data, frameworks, models, runner, schedules
from .cluster import ClusterResult
from .core import analytic, costs, hardware, precision
from .core.analytic import activation_memory_bytes, bubble_overhead, bubble_ratio, inflight_microbatches, step_ms
from .core.hardware import Hardware
from .core.jct import JCT
from .core.link import Link
from .core.schedule import Schedule, ScheduleDeadlock
from .core.topology import Topology
from .core.transformer_flops import megatron_flops_per_iteration, megatron_params, transformer_flops
from .core.transformer_memory import transformer_memory
from .core.transformer_spec import TransformerSpec
from .core.version import __version__ as __version__
from .core.vocabulary import SCHEDULES
from .fidelity import Calibration, Comparison, MeasuredRun, PublishedRun, calibrate, compare
from .partitioning import Partition, partition
from .planning import Plan, plan
from .profiling import Profile, UnitByUnit, analytic_profile, profile, profile_step
from .runner import (
    FSDP,
    TP,
    Checkpoint,
    Checkpointing,
    Elastic,
    Faults,
    Launch,
    RunError,
    RunResult,
    latest_checkpoint,
    load_checkpoint,
    run,
)
from .simulation import Sweep, Timeline, compute_orders, explore, simulate, sweep  # noqa: F401 - importable

#: Faces loaded on first attribute access (``psl.widgets``), so that ``import pipeswift_lab`` stays light.
_LAZY_SUBMODULES = {"widgets": ".faces.widgets", "report": ".faces.report"}


def load_ipython_extension(ipython: Any) -> None:
    """The hook ``%load_ext pipeswift_lab`` calls: registers the magics of :mod:`pipeswift_lab.faces.magics`."""
    from .faces.magics import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(_LAZY_SUBMODULES[name], __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "JCT",
    "SCHEDULES",
    "Calibration",
    "Checkpoint",
    "Checkpointing",
    "Elastic",
    "FSDP",
    "Hardware",
    "TP",
    "Faults",
    "Launch",
    "ClusterResult",
    "Comparison",
    "Link",
    "MeasuredRun",
    "Partition",
    "Plan",
    "Profile",
    "PublishedRun",
    "RunError",
    "RunResult",
    "Schedule",
    "ScheduleDeadlock",
    "Sweep",
    "Timeline",
    "Topology",
    "TransformerSpec",
    "UnitByUnit",
    "activation_memory_bytes",
    "analytic",
    "analytic_profile",
    "bubble_overhead",
    "bubble_ratio",
    "calibrate",
    "cluster",
    "compare",
    "costs",
    "data",
    "frameworks",
    "hardware",
    "inflight_microbatches",
    "latest_checkpoint",
    "load_checkpoint",
    "megatron_flops_per_iteration",
    "megatron_params",
    "models",
    "partition",
    "plan",
    "precision",
    "profile",
    "profile_step",
    "report",
    "run",
    "runner",
    "schedules",
    "simulate",
    "step_ms",
    "sweep",
    "transformer_flops",
    "transformer_memory",
    "widgets",
]
