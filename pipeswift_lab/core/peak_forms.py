"""Every rank's replayed peak (:func:`~pipeswift_lab.core.memory_model.rank_peak`) compiled once per order into
arrays, so that a split's peaks cost a few array operations instead of a Python call per action.

For a fixed order, every moment the replay considers has a total that is linear in the
:class:`~pipeswift_lab.core.memory_model.StageBytes` of the rank's ``v`` stages ``j``:

* ``weights_bytes`` and ``optimizer_bytes``: their sums over ``j``, at every moment;
* ``grads_bytes``: ``grads_j`` of the stages whose first backward (``B`` or ``W``) ran;
* ``activations_bytes``: ``held_j * activations_j``, ``held_j`` the micro-batches forwarded and not yet released
  (by ``B`` or ``W``), plus ``inputs_j * retained_j`` for the ``inputs_j`` input gradients (``B`` or ``I``) run and,
  where the schedule waits on its sends at the step's end, ``released_j * sent_output_j``;
* ``buffers_bytes``: ``m * (recv_j + grad_recv_j + batch_j) + buckets_j`` summed, plus the gradients sent and not
  waited on: ``inputs_j * sent_grad_j``, or (``1F1B``, which waits before its next send) ``sent_grad_j`` once
  stage ``j`` has run one;
* ``transient_bytes``: 0 at a forward; ``transient_j`` at a backward; at a stage's first ``B``/``W`` its
  ``first_transient_j`` when that is ``>= 0`` (the ``.grad`` not yet counted), else ``transient_j`` with the
  ``.grad`` counted; at an ``I`` its ``input_transient_j`` when that is ``>= 0``, else ``transient_j``; the
  optimizer's temporaries at the optimizer step.

So a moment is a row of counts (``held``, ``inputs``, ``graded`` per stage) and a choice of transient, compiled
from :func:`~pipeswift_lab.core.order_arrays.order_arrays`. A moment never exceeds a later one that holds as much
of everything (bytes are ``>= 0`` and ``inputs`` and ``graded`` only grow), so :class:`PeakForm` keeps only the
moments that may be a peak, as one matrix per rank::

    form = peak_form(P=8, m=16, schedule="Interleaved1F1B", v=2)  # cached by (P, m, schedule, v)
    fields = StageFields.of([stage_0_bytes, stage_1_bytes, ...])  # or SplitBytes(...).of(bounds)
    form.peaks(fields, optimizer)       # every rank's peak_bytes: one matrix product and a max
    form.rank_peaks(fields, optimizer)  # rank_peak's dicts (terms at the peak, peak_at), from every moment

``rank_peaks`` returns what the replay returns, the earliest of tied moments included, and ``peaks`` its
``peak_bytes``, both to float rounding (the sums are taken in another order). What mirrors the replay is
:func:`_moments` (what each action adds and frees, and when it is counted) and :func:`_evaluate` and
:func:`_vector` (how the terms add up); ``tests/core/test_peak_forms.py`` holds them to
:func:`~pipeswift_lab.core.memory_model.rank_peak` on random stages of every schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .memory_model import MEMORY_TERMS, OptimizerMemory, StageBytes, send_wait
from .order_arrays import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, PAD, OrderArrays, order_arrays
from .vocabulary import COMPUTE_KINDS, check_schedule_v, stage_to_rank

__all__ = ["STAGE_FIELDS", "PeakForm", "StageFields", "peak_form"]

#: The fields of :class:`~pipeswift_lab.core.memory_model.StageBytes`, in their order: the rows of
#: :attr:`StageFields.values`.
STAGE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StageBytes))

# a moment's transient: none (a forward), a backward's, a stage's first backward (rank_peak's first_transient
# branch, decided by the value), the optimizer step's, an input-gradient pass's (rank_peak's input_transient);
# PAD_ROW fills a rank's rows up to the longest rank's
NONE, TRANSIENT, FIRST, OPTIMIZER, PAD_ROW, INPUT = range(6)
_MAY_BE_NEGATIVE = ("first_transient", "input_transient")  # negative: rank_peak's other branch
# the counts of a moment, per stage: micro-batches held, input gradients run (B or I), graded (a first B or W ran),
# micro-batches released (B or W), sent (an input gradient run at all), between an I and its W
HELD, INPUTS, GRADED, RELEASED, SENT, BETWEEN = range(6)
COUNTS = 6


@dataclass(frozen=True, eq=False)
class StageFields:
    """The :class:`~pipeswift_lab.core.memory_model.StageBytes` of every stage of a split, as one array."""

    values: np.ndarray
    """``(len(STAGE_FIELDS), n_stages)``: row ``STAGE_FIELDS.index(name)`` holds field ``name`` of each stage."""

    @classmethod
    def of(cls, stages: Sequence[StageBytes]) -> StageFields:
        """The fields of ``stages``, in stage order. Returns a :class:`StageFields`."""
        values = np.array([[getattr(s, name) for s in stages] for name in STAGE_FIELDS], dtype=float)
        return cls(values.reshape(len(STAGE_FIELDS), len(stages)))

    def __getitem__(self, name: str) -> np.ndarray:
        """Field ``name`` of every stage, an array."""
        return self.values[STAGE_FIELDS.index(name)]


@dataclass(frozen=True, eq=False)
class _Rows:
    """Moments of every rank in order, padded with ``PAD_ROW`` to the rank with the most."""

    counts: np.ndarray
    """``(P, R, COUNTS, v)``: per moment and local stage, ``HELD``, ``INPUTS``, ``GRADED``, ``RELEASED`` and
    ``SENT`` as the replay counts them there (a forward's own micro-batch held; a backward's not yet released, its
    input gradient not yet run)."""
    kind: np.ndarray
    """``(P, R)``: ``NONE``, ``TRANSIENT``, ``FIRST``, ``OPTIMIZER``, ``INPUT`` or ``PAD_ROW``."""
    local: np.ndarray
    """``(P, R)``: the local stage of the moment's action (0 where there is none)."""
    action: np.ndarray
    """``(P, R)``: the action's index in its rank's order (-1 at the optimizer step and the padding)."""


@dataclass(frozen=True, eq=False)
class PeakForm:
    """The replay of every rank of one ``(P, m, schedule, v)``, compiled by :func:`peak_form`."""

    P: int
    """Ranks."""
    m: int
    """Micro-batches per step."""
    schedule: str
    """The schedule's canonical name."""
    v: int
    """Stages per rank."""
    stage_of: np.ndarray
    """``(P, v)``: each rank's stages, ascending (the order of rank_peak's ``stages`` in ``rank_memory``)."""
    matrix: np.ndarray
    """``(P, R, (COUNTS + 3)v + 2)``: per rank, the moments that may be its peak, as coefficients of
    :func:`_vector`."""
    sends: str
    """When the schedule waits on its sends (:func:`~pipeswift_lab.core.memory_model.send_wait`)."""

    def peaks(self, fields: StageFields, optimizer: OptimizerMemory) -> np.ndarray:
        """Every rank's ``peak_bytes`` with stages of ``fields`` (bytes ``>= 0``; ``first_transient`` and
        ``input_transient`` may be negative, meaning none) and ``optimizer``. Returns a ``(P,)`` array."""
        vector = _vector(self._gathered(fields), self.m, optimizer, self.sends)
        return np.matmul(self.matrix, vector[..., None])[..., 0].max(1)

    def rank_peaks(self, fields: StageFields, optimizer: OptimizerMemory) -> list[dict[str, float | str]]:
        """What :func:`~pipeswift_lab.core.memory_model.rank_peak` returns for each rank, from all its moments.
        Returns a list of dicts: ``peak_bytes``, ``{term}_bytes`` of :data:`MEMORY_TERMS` and ``peak_at``."""
        orders = self.orders()
        rows = _moments(orders, self.stage_of, forwards=True)
        total, terms = _evaluate(rows, self._gathered(fields), self.m, optimizer, self.sends)
        out: list[dict[str, float | str]] = []
        for r, t in enumerate(np.argmax(total, axis=1).tolist()):  # the earliest of equal totals, as ">" keeps
            peak = {f"{name}_bytes": float(terms[name][r, t]) for name in MEMORY_TERMS}
            a = int(rows.action[r, t])
            where = (
                f"{COMPUTE_KINDS[orders.kind[r, a]]} stage {orders.stage[r, a]} mb {orders.mb[r, a]}"
                if a >= 0
                else "optimizer step"
            )
            out.append({"peak_bytes": sum(peak.values()), **peak, "peak_at": where})
        return out

    def orders(self) -> OrderArrays:
        """The orders the form is compiled from (:func:`~pipeswift_lab.core.order_arrays.order_arrays`)."""
        return order_arrays(self.P, self.m, self.schedule, self.v, check=False)

    def _gathered(self, fields: StageFields) -> np.ndarray:
        """``(len(STAGE_FIELDS), P, v)``: each rank's stages' fields. Raises ``ValueError`` on a shape that does not
        fit or negative bytes."""
        values = fields.values
        if values.shape != (len(STAGE_FIELDS), self.P * self.v):
            raise ValueError(
                f"fields has shape {values.shape}; the {self.schedule} pipeline of P={self.P}, v={self.v} needs "
                f"({len(STAGE_FIELDS)}, {self.P * self.v}), one column per stage"
            )
        negative = values < 0
        for name in _MAY_BE_NEGATIVE:
            negative[STAGE_FIELDS.index(name)] = False
        if negative.any():
            field, stage = np.argwhere(negative)[0]
            raise ValueError(
                f"stage {stage} has {STAGE_FIELDS[field]}={float(values[field, stage])!r}; bytes must be >= 0 (only "
                f"{' and '.join(_MAY_BE_NEGATIVE)} may be negative, meaning none)"
            )
        return values[:, self.stage_of]


@lru_cache(maxsize=1024)
def peak_form(P: int, m: int, schedule: str = "1F1B", v: int = 1) -> PeakForm:
    """The :class:`PeakForm` of every rank of ``schedule`` with ``P`` ranks, ``m`` micro-batches and ``v`` stages
    per rank (cached). GPipe and 1F1B take ``m < P`` (as ``compute_orders(check=False)`` does); other combinations
    torch refuses raise ``ValueError``."""
    schedule, v = check_schedule_v(schedule, v)
    orders = order_arrays(P, m, schedule, v, check=False)
    placement = np.asarray(stage_to_rank(P, v, schedule))
    stage_of = np.argsort(placement, kind="stable").reshape(P, v)  # a rank's stages ascend, as rank_memory's do
    matrix = _matrix(_front(_moments(orders, stage_of, forwards=False)))
    return PeakForm(
        P=int(P), m=int(m), schedule=schedule, v=int(v), stage_of=stage_of, matrix=matrix, sends=send_wait(schedule)
    )


def _moments(orders: OrderArrays, stage_of: np.ndarray, *, forwards: bool) -> _Rows:
    """The moments :func:`~pipeswift_lab.core.memory_model.rank_peak` considers, one per action and the optimizer
    step, in its order; ``forwards=False`` leaves out the forwards' (each holds no more than the action after it).

    The held counts are rank_peak's ``held`` where every rank forwards each of its (stage, micro-batch) once and
    releases it once after, by ``B`` or ``W`` (``tests/core/test_order_arrays.py`` checks torch's orders do)."""
    P, v = stage_of.shape
    local_of = np.empty(P * v, dtype=np.int64)
    local_of[stage_of] = np.broadcast_to(np.arange(v), (P, v))
    kind = orders.kind
    real = kind != PAD
    local = np.where(real, local_of[np.where(real, orders.stage, 0)], 0)
    count = np.int16 if kind.shape[1] < 2**15 else np.int64
    stages = np.arange(v)[:, None, None]  # the counts are built (v, P, actions): cumulative sums along the last axis
    forwarded = np.cumsum((local == stages) & (kind == FORWARD), axis=-1, dtype=count)
    keep = real if forwards else real & (kind != FORWARD)  # the actions whose moments are kept, moved to the front
    pick, kept = _front_columns(keep)
    kind, local = _take_rows(kind, pick), _take_rows(local, pick)
    own = (local == stages) & kept  # the action's stage
    backward = (kind == FULL_BACKWARD) | (kind == BACKWARD_WEIGHT)  # rank_peak: held.pop, graded.add at the first
    inputs = own & ((kind == FULL_BACKWARD) | (kind == BACKWARD_INPUT))  # rank_peak: input_grads += stage.recv
    releases = own & backward
    inputs_before = np.cumsum(inputs, axis=-1, dtype=count) - inputs
    releases_before = np.cumsum(releases, axis=-1, dtype=count) - releases
    flat = (np.arange(P)[:, None] * forwarded.shape[-1] + pick).ravel()
    held = forwarded.reshape(v, -1)[:, flat].reshape(releases.shape) - releases_before  # a forward holds its own
    graded = releases_before > 0  # rank_peak's graded: the stages whose first B or W ran
    sent = inputs_before > 0  # rank_peak's last_sent: the stages whose input gradient has been sent
    # rank_peak's again: I run, W not yet (a B counts in both); a W's own counts in its transient
    between = inputs_before - releases_before - (own & (kind == BACKWARD_WEIGHT))
    counts = np.stack([held, inputs_before, graded, releases_before, sent, between], axis=0)
    counts = counts.transpose(2, 3, 0, 1).copy()
    ranks, times = np.arange(P)[:, None], np.arange(pick.shape[1])
    first = backward & ~graded[local, ranks, times]
    row_kind = np.select(
        [~kept, kind == FORWARD, first, kind == BACKWARD_INPUT], [PAD_ROW, NONE, FIRST, INPUT], default=TRANSIENT
    )
    none = np.zeros((v, P), dtype=count)
    step = np.stack(  # the optimizer step: all released, every stage graded; the step's sends and losses gone
        [forwarded[..., -1] - releases_before[..., -1] - releases[..., -1], none, np.ones((v, P), dtype=count)]
        + [none, none, none],
        axis=0,
    ).transpose(2, 0, 1)  # (P, COUNTS, v)
    return _Rows(
        counts=np.concatenate([counts, step[:, None].astype(counts.dtype)], axis=1),
        kind=np.concatenate([row_kind, np.full((P, 1), OPTIMIZER)], axis=1),
        local=np.concatenate([local, np.zeros((P, 1), dtype=np.int64)], axis=1),
        action=np.concatenate([np.where(kept, pick, -1), np.full((P, 1), -1)], axis=1),
    )


def _front_columns(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(pick, kept)``, both ``(P, R)`` with ``R`` the most True in a row of ``keep``: per row, the columns where
    ``keep`` is True, in order, then column 0 where ``kept`` is False."""
    per_row = keep.sum(axis=1)
    ranks, columns = np.nonzero(keep)
    width = max(int(per_row.max(initial=0)), 1)
    kept = np.arange(width) < per_row[:, None]
    if keep.shape[0] and np.all(per_row == width):
        return columns.reshape(keep.shape[0], width), kept
    pick = np.zeros((keep.shape[0], width), dtype=np.int64)
    pick[ranks, np.arange(len(ranks)) - np.repeat(np.cumsum(per_row) - per_row, per_row)] = columns
    return pick, kept


def _take_rows(values: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """``values[p, pick[p, i]]`` for every rank ``p`` and ``i`` (``take_along_axis`` on axis 1, with what follows
    it taken whole)."""
    P, n = values.shape[:2]
    flat = (np.arange(P)[:, None] * n + pick).ravel()
    return values.reshape(P * n, *values.shape[2:])[flat].reshape(*pick.shape, *values.shape[2:])


def _own(values: np.ndarray, local: np.ndarray) -> np.ndarray:
    """``values[p, j, local[p, j]]`` (``(P, R, v)`` and ``(P, R)`` -> ``(P, R)``), or ``values[p, local[p, j]]`` when
    ``values`` is ``(P, v)``: the value of each moment's own stage."""
    if values.ndim == 2:
        return values[np.arange(values.shape[0])[:, None], local]
    P, R, v = values.shape
    return values.reshape(P * R, v)[np.arange(P * R), local.ravel()].reshape(P, R)


def _front(rows: _Rows) -> _Rows:
    """The moments of ``rows`` (no forwards) that may be a peak. Of each stage's backwards of one transient (its
    ``I``, or its other ones: one group each):

    * of those that hold alike (and have as many between an ``I`` and its ``W``) only the last (the other counts
      only grow, so it is no smaller);
    * of a run left whose counts step alike from one to the next only the first and the last: the others lie
      between them, so no total over them exceeds both (1F1B's cool-down, GPipe's backwards).
    """
    keep = rows.kind != PAD_ROW
    P, R, _, v = rows.counts.shape
    ranks, times = np.nonzero((rows.kind == TRANSIENT) | (rows.kind == INPUT))  # by rank, then time
    flat = ranks * R + times
    counts = rows.counts.reshape(P * R, COUNTS * v)[flat]
    group = (ranks * v + rows.local.reshape(-1)[flat]) * 2 + (rows.kind.reshape(-1)[flat] == INPUT)
    # the counts that rise and fall: micro-batches held, and those between an I and its W
    held = np.concatenate([counts[:, HELD * v : (HELD + 1) * v], counts[:, BETWEEN * v : (BETWEEN + 1) * v]], axis=1)
    width = held.shape[1]
    base = int(held.max(initial=0)) + 1
    if 2 * P * v * float(base) ** width < 2**62:  # one integer per (group, held)
        key = group
        for j in range(width):
            key = key * base + held[:, j]
        by_held = np.argsort(key, kind="stable")  # by stage, then held alike, then time
        alike = np.zeros(len(key), dtype=bool)
        alike[by_held[:-1]] = key[by_held[1:]] == key[by_held[:-1]]
    else:
        by_held = np.lexsort((times, *held.T, group))
        alike = np.zeros(len(group), dtype=bool)
        alike[by_held[:-1]] = np.all(held[by_held[1:]] == held[by_held[:-1]], axis=1) & (
            group[by_held[1:]] == group[by_held[:-1]]
        )
    left = np.flatnonzero(~alike)
    left = left[np.argsort(group[left], kind="stable")]  # by stage, then time
    step = np.diff(counts[left], axis=0)
    same = group[left][1:] == group[left][:-1]
    between = np.zeros(len(left), dtype=bool)
    between[1:-1] = same[:-1] & same[1:] & np.all(step[:-1] == step[1:], axis=1)
    drop = np.concatenate([np.flatnonzero(alike), left[between]])
    keep[ranks[drop], times[drop]] = False
    pick, kept = _front_columns(keep)
    return _Rows(
        counts=_take_rows(rows.counts, pick),
        kind=np.where(kept, _take_rows(rows.kind, pick), PAD_ROW),
        local=_take_rows(rows.local, pick),
        action=np.where(kept, _take_rows(rows.action, pick), -1),
    )


def _matrix(rows: _Rows) -> np.ndarray:
    """``(P, R, (COUNTS + 3)v + 2)``: each moment of ``rows`` as the coefficients of :func:`_vector`'s entries; a
    padding row repeats its rank's optimizer step (the last real moment), which leaves the rank's maximum as it
    is."""
    P, R, _, v = rows.counts.shape
    width = COUNTS * v
    out = np.zeros((P, R, width + 3 * v + 2))
    out[:, :, :width] = rows.counts.reshape(P, R, width)
    for block, kind in enumerate((TRANSIENT, FIRST, INPUT)):
        pr, pt = np.nonzero(rows.kind == kind)
        out[pr, pt, width + block * v + rows.local[pr, pt]] = 1.0
    out[:, :, width + 3 * v] = rows.kind == OPTIMIZER
    out[:, :, width + 3 * v + 1] = 1.0
    pad = rows.kind == PAD_ROW
    step = np.argmax(rows.kind == OPTIMIZER, axis=1)
    out[pad] = out[np.arange(P), step][np.nonzero(pad)[0]]
    return out


def _vector(stage: np.ndarray, m: int, optimizer: OptimizerMemory, sends: str) -> np.ndarray:
    """``(P, (COUNTS + 3)v + 2)``: per rank, what each column of :attr:`PeakForm.matrix` counts, from the gathered
    fields ``stage`` (``(fields, P, v)``), when the schedule waits on its sends as ``sends`` says: per stage what a
    held micro-batch, an input gradient run, a graded stage, a released micro-batch and a sent gradient add; a
    backward's transient; a first backward's (its ``first_transient``, or its transient with its ``.grad``); an
    ``I``'s (its ``input_transient``, or its transient); the optimizer step's; the bytes every moment holds
    (weights, optimizer state, buffers, the batch, buckets)."""

    def field(name: str) -> np.ndarray:
        return stage[STAGE_FIELDS.index(name)]

    weights, transient, first = field("weights").sum(axis=1), field("transient"), field("first_transient")
    fixed = weights + field("optimizer").sum(axis=1) + _fixed_buffers(field, m)
    step = np.asarray(optimizer.transient(field("largest_param").max(axis=1, initial=0.0), weights))  # per rank
    per_input = field("retained") + (field("sent_grad") if sends != "next" else 0.0)
    return np.concatenate(
        [
            field("activations"),
            per_input,
            field("grads"),
            field("sent_output") * (sends == "step"),
            field("sent_grad") * (sends == "next"),
            field("weight_pass_held"),
            transient,
            np.where(first >= 0, first, transient + field("grads")),
            _input_transient(field),
            step[:, None],
            fixed[:, None],
        ],
        axis=1,
    )


def _input_transient(field: Any) -> np.ndarray:
    """Per stage, an ``I``'s transient: its ``input_transient``, or its ``transient`` where that is negative."""
    given = field("input_transient")
    return np.where(given >= 0, given, field("transient"))


def _fixed_buffers(field: Any, m: int) -> np.ndarray:
    """Per rank, the buffers every moment holds: ``m`` receive buffers and micro-batches of the batch, buckets."""
    return m * (field("recv") + field("grad_recv") + field("batch")).sum(axis=1) + field("buckets").sum(axis=1)


def _evaluate(
    rows: _Rows, stage: np.ndarray, m: int, optimizer: OptimizerMemory, sends: str
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(total, terms)`` of every moment of ``rows`` with the gathered fields ``stage`` (``(fields, P, v)``), term
    by term as :func:`~pipeswift_lab.core.memory_model.rank_peak` adds them: ``total`` is ``(P, R)`` (``-inf`` at the
    padding) and ``terms`` maps each of :data:`MEMORY_TERMS` to its ``(P, R)`` array."""

    def field(name: str) -> np.ndarray:
        return stage[STAGE_FIELDS.index(name)]

    def own(name: str) -> np.ndarray:  # the field of each moment's stage
        return _own(field(name), rows.local)

    def counted(count: int, values: np.ndarray) -> np.ndarray:
        return np.einsum("prj,pj->pr", counts[:, :, count], values)

    counts = rows.counts.astype(float)
    weights = field("weights").sum(axis=1)
    first = rows.kind == FIRST
    has_first = own("first_transient") >= 0  # rank_peak: the first backward's .grad is in first_transient ...
    step = np.asarray(optimizer.transient(field("largest_param").max(axis=1, initial=0.0), weights))  # per rank
    sent_grads = counted(SENT, field("sent_grad")) if sends == "next" else counted(INPUTS, field("sent_grad"))
    terms = {
        "weights": np.broadcast_to(weights[:, None], rows.kind.shape),
        # ... or, without one, its .grad is counted while it runs
        "grads": counted(GRADED, field("grads")) + np.where(first & ~has_first, own("grads"), 0.0),
        "optimizer": np.broadcast_to(field("optimizer").sum(axis=1)[:, None], rows.kind.shape),
        "activations": counted(HELD, field("activations"))
        + counted(BETWEEN, field("weight_pass_held"))
        + counted(INPUTS, field("retained"))
        + (counted(RELEASED, field("sent_output")) if sends == "step" else 0.0),
        "buffers": _fixed_buffers(field, m)[:, None] + sent_grads,
        "transient": np.select(
            [rows.kind == TRANSIENT, first & has_first, first, rows.kind == INPUT, rows.kind == OPTIMIZER],
            [
                own("transient"),
                own("first_transient"),
                own("transient"),
                _own(_input_transient(field), rows.local),
                np.broadcast_to(step[:, None], first.shape),
            ],
            0.0,
        ),
    }
    total = sum(terms[name] for name in MEMORY_TERMS)
    return np.where(rows.kind == PAD_ROW, -np.inf, total), terms
