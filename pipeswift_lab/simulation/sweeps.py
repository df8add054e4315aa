"""Sweeps over pipeline configurations, and the explorer's pure core.

:func:`sweep` partitions and simulates every combination of ranks ``P``, micro-batches
``m``, schedules and split methods, and tabulates step time, bubble, peak memory and the
training term of JCT, ``steps * step_ms``. Combinations torch refuses (or that do not fit a
memory cap) stay in the table with ``feasible=False`` and the ``reason``.
:func:`plot_sweep` draws a table as a heatmap; :func:`explore` is what the notebook explorer
calls for one configuration.
"""

from __future__ import annotations

import itertools
import math
import numbers

import pandas as pd

from ..core.checks import check_int
from ..core.link import check_link
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, canonical_schedule, default_v, validate
from ..partitioning.balance import METHODS, Partition, _Layers, memory_cap, partition
from ..partitioning.layers import rank_totals
from .simulator import simulate
from .timeline import Timeline

#: Columns of :func:`sweep`'s table, in order.
SWEEP_COLUMNS = (
    "P", "m", "schedule", "v", "method", "feasible", "reason", "step_ms", "bubble_ratio",
    "bottleneck_ms", "peak_mem_bytes", "training_s",
)  # fmt: skip


def _as_list(name, values, kind):
    if isinstance(values, (str, numbers.Integral)) and not isinstance(values, bool):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a {kind} or a list of them; got {type(values).__name__} {values!r}") from None
    if not values:
        raise ValueError(f"{name} is empty; give at least one value")
    return values


def peak_memory_bytes(part: Partition, timeline: Timeline) -> float:
    """Largest rank memory: parameters, gradients and optimizer state of its stages plus its simulated peak activations.

    Returns NaN when the profile has no ``param_bytes`` or ``activation_bytes``.
    """
    if any(math.isnan(x) for x in part.stage_state_bytes) or any(math.isnan(x) for x in part.stage_activation_bytes):
        return math.nan
    static = rank_totals(part.stage_state_bytes, part.stage_to_rank, part.P)
    act = timeline.peak_activation_bytes
    return float(max(static[r] + act[r] for r in range(part.P)))


def explore(
    profile,
    P,
    m,
    schedule="1F1B",
    *,
    method="balanced",
    v=None,
    link=None,
    optimizer="adam",
    wgrad_fraction=None,
    calibration=None,
    precision=None,
) -> tuple[Partition, Timeline]:
    """Partition ``profile`` for ``(P, schedule, method)`` and simulate ``m`` micro-batches.

    ``v`` defaults to 1 for GPipe/1F1B and 2 for the multi-chunk schedules; ``calibration``
    (from :func:`~pipeswift_lab.fidelity.calibrator.calibrate`) makes the simulation a calibrated one; ``precision``
    sets the bytes of training state per parameter (:func:`~pipeswift_lab.partitioning.balance.partition`).
    Returns ``(Partition, Timeline)``; raises ``ValueError`` for combinations torch refuses.
    """
    schedule = canonical_schedule(schedule)
    v = default_v(schedule) if v is None else v
    validate(P, m, schedule, v)
    part = partition(
        profile, P, method=method, v=v, schedule=schedule, link=link, optimizer=optimizer, m=m, precision=precision
    )
    return part, simulate(part, m, schedule=schedule, link=link, wgrad_fraction=wgrad_fraction, calibration=calibration)


def sweep(
    profile,
    P=(2, 4),
    m=(4, 8, 16),
    *,
    schedules=("1F1B",),
    methods=("balanced",),
    v=None,
    steps=None,
    link=None,
    mem_per_gpu_bytes=None,
    optimizer="adam",
    wgrad_fraction=None,
    progress=True,
    calibration=None,
    precision=None,
) -> pd.DataFrame:
    """Simulate every combination of ``P`` x ``m`` x ``schedules`` x ``methods`` (x ``v``).

    ``v`` (one value or a list) sets the chunks per rank of the multi-chunk schedules;
    None means 2. GPipe and 1F1B always use 1, ZBV/DualPipeV only 2. ``steps`` (training
    steps) gives ``training_s = steps * step_ms / 1000``, the training term of JCT (NaN when
    None). Returns a DataFrame with :data:`SWEEP_COLUMNS`: ``peak_mem_bytes`` is the
    largest rank's parameters, gradients, optimizer state and simulated peak activations;
    infeasible rows carry ``feasible=False``, the ``reason`` and NaN metrics. ``precision``
    sets the bytes of training state per parameter (:func:`~pipeswift_lab.partitioning.balance.partition`). A ``tqdm``
    progress bar shows unless ``progress=False``. With a ``calibration`` (from
    :func:`~pipeswift_lab.fidelity.calibrator.calibrate`) every configuration is simulated calibrated and
    ``step_ms`` is the whole predicted step: the calibrated action span plus the runtime's
    per-step overhead (:func:`~pipeswift_lab.fidelity.calibrator.whole_step_ms`). ``mem_per_gpu_bytes``
    caps each rank's memory, as in :func:`~pipeswift_lab.partitioning.balance.partition` and
    :func:`~pipeswift_lab.plan`.
    """
    from .calibration import check_calibration, whole_step_ms

    calibration = check_calibration(calibration)
    mem_per_gpu_bytes = memory_cap(mem_per_gpu_bytes)
    layers = _Layers(profile)
    Ps = [check_int("P", p, minimum=1) for p in _as_list("P", P, "int")]
    ms = [check_int("m", x, minimum=1) for x in _as_list("m", m, "int")]
    scheds = [canonical_schedule(s) for s in _as_list("schedules", schedules, "schedule name")]
    meths = _as_list("methods", methods, "method name")
    for meth in meths:
        if meth not in METHODS:
            raise ValueError(f"methods holds {meth!r}; valid methods are {list(METHODS)}")
    vs = None if v is None else [check_int("v", x, minimum=1) for x in _as_list("v", v, "int")]
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
    link = check_link(link)

    combos = []
    for p, sched, meth in itertools.product(Ps, scheds, meths):
        if sched in SINGLE_CHUNK_SCHEDULES:
            chunk_options = [1]
        elif vs is None:
            chunk_options = [2]
        else:
            chunk_options = vs
        for chunks in chunk_options:
            for mm in ms:
                combos.append((p, mm, sched, chunks, meth))

    from ..core.progress import progress_bar

    parts: dict = {}
    rows = []
    for p, mm, sched, chunks, meth in progress_bar(combos, desc="sweep", progress=progress, leave=False):
        row = {"P": p, "m": mm, "schedule": sched, "v": chunks, "method": meth, "feasible": False, "reason": ""}
        try:
            if p * chunks > layers.n:
                raise ValueError(f"P*v={p * chunks} stages exceed the {layers.n} profiled layers")
            validate(p, mm, sched, chunks)
            placement = "v" if sched in V_SHAPE_SCHEDULES else "loop"
            key = (p, chunks, placement, meth) if mem_per_gpu_bytes is None else (p, chunks, sched, meth, mm)
            if key not in parts:
                parts[key] = partition(
                    layers.df, p, method=meth, v=chunks, schedule=sched, link=link,
                    mem_per_gpu_bytes=mem_per_gpu_bytes, optimizer=optimizer, m=None if mem_per_gpu_bytes is None else mm, precision=precision,
                )  # fmt: skip
            part = parts[key]
            tl = simulate(part, mm, schedule=sched, link=link, wgrad_fraction=wgrad_fraction, calibration=calibration)
        except ValueError as exc:
            row["reason"] = str(exc)
            row.update(
                {
                    "step_ms": math.nan,
                    "bubble_ratio": math.nan,
                    "bottleneck_ms": math.nan,
                    "peak_mem_bytes": math.nan,
                    "training_s": math.nan,
                }
            )
            rows.append(row)
            continue
        step = whole_step_ms(tl)
        row.update(
            feasible=True,
            step_ms=step,
            bubble_ratio=tl.bubble_ratio,
            bottleneck_ms=part.bottleneck_ms,
            peak_mem_bytes=peak_memory_bytes(part, tl),
            training_s=steps * step / 1000.0 if steps is not None else math.nan,
        )
        rows.append(row)
    out = pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))
    out["feasible"] = out["feasible"].astype(bool)
    return out


def plot_sweep(df: pd.DataFrame, *, x="m", y="P", value="step_ms", ax=None, annot=True, fmt=".3g"):
    """Heatmap of ``value`` over ``x`` and ``y`` from a :func:`sweep` table; returns the Axes.

    Filter the table to one schedule and method first when it holds several: each
    ``(x, y)`` cell must be unique among the feasible rows.
    """
    from ..core.plot import get_ax

    for col in (x, y, value):
        if col not in df.columns:
            raise ValueError(f"column {col!r} is not in the sweep table; columns are {list(df.columns)}")
    data = df[df["feasible"]] if "feasible" in df.columns else df
    if data.duplicated([x, y]).any():
        dup = data[data.duplicated([x, y], keep=False)].iloc[0]
        others = [c for c in ("schedule", "method", "v") if c in data.columns and data[c].nunique() > 1]
        raise ValueError(f"several rows share {x}={dup[x]}, {y}={dup[y]}; filter the table by {others} first")
    grid = data.pivot(index=y, columns=x, values=value).sort_index(ascending=False)
    import seaborn as sns

    ax = get_ax(ax, figsize=(1.0 + 0.9 * max(3, grid.shape[1]), 1.0 + 0.55 * max(3, grid.shape[0])))
    sns.heatmap(grid.astype(float), annot=annot, fmt=fmt, cmap="viridis_r", ax=ax, cbar_kws={"label": value})
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    title = ", ".join(
        f"{c}={data[c].iloc[0]}" for c in ("schedule", "method") if c in data.columns and data[c].nunique() == 1
    )
    ax.set_title(f"{value}" + (f" ({title})" if title else ""))
    return ax


__all__ = ["SWEEP_COLUMNS", "explore", "peak_memory_bytes", "plot_sweep", "sweep"]
