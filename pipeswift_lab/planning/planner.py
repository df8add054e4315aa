"""The JCT planner: the pipeline configuration that finishes the job first, queue included.

:func:`plan` searches ranks ``P`` (pipeline stages, ``P * v`` with ``v`` chunks each) × data-parallel replicas ``D``
within the GPUs, every micro-batch size and count ``m`` that make up the global batch, every schedule (and ``v``)
with a balanced partition that fits memory, and ranks them by predicted job completion
time::

    JCT = queue + assembly + steps * step + cleanup + preemption loss
    step = simulated pipeline step + gradient all-reduce over D replicas + optimizer step

Each row of the plan has a ``strategy``, named by what it does: ``now`` (start now on GPUs free now and keep one
configuration to the end), ``wait`` (wait for the GPUs, then one configuration), ``grow`` (start on the GPUs free
now, then, when more free up, checkpoint, re-assemble on more and finish there) and ``shrink`` (when GPUs a
configuration holds are taken mid-run, availability drops, it is no longer feasible as planned, and the plan
continues it on what stays free); see :mod:`.strategies`.

The profile is taken at one micro-batch size ``b0`` (``profile.meta["batch_size"]``);
layer times and activation bytes are scaled linearly to other micro-batch sizes, which
overstates small micro-batches' speed (fixed per-kernel costs do not shrink) — profile at
the micro-batch size you mean to run to remove that error. Without a pipeline ``link``,
a simulated step scales exactly with the durations, so each ``(P, m, schedule, v)`` is
simulated once and rescaled.

:class:`Plan` and :class:`PlannedConfig` live in :mod:`.result`, the checked inputs in :mod:`.inputs`; both are
importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from ..core.checks import moved_keywords
from ..core.costs import AssemblyModel, Availability, CheckpointModel
from ..core.link import Link
from ..core.topology import Topology
from ..profiling.table import Profile
from ..simulation.calibration import SimulatorCalibration
from .inputs import DEFAULT_DP_LINK, OPTIMIZER_MEMORY_GBps, PlanInputs, check_plan_inputs
from .layouts import search_layouts
from .result import Plan, PlannedConfig
from .search import Evaluator
from .steps import bound_configs, branch_and_bound, enumerate_configs, rank_table

__all__ = [
    "DEFAULT_DP_LINK",
    "OPTIMIZER_MEMORY_GBps",
    "Plan",
    "PlanInputs",
    "PlannedConfig",
    "evaluator_of",
    "plan",
    "search",
]


@moved_keywords(
    {
        "assembly": "costs=AssemblyModel(...) (or AssemblyModel.calibrate(runs); a tuple or dict with the "
        "CheckpointModel), as in cluster.simulate",
        "checkpoint": "costs=CheckpointModel(...) (a tuple or dict with the AssemblyModel), as in cluster.simulate",
        "quantile": 'objective="p95" (it adds the column total_s_p95 and ranks by it; Plan.ranked_by("total_s") '
        "ranks the same table by the mean)",
    }
)
def plan(
    profile: Profile | pd.DataFrame | Sequence[Profile],
    gpus: int,
    global_batch: int,
    steps: int,
    *,
    link: Link | None = None,
    dp_link: Link | None = None,
    mem_per_gpu_bytes: float | None = None,
    schedules: str | Sequence[str] | None = None,
    microbatch_sizes: int | Sequence[int] | None = None,
    availability: Availability | Sequence[tuple[float, int]] | None = None,
    costs: AssemblyModel | CheckpointModel | Sequence[Any] | dict[str, Any] | None = None,
    mtbf_s: float | None = None,
    P: int | Sequence[int] | None = None,
    optimizer: str = "adam",
    exhaustive: bool = False,
    progress: bool = True,
    calibration: SimulatorCalibration | None = None,
    objective: str = "mean",
    step_cv: float | None = None,
    precision: str | None = None,
    recompute: str | None = None,
    topology: Topology | None = None,
    tp: int | Sequence[int] | None = None,
    fsdp: int | Sequence[int] | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """Rank every feasible pipeline configuration by predicted job completion time; return a :class:`Plan`.

    * ``profile`` — a :class:`~pipeswift_lab.Profile` (or per-layer DataFrame) taken at
      micro-batch size ``profile.meta["batch_size"]``, or a list of Profiles of the same
      model at several sizes (times are then interpolated between them, see
      :class:`~pipeswift_lab.planning.costs.MicrobatchCosts`);
    * ``gpus`` — the most GPUs the job may use; ``global_batch`` — samples per step;
      ``steps`` — training steps;
    * ``link`` — pipeline point-to-point :class:`~pipeswift_lab.Link` (None: free);
      ``dp_link`` — the data-parallel all-reduce link (default :data:`DEFAULT_DP_LINK`);
    * ``mem_per_gpu_bytes`` — memory cap per GPU; ``schedules`` — names to consider (default
      all); ``microbatch_sizes`` — candidates (default: the smallest profiled size times
      powers of two, up to the global batch); ``P`` — stage counts to consider (default: every
      divisor of the layer count and every power of two up to it); ``optimizer`` — a name in
      :data:`~pipeswift_lab.core.precision.OPTIMIZER_STATES`;
    * ``availability`` — free GPUs over time, ``[(seconds_from_now, free_gpus), ...]``
      (default: ``gpus`` free now); ``costs`` — what assembly and checkpoints cost, as in
      :func:`pipeswift_lab.cluster.simulate`: an :class:`~pipeswift_lab.core.costs.AssemblyModel` (e.g.
      ``AssemblyModel.calibrate(runs)``), a :class:`~pipeswift_lab.core.costs.CheckpointModel`, both in a tuple, or
      ``{"assembly": ..., "checkpoint": ...}`` (the stated defaults for what is not given);
    * ``mtbf_s`` — mean time between preemptions of *one GPU*; a job on ``N`` GPUs is
      preempted every ``mtbf_s / N`` on average and checkpoints at the Young/Daly interval of the
      checkpoint's stall (``CheckpointModel.interval_s``: the staging copy of an asynchronous save, never
      closer than one write), each checkpoint stalling training ``CheckpointModel.stall_s``;
    * ``precision`` — bytes of training state per parameter (Adam): ``None`` the profile's
      ``param_bytes`` x 4; ``"fp32"`` and ``"bf16-mixed"`` 16 B/param; ``"bf16-mixed-zero1"``
      ``4 + 12 / D`` B/param, the fp32 master and moments sharded over the ``D`` replicas
      (:mod:`pipeswift_lab.core.precision`). A named precision also sets the gradient bytes of the
      all-reduce (4 or 2 per parameter) and the checkpoint shard (everything but gradients).

    The search is a branch and bound: configurations are simulated in order of a JCT lower
    bound (the busiest rank's compute with no bubble), and those whose bound exceeds the
    best JCT found are listed as not simulated (``exhaustive=True`` simulates them all).
    ``throughput_best`` and ``bubble_best`` are taken among the simulated ones; the
    configuration with the smallest closed-form bubble on the best's GPU count is always
    simulated. Starting small and growing is not weighed when ``mtbf_s`` is given.

    * ``calibration`` — a :class:`~pipeswift_lab.fidelity.calibrator.Calibration`: every pipeline
      step is simulated calibrated (scaled actions, fixed costs, transfers, the runtime's step
      overhead) instead of from the raw profile;
    * ``objective`` — ``"mean"`` (the default) ranks by the expected JCT; ``"p95"`` (any ``"pNN"``, ``0 < NN < 100``)
      by the JCT each configuration finishes within with that probability, added as column ``total_s_p95``, by
      Monte Carlo with a fixed seed over the step-time dispersion ``step_cv`` (default: the calibration's, else 0)
      and preemptions at ``mtbf_s`` (:mod:`pipeswift_lab.planning.quantiles` states the model). Ranking by a
      quantile simulates every configuration (the branch and bound's bound is on the mean);
      ``Plan.ranked_by("total_s")`` shows the same table ranked by the mean;
    * ``recompute="search"`` — where a configuration's balanced split does not fit ``mem_per_gpu_bytes``, choose
      each stage's recomputation (none, selective, full) with the split, greedily for the least added time that
      fits, and every stage recomputing fully on the splits balanced within the cap and tighter caps, each lowered
      as far as it fits (:mod:`pipeswift_lab.planning.recompute_search`; AdaPipe, ASPLOS 2024), beside the split
      that moves layers to fit; the shortest simulated step wins. It needs a profile taken with
      ``profile(..., recompute=True)``; the table's ``recompute`` column says what each configuration recomputes,
      and :meth:`Plan.run_arguments` carries it (and ``precision``) to :func:`pipeswift_lab.run`;
      ``recompute="full"`` or ``"selective"`` forces that recomputation on every stage of every configuration,
      whether memory binds or not: each layer holds and takes what the profile's recompute columns say it does
      recomputed (:func:`~pipeswift_lab.planning.recompute_search.forced_costs`), the table's ``recompute`` column
      names every stage, and :meth:`Plan.run_arguments` carries it;
    * ``exhaustive`` — simulate every feasible configuration; ``progress`` — show a progress bar;
    * ``topology`` — a :class:`~pipeswift_lab.Topology`: nodes of ``gpus_per_node`` GPUs and the links inside and
      between them, on which every group of a layout is priced by where it sits (the pipeline's sends unless
      ``link`` is given, the replicas' all-reduce unless ``dp_link`` is given, FSDP's and tensor parallelism's
      collectives); ``tp`` and ``fsdp`` — the tensor-parallel and FSDP degrees to weigh (an int or ints; None: every
      one that fits, :mod:`~pipeswift_lab.planning.degrees`). With any of the three the search is 3-D: layouts
      ``P × D × fsdp × tp`` on ``gpus = P·D·fsdp·tp`` GPUs, a tensor-parallel group inside one node, ``P = 1``
      (no pipeline) weighed beside the pipelines (:mod:`~pipeswift_lab.planning.layouts`); the table gains what a
      tensor-parallel rank computes and holds (:mod:`~pipeswift_lab.planning.sharding`) and ``fsdp_ms``, FSDP's
      all-gather and reduce-scatter, once a step, not overlapped (:mod:`~pipeswift_lab.planning.placement`).
      Without any of them it weighs ``tp = fsdp = 1``, pipelines × replicas, as it always has; given ``tp`` or
      ``fsdp`` without a topology, nodes of 8 GPUs linked by NVLink-class links inside
      (:data:`~pipeswift_lab.core.topology.DEFAULT_INTRA_NODE_LINK`) and ``dp_link`` between them;
    * ``sequence_parallel`` — weigh every ``tp > 1`` layout with sequence parallelism: its activations are the
      profile's ``sp_activation_bytes`` and its collectives all-gathers and reduce-scatters of the same bytes
      (:mod:`~pipeswift_lab.planning.sharding`); :meth:`Plan.run_arguments` then gives ``tp`` as
      ``psl.TP(tp, sequence_parallel=True)``. It needs a profile whose plan allows it
      (``profile.meta["sequence_parallel"]``).

    The steps: :func:`~pipeswift_lab.planning.inputs.check_plan_inputs` (validate and resolve, once),
    :func:`evaluator_of`, then :func:`search`: :func:`~pipeswift_lab.planning.steps.enumerate_configs`,
    :func:`~pipeswift_lab.planning.steps.bound_configs`, :func:`~pipeswift_lab.planning.steps.branch_and_bound`
    and :func:`~pipeswift_lab.planning.steps.rank_table` (assemble).

    Raises ``ValueError`` when no configuration is feasible, listing the closest misses.
    """
    inputs = check_plan_inputs(
        profile,
        gpus=gpus,
        global_batch=global_batch,
        steps=steps,
        link=link,
        dp_link=dp_link,
        mem_per_gpu_bytes=mem_per_gpu_bytes,
        schedules=schedules,
        microbatch_sizes=microbatch_sizes,
        availability=availability,
        costs=costs,
        mtbf_s=mtbf_s,
        P=P,
        optimizer=optimizer,
        exhaustive=exhaustive,
        progress=progress,
        calibration=calibration,
        objective=objective,
        step_cv=step_cv,
        precision=precision,
        recompute=recompute,
        topology=topology,
        tp=tp,
        fsdp=fsdp,
        sequence_parallel=sequence_parallel,
    )
    return search(inputs, evaluator_of(inputs))


def evaluator_of(inputs: PlanInputs, *, replay: bool = False) -> Evaluator:
    """The :class:`~pipeswift_lab.planning.search.Evaluator` of checked inputs; ``replay=True`` takes every rank's
    peak memory from the action-by-action replay instead of its compiled form (the reference, far slower)."""
    return Evaluator(inputs, replay=replay)


def search(inputs: PlanInputs, evaluator: Evaluator) -> Plan:
    """The search of :func:`plan` on checked inputs (:func:`~pipeswift_lab.planning.inputs.check_plan_inputs`) with
    ``evaluator`` (:func:`evaluator_of`); returns a :class:`Plan`."""
    if inputs.three_d:
        rows, more = search_layouts(inputs, evaluator)
        return Plan(rank_table(rows, inputs, more), inputs.as_dict(), inputs.costs, inputs)
    rows, candidates = bound_configs(enumerate_configs(inputs), inputs, evaluator)
    rows = branch_and_bound(candidates, rows, inputs, evaluator)
    return Plan(rank_table(rows, inputs), inputs.as_dict(), inputs.costs, inputs)
