"""A user-defined pipeline schedule: the ordered compute actions of every rank.

torch runs such orders: ``_PipelineScheduleRuntime`` loads compute-only action lists (its ``_load_csv``, torchtitan's
``pipeline_parallel_schedule_csv``), infers which rank holds which stage from them, and lowers them to sends,
receives and gradient reductions. :class:`Schedule` is that order as a value the whole toolkit accepts wherever a
schedule name is accepted: the simulator replays it, the memory model follows its in-flight activations, the runner
hands it to torch's runtime, the planner searches it.

Each action is ``(kind, stage, microbatch)`` with ``kind`` one of torch's compute types: ``F`` forward, ``B`` full
backward, ``I`` input gradient, ``W`` weight gradient (an ``I`` keeps what its ``W`` needs until the ``W`` runs).
A CSV cell spells it as torch does: ``{stage}{kind}{microbatch}``, e.g. ``0F0``, ``1I2``, ``1W2``, ``0B3``; torch's
overlapped forward-backward step (DualPipeV's) as ``(3F2;0B0)OVERLAP_F_B``, a group whose sends go out after both
parts ran.

Everything is checked when a Schedule is made, before anything runs: the cells parse,
every stage of every micro-batch has its forward and its backward exactly once, an ``I`` has its ``W``, each stage
uses one backward form, each stage sits on one rank, every rank holds the same number of stages, and the order can
finish (its dependencies are replayed, cross-rank sends included; :class:`ScheduleDeadlock` names the first rank that
would wait forever, its action and what it waits for). A Schedule that exists is one that can run.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Union

from .schedule_cells import KINDS, Action, Groups, group_cell, is_cell, parse_cell, parse_group
from .schedule_checks import ScheduleDeadlock, check_actions, check_finishes, check_placement

__all__ = [
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleLike",
    "held_chunks",
    "schedule_from_meta",
    "schedule_meta",
    "torch_actions",
]


def _group(item: Any, where: str) -> tuple[Action, ...]:
    """A cell, an ``(kind, stage, microbatch)`` tuple, or a list of two actions run as one OVERLAP_F_B."""
    if isinstance(item, str):
        return parse_group(item, where)
    if isinstance(item, list) and len(item) == 2:
        group = tuple(_action(a, where) for a in item)
        if sorted(k for k, _, _ in group) != ["B", "F"]:
            raise ValueError(f"{where} {item!r}: a pair runs as torch's OVERLAP_F_B, one forward and one full backward")
        return group
    return (_action(item, where),)


def _action(item: Any, where: str) -> Action:
    if isinstance(item, str):
        return parse_cell(item, where)
    if isinstance(item, Sequence) and len(item) == 3:
        kind, stage, microbatch = item
        if kind in KINDS and isinstance(stage, int) and isinstance(microbatch, int) and stage >= 0 <= microbatch:
            return str(kind), int(stage), int(microbatch)
    raise ValueError(
        f"{where} {item!r} is not a compute action: give a cell such as '1I2' or a tuple (kind, stage, microbatch) "
        "with kind one of F, B, I, W"
    )


@dataclass(frozen=True, eq=True)
class Schedule:
    """The ordered compute actions of every rank: ``actions[rank]`` is a tuple of ``(kind, stage, microbatch)``;
    ``groups[rank]`` the same grouped as torch runs them (an ``OVERLAP_F_B`` holds two).

    Make one with :meth:`from_csv`, :meth:`from_lists` or :meth:`of` (any built-in schedule); the constructors check
    it whole (see the module docstring). ``P`` ranks, ``S`` stages (``v = S / P`` per rank), ``m`` micro-batches;
    ``placement[s]`` is the rank of stage ``s``, inferred from the actions as torch infers it.
    """

    groups: Groups
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self.check()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lists(cls, lists: Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]], name: str = "custom") -> Schedule:
        """A Schedule from ``{rank: [action, ...]}`` (or a list indexed by rank); each action a cell (``"1I2"``,
        ``"(3F2;0B0)OVERLAP_F_B"``), a ``(kind, stage, microbatch)`` tuple, or a list of a forward and a backward run as
        one ``OVERLAP_F_B``. Raises ``ValueError`` (or :class:`ScheduleDeadlock`) naming the first
        problem: ranks missing, an action that does not parse, missing or repeated, an ``I`` without its ``W``, a
        stage on two ranks, an order that cannot finish."""
        if isinstance(lists, Mapping):
            ranks = sorted(lists)
            if any(not isinstance(r, int) for r in ranks) or ranks != list(range(len(ranks))):
                raise ValueError(f"a schedule's ranks must be 0..P-1; got {ranks}")
            rows = [lists[r] for r in ranks]
        else:
            rows = list(lists)
        if not rows:
            raise ValueError("a schedule needs at least one rank")
        groups = tuple(
            tuple(_group(item, f"rank {r}, position {j}:") for j, item in enumerate(row)) for r, row in enumerate(rows)
        )
        return cls(groups, str(name))

    @classmethod
    def from_csv(cls, path_or_text: str | Path, name: str | None = None) -> Schedule:
        """Read torch's compute-only CSV (``_load_csv(format="compute_only")``): row ``r`` is rank ``r``'s actions, one
        cell each (``0F0``, ``1I2``); empty cells are skipped. ``path_or_text`` is a file or the CSV text itself. A cell
        that does not parse is named by its row (rank) and column."""
        text, default_name = _read_text(path_or_text)
        rows = [[c for c in row] for row in csv.reader(io.StringIO(text))]
        while rows and not any(c.strip() for c in rows[-1]):
            rows.pop()
        parsed = []
        for r, row in enumerate(rows):
            parsed.append(
                [parse_group(c, f"row {r + 1} (rank {r}), column {j + 1}:") for j, c in enumerate(row) if c.strip()]
            )
        return cls.from_lists([[list(g) if len(g) > 1 else g[0] for g in row] for row in parsed], name or default_name)

    @classmethod
    def of(cls, name: str, P: int, m: int, v: int = 1) -> Schedule:
        """A built-in schedule (any of :data:`~pipeswift_lab.core.vocabulary.SCHEDULES`) as the action lists torch's
        runtime executes (:func:`~pipeswift_lab.core.schedule_orders.compute_orders`; DualPipeV's overlapped
        forward-backward steps as their two parts, forward first)."""
        from .schedule_orders import builtin_groups  # an import allowed to close a circle: tests/layout

        name, groups = builtin_groups(name, P, m, v)
        return cls.from_lists([[list(g) if len(g) > 1 else g[0] for g in row] for row in groups], name=name)

    # ------------------------------------------------------------------ shape
    @cached_property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Every rank's compute actions in order, an ``OVERLAP_F_B`` as its two parts (forward first)."""
        return tuple(tuple(a for group in row for a in group) for row in self.groups)

    @property
    def P(self) -> int:
        """Ranks."""
        return len(self.groups)

    @cached_property
    def S(self) -> int:
        """Stages."""
        return 1 + max((s for row in self.actions for _, s, _ in row), default=-1)

    @cached_property
    def m(self) -> int:
        """Micro-batches."""
        return 1 + max((i for row in self.actions for _, _, i in row), default=-1)

    @property
    def v(self) -> int:
        """Stages per rank."""
        return self.S // self.P

    @cached_property
    def placement(self) -> tuple[int, ...]:
        """The rank of every stage, in stage order, read from which rank runs it (as torch's ``_validate_schedule``)."""
        where: dict[int, int] = {}
        for rank, row in enumerate(self.actions):
            for _, s, _ in row:
                where.setdefault(s, rank)
        return tuple(where[s] for s in range(self.S))

    @property
    def shape(self) -> str:
        """``"loop"`` when stage ``s`` sits on rank ``s % P`` (Interleaved1F1B's placement), ``"v"`` when rank ``r``
        holds stages ``r`` and ``2P-1-r`` (ZBVZeroBubble's and DualPipeV's), ``"other"`` otherwise."""
        P = self.P
        if self.placement == tuple(s % P for s in range(self.S)):
            return "loop"
        if self.S == 2 * P and self.placement == tuple(s if s < P else 2 * P - 1 - s for s in range(2 * P)):
            return "v"
        return "other"

    @cached_property
    def splits_backward(self) -> bool:
        """Whether the backward runs as ``I`` and ``W`` (on any stage)."""
        return any(k == "I" for row in self.actions for k, _, _ in row)

    def __len__(self) -> int:
        return sum(len(row) for row in self.actions)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, P={self.P}, S={self.S}, m={self.m}, {self.shape})"

    def _repr_html_(self) -> str:
        return self.frame().to_html(max_cols=40)

    def frame(self) -> Any:
        """The order as a DataFrame: one row per rank, one column per position, cells spelled as in the CSV."""
        import pandas as pd

        return pd.DataFrame([[group_cell(g) for g in row] for row in self.groups]).fillna("").rename_axis("rank")

    def to_csv(self, path: str | Path | None = None) -> str:
        """torch's compute-only CSV (what ``_PipelineScheduleRuntime._load_csv`` and torchtitan's
        ``pipeline_parallel_schedule_csv`` read); written to ``path`` when given. Returns the text."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for row in self.groups:
            writer.writerow([group_cell(g) for g in row])
        text = buffer.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    @property
    def torchtitan_schedule(self) -> str:
        """The ``pipeline_parallel_schedule`` torchtitan needs beside this order's CSV: with
        ``pipeline_parallel_schedule_csv`` set it runs ``_PipelineScheduleRuntime``, but still takes the stage-to-rank
        mapping and the stages per rank from the named schedule (``_get_pp_rank_to_stage_indices_mapping``): a V-shaped
        order needs ``ZBVZeroBubble`` (or ``DualPipeV``), a loop with several stages per rank ``Interleaved1F1B``
        (or ``InterleavedZeroBubble``), one stage per rank ``1F1B``. Raises ``ValueError`` for a placement torchtitan
        cannot make."""
        if self.shape == "v":
            return "ZBVZeroBubble"
        if self.shape == "loop":
            return "1F1B" if self.v == 1 else "Interleaved1F1B"
        raise ValueError(
            f"schedule {self.name!r} places its stages on ranks {list(self.placement)}: torchtitan places them in a "
            "loop (stage s on rank s % P) or a V (rank r holds stages r and 2P-1-r), nothing else"
        )

    def to_torchtitan(self, path: str | Path) -> dict[str, Any]:
        """Write the order as the CSV torchtitan's ``parallelism.pipeline_parallel_schedule_csv`` reads and return the
        ``[parallelism]`` settings that go with it (degree, :attr:`torchtitan_schedule`, the CSV's path, the
        micro-batches), as a dict to put in the job's TOML or on its command line."""
        self.to_csv(path)
        return {
            "pipeline_parallel_degree": self.P,
            "pipeline_parallel_schedule": self.torchtitan_schedule,
            "pipeline_parallel_schedule_csv": str(path),
            "num_pp_microbatches": self.m,
        }

    def orders(self) -> dict[int, list[Action]]:
        """``{rank: [(kind, stage, microbatch), ...]}``, as :func:`~pipeswift_lab.core.schedule_orders.compute_orders`
        gives a named schedule's."""
        return {rank: list(row) for rank, row in enumerate(self.actions)}

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Check the order whole (done when it is made); raise ``ValueError`` (or :class:`ScheduleDeadlock`) naming the
        first problem."""
        check_actions(self)
        check_placement(self)
        check_finishes(self)

    def check_fits(self, P: int, S: int, m: int | None = None) -> None:
        """Raise ``ValueError`` unless the schedule has ``P`` ranks, ``S`` stages and (when given) ``m``
        micro-batches."""
        wrong = [
            f"{what}={got} (the {against} has {want})"
            for what, got, want, against in (
                ("P", self.P, P, "pipeline"),
                ("stages", self.S, S, "partition"),
                ("m", self.m, m, "run"),
            )
            if want is not None and got != want
        ]
        if wrong:
            raise ValueError(f"schedule {self.name!r} does not fit: it has {', '.join(wrong)}")


ScheduleLike = Union[str, Schedule]  # noqa: UP007 - a runtime alias


def _read_text(path_or_text: str | Path) -> tuple[str, str]:
    """The CSV text and a default name: the file's stem, or ``"custom"`` for text given inline."""
    if isinstance(path_or_text, Path):
        return path_or_text.read_text(), path_or_text.stem
    text = str(path_or_text)
    if "\n" in text or "," in text or is_cell(text):
        return text, "custom"
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"no schedule file {text!r} (give a path, or the CSV text itself)")
    return path.read_text(), path.stem


def schedule_meta(schedule: ScheduleLike) -> dict[str, str]:
    """What a Timeline's or a run's ``meta`` records of ``schedule``: ``schedule`` (the name) and, for a
    :class:`Schedule`, ``schedule_csv`` (its order, so that the record reads back as JSON and names the order)."""
    if isinstance(schedule, Schedule):
        return {"schedule": schedule.name, "schedule_csv": schedule.to_csv()}
    return {"schedule": str(schedule)}


def schedule_from_meta(meta: Mapping[str, Any]) -> ScheduleLike:
    """The schedule a ``meta`` written with :func:`schedule_meta` records: the :class:`Schedule` its ``schedule_csv``
    holds, else the name."""
    if meta.get("schedule_csv"):
        return Schedule.from_csv(str(meta["schedule_csv"]), name=str(meta["schedule"]))
    return str(meta["schedule"])


def torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """The order as torch's ``_Action`` lists, ``{rank: [...]}``, what ``_PipelineScheduleRuntime``'s
    ``_prepare_schedule_with_comms`` lowers (an ``OVERLAP_F_B`` as one action holding its two parts)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    def one(action: Action) -> Any:
        kind, stage, microbatch = action
        return _Action(stage, _ComputationType.from_str(kind), microbatch)

    return {
        rank: [
            one(g[0])
            if len(g) == 1
            else _Action(-1, _ComputationType.from_str("OVERLAP_F_B"), None, sub_actions=tuple(one(a) for a in g))
            for g in row
        ]
        for rank, row in enumerate(schedule.groups)
    }


def held_chunks(schedule: Schedule) -> list[int]:
    """The most stage chunks each rank holds activations for at once along its order: a chunk is held from its ``F``
    until its backward ends, until its ``W`` when the backward is split (the ``I`` keeps what the ``W`` needs)."""
    peaks = []
    for row in schedule.actions:
        held = peak = 0
        for kind, _, _ in row:
            held += 1 if kind == "F" else -1 if kind in "BW" else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
