"""Trace-driven simulation of a shared GPU cluster, measured as job completion time.

Reads a job trace, the GPUs and a policy; returns a :class:`ClusterResult`::

    static = psl.cluster.simulate(psl.data.philly_jobs(), 256, policy="static")
    jct = psl.cluster.simulate(psl.data.philly_jobs(), 256, policy="jct")
    psl.cluster.compare(static, jct).ranking

``psl.cluster.simulate(jobs, gpus, policy)`` replays a job trace (e.g.
:func:`pipeswift_lab.data.philly_jobs`) on a cluster of ``gpus`` under a scheduling policy
and returns a :class:`ClusterResult`: every job's JCT split into queue, assembly,
training, cleanup and preemption loss, the GPUs in use over time, and a summary.
``psl.cluster.compare(*results)`` puts policies side by side.

Modules: :mod:`.inputs` (checking jobs, capacity and costs; :func:`read_capacity` for availability traces),
:mod:`.scaling` (a job's speed and costs on any GPU count, from a profile and the cost models), :mod:`.engine` (the
event heap, :class:`~.engine.ClusterJob` segments and the JCT accounting), :mod:`.policies` (static, elastic,
preemptive, and the :class:`Policy` base for custom ones), :mod:`.joint` (:class:`JointJCT`, ``policy="jct"``: queue
and GPU counts chosen together for the lowest predicted JCT), :mod:`.registry` (the policies by name),
:mod:`.simulator` (:func:`simulate`: check, resolve, replay, close), :mod:`.result` (:class:`ClusterResult`,
:func:`compare` and its per-workload ``ranking``).
"""

from __future__ import annotations

from .inputs import read_capacity
from .joint import JointJCT
from .policies import Elastic, Policy, Preemptive, Static
from .registry import POLICIES
from .result import ClusterComparison, ClusterResult, compare
from .scaling import ScalingModel, default_profile, profile_library
from .simulator import simulate

__all__ = [
    "POLICIES",
    "ClusterComparison",
    "ClusterResult",
    "Elastic",
    "JointJCT",
    "Policy",
    "Preemptive",
    "ScalingModel",
    "Static",
    "compare",
    "default_profile",
    "profile_library",
    "read_capacity",
    "simulate",
]
