"""What the planner reads, checked once: :class:`PlanInputs`, built by :func:`check_plan_inputs` from the keyword
arguments of :func:`~pipeswift_lab.planning.planner.plan`.

Every step of the search (:mod:`.steps`) reads this one record; none of them checks an argument again.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.checks import check_flag, check_int, check_time
from ..core.costs import AssemblyModel, Availability, CheckpointModel, cost_models
from ..core.link import Link, check_link
from ..core.precision import check_optimizer, check_precision
from ..core.schedule import Schedule
from ..core.schedule_generators import is_generator, takes_v
from ..core.topology import DEFAULT_INTER_NODE_LINK, Topology
from ..core.vocabulary import MULTI_CHUNK_SCHEDULES, SCHEDULES, V_SHAPE_SCHEDULES, canonical_schedule
from ..simulation.calibration import SimulatorCalibration, check_calibration
from .costs import MicrobatchCosts
from .degrees import Degrees, check_degrees
from .quantiles import check_quantile

__all__ = ["DEFAULT_DP_LINK", "OPTIMIZER_MEMORY_GBps", "PlanInputs", "check_plan_inputs", "divisors"]

#: Data-parallel link when none is given: a 200 Gb/s network (25 GB/s) with 10 µs latency (the default inter-node
#: link of a :class:`~pipeswift_lab.core.topology.Topology`).
DEFAULT_DP_LINK: Link = DEFAULT_INTER_NODE_LINK
#: Memory bandwidth (GB/s) the optimizer step streams at, by profiled device type.
OPTIMIZER_MEMORY_GBps = {"cuda": 1500.0, "cpu": 20.0}


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """The job, the cluster, the cost models and the search's options, checked by :func:`check_plan_inputs`."""

    costs: MicrobatchCosts
    """Per-layer costs at any micro-batch size, from the profile (or profiles) the plan was given."""
    gpus: int
    """The most GPUs the job may use (>= 1)."""
    global_batch: int
    """Samples per training step (>= 1): ``D * m * microbatch_size`` of every configuration."""
    steps: int
    """Training steps of the job (>= 1)."""
    stage_counts: tuple[int, ...]
    """The ranks ``P`` to weigh, ascending, each at most the layer count and the GPUs."""
    stage_choices: tuple[tuple[Any, int], ...]
    """``(schedule, v)`` pairs to weigh: a V-shaped schedule with ``v=2``, another multi-chunk one with 2 and 4; a
    generator with the ``v`` it is asked for (0: its own)."""
    microbatch_sizes: tuple[int, ...]
    """Micro-batch sizes to weigh, ascending (default: the smallest profiled size times powers of two)."""
    link: Link | None
    """The pipeline's point-to-point link between ranks; None: transfers are free."""
    dp_link: Link
    """The link of the gradient all-reduce over ``D`` replicas (default :data:`DEFAULT_DP_LINK`)."""
    mem_per_gpu_bytes: float | None
    """Memory cap per GPU (> 0); None: every split is taken to fit."""
    availability: Availability
    """Free GPUs over time (default: ``gpus`` free now and forever)."""
    assembly: AssemblyModel
    """Seconds from launch to the first step, by ``(P, D)``."""
    checkpoint: CheckpointModel
    """Seconds of a periodic checkpoint's stall, a waited save, a restore and the final cleanup, by the largest
    shard."""
    mtbf_s: float | None
    """Mean time between preemptions of one GPU (> 0); None: no preemptions."""
    optimizer: str
    """Name in :data:`~pipeswift_lab.core.precision.OPTIMIZER_STATES`: the optimizer states per parameter."""
    precision: str | None
    """Name in :data:`~pipeswift_lab.core.precision.PRECISIONS`; None: the profile's ``param_bytes`` x 4."""
    mem_GBps: float
    """Memory bandwidth (GB/s) the optimizer step streams at, from the profiled device."""
    calibration: SimulatorCalibration | None
    """Simulate every pipeline step calibrated; None: from the raw profile."""
    quantile: float | None
    """The JCT quantile the objective ranks by, added as a column (e.g. 0.95 for ``"p95"``); None: the mean."""
    objective: str
    """What ranks the table as given: ``"mean"`` or a quantile name such as ``"p95"``."""
    rank_by: str
    """The table column the objective ranks by: ``total_s`` or ``total_s_p95``."""
    step_cv: float
    """Coefficient of variation of the step time (>= 0) the quantile samples."""
    exhaustive: bool
    """Simulate every feasible configuration (also True when ranking by a quantile, whose bound is not known)."""
    progress: bool
    """Show a progress bar over the simulated configurations."""
    recompute: str | None = None
    """``"search"``: where memory binds, each stage's recomputation is chosen with the split; ``"full"`` or
    ``"selective"``: every stage recomputes so, whether memory binds or not; None: none."""
    degrees: Degrees | None = None
    """The tensor-parallel and FSDP degrees weighed and the topology (:mod:`.degrees`); None: ``tp = fsdp = 1``
    without a topology."""
    given_dp_link: Link | None = None
    """``dp_link`` as given (None: not given): with a topology it overrides the topology's link for the replicas."""

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees weighed."""
        return self.degrees.tp if self.degrees is not None else (1,)

    @property
    def fsdp_degrees(self) -> tuple[int, ...]:
        """The FSDP shard degrees weighed."""
        return self.degrees.fsdp if self.degrees is not None else (1,)

    @property
    def three_d(self) -> bool:
        """Whether the search weighs layouts beyond pipelines × replicas (:attr:`Degrees.three_d`)."""
        return self.degrees is not None and self.degrees.three_d

    @property
    def topology(self) -> Topology | None:
        """The topology given to the plan (None: none)."""
        return self.degrees.topology if self.degrees is not None else None

    @property
    def n_layers(self) -> int:
        """Layers of the profiled model."""
        return self.costs.n_layers

    def as_dict(self) -> dict[str, Any]:
        """What :attr:`~pipeswift_lab.planning.result.Plan.inputs` shows and its methods read."""
        return {
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "steps": self.steps,
            "availability": self.availability.points,
            "profiled_batch_sizes": self.costs.sizes,
            "optimizer": self.optimizer,
            "precision": self.precision,
            "recompute": self.recompute,
            "link": self.link,
            "topology": self.topology,
            "three_d": self.three_d,
            "tp": self.tp_degrees,
            "fsdp": self.fsdp_degrees,
            "sequence_parallel": self.degrees.sequence_parallel if self.degrees is not None else False,
            "mem_per_gpu_bytes": self.mem_per_gpu_bytes,
            "calibration": self.calibration,
            "objective": self.objective,
            "step_cv": self.step_cv,
        }


def check_plan_inputs(
    profile: Any,
    *,
    gpus: Any,
    global_batch: Any,
    steps: Any,
    link: Any = None,
    dp_link: Any = None,
    mem_per_gpu_bytes: Any = None,
    schedules: Any = None,
    microbatch_sizes: Any = None,
    availability: Any = None,
    costs: Any = None,
    mtbf_s: Any = None,
    P: Any = None,
    optimizer: Any = "adam",
    exhaustive: Any = False,
    progress: Any = True,
    calibration: Any = None,
    objective: Any = "mean",
    step_cv: Any = None,
    precision: Any = None,
    recompute: Any = None,
    topology: Any = None,
    tp: Any = None,
    fsdp: Any = None,
    sequence_parallel: bool = False,
) -> PlanInputs:
    """Check the arguments of :func:`~pipeswift_lab.planning.planner.plan` (the meanings are there) and resolve their
    defaults; return the :class:`PlanInputs` the search reads. Raises ``TypeError``/``ValueError`` naming the argument.
    """
    assembly, checkpoint = cost_models(costs)
    costs = MicrobatchCosts(profile)
    gpus = check_int("gpus", gpus, minimum=1)
    global_batch = check_int("global_batch", global_batch, minimum=1)
    calibration = check_calibration(calibration)
    quantile, rank_by = check_quantile(objective)
    given_dp_link = check_link(dp_link)
    precision = check_precision(precision)
    degrees = check_degrees(
        tp=tp,
        fsdp=fsdp,
        topology=topology,
        costs=costs,
        gpus=gpus,
        global_batch=global_batch,
        precision=precision,
        dp_link=given_dp_link or DEFAULT_DP_LINK,
        sequence_parallel=sequence_parallel,
    )
    return PlanInputs(
        costs=costs,
        gpus=gpus,
        global_batch=global_batch,
        steps=check_int("steps", steps, minimum=1),
        link=check_link(link),
        dp_link=given_dp_link or DEFAULT_DP_LINK,
        given_dp_link=given_dp_link,
        degrees=degrees,
        mem_per_gpu_bytes=_positive_or_none("mem_per_gpu_bytes", mem_per_gpu_bytes),
        mtbf_s=_positive_or_none("mtbf_s", mtbf_s),
        stage_choices=_stage_choices(SCHEDULES if schedules is None else schedules),
        stage_counts=_stage_counts(P, costs.n_layers, gpus),
        microbatch_sizes=_microbatch_sizes(microbatch_sizes, costs.b0, global_batch),
        availability=Availability.now(gpus) if availability is None else Availability(availability),
        assembly=assembly or AssemblyModel(),
        checkpoint=checkpoint or CheckpointModel(),
        optimizer=check_optimizer(optimizer),
        precision=precision,
        mem_GBps=OPTIMIZER_MEMORY_GBps.get(costs.device, OPTIMIZER_MEMORY_GBps["cuda"]),
        calibration=calibration,
        quantile=quantile,
        objective=objective,
        rank_by=rank_by,
        step_cv=_step_cv(step_cv, calibration),
        exhaustive=check_flag("exhaustive", exhaustive) or rank_by != "total_s",
        progress=check_flag("progress", progress),
        recompute=_recompute(recompute, mem_per_gpu_bytes, costs),
    )


def _recompute(recompute: Any, cap: Any, costs: MicrobatchCosts) -> str | None:
    """``recompute`` checked: None; ``"search"``, which needs a memory cap and the profile's recompute columns; or
    ``"full"`` / ``"selective"``, which need the columns alone (every stage recomputes so)."""
    from .recompute_search import FORCED_MODES, has_recompute_columns

    if recompute is None:
        return None
    if recompute != "search" and recompute not in FORCED_MODES:
        raise ValueError(
            f"recompute={recompute!r} is not 'search' (plan chooses each stage's recomputation), 'full' or "
            "'selective' (every stage recomputes so), or None"
        )
    if recompute == "search" and cap is None:
        raise ValueError('recompute="search" needs mem_per_gpu_bytes: recomputation only pays where memory binds')
    if not all(has_recompute_columns(t) for t in costs.tables.values()):
        raise ValueError(
            f"recompute={recompute!r} needs the recompute columns: profile the model with recompute=True (or "
            "psl.analytic_profile, which computes them)"
        )
    return str(recompute)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_or_none(name: str, value: Any) -> float | None:
    return None if value is None else check_time(name, value, allow_zero=False)


def _candidates(name: str, values: Any, default: Iterable[int], minimum: int = 1) -> tuple[int, ...]:
    """``values`` (an int or ints) checked, deduplicated and ascending; ``default`` when None."""
    if values is None:
        return tuple(default)
    if isinstance(values, numbers.Integral):
        values = [values]
    out = sorted({check_int(f"{name}[{i}]", x, minimum=minimum) for i, x in enumerate(values)})
    if not out:
        raise ValueError(f"{name} is empty; give at least one value")
    return tuple(out)


def _stage_counts(P: Any, n_layers: int, gpus: int) -> tuple[int, ...]:
    """The ``P`` to weigh: the given ones, or every divisor of the layer count and every power of two up to it."""
    default = sorted(set(divisors(n_layers)) | {2**k for k in range(12) if 2**k <= n_layers})
    counts = tuple(p for p in _candidates("P", P, default) if p <= min(n_layers, gpus))
    if not counts:
        raise ValueError(f"P={P} leaves no stage count <= min(layers={n_layers}, gpus={gpus})")
    return counts


def _microbatch_sizes(sizes: Any, b0: int, global_batch: int) -> tuple[int, ...]:
    """The given sizes, or the smallest profiled size ``b0`` times powers of two up to the global batch."""
    # by default never below the smallest profiled size, where proportional scaling would be optimistic
    if sizes is None and global_batch < b0:
        raise ValueError(
            f"global_batch={global_batch} is smaller than the profiled micro-batch size {b0} "
            f"(profile.meta['batch_size']); give global_batch >= {b0}, or microbatch_sizes= that divide it "
            f"(times then scale down from the profiled size)"
        )
    return _candidates("microbatch_sizes", sizes, [b0 * 2**k for k in range(20) if b0 * 2**k <= global_batch])


def _stage_choices(schedules: Any) -> tuple[tuple[Any, int], ...]:
    """``(schedule, v)`` of each schedule: ``v=2`` for a V shape, 2 and 4 for another multi-chunk one, else 1; a
    Schedule's own ``v``; a generator with ``v=0`` (its own) or, where it takes ``v``, 1 and 2 (made for each ``P``
    and ``m`` when the search enumerates them: :func:`~pipeswift_lab.planning.steps.made_choice`)."""
    if isinstance(schedules, (str, Schedule)) or is_generator(schedules):
        schedules = [schedules]
    if hasattr(schedules, "__len__") and len(schedules) == 0:
        raise ValueError(
            f"schedules={list(schedules)!r} is empty; give at least one of {list(SCHEDULES)}, or None for all of them"
        )
    out: list[tuple[Any, int]] = []
    for name in schedules:
        if is_generator(name):
            out += [(name, 1), (name, 2)] if takes_v(name) else [(name, 0)]
            continue
        schedule = canonical_schedule(name)
        if isinstance(schedule, Schedule):
            out.append((schedule, schedule.v))
        elif schedule in V_SHAPE_SCHEDULES:
            out.append((schedule, 2))
        elif schedule in MULTI_CHUNK_SCHEDULES:
            out += [(schedule, 2), (schedule, 4)]
        else:
            out.append((schedule, 1))
    return tuple(out)


def _step_cv(step_cv: Any, calibration: SimulatorCalibration | None) -> float:
    """The step time's dispersion: as given, else the calibration's (when fitted), else 0."""
    if step_cv is None:
        step_cv = calibration.step_cv if calibration is not None and math.isfinite(calibration.step_cv) else 0.0
    return check_time("step_cv", step_cv)
