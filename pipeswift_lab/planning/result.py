"""What :func:`~pipeswift_lab.planning.planner.plan` returns: a :class:`Plan` (every configuration weighed, ranked),
whose rows read as :class:`PlannedConfig` values."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..core.display import hours, html_card, text_card
from ..core.jct import JCT, TERMS
from ..partitioning.balance import partition
from ..partitioning.stages import Partition
from ..profiling.table import Profile
from .costs import MicrobatchCosts
from .explanation import layout_comparisons, versus, why_no_pipeline
from .placement import pipeline_link
from .planned_config import PlannedConfig
from .pricing import bounds_of
from .strategies import HOLDING, STRATEGIES, check_strategy

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.axes import Axes

    from ..frameworks import ImportedConfig
    from .inputs import PlanInputs

__all__ = ["Plan", "PlannedConfig"]  # PlannedConfig lives in .planned_config


@dataclass(frozen=True)
class Plan:
    """Every configuration the planner weighed, ranked by predicted JCT.

    * ``table`` — one row per configuration: its ``strategy`` (``"now"``: start now on GPUs free now, one
      configuration to the end; ``"wait"``: wait for the GPUs, ``queue_s > 0``, then one configuration; ``"grow"`` and
      ``"shrink"``: change configuration once, as the ``change`` column says; :meth:`strategy_rows` selects them);
      the simulated feasible ones ranked by
      ``total_s``, then the feasible ones the branch and bound did not simulate (``simulated``
      False), ranked after them by ``jct_lower_bound_s`` (column ``ranked_by`` names what each
      ``rank`` is by), then the unranked rejected ones with their ``reason``; the JCT terms in the columns
      ``queue_s``, ``assembly_s``, ``training_s``, ``cleanup_s``, ``preemption_loss_s``,
      ``total_s``, and ``step_ms``, ``bubble_ratio``, ``peak_mem_bytes``; with ``objective="p95"`` also
      ``total_s_p95`` (the JCT at that quantile), ranked by it (:meth:`ranked_by` ranks by another column);
    * ``best`` — the shortest JCT, a :class:`PlannedConfig`;
    * ``throughput_best`` — the shortest training term; ``bubble_best`` — the smallest bubble.
    """

    table: pd.DataFrame = field(repr=False)
    inputs: dict[str, Any] = field(repr=False)
    costs: MicrobatchCosts | None = field(default=None, repr=False, compare=False)
    """The per-layer costs the plan used (what :meth:`partition_of` splits)."""
    checked: PlanInputs | None = field(default=None, repr=False, compare=False)
    """The checked inputs the plan searched with (what :meth:`price`, :meth:`compare` and :meth:`export` price
    with)."""

    @property
    def feasible(self) -> pd.DataFrame:
        """The feasible, simulated rows, ranked by predicted JCT."""
        return self.table[self.table["feasible"] & self.table["simulated"]]

    def config(self, row: pd.Series | Hashable) -> PlannedConfig:
        """The :class:`PlannedConfig` of a row of :attr:`table` (a Series or a row label)."""
        if not isinstance(row, pd.Series):
            row = self.table.loc[row]
        if not (row["feasible"] and row["simulated"]):
            raise ValueError(f"row {row.name} has no predicted JCT ({row['reason'] or 'not simulated'})")
        return PlannedConfig.from_row(row)

    def strategy_rows(self, *names: str) -> pd.DataFrame:
        """The feasible, simulated rows of the named strategies (``"now"``, ``"wait"``, ``"grow"``, ``"shrink"``;
        all four when none is named), ranked. Raises ``ValueError`` on any other name, saying what the old
        ``"start"`` became."""
        wanted = [check_strategy(name) for name in names] or list(STRATEGIES)
        return self.feasible[self.feasible["strategy"].isin(wanted)]

    def ranked_by(self, column: str) -> Plan:
        """This plan with its simulated feasible rows ranked by ``column`` (ties: fewer GPUs, then the shorter step),
        e.g. ``"total_s"`` for the expected JCT of a plan ranked by ``objective="p95"``; :attr:`best` follows."""
        if column not in self.table.columns:
            raise ValueError(f"column={column!r} is not a column of the plan's table; give one of {list(self.table)}")
        feasible = self.feasible.sort_values([column, "gpus", "step_ms"], kind="stable")
        table = pd.concat([feasible, self.table.drop(feasible.index)])
        table["rank"] = pd.array(
            list(range(1, len(feasible) + 1)) + list(table["rank"].iloc[len(feasible) :]), dtype="Int64"
        )
        table["ranked_by"] = [column] * len(feasible) + list(table["ranked_by"].iloc[len(feasible) :])
        return dataclasses.replace(self, table=table.reset_index(drop=True))

    @property
    def best(self) -> PlannedConfig:
        """The configuration with the shortest predicted JCT (at the plan's ``objective``: the mean, or a quantile
        such as p95)."""
        return PlannedConfig.from_row(self.feasible.iloc[0])

    @property
    def throughput_best(self) -> PlannedConfig:
        """The configuration held from start to end (strategy ``now`` or ``wait``) with the shortest training term (the
        highest throughput)."""
        rows = self.strategy_rows(*HOLDING)
        return PlannedConfig.from_row(rows.loc[rows["training_s"].idxmin()])

    @property
    def bubble_best(self) -> PlannedConfig:
        """The smallest simulated bubble (ties: shorter JCT) on as many GPUs as the best, among configurations that
        pipeline (P > 1).

        The search always simulates, on the best's GPU count, the configuration with the
        smallest closed-form bubble (ties: the most micro-batch chunks), the one a
        bubble-minded choice would make, so that what choosing by the bubble costs is shown.
        """
        start = self.strategy_rows(*HOLDING)
        rows = start[(start["P"] > 1) & (start["gpus"] == self.best.gpus)]
        if rows.empty:
            rows = start[start["P"] > 1]
        if rows.empty:
            rows = start
        return PlannedConfig.from_row(rows.sort_values(["bubble_ratio", "total_s"], kind="stable").iloc[0])

    def partition_of(self, config: PlannedConfig | pd.Series) -> Partition:
        """The balanced :class:`~pipeswift_lab.Partition` of a configuration (a :class:`PlannedConfig` or a table
        row), ready for :func:`pipeswift_lab.run`."""
        if isinstance(config, pd.Series):
            config = PlannedConfig.from_row(config)
        if not isinstance(config, PlannedConfig):
            raise TypeError(f"config must be a PlannedConfig or a row of Plan.table; got {type(config).__name__}")
        if self.costs is None:
            raise ValueError("this Plan holds no costs (Plan.costs is None); plan again to split its configurations")
        if config.recompute:  # the split found with each stage's recomputation
            return self._recomputed_partition(config)
        if config.stage_bounds:  # a tensor-parallel or FSDP layout's own split, found on what one of its ranks holds
            return Partition.from_bounds(
                self.costs.table(config.microbatch_size),
                bounds_of(config.stage_bounds),
                v=config.v,
                schedule=config.schedule,
                m=config.m,
                optimizer=self.inputs["optimizer"],
                link=pipeline_link(
                    self.inputs["link"], self.inputs.get("topology"), (config.P, config.D, config.fsdp, config.tp)
                ),
                precision=self.inputs.get("precision"),
                D=config.D,
            )
        return partition(
            self.costs.table(config.microbatch_size),
            config.P,
            "balanced",
            v=config.v,
            schedule=config.schedule,
            m=config.m,
            optimizer=self.inputs["optimizer"],
            link=self.inputs["link"],
            mem_per_gpu_bytes=self.inputs["mem_per_gpu_bytes"],
            precision=self.inputs.get("precision"),
            D=config.D,
        )

    def _recomputed_partition(self, config: PlannedConfig) -> Partition:
        """The split a recomputing configuration found, its layers as they cost recomputed: times at its micro-batch
        size, bytes as the nearest profile measured them (its ``meta["batch_size"]`` scales them, as the search did)."""
        assert self.costs is not None
        b, nearest = config.microbatch_size, self.costs.nearest(config.microbatch_size)
        df = self.costs.tables[nearest].copy()
        at_b = self.costs.table(b)
        for column in ("fwd_ms", "bwd_ms", "wgrad_ms"):
            if column in df.columns:
                df[column] = at_b[column]
        for column in ("recompute_ms", "selective_recompute_ms"):
            df[column] = df[column] * (b / nearest)
        df["total_ms"] = df["fwd_ms"] + df["bwd_ms"]
        bounds = bounds_of(config.stage_bounds)
        names = [str(n) for n in df["name"]]
        chosen = config.recompute_by_stage()
        by_layer = {names[i]: chosen[s] for s, (a, e) in enumerate(bounds) if s in chosen for i in range(a, e)}
        profile = Profile(df, {**self.costs.metas[nearest], "batch_size": nearest})
        return Partition.from_bounds(
            profile.with_recompute(by_layer),
            bounds,
            v=config.v,
            schedule=config.schedule,
            m=config.m,
            optimizer=self.inputs["optimizer"],
            link=self.inputs["link"],
            precision=self.inputs.get("precision"),
            D=config.D,
        )

    def run_arguments(self, row: PlannedConfig | pd.Series | Hashable) -> dict[str, Any]:
        """``{"partition", "m", "schedule", "D", "fsdp", "tp"}`` (and ``recompute``, ``precision`` where the plan has
        them) of a ranked row (a label, a row of :attr:`table` or a
        :class:`PlannedConfig`): the keyword arguments :func:`pipeswift_lab.run` takes, so a planned configuration
        runs as is with a global batch of ``microbatch_size * m * D * fsdp`` samples on ``P * D * fsdp * tp``
        processes: ``psl.run(model, data, loss_fn, **plan.run_arguments(0), steps=...)``. A plan weighed with
        sequence parallelism gives ``tp`` as ``psl.TP(tp, sequence_parallel=True)`` where ``tp > 1``."""
        config = row if isinstance(row, PlannedConfig) else self.config(row)
        args: dict[str, Any] = {
            "partition": self.partition_of(config),
            "m": int(config.m),
            "schedule": config.schedule,
            "D": int(config.D),
            "fsdp": int(config.fsdp),
            "tp": int(config.tp),
        }
        if self.inputs.get("sequence_parallel") and config.tp > 1:
            from ..core.tp_plan import TP

            args["tp"] = TP(int(config.tp), sequence_parallel=True)
        if config.recompute:
            args["recompute"] = config.recompute_by_stage()
        if self.inputs.get("precision") is not None:
            args["precision"] = self.inputs["precision"]
        return args

    def price(self, config: PlannedConfig | ImportedConfig) -> PlannedConfig:
        """``config`` (a configuration of this plan or a framework's, :func:`pipeswift_lab.frameworks.read`) priced
        as written with this plan's inputs: its JCT terms, step and each rank's peak; its split in ``stage_bounds``
        (:mod:`~pipeswift_lab.planning.pricing`). A global batch other than the plan's trains as many steps as make
        the same samples."""
        from .handoff import price

        return price(self, config)

    def compare(self, imported: ImportedConfig | PlannedConfig) -> pd.DataFrame:
        """Your configuration (read with :func:`pipeswift_lab.frameworks.read`) beside the plan's best: rows
        ``"plan's best"``, ``"yours"`` and ``"yours - best"``; columns ``label``, the layout, ``global_batch``,
        ``steps``, the JCT terms, ``total_s``, ``step_ms``, ``bubble_ratio``, ``peak_mem_bytes`` (per GPU) and
        ``fits`` (within ``mem_per_gpu_bytes``)."""
        from .handoff import compare

        return compare(self, imported)

    def export(
        self,
        framework: str,
        config: PlannedConfig | pd.Series | Hashable | None = None,
        *,
        model_config: Any = None,
        seq_len: int | None = None,
        path: str | Path | None = None,
        strict: bool = False,
    ) -> Any:
        """A configuration (default :attr:`best`; a row or label of :attr:`table`) in the terms of the framework you
        train with, written to ``path`` if given (:mod:`pipeswift_lab.frameworks`):

        * ``"torchtitan"`` — the Python source of a module defining ``config()`` (torchtitan 0.3 and later);
          ``"torchtitan-toml"`` — a TOML ``JobConfig`` (0.2.2 and earlier);
        * ``"megatron"`` — Megatron-LM's command-line arguments, a list;
        * ``"deepspeed"`` — ``{"ds_config": {...}, "pipeline_module": {...}}``, the JSON configuration and
          ``PipelineModule``'s arguments.

        ``model_config`` is the Hugging Face config or a :class:`~pipeswift_lab.TransformerSpec` (default: what the
        profile recorded); ``seq_len`` the sequence length (default: the profile's). The split, every degree, ``m``,
        the micro-batch size, the schedule, recomputation and precision are carried where the framework expresses
        them; where it cannot, the nearest configuration it can run is exported with an
        :class:`~pipeswift_lab.frameworks.ExportWarning` naming what changed and its predicted cost (``strict=True``
        raises ``ValueError`` instead). Raises ``ValueError`` for a framework not known, layers a framework does not
        name (the first one), and what the framework refuses."""
        from .handoff import export

        chosen = None if config is None else config if isinstance(config, PlannedConfig) else self.config(config)
        return export(self, framework, chosen, model_config, seq_len, path, strict)

    def top(self, n: int = 5) -> pd.DataFrame:
        """The ``n`` best feasible rows."""
        return self.feasible.head(n)

    def explain(self) -> str:
        """A few sentences on why the best configuration beats the bubble-best and the throughput-best."""
        best = self.best
        out = [
            f"Best: {best.label} on {best.gpus} GPUs finishes in {hours(best.total_s)} "
            f"(queue {hours(best.queue_s)}, training {hours(best.training_s)}, step {best.step_ms:.4g} ms, "
            f"bubble {best.bubble_ratio:.1%})."
        ]
        if best.P == 1:
            out.append(why_no_pipeline(self, best))
        for name, other in (("bubble-best", self.bubble_best), ("throughput-best", self.throughput_best)):
            out.append(versus(best, name, other))
        if self.inputs.get("three_d"):
            out += layout_comparisons(self, best)
        return " ".join(out)

    def plot(self, ax: Axes | None = None, n: int = 5, unit: str = "h") -> Axes:
        """Stacked JCT bars of the ``n`` best configurations, the throughput-best and the bubble-best (marked).
        Returns the Axes."""
        configs = [PlannedConfig.from_row(r) for _, r in self.top(n).iterrows()]
        marks: dict[str, list[str]] = {}
        for name, extra in (("throughput-best", self.throughput_best), ("bubble-best", self.bubble_best)):
            if extra.label not in {c.label for c in configs}:
                configs.append(extra)
            marks.setdefault(extra.label, []).append(name)
        jcts = [
            JCT(
                **{t: getattr(c, t) for t in TERMS},
                label=c.label + (f"  [{', '.join(marks[c.label])}]" if c.label in marks else ""),
            )
            for c in configs
        ]
        ax = JCT.plot_many(jcts, ax=ax, unit=unit)
        ax.set_title("predicted JCT: best configurations vs throughput-best and bubble-best")
        return ax

    def _summary(self) -> dict[str, Any]:
        best = self.best
        weighed = (
            f"{len(self.feasible)} simulated, {int(self.table['feasible'].sum())} feasible, {len(self.table)} weighed"
        )
        return {
            "best": best.label,
            "JCT": hours(best.total_s),
            "step_ms": best.step_ms,
            "bubble_ratio": best.bubble_ratio,
            "configurations": weighed,
        }

    def _repr_html_(self) -> str:
        return html_card("Plan", self._summary(), self.top(10)) + f"<p>{self.explain()}</p>"

    def __str__(self) -> str:
        return text_card("Plan", self._summary())

    def __repr__(self) -> str:
        return f"Plan(best={self.best.label!r}, total_s={self.best.total_s:.6g}, configurations={len(self.table)})"
