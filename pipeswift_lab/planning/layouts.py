"""The 3-D search: every layout ``(P, D, fsdp, tp)`` with every ``m``, micro-batch size, schedule and ``v``, bounded
in closed form before any split is made, then branched and bounded as :mod:`.steps` does.

What :func:`~pipeswift_lab.planning.planner.plan` runs when it weighs tensor parallelism or FSDP (a ``topology``,
``tp=`` or ``fsdp=``; :mod:`.degrees`). Its grid is tens of thousands of configurations on thousands of GPUs, too
many to split and replay each, so:

1. :func:`enumerate_layouts` — every ``(P, D, m, b, schedule, v, fsdp, tp)`` with ``P · D · fsdp · tp <= gpus`` and
   ``D · fsdp · m · b == global_batch``, as arrays;
2. :func:`closed_form_bounds` — what needs no split: the configurations that cannot run (more stages than layers,
   a schedule that refuses ``m``, GPUs never free, or the training state of the average rank over
   ``mem_per_gpu_bytes``, which no split beats), and a JCT lower bound for the others from the queue, assembly and
   cleanup, the pipeline's step bounded from the compute of one tensor-parallel rank and the schedule's dependencies
   (:func:`~pipeswift_lab.planning.step_bounds.closed_form_step_lower_ms`: no transfer), the collectives of the
   average rank (:mod:`.placement`);
3. :func:`search_layouts` — in order of that bound, each configuration is pruned while its bound is no shorter than
   the best JCT found at its wait; the others are rejected where no split can fit ``mem_per_gpu_bytes`` (the fullest
   rank's closed-form bound, :mod:`.memory_bound`), else split and bounded by their schedule's dependencies
   (:func:`.steps.bound_config`, :func:`~pipeswift_lab.planning.step_bounds.split_step_lower_ms`) and simulated while
   that bound is shorter. The best without a pipeline (``P = 1``) and the best without tensor
   parallelism (``tp = 1``) are kept apart, so both are always simulated (what :meth:`Plan.explain
   <pipeswift_lab.planning.result.Plan.explain>` compares the best with); so is the configuration with the
   smallest closed-form bubble on the best's GPU count, as in the search of pipelines × replicas.

A configuration pruned at step 3 before its split is listed, unranked, with ``feasible`` False and a reason that
starts ``not weighed:`` (its memory was not checked, so it is not claimed to fit); one pruned after its split is
feasible and ranked by its bound, as in :func:`.steps.branch_and_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..core.jct import TERMS
from ..core.schedule_generators import is_generator
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, splits_backward, validate
from ..partitioning.memory import MEM_RTOL
from .inputs import PlanInputs, divisors
from .placement import collective_terms, pipeline_link_of
from .steps import Config, Row, bound_config, by_bubble, evaluate, made_choice, one_stage_choice
from .strategies import HOLDING, first_drop

if TYPE_CHECKING:
    from .search import Evaluator
    from .splits import Split

__all__ = ["NOT_WEIGHED", "ClosedForm", "Grid", "closed_form_bounds", "enumerate_layouts", "search_layouts"]

#: The reason of a configuration pruned by its closed-form bound, before its split and memory were computed.
NOT_WEIGHED = (
    "not weighed: its JCT lower bound from compute and collectives alone (jct_lower_bound_s) is no shorter than the "
    "best at its wait; its split and memory were not computed"
)


@dataclass(frozen=True, eq=False)
class Grid:
    """Every configuration of a 3-D search, one entry per configuration in each array."""

    P: np.ndarray
    D: np.ndarray
    fsdp: np.ndarray
    tp: np.ndarray
    m: np.ndarray
    b: np.ndarray
    choice: np.ndarray
    """Index into :attr:`choices`."""
    choices: tuple[tuple[str, int], ...]
    """The ``(schedule, v)`` pairs weighed."""

    def __len__(self) -> int:
        return len(self.P)

    @cached_property
    def gpus(self) -> np.ndarray:
        """``P · D · fsdp · tp`` of each configuration."""
        return self.P * self.D * self.fsdp * self.tp

    @cached_property
    def v(self) -> np.ndarray:
        """Stages per rank of each configuration."""
        return np.array([v for _, v in self.choices])[self.choice]

    def config(self, i: int) -> Config:
        """Configuration ``i`` as :mod:`.steps` takes it: ``(P, D, m, b, schedule, v, fsdp, tp)``."""
        schedule, v = self.choices[int(self.choice[i])]
        return (
            int(self.P[i]),
            int(self.D[i]),
            int(self.m[i]),
            int(self.b[i]),
            schedule,
            v,
            int(self.fsdp[i]),
            int(self.tp[i]),
        )


def enumerate_layouts(inputs: PlanInputs) -> Grid:
    """Every ``(P, D, m, b, schedule, v, fsdp, tp)`` with ``P · D · fsdp · tp <= gpus`` and ``D · fsdp · m · b ==
    global_batch``; one stage (``P = 1``) is weighed with one schedule (:func:`~.steps.one_stage_choice`: the same
    time under any, the least memory under 1F1B). Returns a :class:`Grid`."""
    choices = inputs.stage_choices
    single = one_stage_choice(choices)
    all_choices = list(dict.fromkeys([*choices, *single]))
    index = {c: i for i, c in enumerate(all_choices)}
    one = [index[c] for c in single]

    def many(p: int, m: int) -> list[int]:
        """The choices weighed at ``p`` ranks and ``m`` micro-batches, generators made for them."""
        out: dict[int, None] = {}  # a generator asked for v=1 and v=2 may make the same order twice
        for choice in choices:
            made = made_choice(choice, p, m)
            if made is not None:
                out[index.setdefault(made, len(index))] = None
                if len(all_choices) < len(index):
                    all_choices.append(made)
        return list(out)

    out: list[tuple[int, int, int, int, int, int, int]] = []
    gb = inputs.global_batch
    for tp in inputs.tp_degrees:
        for fsdp in inputs.fsdp_degrees:
            for p in inputs.stage_counts:
                for d in divisors(gb // fsdp):
                    if p * d * fsdp * tp > inputs.gpus:
                        break
                    per_rank = gb // (d * fsdp)
                    for b in inputs.microbatch_sizes:
                        if per_rank % b == 0:
                            m = per_rank // b
                            out += [(p, d, fsdp, tp, m, b, c) for c in (many(p, m) if p > 1 else one)]
    columns = np.array(out, dtype=np.int64).reshape(-1, 7).T
    names = ("P", "D", "fsdp", "tp", "m", "b", "choice")
    return Grid(**dict(zip(names, columns)), choices=tuple(all_choices))


@dataclass(frozen=True, eq=False)
class ClosedForm:
    """What the closed forms say of every configuration of a :class:`Grid`."""

    bound_s: np.ndarray
    """A JCT lower bound (NaN where the configuration cannot run)."""
    queue_s: np.ndarray
    """Seconds until its GPUs are free."""
    assembly_s: np.ndarray
    """Its assembly."""
    reason: list[str]
    """Why it cannot run (``""`` where it may)."""


def closed_form_bounds(grid: Grid, inputs: PlanInputs, evaluator: Evaluator) -> ClosedForm:
    """The closed-form JCT lower bound of every configuration of ``grid`` and the reason of those that cannot run
    (the module docs say which). Returns a :class:`ClosedForm`."""
    gpus = grid.gpus
    queue = _by_key(gpus, inputs.availability.wait_s)
    assembly = _by_keys((grid.P, gpus // grid.P), inputs.assembly.seconds)
    pipeline_ms = _pipeline_lower_ms(grid, inputs, evaluator)
    fixed_ms, cleanup_s, state_reason = _layout_terms(grid, inputs, evaluator)
    # each reason where the one before it leaves none, in the order the split of steps.bound_config finds them
    reasons = [_by_keys_text((grid.P, grid.m, grid.choice), lambda p, m, c: _schedule_refuses(p, m, c, grid, inputs))]
    reasons.append(state_reason)
    never = np.flatnonzero(queue == math.inf)
    free = inputs.availability.max_gpus
    reasons.append(_sparse(len(grid), never, [f"{int(g)} GPUs are never free (at most {free})" for g in gpus[never]]))
    reason = [next((r for r in texts if r), "") for texts in zip(*reasons)]
    bound = queue + assembly + cleanup_s + inputs.steps * (pipeline_ms + fixed_ms) / 1000.0
    bound = np.where([r == "" for r in reason], bound, np.nan)
    return ClosedForm(bound_s=bound, queue_s=queue, assembly_s=assembly, reason=reason)


def _schedule_refuses(P: int, m: int, choice: int, grid: Grid, inputs: PlanInputs) -> str:
    """Why ``P`` ranks with ``m`` micro-batches cannot run the schedule ``grid.choices[choice]`` (``""``: they can)."""
    schedule, v = grid.choices[choice]
    if P * v > inputs.n_layers:
        return f"P*v={P * v} stages exceed the {inputs.n_layers} layers"
    try:
        validate(P, m, schedule, v)
    except ValueError as error:
        return str(error).split("; ")[0]
    return ""


def _sparse(n: int, index: np.ndarray, texts: Sequence[str]) -> list[str]:
    """``n`` texts, ``texts`` at ``index`` and ``""`` elsewhere."""
    out = [""] * n
    for i, text in zip(index.tolist(), texts):
        out[i] = text
    return out


def _by_keys_text(keys: Sequence[np.ndarray], of: Callable[..., str]) -> list[str]:
    """``of(*key)`` of each entry of the parallel arrays ``keys``, computed once per distinct key. Returns a list."""
    distinct, inverse = np.unique(np.stack(keys), axis=1, return_inverse=True)
    values = [of(*(int(x) for x in key)) for key in distinct.T]
    return [values[k] for k in inverse.reshape(-1).tolist()]


def _by_key(keys: np.ndarray, of: Callable[[int], float]) -> np.ndarray:
    """``of(key)`` of each entry of ``keys``, computed once per distinct key. Returns a float array."""
    distinct, inverse = np.unique(keys, return_inverse=True)
    values = np.array([of(int(k)) for k in distinct], dtype=float)
    return values[inverse.reshape(-1)]


def _by_keys(keys: Sequence[np.ndarray], of: Callable[..., float]) -> np.ndarray:
    """``of(*key)`` of each entry of the parallel arrays ``keys``, computed once per distinct key. Returns a float
    array."""
    distinct, inverse = np.unique(np.stack(keys), axis=1, return_inverse=True)
    values = np.array([of(*(int(x) for x in key)) for key in distinct.T], dtype=float)
    return values[inverse.reshape(-1)]


def _pipeline_lower_ms(grid: Grid, inputs: PlanInputs, evaluator: Evaluator) -> np.ndarray:
    """Per configuration, :func:`~pipeswift_lab.planning.step_bounds.closed_form_step_lower_ms` of one
    tensor-parallel rank's layers (calibrated where the plan is). Returns an array in ms."""
    sums: dict[tuple[int, int], tuple[float, float, float]] = {}
    pairs = list(zip(grid.tp.tolist(), grid.b.tolist()))
    for tp, b in set(pairs):
        table = evaluator.costs_at(tp).table(b)
        forward, backward = table["fwd_ms"].to_numpy(float), table["bwd_ms"].to_numpy(float)
        sums[(tp, b)] = (float((forward + backward).sum()), float(forward.sum()), float((forward + backward).max()))
    total, forward, slowest = (np.array([sums[pair][j] for pair in pairs]) for j in range(3))
    schedules = [s for s, _ in grid.choices]
    zero_bubble = np.array([not is_generator(s) and splits_backward(s) for s in schedules])[grid.choice]
    single = np.array([s in SINGLE_CHUNK_SCHEDULES for s in schedules])[grid.choice]
    m, P = grid.m.astype(float), grid.P.astype(float)
    lower = np.maximum.reduce([m * total / P, m * slowest, np.where(zero_bubble, forward, total)])
    filled = total / (1.0 - (1.0 - 1.0 / m) ** P)
    lower = np.where(single, np.maximum(lower, filled), lower)
    calibration = inputs.calibration
    if calibration is not None:
        scale = _by_key(grid.P, calibration.scale)
        overhead = np.array([calibration.step_overhead_ms(s) for s in schedules])[grid.choice]
        lower = lower * scale + overhead
    return lower


def _layout_terms(grid: Grid, inputs: PlanInputs, evaluator: Evaluator) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per configuration: the collectives and optimizer step of its average rank (ms, a lower bound on its busiest
    rank's), its cleanup from the average rank's checkpoint shard (s), and the reason no split of it fits memory
    (``""`` where one may)."""
    keys = np.stack([grid.P, grid.D, grid.fsdp, grid.tp])
    distinct, inverse = np.unique(keys, axis=1, return_inverse=True)
    fixed, cleanup, reasons = [], [], []
    for p, d, fsdp, tp in distinct.T.tolist():
        sibling = evaluator.at(tp, inputs.link)
        layers = sibling.layers(sibling.costs.b0)
        param_bytes = float(layers.param_bytes.sum()) if layers.param_bytes is not None else 0.0
        params = float(layers.params.sum()) if layers.params is not None else math.nan
        terms = collective_terms(inputs, (p, d, fsdp, tp), param_bytes / p, params / p)
        fixed.append(terms["allreduce_ms"] + terms["fsdp_ms"] + terms["optimizer_ms"])
        cleanup.append(inputs.checkpoint.cleanup_s(terms["_shard_bytes"]))
        try:
            sibling.check_average_fits(p, d, fsdp)
            reasons.append("")
        except ValueError as error:
            reasons.append(str(error).split("; ")[0])
    inverse = inverse.reshape(-1)
    return np.array(fixed)[inverse], np.array(cleanup)[inverse], [reasons[k] for k in inverse.tolist()]


# --------------------------------------------------------------------------- the branch and bound
class _Incumbents:
    """The best JCT found per queue wait, overall, without a pipeline and without tensor parallelism."""

    def __init__(self) -> None:
        self.best: dict[tuple[float, str], float] = {}

    @staticmethod
    def classes(P: int, tp: int) -> tuple[str, ...]:
        """The classes a configuration may be the best of."""
        return ("all",) + (("P1",) if P == 1 else ()) + (("tp1",) if tp == 1 else ())

    def threshold(self, queue_s: float, P: int, tp: int) -> float:
        """The bound at and above which a configuration improves none of its classes."""
        return max(self.best.get((queue_s, c), math.inf) for c in self.classes(P, tp))

    def add(self, queue_s: float, P: int, tp: int, total_s: float) -> None:
        """Record a feasible configuration that keeps its GPUs to its end."""
        for c in self.classes(P, tp):
            self.best[(queue_s, c)] = min(self.best.get((queue_s, c), math.inf), total_s)


def search_layouts(inputs: PlanInputs, evaluator: Evaluator) -> tuple[list[Row], pd.DataFrame]:
    """``(rows, not_weighed)``: the rows of every configuration split (rejected, pruned by its bound, or
    simulated), and a table of those pruned by their closed-form bound alone (:data:`NOT_WEIGHED`), for
    :func:`~pipeswift_lab.planning.steps.rank_table`."""
    from ..core.progress import progress_bar

    grid = enumerate_layouts(inputs)
    closed = closed_form_bounds(grid, inputs, evaluator)
    rows: list[Row] = []
    rejected = np.flatnonzero([r != "" for r in closed.reason])
    candidates = np.flatnonzero(np.isfinite(closed.bound_s))
    order = candidates[np.argsort(closed.bound_s[candidates], kind="stable")]
    incumbents = _Incumbents()
    pruned: dict[int, tuple[Row, Split]] = {}
    skipped: list[int] = []
    for i in progress_bar(order.tolist(), desc="plan", progress=inputs.progress):
        queue, p, tp = float(closed.queue_s[i]), int(grid.P[i]), int(grid.tp[i])
        threshold = incumbents.threshold(queue, p, tp)
        if not inputs.exhaustive and closed.bound_s[i] >= threshold:
            skipped.append(i)
            continue
        config = grid.config(i)
        too_full = _too_full(config, inputs, evaluator)
        if too_full:
            rows.append({**_row_of(config, float(closed.queue_s[i])), "feasible": False, "reason": too_full})
            continue
        _weigh(config, inputs, evaluator, rows, pruned, incumbents, threshold)
    _simulate_bubble_pick(grid, closed, skipped, rows, pruned, inputs, evaluator)
    reasons = [closed.reason[i] for i in rejected.tolist()] + [NOT_WEIGHED] * len(skipped)
    return rows, _closed_frame(grid, closed, np.concatenate([rejected, np.asarray(skipped, dtype=np.int64)]), reasons)


def _too_full(config: Config, inputs: PlanInputs, evaluator: Evaluator) -> str:
    """Why no split of ``config`` fits ``mem_per_gpu_bytes`` by the closed-form bound on its fullest rank
    (:mod:`.memory_bound`; within the tolerance the splits are held to), or ``""`` where one may."""
    limit = inputs.mem_per_gpu_bytes
    if limit is None:
        return ""
    p, d, m, b, schedule, v, fsdp, tp = config
    sibling = evaluator.at(tp, pipeline_link_of(inputs, (p, d, fsdp, tp)))  # the one that splits it, if it comes to it
    need = sibling.fullest_rank_lower_bytes(p, m, b, schedule, v, d, fsdp)
    if need <= limit * (1 + MEM_RTOL):
        return ""
    return (
        f"needs at least {need / 2**30:.3g} GiB per GPU on its fullest rank (its training state and the "
        f"micro-batches it holds in flight, however split) > mem_per_gpu_bytes={limit:.4g}"
    )


def _row_of(config: Config, queue_s: float) -> Row:
    """The row of ``config`` before it is weighed: its layout and its strategy."""
    p, d, m, b, schedule, v, fsdp, tp = config
    return {
        "strategy": "now" if queue_s == 0 else "wait",
        "change": "",
        "P": p,
        "D": d,
        "fsdp": fsdp,
        "tp": tp,
        "gpus": p * d * fsdp * tp,
        "m": m,
        "microbatch_size": b,
        "schedule": schedule,
        "v": v,
    }


def _weigh(
    config: Config,
    inputs: PlanInputs,
    evaluator: Evaluator,
    rows: list[Row],
    pruned: dict[int, tuple[Row, Split]],
    incumbents: _Incumbents,
    threshold: float,
) -> None:
    """Split ``config`` and bound it by its busiest rank; simulate it unless that bound reaches ``threshold``. Appends
    its row to ``rows`` (a pruned one's index to ``pruned``) and records a simulated feasible one."""
    from ..core.display import distinct_hours

    row, split, reason = bound_config(config, inputs, evaluator)
    if split is None:
        rows.append({**row, "feasible": False, "reason": reason})
        return
    lower = row["jct_lower_bound_s"]
    if not inputs.exhaustive and lower >= threshold:
        bound_text, best_text = distinct_hours(lower, threshold)
        why = f"not simulated: its JCT lower bound {bound_text} is no shorter than the best {best_text} at its wait"
        pruned[len(rows)] = (row, split)
        rows.append({**row, "feasible": True, "simulated": False, "reason": why})
        return
    rows.append(evaluate(inputs, evaluator, row, split))
    done = rows[-1]
    if done["feasible"]:
        total = sum(done[t] for t in TERMS)
        if first_drop(inputs.availability, done["gpus"], done["queue_s"], total) is None:
            incumbents.add(done["queue_s"], done["P"], done["tp"], total)


def _closed_frame(grid: Grid, closed: ClosedForm, index: np.ndarray, reasons: Sequence[str]) -> pd.DataFrame:
    """The rows of the configurations ``index`` that the closed forms settle (those that cannot run, and those
    pruned by their closed-form bound, :data:`NOT_WEIGHED`), each with its reason, built column by column."""
    queue = closed.queue_s[index]
    schedules = np.array([s for s, _ in grid.choices], dtype=object)
    return pd.DataFrame(
        {
            "strategy": np.where(queue == 0, "now", "wait"),
            "change": "",
            "P": grid.P[index],
            "D": grid.D[index],
            "fsdp": grid.fsdp[index],
            "tp": grid.tp[index],
            "gpus": grid.gpus[index],
            "m": grid.m[index],
            "microbatch_size": grid.b[index],
            "schedule": schedules[grid.choice[index]],
            "v": grid.v[index],
            "feasible": False,
            "simulated": False,
            "reason": list(reasons),
            "queue_s": queue,
            "assembly_s": closed.assembly_s[index],
            "jct_lower_bound_s": closed.bound_s[index],
        }
    )


def _simulate_bubble_pick(
    grid: Grid,
    closed: ClosedForm,
    skipped: list[int],
    rows: list[Row],
    pruned: dict[int, tuple[Row, Split]],
    inputs: PlanInputs,
    evaluator: Evaluator,
) -> None:
    """Simulate the pipelined configuration with the smallest closed-form bubble on the best's GPU count (split
    first if the closed-form bound pruned it), unless a simulated one already has a bubble as small."""
    done = [r for r in rows if r.get("simulated") and r["feasible"] and r["strategy"] in HOLDING]
    if not done:
        return
    gpus_best = min(done, key=lambda r: sum(r[t] for t in TERMS))["gpus"]
    pool: list[tuple[tuple[float, int], int, bool]] = []
    for k, (row, _) in pruned.items():
        if row["P"] > 1 and row["gpus"] == gpus_best:
            pool.append((by_bubble(row["P"], row["m"], row["schedule"], row["v"]), k, True))
    for i in skipped:
        if grid.P[i] > 1 and grid.gpus[i] == gpus_best:
            p, _, m, _, schedule, v, _, _ = grid.config(i)
            pool.append((by_bubble(p, m, schedule, v), i, False))
    if not pool:
        return
    key, k, was_split = min(pool, key=lambda item: item[0])
    rivals = [by_bubble(r["P"], r["m"], r["schedule"], r["v"]) for r in done if r["P"] > 1 and r["gpus"] == gpus_best]
    if rivals and key >= min(rivals):
        return
    if was_split:
        rows[k] = evaluate(inputs, evaluator, *pruned[k])
        return
    row, fresh, reason = bound_config(grid.config(k), inputs, evaluator)
    skipped.remove(k)
    rows.append(
        {**row, "feasible": False, "reason": reason} if fresh is None else evaluate(inputs, evaluator, row, fresh)
    )
