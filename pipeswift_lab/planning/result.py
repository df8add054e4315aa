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
from ..core.schedule import Schedule, ScheduleLike
from ..partitioning.balance import partition
from ..partitioning.stages import Partition
from ..profiling.table import Profile
from .costs import MicrobatchCosts
from .placement import layout_name, pipeline_link
from .strategies import HOLDING, STRATEGIES, check_strategy

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Plan", "PlannedConfig"]


@dataclass(frozen=True)
class PlannedConfig:
    """One configuration and its predicted JCT terms (seconds) and step.

    ``strategy`` is one of :data:`~pipeswift_lab.planning.strategies.STRATEGIES` (``"now"``, ``"wait"``, ``"grow"``,
    ``"shrink"``); for a move (grow, shrink), ``change`` says when and from which configuration, and the other fields
    are the configuration it finishes on.
    """

    P: int
    D: int
    m: int
    microbatch_size: int
    schedule: ScheduleLike
    v: int
    queue_s: float
    assembly_s: float
    training_s: float
    cleanup_s: float
    preemption_loss_s: float
    step_ms: float
    bubble_ratio: float
    peak_mem_bytes: float
    strategy: str = "now"
    change: str = ""
    recompute: str = ""
    """The stages that recompute and how, ``"0:full 1:selective"`` (``""``: none; ``plan(recompute="search")``)."""
    stage_bounds: str = ""
    """The split the search weighed where it is not the profile's balanced one, ``"0-3 3-7"``: a recomputing
    configuration's, or a tensor-parallel or FSDP layout's, found on the memory one of its ranks holds (``""``: the
    balanced split)."""
    tp: int = 1
    """Tensor-parallel ranks of each stage (``tp`` adjacent ranks inside a node)."""
    fsdp: int = 1
    """FSDP shards of each replica (HSDP with ``D > 1``)."""

    def __post_init__(self) -> None:
        check_strategy(self.strategy)

    @property
    def total_s(self) -> float:
        """The predicted JCT."""
        return self.queue_s + self.assembly_s + self.training_s + self.cleanup_s + self.preemption_loss_s

    @property
    def gpus(self) -> int:
        """GPUs used: ``P * D * fsdp * tp``."""
        return self.P * self.D * self.fsdp * self.tp

    @property
    def label(self) -> str:
        """A short name: ``P4×D2 m16 b2 1F1B`` (``P4×D2×fsdp4×tp8 ...`` where FSDP or tensor parallelism is used,
        ``... 1F1B recompute 0:full`` where stages recompute); a move's starts with its strategy and change,
        ``grow at 2.00 h from P4×D2 m32 b2 1F1B: P4×D4 m16 b2 1F1B``."""
        v = f" v{self.v}" if self.v > 1 else ""
        prefix = "" if self.strategy in HOLDING else f"{self.strategy} {self.change}: "
        recompute = f" recompute {self.recompute}" if self.recompute else ""
        return (
            f"{prefix}{layout_name(self.P, self.D, self.fsdp, self.tp)} m{self.m} b{self.microbatch_size} "
            f"{self.schedule}{v}{recompute}"
        )

    @property
    def jct(self) -> JCT:
        """The predicted :class:`~pipeswift_lab.JCT`."""
        return JCT(
            self.queue_s, self.assembly_s, self.training_s, self.cleanup_s, self.preemption_loss_s, label=self.label
        )

    @classmethod
    def from_row(cls, row: pd.Series) -> PlannedConfig:
        """The configuration of a row of :attr:`Plan.table`."""
        ints = ("P", "D", "m", "microbatch_size", "v")
        floats = ("step_ms", "bubble_ratio", "peak_mem_bytes", *TERMS)
        values: dict[str, Any] = {k: int(row[k]) for k in ints} | {k: float(row[k]) for k in floats}
        for k in ("tp", "fsdp"):  # a table saved before the 3-D search has neither: 1
            value = row.get(k, 1)
            values[k] = 1 if pd.isna(value) else int(value)

        def text(key: str) -> str:
            value = row.get(key, "")
            return value if isinstance(value, str) else ""

        return cls(
            **values,
            schedule=row["order"] if isinstance(row.get("order"), Schedule) else str(row["schedule"]),
            strategy=str(row["strategy"]),
            change=text("change"),
            recompute=text("recompute"),
            stage_bounds=text("stage_bounds"),
        )

    def recompute_by_stage(self) -> dict[int, str]:
        """``{stage: "full" | "selective"}`` of the stages that recompute (what :func:`pipeswift_lab.run` takes)."""
        return {int(s): mode for s, mode in (item.split(":") for item in self.recompute.split())}


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
                _bounds_of(config.stage_bounds),
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
        bounds = _bounds_of(config.stage_bounds)
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
            out.append(self._why_no_pipeline(best))
        for name, other in (("bubble-best", self.bubble_best), ("throughput-best", self.throughput_best)):
            out.append(_versus(best, name, other))
        if self.inputs.get("three_d"):
            out += self._layout_comparisons(best)
        return " ".join(out)

    def _layout_comparisons(self, best: PlannedConfig) -> list[str]:
        """A 3-D plan's comparisons of the best with the best without a pipeline (``P = 1``) and the best without
        tensor parallelism (``tp = 1``): their JCT and step, or why none of them runs."""
        out = []
        classes = [("P", "without a pipeline (P=1)", best.P == 1, "The best has no pipeline.")]
        if max(self.inputs.get("tp", (1,))) > 1:
            classes.append(
                ("tp", "without tensor parallelism (tp=1)", best.tp == 1, "The best uses no tensor parallelism.")
            )
        else:
            out.append("Tensor parallelism was not weighed (tp=1 alone: the profile or tp= allows no other degree).")
        held = self.strategy_rows(*HOLDING)
        for column, name, is_best, same in classes:
            rows = held[held[column] == 1]
            if is_best and (best.strategy in HOLDING or rows.empty):
                out.append(same)
            elif not rows.empty:
                other = PlannedConfig.from_row(rows.sort_values(["total_s", "gpus", "step_ms"], kind="stable").iloc[0])
                out.append(_versus(best, f"best {name}", other))
            else:
                out.append(self._none_runs(column, name))
        return out

    def _none_runs(self, column: str, name: str) -> str:
        """Why no configuration of a class (``column == 1``) has a predicted JCT: out of memory (the most sharded one's
        reason), or their most common reasons."""
        rows = self.table[self.table[column] == 1]
        if rows.empty:
            return f"No configuration {name} was weighed."
        memory = rows["reason"].str.contains("GiB per GPU|mem_per_gpu_bytes=", regex=True)
        if memory.all():
            sharded = rows.assign(_shards=rows["fsdp"] * rows["tp"]).sort_values(["_shards", "gpus"], kind="stable")
            widest = sharded.iloc[-1]
            cap = self.inputs.get("mem_per_gpu_bytes")
            return (
                f"No configuration {name} fits mem_per_gpu_bytes={cap:.4g}: none of the {len(rows)} weighed does; the "
                f"most sharded, {PlannedConfig.from_row(widest.fillna(0.0)).label}, {widest['reason']}."
            )
        reasons = rows["reason"].value_counts().head(2)
        why = "; ".join(f"{k} ({v} of {len(rows)})" for k, v in reasons.items())
        return f"No configuration {name} runs: {why}."

    def _why_no_pipeline(self, best: PlannedConfig) -> str:
        """Why one stage (pure data parallelism) wins: it fits memory and has no bubble; what the best pipeline
        costs."""
        cap = self.inputs.get("mem_per_gpu_bytes")
        shards = " ".join(f"{k}={n}" for k, n in (("fsdp", best.fsdp), ("tp", best.tp)) if n > 1)
        if cap:
            whole = f"the whole model fits one GPU as {shards} shards" if shards else "the whole model fits one GPU"
            fits = f"{whole} ({best.peak_mem_bytes / 2**30:.3g} GiB of the mem_per_gpu_bytes={cap:.4g} cap)"
        else:
            fits = "no memory cap is given (mem_per_gpu_bytes=None), so the whole model is taken to fit one GPU"
        held = self.strategy_rows(*HOLDING)
        piped = held[held["P"] > 1]
        sharded = "".join(f", {k}={n}" for k, n in (("fsdp", best.fsdp), ("tp", best.tp)) if n > 1)
        text = (
            f"No pipeline (P=1, {best.D} data-parallel replicas{sharded}) wins because {fits}, and a pipeline only "
            f"adds a bubble and stage transfers"
        )
        if piped.empty:
            return text + "."
        other = PlannedConfig.from_row(piped.sort_values("total_s", kind="stable").iloc[0])
        return (
            f"{text}: the best pipelined configuration, {other.label}, takes {hours(other.total_s)} "
            f"({hours(other.total_s - best.total_s)} longer)."
        )

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


def _bounds_of(stage_bounds: str) -> list[tuple[int, ...]]:
    """The ``(start, end)`` pairs of a ``stage_bounds`` text, ``"0-3 3-7"``."""
    return [tuple(int(x) for x in item.split("-")) for item in stage_bounds.split()]


def _versus(best: PlannedConfig, name: str, other: PlannedConfig) -> str:
    """One sentence on what ``other`` (the bubble-best or the throughput-best) loses against ``best``."""
    if other.label == best.label:
        return f"The best is also the {name} configuration."
    diffs = {t: getattr(other, t) - getattr(best, t) for t in TERMS}
    worst = max(diffs, key=lambda t: diffs[t])
    gain = [f"{t.removesuffix('_s')} {hours(-d)} shorter" for t, d in diffs.items() if d < -0.005 * best.total_s]
    return (
        f"The {name} {other.label} (bubble {other.bubble_ratio:.1%}, step {other.step_ms:.4g} ms) takes "
        f"{hours(other.total_s)}, {hours(other.total_s - best.total_s)} longer: its {worst.removesuffix('_s')} "
        f"term is {hours(diffs[worst])} longer"
        + (f"; its gains ({', '.join(gain)}) do not make up for it." if gain else ".")
    )
