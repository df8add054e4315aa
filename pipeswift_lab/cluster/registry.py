"""The built-in scheduling policies by name (:data:`POLICIES`) and :func:`get_policy`, which resolves ``policy=``."""

from __future__ import annotations

from ..core.checks import check_choice
from .joint import JointJCT
from .policies import Elastic, Policy, Preemptive, Static

__all__ = ["POLICIES", "get_policy"]

#: Built-in policies by name; ``"jct"`` is :class:`~pipeswift_lab.cluster.joint.JointJCT` with its defaults.
POLICIES: dict[str, type[Policy]] = {"static": Static, "elastic": Elastic, "preemptive": Preemptive, "jct": JointJCT}


def get_policy(policy: str | Policy | type[Policy]) -> Policy:
    """A :class:`Policy` instance from a name in :data:`POLICIES` (any case), a :class:`Policy` subclass
    (instantiated) or an instance (returned as is). Raises ``ValueError`` for an unknown name listing the known
    ones, ``TypeError`` for anything else."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        return policy()
    if isinstance(policy, str) and policy.lower() in POLICIES:
        policy = policy.lower()
    hint = ", or a pipeswift_lab.cluster.Policy subclass or instance"
    return POLICIES[check_choice("policy", policy, POLICIES, hint=hint)]()
