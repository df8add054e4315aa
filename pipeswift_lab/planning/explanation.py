"""The sentences of :meth:`Plan.explain <pipeswift_lab.planning.result.Plan.explain>`: why the best configuration
beats the bubble-best, the throughput-best, the best without a pipeline and the best without tensor parallelism."""

from __future__ import annotations

from typing import Any, Protocol

import pandas as pd

from ..core.display import hours
from ..core.jct import TERMS
from .planned_config import PlannedConfig
from .strategies import HOLDING


class Plan(Protocol):
    """What the explanation reads of a :class:`~pipeswift_lab.planning.result.Plan`."""

    @property
    def table(self) -> pd.DataFrame: ...
    @property
    def inputs(self) -> dict[str, Any]: ...
    def strategy_rows(self, *names: str) -> pd.DataFrame: ...


__all__ = ["layout_comparisons", "none_runs", "versus", "why_no_pipeline"]


def layout_comparisons(plan: Plan, best: PlannedConfig) -> list[str]:
    """A 3-D plan's comparisons of the best with the best without a pipeline (``P = 1``) and the best without
    tensor parallelism (``tp = 1``): their JCT and step, or why none of them runs."""
    out = []
    classes = [("P", "without a pipeline (P=1)", best.P == 1, "The best has no pipeline.")]
    if max(plan.inputs.get("tp", (1,))) > 1:
        classes.append(
            ("tp", "without tensor parallelism (tp=1)", best.tp == 1, "The best uses no tensor parallelism.")
        )
    else:
        out.append("Tensor parallelism was not weighed (tp=1 alone: the profile or tp= allows no other degree).")
    held = plan.strategy_rows(*HOLDING)
    for column, name, is_best, same in classes:
        rows = held[held[column] == 1]
        if is_best and (best.strategy in HOLDING or rows.empty):
            out.append(same)
        elif not rows.empty:
            other = PlannedConfig.from_row(rows.sort_values(["total_s", "gpus", "step_ms"], kind="stable").iloc[0])
            out.append(versus(best, f"best {name}", other))
        else:
            out.append(none_runs(plan, column, name))
    return out


def none_runs(plan: Plan, column: str, name: str) -> str:
    """Why no configuration of a class (``column == 1``) has a predicted JCT: out of memory (the most sharded one's
    reason), or their most common reasons."""
    rows = plan.table[plan.table[column] == 1]
    if rows.empty:
        return f"No configuration {name} was weighed."
    memory = rows["reason"].str.contains("GiB per GPU|mem_per_gpu_bytes=", regex=True)
    if memory.all():
        sharded = rows.assign(_shards=rows["fsdp"] * rows["tp"]).sort_values(["_shards", "gpus"], kind="stable")
        widest = sharded.iloc[-1]
        cap = plan.inputs.get("mem_per_gpu_bytes")
        return (
            f"No configuration {name} fits mem_per_gpu_bytes={cap:.4g}: none of the {len(rows)} weighed does; the "
            f"most sharded, {PlannedConfig.from_row(widest.fillna(0.0)).label}, {widest['reason']}."
        )
    reasons = rows["reason"].value_counts().head(2)
    why = "; ".join(f"{k} ({v} of {len(rows)})" for k, v in reasons.items())
    return f"No configuration {name} runs: {why}."


def why_no_pipeline(plan: Plan, best: PlannedConfig) -> str:
    """Why one stage (pure data parallelism) wins: it fits memory and has no bubble; what the best pipeline
    costs."""
    cap = plan.inputs.get("mem_per_gpu_bytes")
    shards = " ".join(f"{k}={n}" for k, n in (("fsdp", best.fsdp), ("tp", best.tp)) if n > 1)
    if cap:
        whole = f"the whole model fits one GPU as {shards} shards" if shards else "the whole model fits one GPU"
        fits = f"{whole} ({best.peak_mem_bytes / 2**30:.3g} GiB of the mem_per_gpu_bytes={cap:.4g} cap)"
    else:
        fits = "no memory cap is given (mem_per_gpu_bytes=None), so the whole model is taken to fit one GPU"
    held = plan.strategy_rows(*HOLDING)
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


def versus(best: PlannedConfig, name: str, other: PlannedConfig) -> str:
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
