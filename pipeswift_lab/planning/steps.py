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
from dataclasses import dataclass

import pandas as pd

from ..core.analytic import bubble_ratio
from ..core.costs import allreduce_ms, preemption_loss_s, young_daly_interval_s
from ..core.display import distinct_hours, hours
from ..core.jct import TERMS
from ..core.precision import OPTIMIZER_STATES, checkpoint_bytes_per_param, grad_bytes_per_param
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, validate
from .quantiles import jct_quantile, quantile_column
from .strategies import first_drop, grow_rows, shrink_rows, split_by_drops

#: Bytes the Adam step reads and writes per byte of parameters: parameter, gradient and two
#: moments read, parameter and two moments written.
OPTIMIZER_TRAFFIC_FACTOR = 7.0

TABLE_COLUMNS = (
    "rank", "ranked_by", "strategy", "P", "D", "gpus", "m", "microbatch_size", "schedule", "v", "feasible", "simulated", "reason",
    *TERMS, "total_s", "jct_lower_bound_s", "checkpoint_interval_s", "step_ms", "pipeline_ms", "allreduce_ms", "optimizer_ms", "bubble_ratio",
    "peak_mem_bytes", "samples_per_s",
)  # fmt: skip


@dataclass(frozen=True)
class Job:
    """What every step reads: the job, the cluster and the cost models, checked by :func:`~pipeswift_lab.plan`."""

    n_layers: int
    gpus: int
    global_batch: int
    steps: int
    availability: object  # costs.Availability
    assembly: object  # costs.AssemblyModel
    checkpoint: object  # costs.CheckpointModel
    mtbf_s: float | None
    optimizer: str
    precision: str | None
    dp_link: object  # link.Link of the gradient all-reduce
    mem_GBps: float  # memory bandwidth the optimizer step streams at
    mem_per_gpu_bytes: float | None
    mb_sizes: tuple


# --------------------------------------------------------------------------- 1. enumerate
def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(Ps, stage_choices, job: Job) -> list[tuple]:
    """Every ``(P, D, m, b, schedule, v)`` with ``P * D <= gpus`` and ``D * m * b == global_batch``.

    One stage is plain data parallelism: every schedule runs it alike, so it is weighed once.
    """
    single_stage = [c for c in stage_choices if c[1] == 1 and c[0] in SINGLE_CHUNK_SCHEDULES][:1] or [("GPipe", 1)]
    combos = []
    for p in Ps:
        for d in divisors(job.global_batch):
            if p * d > job.gpus:
                break
            for b in job.mb_sizes:
                if (job.global_batch // d) % b == 0:
                    for schedule, v in stage_choices if p > 1 else single_stage:
                        combos.append((p, d, (job.global_batch // d) // b, b, schedule, v))
    return combos


# --------------------------------------------------------------------------- 2. bound
def bound_configs(combos, job: Job, evaluator) -> tuple[list[dict], list[tuple]]:
    """``(rejected rows, candidates)``; a candidate is ``(jct_lower_bound_s, row, split)``, unsorted."""
    rows, candidates = [], []
    for p, d, m, b, schedule, v in combos:
        row = {
            "strategy": "start",
            "P": p,
            "D": d,
            "gpus": p * d,
            "m": m,
            "microbatch_size": b,
            "schedule": schedule,
            "v": v,
        }
        try:
            if p * v > job.n_layers:
                raise ValueError(f"P*v={p * v} stages exceed the {job.n_layers} layers")
            validate(p, m, schedule, v)
            split = evaluator.split(p, m, b, schedule, v, d)
        except ValueError as error:
            rows.append({**row, "feasible": False, "reason": str(error).split("; ")[0]})
            continue
        queue = job.availability.wait_s(p * d)
        if queue == math.inf:
            rows.append(
                {
                    **row,
                    "feasible": False,
                    "reason": f"{p * d} GPUs are never free (at most {job.availability.max_gpus})",
                }
            )
            continue
        rank_param_bytes = split.rank_param_bytes
        if job.precision is None:
            grad_bytes, shard_bytes = rank_param_bytes, rank_param_bytes * (1.0 + OPTIMIZER_STATES[job.optimizer])
        else:
            grad_bytes = split.rank_params * grad_bytes_per_param(job.precision)
            shard_bytes = split.rank_params * checkpoint_bytes_per_param(job.precision, job.optimizer, d)
        ar_ms = allreduce_ms(grad_bytes, d, job.dp_link.bandwidth_GBps, job.dp_link.latency_ms)
        opt_ms = OPTIMIZER_TRAFFIC_FACTOR * rank_param_bytes / (job.mem_GBps * 1e6)
        row.update(queue_s=queue, assembly_s=job.assembly.seconds(p, d), cleanup_s=job.checkpoint.cleanup_s(shard_bytes),
                   allreduce_ms=ar_ms, optimizer_ms=opt_ms, peak_mem_bytes=split.peak_mem_bytes, _shard_bytes=shard_bytes)  # fmt: skip
        lower_training, lower_loss = terms(job, row, split.lower_bound_ms)
        if lower_loss == math.inf:  # even its fastest step is preempted more often than it can checkpoint
            rows.append(
                {
                    **row,
                    "feasible": False,
                    "reason": f"preempted more often than it can checkpoint (every {hours(job.mtbf_s / (p * d))} on {p * d} GPUs)",
                }
            )
            continue
        lower = row["queue_s"] + row["assembly_s"] + row["cleanup_s"] + lower_training + lower_loss
        row["jct_lower_bound_s"] = lower
        if job.mtbf_s is not None:
            row["checkpoint_interval_s"] = young_daly_interval_s(
                job.checkpoint.save_s(shard_bytes), job.mtbf_s / (p * d)
            )
        candidates.append((lower, row, split))
    return rows, candidates


def terms(job: Job, row: dict, pipeline_ms: float) -> tuple[float, float]:
    """``(training_s, preemption_loss_s)`` of a configuration whose pipeline step takes ``pipeline_ms``."""
    training_s = job.steps * (pipeline_ms + row["allreduce_ms"] + row["optimizer_ms"]) / 1000.0
    loss = 0.0
    if job.mtbf_s is not None:
        restart = row["assembly_s"] + job.checkpoint.restore_s(row["_shard_bytes"])
        loss = preemption_loss_s(
            training_s, job.checkpoint.save_s(row["_shard_bytes"]), restart, job.mtbf_s / row["gpus"]
        )
    return training_s, loss


# --------------------------------------------------------------------------- 3. branch and bound
def evaluate(job: Job, evaluator, row: dict, split) -> dict:
    """The row of a simulated configuration: its pipeline step, JCT terms and bubble."""
    pipeline_ms, bubble = evaluator.simulate(split)
    training_s, loss = terms(job, row, pipeline_ms)
    step = pipeline_ms + row["allreduce_ms"] + row["optimizer_ms"]
    return {
        **row, "feasible": loss != math.inf, "simulated": True,
        "reason": "" if loss != math.inf else "preempted more often than it can checkpoint",
        "training_s": training_s, "preemption_loss_s": loss, "step_ms": step, "pipeline_ms": pipeline_ms,
        "bubble_ratio": bubble, "samples_per_s": job.global_batch / step * 1000.0,
    }  # fmt: skip


def branch_and_bound(candidates, rows: list, job: Job, evaluator, exhaustive: bool, progress: bool) -> list[dict]:
    """Simulate the candidates in order of their JCT lower bound; return ``rows`` with one row per candidate appended.

    Once the bound passes the best JCT found at the same queue wait, no later configuration can
    win there (bounding per wait keeps the best start-now configuration for the grow strategy);
    those are listed as not simulated unless ``exhaustive``. The configuration a bubble-minded
    engineer picks (smallest closed-form bubble, then the most micro-batch chunks) on the best's
    GPU count is always simulated, so that the plan can show what choosing by the bubble costs.
    """
    from ..core.progress import progress_bar

    candidates = sorted(candidates, key=lambda c: c[0])
    best_by_wait: dict[float, float] = {}
    pruned = {}
    for lower, row, split in progress_bar(candidates, desc="plan", progress=progress):
        best_total = best_by_wait.get(row["queue_s"], math.inf)
        if not exhaustive and lower >= best_total:
            pruned[len(rows)] = (row, split)
            bound_text, best_text = distinct_hours(lower, best_total)
            rows.append(
                {
                    **row,
                    "feasible": True,
                    "simulated": False,
                    "reason": f"not simulated: its JCT lower bound {bound_text} is no shorter than the best {best_text} at its wait",
                }
            )
            continue
        rows.append(evaluate(job, evaluator, row, split))
        if rows[-1]["feasible"]:
            total = sum(rows[-1][t] for t in TERMS)
            if (
                first_drop(job.availability, row["gpus"], row["queue_s"], total) is None
            ):  # one that loses its GPUs bounds nothing
                best_by_wait[row["queue_s"]] = min(best_total, total)
    done = [r for r in rows if r.get("simulated") and r["feasible"] and r["strategy"] == "start"]
    if done and pruned:
        gpus_best = min(done, key=lambda r: sum(r[t] for t in TERMS))["gpus"]

        def by_bubble(r):
            return (bubble_ratio(r["P"], r["m"], r["schedule"], v=r["v"]), -r["m"] * r["v"])

        pool = [(i, c) for i, c in pruned.items() if c[0]["P"] > 1 and c[0]["gpus"] == gpus_best]
        if pool:
            i, (row, split) = min(pool, key=lambda ic: by_bubble(ic[1][0]))
            rivals = [r for r in done if r["P"] > 1 and r["gpus"] == gpus_best]
            if not rivals or by_bubble(row) < min(by_bubble(r) for r in rivals):
                rows[i] = evaluate(job, evaluator, row, split)
    return rows


# --------------------------------------------------------------------------- 4. rank
def rank_table(rows: list, job: Job, quantile, step_cv, rank_by) -> pd.DataFrame:
    """One table: simulated feasible rows and the grow/shrink strategies by ``rank_by``, then the pruned
    ones by their bound, then the rejected ones. Raises ``ValueError`` when nothing is feasible."""
    table = pd.DataFrame(rows)
    for col in TABLE_COLUMNS:
        if col not in table.columns:
            table[col] = math.nan
    feasible = table[(table["feasible"] == True) & (table["simulated"] == True)]  # noqa: E712 - NaN-safe on object columns
    if feasible.empty:
        raise ValueError(no_fit_message(table, job))
    feasible = feasible.assign(total_s=feasible[list(TERMS)].sum(axis=1))
    feasible, lost = split_by_drops(feasible, job.availability)
    if feasible.empty and lost.empty:
        raise ValueError(no_fit_message(table, job))
    shrink = shrink_rows(lost, feasible, job.availability, job.assembly, job.checkpoint, job.steps, job.mtbf_s)
    grow = (
        grow_rows(feasible, job.availability, job.assembly, job.checkpoint, job.steps, job.mtbf_s)
        if not feasible.empty
        else feasible
    )
    parts = [x for x in (feasible, grow, shrink) if not x.empty]
    if not parts:
        raise ValueError(
            no_fit_message(table, job)
            + "\nevery configuration loses GPUs mid-run and none fits the GPUs that stay free"
        )
    ranked = pd.concat(parts, ignore_index=True)
    columns = list(TABLE_COLUMNS)
    if quantile is not None:
        ranked[quantile_column(quantile)] = jct_quantile(ranked, quantile, step_cv, job.mtbf_s, job.checkpoint)
        columns.insert(columns.index("total_s") + 1, quantile_column(quantile))
    ranked = ranked.sort_values([rank_by, "gpus", "step_ms"], kind="stable")
    unsimulated = table[(table["feasible"] == True) & (table["simulated"] != True)].sort_values(
        "jct_lower_bound_s", kind="stable"
    )  # noqa: E712
    rejected = pd.concat([lost, table[table["feasible"] != True].assign(total_s=math.nan)], ignore_index=True)  # noqa: E712
    out = pd.concat([ranked, unsimulated, rejected], ignore_index=True).drop(columns=["_shard_bytes"], errors="ignore")
    out["feasible"] = out["feasible"].astype(bool)
    out["simulated"] = out["simulated"].fillna(False).astype(bool)
    out["reason"] = out["reason"].fillna("")
    n_ranked = len(ranked) + len(
        unsimulated
    )  # every feasible row: simulated ones by JCT, then the pruned ones by their bound
    out["rank"] = pd.array([i + 1 if i < n_ranked else pd.NA for i in range(len(out))], dtype="Int64")
    out["ranked_by"] = [rank_by] * len(ranked) + ["jct_lower_bound_s"] * len(unsimulated) + [""] * (len(out) - n_ranked)
    return out[columns].reset_index(drop=True)


def no_fit_message(table, job: Job) -> str:
    """Why no configuration is feasible: the closest memory misses, the failure rate, the other reasons."""
    mem = job.mem_per_gpu_bytes
    lines = [
        f"no feasible configuration for gpus={job.gpus}, global_batch={job.global_batch}"
        + (f", mem_per_gpu_bytes={mem:.4g}" if mem else "")
    ]
    if table.empty:
        lines.append(
            f"no micro-batch size among {list(job.mb_sizes)} divides global_batch / D for any D; pass microbatch_sizes= that "
            f"divide it (the default is the profiled size times powers of two)"
        )
        return "\n".join(lines)
    memory = table[table["reason"].str.contains("mem_per_gpu_bytes=[^ ]*: no|GiB per GPU", regex=True, na=False)]
    if mem and not memory.empty:
        lines.append(
            f"{len(memory)} of {len(table)} configurations do not fit mem_per_gpu_bytes={mem:.4g}; the ones with the most stages:"
        )
        for _, r in memory.sort_values(["P", "microbatch_size"], ascending=[False, True]).head(3).iterrows():
            lines.append(f"  P={r.P} D={r.D} m={r.m} b={r.microbatch_size} {r.schedule} v={r.v}: {r.reason}")
        lines.append("  they fit with more GPUs (more stages), smaller micro-batches, or a larger mem_per_gpu_bytes")
    preempted = table[table["reason"].str.startswith("preempted more often", na=False)]
    if job.mtbf_s is not None and not preempted.empty:
        lines.append(
            f"{len(preempted)} of {len(table)} configurations do not survive mtbf_s={job.mtbf_s:.4g} (one GPU's mean time between "
            f"preemptions): each is preempted more often than it can save a checkpoint; give a larger mtbf_s (seconds per GPU) "
            f"or a faster CheckpointModel"
        )
        memory = pd.concat([memory, preempted])
    others = table.drop(memory.index)
    if not others.empty:
        reasons = others["reason"].value_counts().head(3)
        lines.append("other reasons: " + "; ".join(f"{k} ({v}x)" for k, v in reasons.items()))
    return "\n".join(lines)
