"""The JCT planner: the pipeline configuration that finishes the job first, queue included.

:func:`plan` searches ranks ``P`` (pipeline stages, ``P * v`` with ``v`` chunks each) × data-parallel replicas ``D`` within the GPUs, every
micro-batch size and count ``m`` that make up the global batch, every schedule (and ``v``)
with a balanced partition that fits memory, and ranks them by predicted job completion
time::

    JCT = queue + assembly + steps * step + cleanup + preemption loss
    step = simulated pipeline step + gradient all-reduce over D replicas + optimizer step

It also weighs *starting small and growing*: run on the GPUs free now, then, when more
free up, checkpoint, re-assemble on more and finish there; and *shrinking*: when GPUs a
configuration holds are taken mid-run (availability drops), it is no longer feasible as
planned, and the plan continues it on what stays free (see :mod:`._plan_strategies`).

The profile is taken at one micro-batch size ``b0`` (``profile.meta["batch_size"]``);
layer times and activation bytes are scaled linearly to other micro-batch sizes, which
overstates small micro-batches' speed (fixed per-kernel costs do not shrink) — profile at
the micro-batch size you mean to run to remove that error. Without a pipeline ``link``,
a simulated step scales exactly with the durations, so each ``(P, m, schedule, v)`` is
simulated once and rescaled.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import pandas as pd

from ..core.checks import check_int, check_time
from ..core.costs import AssemblyModel, Availability, CheckpointModel
from ..core.display import hours, html_card, text_card
from ..core.jct import JCT, TERMS
from ..core.link import Link, check_link
from ..core.precision import check_precision
from ..core.vocabulary import MULTI_CHUNK_SCHEDULES, SCHEDULES, V_SHAPE_SCHEDULES, canonical_schedule
from ..partitioning.balance import Partition, partition
from ..simulation.calibration import check_calibration
from .quantiles import check_quantile
from .search import Evaluator, MicrobatchCosts
from .steps import (
    Job,
    bound_configs,
    branch_and_bound,
    divisors,
    enumerate_configs,
    rank_table,
)  # noqa: F401

#: Data-parallel link when none is given: a 200 Gb/s network (25 GB/s) with 10 µs latency.
DEFAULT_DP_LINK = Link(latency_ms=0.01, bandwidth_GBps=25.0)
#: Memory bandwidth (GB/s) the optimizer step streams at, by profiled device type.
OPTIMIZER_MEMORY_GBps = {"cuda": 1500.0, "cpu": 20.0}


@dataclass(frozen=True)
class PlannedConfig:
    """One configuration and its predicted JCT terms (seconds) and step."""

    P: int
    D: int
    m: int
    microbatch_size: int
    schedule: str
    v: int
    queue_s: float
    assembly_s: float
    training_s: float
    cleanup_s: float
    preemption_loss_s: float
    step_ms: float
    bubble_ratio: float
    peak_mem_bytes: float
    strategy: str = "start"

    @property
    def total_s(self) -> float:
        """The predicted JCT."""
        return self.queue_s + self.assembly_s + self.training_s + self.cleanup_s + self.preemption_loss_s

    @property
    def gpus(self) -> int:
        """GPUs used: ``P * D``."""
        return self.P * self.D

    @property
    def label(self) -> str:
        """A short name: ``P4×D2 m16 1F1B``."""
        v = f" v{self.v}" if self.v > 1 else ""
        prefix = "" if self.strategy == "start" else f"{self.strategy}: "
        return f"{prefix}P{self.P}×D{self.D} m{self.m} b{self.microbatch_size} {self.schedule}{v}"

    @property
    def jct(self) -> JCT:
        """The predicted :class:`~pipeswift_lab.JCT`."""
        return JCT(
            self.queue_s, self.assembly_s, self.training_s, self.cleanup_s, self.preemption_loss_s, label=self.label
        )


def _from_row(row) -> PlannedConfig:
    ints = ("P", "D", "m", "microbatch_size", "v")
    floats = (
        "queue_s",
        "assembly_s",
        "training_s",
        "cleanup_s",
        "preemption_loss_s",
        "step_ms",
        "bubble_ratio",
        "peak_mem_bytes",
    )
    return PlannedConfig(
        **{k: int(row[k]) for k in ints}, **{k: float(row[k]) for k in floats},
        schedule=str(row["schedule"]), strategy=str(row["strategy"]),
    )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Every configuration the planner weighed, ranked by predicted JCT.

    * ``table`` — one row per configuration: the simulated feasible ones ranked by
      ``total_s``, then the feasible ones the branch and bound did not simulate (``simulated``
      False), ranked after them by ``jct_lower_bound_s`` (column ``ranked_by`` names what each
      ``rank`` is by), then the unranked rejected ones with their ``reason``; the JCT terms in the columns
      ``queue_s``, ``assembly_s``, ``training_s``, ``cleanup_s``, ``preemption_loss_s``,
      ``total_s``, and ``step_ms``, ``bubble_ratio``, ``peak_mem_bytes``; with ``quantile=0.95``
      also ``total_s_p95`` (the JCT at that quantile), and with ``objective="p95"`` ranked by it;
    * ``best`` — the shortest JCT, a :class:`PlannedConfig`;
    * ``throughput_best`` — the shortest training term; ``bubble_best`` — the smallest bubble.
    """

    table: pd.DataFrame = field(repr=False)
    inputs: dict = field(repr=False)
    costs: object = field(default=None, repr=False, compare=False)  # the MicrobatchCosts the plan used

    @property
    def feasible(self) -> pd.DataFrame:
        """The feasible, simulated rows, ranked by predicted JCT."""
        return self.table[self.table["feasible"] & self.table["simulated"]]

    def config(self, row) -> PlannedConfig:
        """The :class:`PlannedConfig` of a row of :attr:`table` (a Series or a row label)."""
        if not isinstance(row, pd.Series):
            row = self.table.loc[row]
        if not (row["feasible"] and row["simulated"]):
            raise ValueError(f"row {row.name} has no predicted JCT ({row['reason'] or 'not simulated'})")
        return _from_row(row)

    @property
    def best(self) -> PlannedConfig:
        """The configuration with the shortest predicted JCT (at the plan's ``objective``: the mean, or a quantile such as p95)."""
        return _from_row(self.feasible.iloc[0])

    @property
    def throughput_best(self) -> PlannedConfig:
        """The start-now-or-wait configuration with the shortest training term (the highest throughput)."""
        rows = self.feasible[self.feasible["strategy"] == "start"]
        return _from_row(rows.loc[rows["training_s"].idxmin()])

    @property
    def bubble_best(self) -> PlannedConfig:
        """The smallest simulated bubble (ties: shorter JCT) on as many GPUs as the best, among configurations that pipeline (P > 1).

        The search always simulates, on the best's GPU count, the configuration with the
        smallest closed-form bubble (ties: the most micro-batch chunks), the one a
        bubble-minded choice would make, so that what choosing by the bubble costs is shown.
        """
        start = self.feasible[self.feasible["strategy"] == "start"]
        rows = start[(start["P"] > 1) & (start["gpus"] == self.best.gpus)]
        if rows.empty:
            rows = start[start["P"] > 1]
        if rows.empty:
            rows = start
        return _from_row(rows.sort_values(["bubble_ratio", "total_s"], kind="stable").iloc[0])

    def partition_of(self, config) -> Partition:
        """The balanced :class:`~pipeswift_lab.Partition` of a configuration (a :class:`PlannedConfig` or a table row), ready for :func:`pipeswift_lab.run`."""
        if isinstance(config, pd.Series):
            config = _from_row(config)
        if not isinstance(config, PlannedConfig):
            raise TypeError(f"config must be a PlannedConfig or a row of Plan.table; got {type(config).__name__}")
        return partition(
            self.costs.table(config.microbatch_size), config.P, "balanced", v=config.v, schedule=config.schedule, m=config.m,
            optimizer=self.inputs["optimizer"], link=self.inputs["link"], mem_per_gpu_bytes=self.inputs["mem_per_gpu_bytes"],
            precision=self.inputs.get("precision"), D=config.D,
        )  # fmt: skip

    def run_arguments(self, row) -> dict:
        """``{"partition", "m", "schedule", "D"}`` of a ranked row (a label, a row of :attr:`table` or a :class:`PlannedConfig`):
        the keyword arguments :func:`pipeswift_lab.run` takes, so a planned configuration runs as is with a global batch
        of ``microbatch_size * m * D`` samples: ``psl.run(model, data, loss_fn, **plan.run_arguments(0), steps=...)``."""
        config = row if isinstance(row, PlannedConfig) else self.config(row)
        return {
            "partition": self.partition_of(config),
            "m": int(config.m),
            "schedule": config.schedule,
            "D": int(config.D),
        }

    def top(self, n=5) -> pd.DataFrame:
        """The ``n`` best feasible rows."""
        return self.feasible.head(n)

    def explain(self) -> str:
        """A few sentences on why the best configuration beats the bubble-best and the throughput-best."""
        best, bubble, fast = self.best, self.bubble_best, self.throughput_best
        out = [
            f"Best: {best.label} on {best.gpus} GPUs finishes in {hours(best.total_s)} "
            f"(queue {hours(best.queue_s)}, training {hours(best.training_s)}, step {best.step_ms:.4g} ms, "
            f"bubble {best.bubble_ratio:.1%})."
        ]
        if best.P == 1:
            out.append(self._why_no_pipeline(best))
        for name, other in (("bubble-best", bubble), ("throughput-best", fast)):
            if other.label == best.label:
                out.append(f"The best is also the {name} configuration.")
                continue
            diffs = {t: getattr(other, t) - getattr(best, t) for t in TERMS}
            worst = max(diffs, key=diffs.get)
            gain = [
                f"{t.removesuffix('_s')} {hours(-d)} shorter" for t, d in diffs.items() if d < -0.005 * best.total_s
            ]
            out.append(
                f"The {name} {other.label} (bubble {other.bubble_ratio:.1%}, step {other.step_ms:.4g} ms) takes "
                f"{hours(other.total_s)}, {hours(other.total_s - best.total_s)} longer: its {worst.removesuffix('_s')} "
                f"term is {hours(diffs[worst])} longer"
                + (f"; its gains ({', '.join(gain)}) do not make up for it." if gain else ".")
            )
        return " ".join(out)

    def _why_no_pipeline(self, best) -> str:
        """Why one stage (pure data parallelism) wins: it fits memory and has no bubble; what the best pipeline costs."""
        cap = self.inputs.get("mem_per_gpu_bytes")
        fits = (f"the whole model fits one GPU ({best.peak_mem_bytes / 2**30:.3g} GiB of the mem_per_gpu_bytes={cap:.4g} cap)" if cap
                else "no memory cap is given (mem_per_gpu_bytes=None), so the whole model is taken to fit one GPU")  # fmt: skip
        piped = self.feasible[(self.feasible["P"] > 1) & (self.feasible["strategy"] == "start")]
        text = f"No pipeline (P=1, {best.D} data-parallel replicas) wins because {fits}, and a pipeline only adds a bubble and stage transfers"
        if piped.empty:
            return text + "."
        other = _from_row(piped.sort_values("total_s", kind="stable").iloc[0])
        return (
            text
            + f": the best pipelined configuration, {other.label}, takes {hours(other.total_s)} ({hours(other.total_s - best.total_s)} longer)."
        )

    def plot(self, ax=None, n=5, unit="h"):
        """Stacked JCT bars of the ``n`` best configurations, the throughput-best and the bubble-best (marked). Returns the Axes."""
        configs = [_from_row(r) for _, r in self.top(n).iterrows()]
        marks = {}
        for name, extra in (("throughput-best", self.throughput_best), ("bubble-best", self.bubble_best)):
            if extra.label not in {c.label for c in configs}:
                configs.append(extra)
            marks.setdefault(extra.label, []).append(name)
        jcts = [
            JCT(
                *[getattr(c, t) for t in TERMS],
                label=c.label + (f"  [{', '.join(marks[c.label])}]" if c.label in marks else ""),
            )
            for c in configs
        ]
        ax = JCT.plot_many(jcts, ax=ax, unit=unit)
        ax.set_title("predicted JCT: best configurations vs throughput-best and bubble-best")
        return ax

    def _summary(self) -> dict:
        best = self.best
        return {
            "best": best.label,
            "JCT": hours(best.total_s),
            "step_ms": best.step_ms,
            "bubble_ratio": best.bubble_ratio,
            "configurations": f"{len(self.feasible)} simulated, {int(self.table['feasible'].sum())} feasible, {len(self.table)} weighed",
        }

    def _repr_html_(self) -> str:
        return html_card("Plan", self._summary(), self.top(10)) + f"<p>{self.explain()}</p>"

    def __str__(self) -> str:
        return text_card("Plan", self._summary())

    def __repr__(self) -> str:
        return f"Plan(best={self.best.label!r}, total_s={self.best.total_s:.6g}, configurations={len(self.table)})"


# --------------------------------------------------------------------------- inputs


def _candidates(name, values, default, minimum=1):
    if values is None:
        return list(default)
    if isinstance(values, numbers.Integral):
        values = [values]
    out = sorted({check_int(f"{name}[{i}]", x, minimum=minimum) for i, x in enumerate(values)})
    if not out:
        raise ValueError(f"{name} is empty; give at least one value")
    return out


def _stage_choices(schedules) -> list[tuple[str, int]]:
    if not isinstance(schedules, str) and hasattr(schedules, "__len__") and len(schedules) == 0:
        raise ValueError(
            f"schedules={list(schedules)!r} is empty; give at least one of {list(SCHEDULES)}, or None for all of them"
        )
    out = []
    for s in schedules:
        s = canonical_schedule(s)
        if s in V_SHAPE_SCHEDULES:
            out.append((s, 2))
        elif s in MULTI_CHUNK_SCHEDULES:
            out += [(s, 2), (s, 4)]
        else:
            out.append((s, 1))
    return out


# --------------------------------------------------------------------------- search


def plan(
    profile,
    gpus,
    global_batch,
    steps,
    *,
    link=None,
    dp_link=None,
    mem_per_gpu_bytes=None,
    schedules=None,
    microbatch_sizes=None,
    availability=None,
    assembly=None,
    checkpoint=None,
    mtbf_s=None,
    P=None,
    optimizer="adam",
    exhaustive=False,
    progress=True,
    calibration=None,
    quantile=None,
    objective="mean",
    step_cv=None,
    precision=None,
) -> Plan:
    """Rank every feasible pipeline configuration by predicted job completion time; return a :class:`Plan`.

    * ``profile`` — a :class:`~pipeswift_lab.Profile` (or per-layer DataFrame) taken at
      micro-batch size ``profile.meta["batch_size"]``, or a list of Profiles of the same
      model at several sizes (times are then interpolated between them, see
      :class:`~pipeswift_lab.planning.search.MicrobatchCosts`);
    * ``gpus`` — the most GPUs the job may use; ``global_batch`` — samples per step;
      ``steps`` — training steps;
    * ``link`` — pipeline point-to-point :class:`~pipeswift_lab.Link` (None: free);
      ``dp_link`` — the data-parallel all-reduce link (default :data:`DEFAULT_DP_LINK`);
    * ``mem_per_gpu_bytes`` — memory cap per GPU; ``schedules`` — names to consider (default
      all); ``microbatch_sizes`` — candidates (default: the smallest profiled size times
      powers of two, up to the global batch); ``P`` — stage counts to consider (default: every divisor of the layer count
      and every power of two up to it);
    * ``availability`` — free GPUs over time, ``[(seconds_from_now, free_gpus), ...]``
      (default: ``gpus`` free now); ``assembly`` — an :class:`~pipeswift_lab.core.costs.AssemblyModel`
      (or RunResults / ``(P, assembly_s)`` pairs to calibrate one); ``checkpoint`` — a
      :class:`~pipeswift_lab.core.costs.CheckpointModel`;
    * ``mtbf_s`` — mean time between preemptions of *one GPU*; a job on ``N`` GPUs is
      preempted every ``mtbf_s / N`` on average and checkpoints at the Young/Daly interval;
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

    * ``calibration`` — a :class:`~pipeswift_lab.fidelity.calibrator.Calibration`: every pipeline step
      is simulated calibrated (scaled actions, fixed costs, transfers, the runtime's step
      overhead) instead of from the raw profile;
    * ``quantile`` (e.g. 0.95) — also the JCT each configuration finishes within with that
      probability, column ``total_s_p95``, by Monte Carlo with a fixed seed over the step-time
      dispersion ``step_cv`` (default: the calibration's, else 0) and preemptions at ``mtbf_s``
      (:mod:`pipeswift_lab.planning.quantiles` states the model); ``objective="p95"`` ranks by it
      (``"mean"``, the default, by the expected JCT). Ranking by a quantile simulates every
      configuration: the branch and bound's bound is on the mean.

    Raises ``ValueError`` when no configuration is feasible, listing the closest misses.
    """
    costs = MicrobatchCosts(profile)
    n_layers, b0 = costs.n_layers, costs.b0
    gpus = check_int("gpus", gpus, minimum=1)
    global_batch = check_int("global_batch", global_batch, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    link = check_link(link)
    dp_link = DEFAULT_DP_LINK if dp_link is None else check_link(dp_link)
    if mem_per_gpu_bytes is not None:
        mem_per_gpu_bytes = check_time("mem_per_gpu_bytes", mem_per_gpu_bytes, allow_zero=False)
    if mtbf_s is not None:
        mtbf_s = check_time("mtbf_s", mtbf_s, allow_zero=False)
    stage_choices = _stage_choices(
        SCHEDULES if schedules is None else ([schedules] if isinstance(schedules, str) else schedules)
    )
    default_P = sorted({d for d in divisors(n_layers)} | {2**k for k in range(12) if 2**k <= n_layers})
    Ps = [p for p in _candidates("P", P, default_P) if p <= min(n_layers, gpus)]
    if not Ps:
        raise ValueError(f"P={P} leaves no stage count <= min(layers={n_layers}, gpus={gpus})")
    # by default never below the smallest profiled size, where proportional scaling would be optimistic
    if microbatch_sizes is None and global_batch < b0:
        raise ValueError(
            f"global_batch={global_batch} is smaller than the profiled micro-batch size {b0} (profile.meta['batch_size']); "
            f"give global_batch >= {b0}, or microbatch_sizes= that divide it (times then scale down from the profiled size)"
        )
    mb_sizes = _candidates(
        "microbatch_sizes", microbatch_sizes, [b0 * 2**k for k in range(20) if b0 * 2**k <= global_batch]
    )
    availability = Availability.now(gpus) if availability is None else Availability(availability)
    if isinstance(assembly, AssemblyModel) or assembly is None:
        assembly = assembly or AssemblyModel()
    else:
        assembly = AssemblyModel.calibrate(assembly)
    checkpoint = checkpoint or CheckpointModel()
    if not isinstance(checkpoint, CheckpointModel):
        raise TypeError(
            f"checkpoint must be a pipeswift_lab.core.costs.CheckpointModel or None; got {type(checkpoint).__name__}"
        )
    mem_GBps = OPTIMIZER_MEMORY_GBps.get(costs.device, OPTIMIZER_MEMORY_GBps["cuda"])
    calibration = check_calibration(calibration)
    quantile, rank_by = check_quantile(quantile, objective)
    if step_cv is None:
        step_cv = calibration.step_cv if calibration is not None and math.isfinite(calibration.step_cv) else 0.0
    step_cv = check_time("step_cv", step_cv)
    exhaustive = exhaustive or rank_by != "total_s"
    precision = check_precision(precision)
    evaluator = Evaluator(costs, link, mem_per_gpu_bytes, optimizer, calibration, precision)
    job = Job(n_layers, gpus, global_batch, steps, availability, assembly, checkpoint, mtbf_s, optimizer, precision, dp_link, mem_GBps,
              mem_per_gpu_bytes, tuple(mb_sizes))  # fmt: skip

    combos = enumerate_configs(Ps, stage_choices, job)
    rows, candidates = bound_configs(combos, job, evaluator)
    rows = branch_and_bound(candidates, rows, job, evaluator, exhaustive, progress)
    out = rank_table(rows, job, quantile, step_cv, rank_by)
    inputs = {
        "gpus": gpus, "global_batch": global_batch, "steps": steps, "availability": availability.points,
        "profiled_batch_sizes": costs.sizes, "optimizer": optimizer, "precision": precision, "link": link, "mem_per_gpu_bytes": mem_per_gpu_bytes,
        "calibration": calibration, "quantile": quantile, "objective": objective, "step_cv": step_cv,
    }  # fmt: skip
    return Plan(out, inputs, costs)
