"""Sweeps over pipeline configurations, and the explorer's pure core.

:func:`sweep` partitions and simulates every combination of ranks ``P``, micro-batches
``m``, schedules and split methods, and tabulates step time, bubble, peak memory and the
training term of JCT, ``steps * step_ms``, in a :class:`Sweep`. Combinations torch refuses (or that do not fit a
memory cap) stay in the table with ``feasible=False`` and the ``reason``. :meth:`Sweep.plot` draws the table as a
heatmap; :func:`explore` is what the notebook explorer calls for one configuration.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..core.checks import check_choice, check_int
from ..core.display import html_card, text_card
from ..core.link import Link, check_link
from ..core.schedule import Schedule, ScheduleLike, schedule_from_meta
from ..core.schedule_generators import generate, generator_name, is_generator, takes_v
from ..core.vocabulary import SINGLE_CHUNK_SCHEDULES, canonical_schedule, default_v, stage_to_rank, validate
from ..partitioning.balance import METHODS, partition
from ..partitioning.layers import Layers
from ..partitioning.memory import memory_cap, rank_totals
from ..partitioning.stages import Partition
from .calibration import SimulatorCalibration, check_calibration, whole_step_ms
from .reconciliation import reconcile
from .simulator import simulate
from .timeline import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Columns of :func:`sweep`'s table, in order.
SWEEP_COLUMNS = (
    "P",
    "m",
    "schedule",
    "v",
    "method",
    "feasible",
    "reason",
    "step_ms",
    "bubble_ratio",
    "bottleneck_ms",
    "peak_mem_bytes",
    "training_s",
)
#: The metric columns, NaN in an infeasible row.
METRICS = ("step_ms", "bubble_ratio", "bottleneck_ms", "peak_mem_bytes", "training_s")


@dataclass(frozen=True, eq=False, repr=False)
class Sweep:
    """The table of a :func:`sweep`, one row per configuration, with :meth:`plot` and a card in notebooks.

    ``df`` has the :data:`SWEEP_COLUMNS`. A Sweep reads as its table: ``sweep["step_ms"]``, ``sweep.iloc[0]``,
    ``sweep[sweep.schedule == "1F1B"]``, ``len(sweep)`` and every other DataFrame attribute go to ``df`` (and a
    column assigned, ``sweep["x"] = ...``, is added to it).
    """

    df: pd.DataFrame
    """One row per configuration: :data:`SWEEP_COLUMNS`."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What was swept: ``steps``, ``calibration`` (its label, or None), ``mem_per_gpu_bytes``, ``link``."""

    # ------------------------------------------------------------------ the table
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("df", "meta"):  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.df, name)

    def __getitem__(self, key: Any) -> Any:
        return self.df[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.df[key] = value

    def __len__(self) -> int:
        return len(self.df)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.df)

    def __contains__(self, key: Any) -> bool:
        return key in self.df

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.df)))

    @property
    def feasible(self) -> pd.DataFrame:
        """The rows torch accepts (and that fit the memory cap)."""
        return self.df[self.df["feasible"]]

    # ------------------------------------------------------------------ display
    def plot(
        self,
        ax: Axes | None = None,
        *,
        x: str = "m",
        y: str = "P",
        value: str = "step_ms",
        annot: bool = True,
        fmt: str = ".3g",
        **where: Any,
    ) -> Axes:
        """Heatmap of ``value`` over ``x`` and ``y`` among the feasible rows; returns the Axes.

        ``where`` keeps the rows whose columns equal the values given (``schedule="1F1B"``, ``method="balanced"``):
        each ``(x, y)`` cell must be unique, so a sweep of several schedules or methods needs them.
        """
        return heatmap(self.df, ax=ax, x=x, y=y, value=value, annot=annot, fmt=fmt, **where)

    def _summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"configurations": len(self.df), "feasible": int(self.df["feasible"].sum())}
        rows = self.feasible
        if len(rows):
            best = rows.loc[rows["step_ms"].idxmin()]
            out["fastest"] = f"P={best['P']}, m={best['m']}, {best['schedule']} v={best['v']}, {best['method']}"
            out["fastest step_ms"] = float(best["step_ms"])
        out.update({k: v for k, v in self.meta.items() if v is not None})
        return out

    def _repr_html_(self) -> str:
        return html_card(f"Sweep of {len(self.df)} configurations", self._summary(), self.df)

    def __repr__(self) -> str:
        return text_card("Sweep", self._summary())


def peak_memory_bytes(part: Partition, timeline: Timeline, schedule: ScheduleLike | None = None) -> float:
    """Largest rank memory: the partition's replayed peak at the simulated ``m`` and schedule (weights, gradients,
    optimizer state, activations in flight, buffers and transients; :meth:`Partition.memory`). ``schedule`` is the one
    simulated (default: the one the timeline records). Returns NaN when the profile has no ``param_bytes`` or
    ``activation_bytes``.
    """
    if any(math.isnan(x) for x in part.stage_state_bytes) or any(math.isnan(x) for x in part.stage_activation_bytes):
        return math.nan
    if part.layers is not None and "schedule" in timeline.meta:
        if schedule is None:  # read back from the record (a Schedule's order is parsed and checked again)
            schedule = schedule_from_meta(timeline.meta)
        return float(part.memory(m=timeline.meta.get("m"), schedule=schedule)["predicted_peak_bytes"].max())
    static = rank_totals(part.stage_state_bytes, part.stage_to_rank, part.P)  # no per-layer profile: the timeline's
    act = timeline.peak_activation_bytes
    return float(max(static[r] + act[r] for r in range(part.P)))


def explore(
    profile: Any,
    P: int,
    m: int,
    schedule: ScheduleLike = "1F1B",
    *,
    method: str = "balanced",
    v: int | None = None,
    link: Link | None = None,
    optimizer: str = "adam",
    wgrad_fraction: float | None = None,
    calibration: SimulatorCalibration | None = None,
    precision: str | None = None,
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


# --------------------------------------------------------------------------- the sweep
@dataclass(frozen=True, kw_only=True)
class _Grid:
    """:func:`sweep`'s arguments, checked: the axes of the grid and what every configuration shares."""

    layers: Layers
    """The profile's per-layer table, read once."""
    Ps: list[int]
    """Ranks to try."""
    ms: list[int]
    """Micro-batches to try."""
    schedules: list[Any]
    """Schedules to try: names (canonical), Schedules and generators."""
    methods: list[str]
    """Split methods to try."""
    vs: list[int] | None
    """Chunks per rank for the interleaved schedules (None: 2)."""
    steps: int | None
    """Training steps of ``training_s`` (None: NaN)."""
    link: Link | None
    """Transfers between ranks (None: free)."""
    mem_per_gpu_bytes: float | None
    """Memory cap per rank (None: no cap)."""
    optimizer: str
    """Optimizer whose state the memory counts."""
    wgrad_fraction: float | None
    """Weight-grad share of the backward (None: the profile's, else the default)."""
    calibration: SimulatorCalibration | None
    """Calibration every simulation applies (None: none)."""
    precision: str | None
    """Bytes of training state per parameter (None: fp32)."""


@dataclass(frozen=True)
class _Config:
    """One configuration of the grid."""

    P: int
    m: int
    schedule: ScheduleLike
    v: int
    method: str


def sweep(
    profile: Any,
    P: int | Iterable[int] = (2, 4),
    m: int | Iterable[int] = (4, 8, 16),
    *,
    schedules: Any = ("1F1B",),
    methods: str | Iterable[str] = ("balanced",),
    v: int | Iterable[int] | None = None,
    steps: int | None = None,
    link: Link | None = None,
    mem_per_gpu_bytes: float | None = None,
    optimizer: str = "adam",
    wgrad_fraction: float | None = None,
    progress: bool = True,
    calibration: SimulatorCalibration | None = None,
    precision: str | None = None,
) -> Sweep:
    """Simulate every combination of ``P`` x ``m`` x ``schedules`` x ``methods`` (x ``v``); return a :class:`Sweep`.

    ``schedules`` holds names, :class:`~pipeswift_lab.Schedule` orders (weighed where their ``P`` and ``m`` are the
    row's) and generators: :mod:`pipeswift_lab.schedules`' functions or any callable ``(P, m)`` or ``(P, m, v)``
    returning a Schedule, called for every row (a row it refuses says why).

    ``v`` (one value or a list) sets the chunks per rank of the multi-chunk schedules;
    None means 2. GPipe and 1F1B always use 1, ZBV/DualPipeV only 2. ``steps`` (training
    steps) gives ``training_s = steps * step_ms / 1000``, the training term of JCT (NaN when
    None). The Sweep's table has :data:`SWEEP_COLUMNS`: ``peak_mem_bytes`` is the
    largest rank's parameters, gradients, optimizer state and simulated peak activations;
    infeasible rows carry ``feasible=False``, the ``reason`` and NaN metrics. ``precision``
    sets the bytes of training state per parameter (:func:`~pipeswift_lab.partitioning.balance.partition`). A
    ``tqdm`` progress bar shows unless ``progress=False``. With a ``calibration`` (from
    :func:`~pipeswift_lab.fidelity.calibrator.calibrate`) every configuration is simulated calibrated and
    ``step_ms`` is the whole predicted step: the calibrated action span plus the runtime's
    per-step overhead (:func:`~pipeswift_lab.simulation.calibration.whole_step_ms`). ``mem_per_gpu_bytes``
    caps each rank's memory, as in :func:`~pipeswift_lab.partitioning.balance.partition` and
    :func:`~pipeswift_lab.plan`.
    """
    from ..core.progress import progress_bar

    grid = _check_grid(
        profile,
        P,
        m,
        schedules,
        methods,
        v,
        steps=steps,
        link=link,
        mem_per_gpu_bytes=mem_per_gpu_bytes,
        optimizer=optimizer,
        wgrad_fraction=wgrad_fraction,
        calibration=calibration,
        precision=precision,
    )
    parts: dict[tuple, Partition] = {}
    configs = progress_bar(_configurations(grid), desc="sweep", progress=progress, leave=False)
    rows = [_row(grid, config, parts) for config in configs]
    return _assemble(grid, rows)


def _check_grid(
    profile: Any,
    P: Any,
    m: Any,
    schedules: Any,
    methods: Any,
    v: Any,
    *,
    steps: int | None,
    link: Link | None,
    mem_per_gpu_bytes: float | None,
    optimizer: str,
    wgrad_fraction: float | None,
    calibration: SimulatorCalibration | None,
    precision: str | None,
) -> _Grid:
    """Every argument of :func:`sweep` checked once; the grid's axes as lists."""
    return _Grid(
        layers=Layers(profile),
        Ps=[check_int("P", p, minimum=1) for p in _as_list("P", P, "int")],
        ms=[check_int("m", x, minimum=1) for x in _as_list("m", m, "int")],
        schedules=[
            s if is_generator(s) else canonical_schedule(s) for s in _as_list("schedules", schedules, "schedule name")
        ],
        methods=[check_choice("methods", meth, METHODS) for meth in _as_list("methods", methods, "method name")],
        vs=None if v is None else [check_int("v", x, minimum=1) for x in _as_list("v", v, "int")],
        steps=None if steps is None else check_int("steps", steps, minimum=1),
        link=check_link(link),
        mem_per_gpu_bytes=memory_cap(mem_per_gpu_bytes),
        optimizer=optimizer,
        wgrad_fraction=wgrad_fraction,
        calibration=check_calibration(calibration),
        precision=precision,
    )


def _as_list(name: str, values: Any, kind: str) -> list[Any]:
    """``values`` as a non-empty list (one value becomes a list of one)."""
    if isinstance(values, (str, numbers.Integral)) and not isinstance(values, bool):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a {kind} or a list of them; got {type(values).__name__} {values!r}") from None
    if not values:
        raise ValueError(f"{name} is empty; give at least one value")
    return values


def _configurations(grid: _Grid) -> list[_Config]:
    """Every configuration of the grid, in table order: P, schedule, method, v, then m."""
    out = []
    for p, sched, meth in itertools.product(grid.Ps, grid.schedules, grid.methods):
        if is_generator(sched):
            chunk_options = (grid.vs or [1]) if takes_v(sched) else [0]  # 0: the generator's own v
        elif isinstance(sched, Schedule):
            chunk_options = [sched.v]
        elif sched in SINGLE_CHUNK_SCHEDULES:
            chunk_options = [1]
        else:
            chunk_options = [2] if grid.vs is None else grid.vs
        out += [_Config(p, mm, sched, chunks, meth) for chunks in chunk_options for mm in grid.ms]
    return out


def _row(grid: _Grid, config: _Config, parts: dict[tuple, Partition]) -> dict[str, Any]:
    """The table row of one configuration: its metrics, or ``feasible=False`` and the reason."""
    label = generator_name(config.schedule) if is_generator(config.schedule) else str(config.schedule)
    row: dict[str, Any] = {
        "P": config.P,
        "m": config.m,
        "schedule": label,
        "v": config.v,
        "method": config.method,
        "feasible": False,
        "reason": "",
    }
    try:
        if is_generator(config.schedule):
            made = generate(config.schedule, config.P, config.m, config.v or 1)
            config = _Config(config.P, config.m, made, made.v, config.method)
            row.update(schedule=made.name, v=made.v)
        part, tl = _simulate_config(grid, config, parts)
    except ValueError as exc:
        return {**row, "reason": str(exc), **dict.fromkeys(METRICS, math.nan)}
    step = whole_step_ms(tl)
    return {
        **row,
        "feasible": True,
        "step_ms": step,
        "bubble_ratio": tl.bubble_ratio,
        "bottleneck_ms": part.bottleneck_ms,
        "peak_mem_bytes": peak_memory_bytes(part, tl, config.schedule),
        "training_s": grid.steps * step / 1000.0 if grid.steps is not None else math.nan,
    }


def _simulate_config(grid: _Grid, config: _Config, parts: dict[tuple, Partition]) -> tuple[Partition, Timeline]:
    """Partition (once per placement, or per configuration under a memory cap) and simulate one configuration."""
    p, mm, sched, chunks, meth = config.P, config.m, config.schedule, config.v, config.method
    if p * chunks > grid.layers.n:
        raise ValueError(f"P*v={p * chunks} stages exceed the {grid.layers.n} profiled layers")
    validate(p, mm, sched, chunks)
    capped = grid.mem_per_gpu_bytes is not None
    key = (p, chunks, sched, meth, mm) if capped else (p, chunks, stage_to_rank(p, chunks, sched), meth)
    if key not in parts:
        parts[key] = partition(
            grid.layers.df,
            p,
            method=meth,
            v=chunks,
            schedule=sched,
            link=grid.link,
            mem_per_gpu_bytes=grid.mem_per_gpu_bytes,
            optimizer=grid.optimizer,
            m=mm if capped else None,
            precision=grid.precision,
        )
    part = parts[key]
    shape = reconcile(part, sched, v=chunks, m=mm)  # a partition shared by the schedules of one placement
    tl = simulate(
        part, mm, shape.schedule, link=grid.link, wgrad_fraction=grid.wgrad_fraction, calibration=grid.calibration
    )
    return part, tl


def _assemble(grid: _Grid, rows: list[dict[str, Any]]) -> Sweep:
    """The rows as a :class:`Sweep` with what was swept."""
    df = pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))
    df["feasible"] = df["feasible"].astype(bool)
    meta = {
        "steps": grid.steps,
        "calibration": grid.calibration.label if grid.calibration is not None else None,
        "mem_per_gpu_bytes": grid.mem_per_gpu_bytes,
        "link": grid.link.as_dict() if grid.link is not None else None,
    }
    return Sweep(df, meta)


# --------------------------------------------------------------------------- the heatmap
def heatmap(
    table: pd.DataFrame | Sweep,
    *,
    ax: Axes | None = None,
    x: str = "m",
    y: str = "P",
    value: str = "step_ms",
    annot: bool = True,
    fmt: str = ".3g",
    **where: Any,
) -> Axes:
    """Heatmap of ``value`` over ``x`` and ``y`` from a sweep table, its rows filtered by ``where``; returns the Axes
    (:meth:`Sweep.plot`)."""
    from ..core.plot import get_ax

    df = table.df if isinstance(table, Sweep) else table
    for col in (x, y, value, *where):
        if col not in df.columns:
            raise ValueError(f"column {col!r} is not in the sweep table; columns are {list(df.columns)}")
    data = df[df["feasible"]] if "feasible" in df.columns else df
    for col, wanted in where.items():
        data = data[data[col] == wanted]
    if data.duplicated([x, y]).any():
        dup = data[data.duplicated([x, y], keep=False)].iloc[0]
        others = [c for c in ("schedule", "method", "v") if c in data.columns and data[c].nunique() > 1]
        raise ValueError(
            f"several rows share {x}={dup[x]}, {y}={dup[y]}; filter the table by {others} first "
            f"(e.g. .plot({others[0] if others else 'schedule'}=...))"
        )
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


__all__ = ["METRICS", "SWEEP_COLUMNS", "Sweep", "explore", "heatmap", "peak_memory_bytes", "sweep"]
