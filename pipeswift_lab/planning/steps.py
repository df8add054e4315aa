"""The steps of :func:`pipeswift_lab.planning.planner.plan`, in the order it runs them.

1. :func:`enumerate_configs` — every ``(P, D, m, micro-batch size, schedule, v)`` within the GPUs
   that makes up the global batch;
2. :func:`bound_configs` — the balanced split of each (or why it cannot run), the terms that do
   not need a simulation (queue, assembly, cleanup, all-reduce, optimizer step) and a JCT lower
   bound from the busiest rank's compute with no bubble;
3. :func:`branch_and_bound` — simulate in order of the bound until the bound passes the best JCT
   found at the same queue wait (and always the configuration a bubble-minded choice would make);
4. :func:`rank_table` — the grow and shrink strategies, then one table: the simulated rows by
   JCT, the pruned ones by their bound, the rejected ones with their reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import pandas as pd

from ..core.analytic import bubble_ratio
from ..core.costs import preemption_loss_s
from ..core.display import distinct_hours, hours
from ..core.jct import TERMS
from ..core.schedule import Schedule, ScheduleLike
from ..core.schedule_generators import generate, is_generator
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, validate
from .inputs import PlanInputs, divisors
from .placement import OPTIMIZER_TRAFFIC_FACTOR, collective_terms, pipeline_link_of
from .quantiles import jct_quantile, quantile_column
from .search import Evaluator
from .splits import Split
from .strategies import HOLDING, first_drop, grow_rows, shrink_rows, split_by_drops

__all__ = [
    "OPTIMIZER_TRAFFIC_FACTOR",
    "TABLE_COLUMNS",
    "bound_config",
    "bound_configs",
    "branch_and_bound",
    "enumerate_configs",
    "evaluate",
    "no_fit_message",
    "rank_table",
    "terms",
]

#: The columns of :attr:`Plan.table <pipeswift_lab.planning.result.Plan.table>`, in order (a quantile column such as
#: ``total_s_p95`` follows ``total_s`` when one is asked for).
TABLE_COLUMNS = (
    *("rank", "ranked_by", "strategy", "change", "P", "D", "fsdp", "tp", "gpus", "m", "microbatch_size"),
    *("schedule", "v", "feasible", "simulated", "reason", *TERMS, "total_s", "jct_lower_bound_s"),
    *("checkpoint_interval_s", "step_ms", "pipeline_ms", "allreduce_ms", "fsdp_ms", "optimizer_ms", "bubble_ratio"),
    *("peak_mem_bytes", "samples_per_s"),
    *("recompute", "stage_bounds"),
)

#: A configuration: ``(P, D, m, microbatch_size, schedule, v, fsdp, tp)``.
Config = tuple[int, int, int, int, str, int, int, int]
#: One row of the plan's table, as the steps build it (``_shard_bytes`` is dropped at the end).
Row = dict[str, Any]
#: A configuration to simulate: ``(jct_lower_bound_s, row, split)``.
Candidate = tuple[float, Row, Split]


# --------------------------------------------------------------------------- 1. enumerate
def made_choice(choice: tuple[Any, int], P: int, m: int) -> tuple[Any, int] | None:
    """``choice`` as the search weighs it at ``P`` ranks and ``m`` micro-batches: a generator's Schedule made for them
    (None where the generator makes none: its configurations are not weighed), a Schedule where it has that ``P`` and
    ``m`` (else None), a name as it is."""
    schedule, v = choice
    if isinstance(schedule, Schedule):
        return choice if (schedule.P, schedule.m) == (P, m) else None
    if not is_generator(schedule):
        return choice
    try:
        made = generate(schedule, P, m, v or 1)
    except ValueError:
        return None
    return made, made.v


def one_stage_choice(choices: Sequence[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """The ``(schedule, v)`` a one-stage configuration is weighed under: 1F1B where weighed (the same time as any, one
    micro-batch's activations at a time), else the first single-chunk schedule weighed, else GPipe."""
    single = [c for c in choices if c[1] == 1 and c[0] in SINGLE_CHUNK_SCHEDULES]
    return [c for c in single if c[0] == "1F1B"][:1] or single[:1] or [("GPipe", 1)]


def enumerate_configs(inputs: PlanInputs) -> list[Config]:
    """Every ``(P, D, m, b, schedule, v, 1, 1)`` with ``P * D <= gpus`` and ``D * m * b == global_batch`` (the
    search of pipelines × replicas; :mod:`.layouts` enumerates the 3-D one).

    One stage is plain data parallelism: every schedule runs it in the same time, so it is weighed once, under 1F1B
    where weighed (one micro-batch's activations at a time, where GPipe holds them all).
    """
    choices = inputs.stage_choices
    single_stage = one_stage_choice(choices)
    configs = []
    for p in inputs.stage_counts:
        for d in divisors(inputs.global_batch):
            if p * d > inputs.gpus:
                break
            for b in inputs.microbatch_sizes:
                if (inputs.global_batch // d) % b == 0:
                    m = (inputs.global_batch // d) // b
                    made = [made_choice(choice, p, m) for choice in (choices if p > 1 else single_stage)]
                    configs += [(p, d, m, b, c[0], c[1], 1, 1) for c in dict.fromkeys(made) if c is not None]
    return configs


# --------------------------------------------------------------------------- 2. bound
def bound_configs(
    configs: Iterable[Config], inputs: PlanInputs, evaluator: Evaluator
) -> tuple[list[Row], list[Candidate]]:
    """``(rejected rows, candidates)``; a candidate is ``(jct_lower_bound_s, row, split)``, unsorted."""
    rows, candidates = [], []
    for config in configs:
        row, split, reason = bound_config(config, inputs, evaluator)
        if split is None:
            rows.append({**row, "feasible": False, "reason": reason})
        else:
            candidates.append((row["jct_lower_bound_s"], row, split))
    return rows, candidates


def bound_config(config: Config, inputs: PlanInputs, evaluator: Evaluator) -> tuple[Row, Split | None, str]:
    """``(row, split, "")`` of a configuration that may run, with its terms and JCT lower bound; ``(row, None,
    reason)`` of one that cannot."""
    p, d, m, b, schedule, v, fsdp, tp = config
    gpus = p * d * fsdp * tp
    queue = inputs.availability.wait_s(gpus)
    row: Row = {"strategy": "now" if queue == 0 else "wait", "change": "", "P": p, "D": d, "fsdp": fsdp, "tp": tp}
    row.update(gpus=gpus, m=m, microbatch_size=b, schedule=schedule, v=v)
    try:
        if p * v > inputs.n_layers:
            raise ValueError(f"P*v={p * v} stages exceed the {inputs.n_layers} layers")
        validate(p, m, schedule, v)
        split = evaluator.at(tp, pipeline_link_of(inputs, (p, d, fsdp, tp))).split(p, m, b, schedule, v, d, fsdp)
    except ValueError as error:
        return row, None, str(error).split("; ")[0]
    if queue == math.inf:
        return row, None, f"{gpus} GPUs are never free (at most {inputs.availability.max_gpus})"
    row.update(_fixed_terms(inputs, split, config, queue))
    lower_training, lower_loss = terms(inputs, row, split.lower_bound_ms)
    if lower_loss == math.inf:  # even its fastest step is preempted more often than it can checkpoint
        every = hours(inputs.mtbf_s / gpus) if inputs.mtbf_s is not None else "never"
        return row, None, f"preempted more often than it can checkpoint (every {every} on {gpus} GPUs)"
    row["jct_lower_bound_s"] = row["queue_s"] + row["assembly_s"] + row["cleanup_s"] + lower_training + lower_loss
    if inputs.mtbf_s is not None:
        row["checkpoint_interval_s"] = inputs.checkpoint.interval_s(row["_shard_bytes"], inputs.mtbf_s / gpus)
    return row, split, ""


def _fixed_terms(inputs: PlanInputs, split: Split, config: Config, queue_s: float) -> Row:
    """The terms that need no simulation: queue, assembly, cleanup, the all-reduce, FSDP's collectives and the
    optimizer step (:func:`~pipeswift_lab.planning.placement.collective_terms`)."""
    p, d, _, _, _, _, fsdp, tp = config
    collectives = collective_terms(inputs, (p, d, fsdp, tp), split.rank_param_bytes, split.rank_params)
    # the split a 3-D layout ran its memory with is its own, not the profile's balanced one: keep it for run()
    own_split = bool(split.recompute) or fsdp > 1 or tp > 1
    return {
        "queue_s": queue_s,
        "assembly_s": inputs.assembly.seconds(p, d * fsdp * tp),
        "cleanup_s": inputs.checkpoint.cleanup_s(collectives["_shard_bytes"]),
        **collectives,
        "peak_mem_bytes": split.peak_mem_bytes,
        "recompute": split.recompute,
        "stage_bounds": " ".join(f"{a}-{e}" for a, e in split.bounds) if own_split else "",
    }


def terms(inputs: PlanInputs, row: Row, pipeline_ms: float) -> tuple[float, float]:
    """``(training_s, preemption_loss_s)`` of a configuration whose pipeline step takes ``pipeline_ms``.

    The preemption loss has each periodic checkpoint stall training :meth:`CheckpointModel.stall_s
    <pipeswift_lab.core.costs.CheckpointModel.stall_s>` at :meth:`~pipeswift_lab.core.costs.CheckpointModel.interval_s`
    (Young/Daly's, never shorter than an asynchronous save's write).
    """
    training_s = (
        inputs.steps * (pipeline_ms + row["allreduce_ms"] + row.get("fsdp_ms", 0.0) + row["optimizer_ms"]) / 1000.0
    )
    if inputs.mtbf_s is None:
        return training_s, 0.0
    checkpoint, shard, job_mtbf_s = inputs.checkpoint, row["_shard_bytes"], inputs.mtbf_s / row["gpus"]
    restart = row["assembly_s"] + checkpoint.restore_s(shard)
    interval = checkpoint.interval_s(shard, job_mtbf_s)
    return training_s, preemption_loss_s(
        training_s, checkpoint.stall_s(shard), restart, job_mtbf_s, interval_s=interval
    )


# --------------------------------------------------------------------------- 3. branch and bound
def evaluate(inputs: PlanInputs, evaluator: Evaluator, row: Row, split: Split) -> Row:
    """The row of a simulated configuration: its pipeline step, JCT terms and bubble."""
    pipeline_ms, bubble = split.evaluator.simulate(split)  # the evaluator of its tp and link, which made it
    training_s, loss = terms(inputs, row, pipeline_ms)
    step = pipeline_ms + row["allreduce_ms"] + row.get("fsdp_ms", 0.0) + row["optimizer_ms"]
    return {
        **row,
        "feasible": loss != math.inf,
        "simulated": True,
        "reason": "" if loss != math.inf else "preempted more often than it can checkpoint",
        "training_s": training_s,
        "preemption_loss_s": loss,
        "step_ms": step,
        "pipeline_ms": pipeline_ms,
        "bubble_ratio": bubble,
        "samples_per_s": inputs.global_batch / step * 1000.0,
    }


def branch_and_bound(
    candidates: Iterable[Candidate], rows: list[Row], inputs: PlanInputs, evaluator: Evaluator
) -> list[Row]:
    """Simulate the candidates in order of their JCT lower bound; return ``rows`` with one row per candidate appended.

    Once the bound passes the best JCT found at the same queue wait, no later configuration can
    win there (bounding per wait keeps the best start-now configuration for the grow strategy);
    those are listed as not simulated unless ``inputs.exhaustive``. The configuration a bubble-minded
    engineer picks (smallest closed-form bubble, then the most micro-batch chunks) on the best's
    GPU count is always simulated, so that the plan can show what choosing by the bubble costs.
    """
    from ..core.progress import progress_bar

    best_by_wait: dict[float, float] = {}
    pruned: dict[int, tuple[Row, Split]] = {}
    ordered = sorted(candidates, key=lambda c: c[0])
    for lower, row, split in progress_bar(ordered, desc="plan", progress=inputs.progress):
        best_total = best_by_wait.get(row["queue_s"], math.inf)
        if not inputs.exhaustive and lower >= best_total:
            pruned[len(rows)] = (row, split)
            bound_text, best_text = distinct_hours(lower, best_total)
            reason = (
                f"not simulated: its JCT lower bound {bound_text} is no shorter than the best {best_text} at its wait"
            )
            rows.append({**row, "feasible": True, "simulated": False, "reason": reason})
            continue
        rows.append(evaluate(inputs, evaluator, row, split))
        if rows[-1]["feasible"]:
            total = sum(rows[-1][t] for t in TERMS)
            if first_drop(inputs.availability, row["gpus"], row["queue_s"], total) is None:
                best_by_wait[row["queue_s"]] = min(best_total, total)  # one that loses its GPUs bounds nothing
    _simulate_bubble_pick(rows, pruned, inputs, evaluator)
    return rows


def row_bubble(row: Row) -> tuple[float, int]:
    """:func:`by_bubble` of a plan row."""
    return by_bubble(row["P"], row["m"], row["schedule"], row["v"])


def by_bubble(P: int, m: int, schedule: ScheduleLike, v: int) -> tuple[float, int]:
    """What a bubble-minded choice minimizes: the closed-form bubble (a Schedule's on equal unit times), then minus the
    micro-batch chunks ``m * v``."""
    if isinstance(schedule, Schedule):
        return unit_bubble_ratio(schedule), -m * v
    return bubble_ratio(P, m, schedule, v=v), -m * v


@lru_cache(maxsize=256)
def unit_bubble_ratio(schedule: Schedule) -> float:
    """The idle share of the step when every action of every stage lasts one unit and transfers are free (F = I = W =
    1, B = 2): the closed form's convention, found by replaying the order (:func:`~pipeswift_lab.simulation.simulate`
    on a uniform stage table)."""
    from ..simulation import simulate

    table = pd.DataFrame({"fwd_ms": [1.0] * schedule.S, "bwd_ms": [2.0] * schedule.S, "wgrad_ms": [1.0] * schedule.S})
    return simulate(table, schedule.m, schedule).bubble_ratio


def _simulate_bubble_pick(
    rows: list[Row], pruned: dict[int, tuple[Row, Split]], inputs: PlanInputs, evaluator: Evaluator
) -> None:
    """Simulate, in place of its pruned row, the pipelined configuration with the smallest closed-form bubble on the
    best's GPU count, unless a simulated one already has a bubble as small."""
    done = [r for r in rows if r.get("simulated") and r["feasible"] and r["strategy"] in HOLDING]
    if not (done and pruned):
        return
    gpus_best = min(done, key=lambda r: sum(r[t] for t in TERMS))["gpus"]
    pool = [(i, c) for i, c in pruned.items() if c[0]["P"] > 1 and c[0]["gpus"] == gpus_best]
    if not pool:
        return
    i, (row, split) = min(
        pool, key=lambda ic: by_bubble(ic[1][0]["P"], ic[1][0]["m"], ic[1][0]["schedule"], ic[1][0]["v"])
    )
    rivals = [r for r in done if r["P"] > 1 and r["gpus"] == gpus_best]
    if not rivals or row_bubble(row) < min(row_bubble(r) for r in rivals):
        rows[i] = evaluate(inputs, evaluator, row, split)


# --------------------------------------------------------------------------- 4. rank
def _orders_apart(table: pd.DataFrame) -> pd.DataFrame:
    """The ``schedule`` column as names, each :class:`~pipeswift_lab.Schedule` kept in an ``order`` column beside its
    name (a column of names groups and sorts; :meth:`PlannedConfig.from_row` reads the order back)."""
    if "schedule" not in table.columns:
        return table
    orders = [s if isinstance(s, Schedule) else None for s in table["schedule"]]
    if "order" in table.columns:
        orders = [o if o is not None else old for o, old in zip(orders, table["order"])]
    table = table.assign(schedule=[str(s) for s in table["schedule"]])
    return table.assign(order=orders) if any(o is not None for o in orders) else table


def rank_table(rows: list[Row], inputs: PlanInputs, more: pd.DataFrame | None = None) -> pd.DataFrame:
    """One table: simulated feasible rows and the grow/shrink strategies by ``inputs.rank_by``, then the pruned
    ones by their bound, then the rejected ones (``more``: rows already in a table, such as those the 3-D search
    did not weigh, :mod:`.layouts`). Raises ``ValueError`` when nothing is feasible."""
    table = pd.DataFrame(rows)
    if more is not None and len(more):
        table = pd.concat([table, more], ignore_index=True) if len(table) else more.reset_index(drop=True)
    table = _orders_apart(table)
    for col in TABLE_COLUMNS:
        if col not in table.columns:
            table[col] = math.nan
    feasible = table[table["feasible"].eq(True) & table["simulated"].eq(True)]  # NaN-safe on object columns
    if feasible.empty:
        raise ValueError(no_fit_message(table, inputs))
    feasible = feasible.assign(total_s=feasible[list(TERMS)].sum(axis=1))
    feasible, lost = split_by_drops(feasible, inputs.availability)
    if feasible.empty and lost.empty:
        raise ValueError(no_fit_message(table, inputs))
    ranked = _ranked(feasible, lost, table, inputs)
    return _assemble(ranked, lost, table, inputs)


def _ranked(feasible: pd.DataFrame, lost: pd.DataFrame, table: pd.DataFrame, inputs: PlanInputs) -> pd.DataFrame:
    """The simulated rows that keep their GPUs, and the grow and shrink strategies, by ``inputs.rank_by``."""
    shrink = shrink_rows(lost, feasible, inputs)
    grow = grow_rows(feasible, inputs) if not feasible.empty else feasible
    parts = [x for x in (feasible, grow, shrink) if not x.empty]
    if not parts:
        raise ValueError(
            no_fit_message(table, inputs)
            + "\nevery configuration loses GPUs mid-run and none fits the GPUs that stay free"
        )
    ranked = pd.concat(parts, ignore_index=True)
    if inputs.quantile is not None:
        column = quantile_column(inputs.quantile)
        ranked[column] = jct_quantile(ranked, inputs.quantile, inputs.step_cv, inputs.mtbf_s, inputs.checkpoint)
    return ranked.sort_values([inputs.rank_by, "gpus", "step_ms"], kind="stable")


def _assemble(ranked: pd.DataFrame, lost: pd.DataFrame, table: pd.DataFrame, inputs: PlanInputs) -> pd.DataFrame:
    """The plan's table: ``ranked``, then the pruned rows by their bound, then the rejected ones; numbered."""
    unsimulated = table[table["feasible"].eq(True) & table["simulated"].ne(True)]
    unsimulated = unsimulated.sort_values("jct_lower_bound_s", kind="stable")
    rejected = pd.concat([lost, table[table["feasible"].ne(True)].assign(total_s=math.nan)], ignore_index=True)
    out = pd.concat([ranked, unsimulated, rejected], ignore_index=True).drop(columns=["_shard_bytes"], errors="ignore")
    out["feasible"] = out["feasible"].astype(bool)
    out["simulated"] = out["simulated"].fillna(False).astype(bool)
    out["reason"] = out["reason"].fillna("")
    out["change"] = out["change"].fillna("")
    n_ranked = len(ranked) + len(unsimulated)  # every feasible row: simulated ones by JCT, the pruned by their bound
    out["rank"] = pd.array([i + 1 if i < n_ranked else pd.NA for i in range(len(out))], dtype="Int64")
    out["ranked_by"] = (
        [inputs.rank_by] * len(ranked) + ["jct_lower_bound_s"] * len(unsimulated) + [""] * (len(out) - n_ranked)
    )
    columns = list(TABLE_COLUMNS)
    if inputs.quantile is not None:
        columns.insert(columns.index("total_s") + 1, quantile_column(inputs.quantile))
    if "order" in out.columns:  # the Schedules weighed, beside their names
        columns.insert(columns.index("v"), "order")
    return out[columns].reset_index(drop=True)


def no_fit_message(table: pd.DataFrame, inputs: PlanInputs) -> str:
    """Why no configuration is feasible: the closest memory misses, the failure rate, the other reasons."""
    mem = inputs.mem_per_gpu_bytes
    lines = [
        f"no feasible configuration for gpus={inputs.gpus}, global_batch={inputs.global_batch}"
        + (f", mem_per_gpu_bytes={mem:.4g}" if mem else "")
    ]
    if table.empty:
        lines.append(
            f"no micro-batch size among {list(inputs.microbatch_sizes)} divides global_batch / D for any D; pass "
            f"microbatch_sizes= that divide it (the default is the profiled size times powers of two)"
        )
        return "\n".join(lines)
    memory = table[table["reason"].str.contains("mem_per_gpu_bytes=[^ ]*: no|GiB per GPU", regex=True, na=False)]
    if mem and not memory.empty:
        lines.append(
            f"{len(memory)} of {len(table)} configurations do not fit mem_per_gpu_bytes={mem:.4g}; "
            f"the ones with the most stages:"
        )
        for _, r in memory.sort_values(["P", "microbatch_size"], ascending=[False, True]).head(3).iterrows():
            layout = f" fsdp={r.fsdp} tp={r.tp}" if max(r.fsdp, r.tp) > 1 else ""
            lines.append(f"  P={r.P} D={r.D}{layout} m={r.m} b={r.microbatch_size} {r.schedule} v={r.v}: {r.reason}")
        hint = "" if inputs.recompute else ', or recomputing activations (plan(..., recompute="search"))'
        lines.append(
            "  they fit with more GPUs (more stages), smaller micro-batches, or a larger mem_per_gpu_bytes" + hint
        )
    preempted = table[table["reason"].str.startswith("preempted more often", na=False)]
    if inputs.mtbf_s is not None and not preempted.empty:
        lines.append(
            f"{len(preempted)} of {len(table)} configurations do not survive mtbf_s={inputs.mtbf_s:.4g} (one GPU's "
            f"mean time between preemptions): each is preempted more often than it can save a checkpoint; give a "
            f"larger mtbf_s (seconds per GPU) or a faster CheckpointModel"
        )
        memory = pd.concat([memory, preempted])
    others = table.drop(memory.index)
    if not others.empty:
        reasons = others["reason"].value_counts().head(3)
        lines.append("other reasons: " + "; ".join(f"{k} ({v}x)" for k, v in reasons.items()))
    return "\n".join(lines)
