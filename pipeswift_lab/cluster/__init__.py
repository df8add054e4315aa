"""Trace-driven simulation of a shared GPU cluster, measured as job completion time.

``psl.cluster.simulate(jobs, gpus, policy)`` replays a job trace (e.g.
:func:`pipeswift_lab.data.philly_jobs`) on a cluster of ``gpus`` under a scheduling policy
and returns a :class:`ClusterResult`: every job's JCT split into queue, assembly,
training, cleanup and preemption loss, the GPUs in use over time, and a summary.
``psl.cluster.compare(*results)`` puts policies side by side.

Modules: :mod:`.inputs` (checking jobs and capacity), :mod:`.scaling` (a job's speed and
costs on any GPU count, from a profile and the cost models), :mod:`.engine` (the event
heap, segments and the JCT accounting), :mod:`.policies` (static, elastic, preemptive, and
the :class:`Policy` base for custom ones), :mod:`.simulate`, :mod:`.result`.
"""

from __future__ import annotations

from .policies import POLICIES, Elastic, Policy, Preemptive, Static
from .result import ClusterComparison, ClusterResult, compare
from .scaling import ScalingModel, default_profile, profile_library
from .simulator import simulate

__all__ = [
    "POLICIES",
    "ClusterComparison",
    "ClusterResult",
    "Elastic",
    "Policy",
    "Preemptive",
    "ScalingModel",
    "Static",
    "compare",
    "default_profile",
    "profile_library",
    "simulate",
]
