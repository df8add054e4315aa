"""The Timeline: one row per executed action, simulated or measured, and its metrics.

One schema serves :func:`pipeswift_lab.simulation.simulator`, the real runner and the traces of other jobs
(:meth:`Timeline.from_profiler`), so predicted and measured runs compare with plain pandas. Columns (exactly):
``step``, ``rank``, ``stage``, ``microbatch``, ``kind`` (``F``, ``B``, ``I``, ``W``, ``SEND_F``, ``RECV_F``, ``SEND_B``,
``RECV_B``, ``REDUCE_GRAD``, ``UNSHARD``, and a measured run's tensor-parallel collectives ``TP_ALL_REDUCE``,
``TP_ALL_GATHER``, ``TP_REDUCE_SCATTER``, ``TP_ALL_TO_ALL``, nested in the compute actions that ran them; none of
them is compute), ``start_ms``, ``end_ms``, ``replica`` (the data-parallel replica,
0 in a simulation; ``rank`` is the pipeline rank within the replica) and, for a run that
changed configuration, ``segment``; for an imported trace, ``time_source`` (``"device"`` or ``"host"``).

Metric definitions (every metric works on one or many steps):

* a step's *span* runs from its earliest row start to its latest row end;
  :attr:`Timeline.step_ms` is the median span over steps;
* a rank is *busy* while it computes (``F``, ``B``, ``I``, ``W`` rows, overlaps merged) and
  *idle* for the rest of the span; :attr:`Timeline.bubble_ratio` is the idle share of the
  span averaged over ranks and steps — GPipe's convention, ``(P-1)/(m+P-1)`` for GPipe
  with equal stages (Huang et al., NeurIPS 2019); with several replicas every (replica,
  rank) is a device of its own, and the averages run over all of them;
* a micro-batch's activations on a stage are *in flight* from the start of its ``F`` to the
  end of its last backward piece: ``B``, or ``W`` when the backward is split (torch's
  ``backward_input`` keeps the autograd graph alive for ``backward_weight``).
  :attr:`Timeline.peak_inflight` is a rank's peak of in-flight micro-batches, each stage's
  counted ``1/v`` (the convention of :func:`pipeswift_lab.core.analytic.inflight_microbatches`);
  :attr:`Timeline.peak_activation_bytes` weighs them by the stage's activation bytes
  (``meta["stage_activation_bytes"]``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from os import PathLike
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.checks import check_choice
from ..core.display import html_card, text_card
from ..core.vocabulary import COMPUTE_KINDS, KINDS
from .chrome_trace import write_chrome_trace
from .schema import COLUMNS, OPTIONAL_COLUMNS, device_index, jsonable, normalize, row_arrays

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: ``source`` values.
SOURCES = ("simulated", "measured")

_CSV_HEADER = "# pipeswift_lab Timeline "


@dataclass(frozen=True, eq=False)
class Timeline:
    """Executed pipeline actions, one row per action, with metrics and exports.

    ``df`` columns: ``step``, ``rank``, ``stage``, ``microbatch``, ``kind``, ``start_ms``,
    ``end_ms``, ``replica`` (and ``segment`` for a run that changed configuration; rows are
    kept sorted by step, rank, start). ``source`` is ``"simulated"`` or
    ``"measured"``; ``meta`` a dict (schedule, P, m, v, ``stage_activation_bytes`` ...).
    """

    df: pd.DataFrame
    source: str = "simulated"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)
        meta = {} if self.meta is None else self.meta
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict or None; got {type(meta).__name__}")
        object.__setattr__(self, "meta", dict(meta))
        object.__setattr__(self, "df", normalize(self.df))

    # ------------------------------------------------------------------ basics
    @property
    def steps(self) -> list[int]:
        """Step numbers present, sorted."""
        return sorted(int(s) for s in self.df["step"].unique())

    @property
    def ranks(self) -> list[int]:
        """Ranks ``0..P-1`` when ``meta["P"]`` is known, else the ranks present."""
        if "P" in self.meta:
            return list(range(int(self.meta["P"])))
        return sorted(int(r) for r in self.df["rank"].unique())

    @property
    def replicas(self) -> list[int]:
        """Data-parallel replicas present (``[0]`` for a simulation or a run with D=1)."""
        return sorted(int(r) for r in self.df["replica"].unique())

    def _lane(self, replica: Any, rank: Any) -> np.ndarray:
        """The device row of each (replica, rank) (:func:`~pipeswift_lab.simulation.schema.device_index`)."""
        return device_index(self.replicas, self.ranks, replica, rank)

    @cached_property
    def _arrays(self) -> dict[str, np.ndarray]:
        return {**row_arrays(self.df), "compute": self.df["kind"].isin(COMPUTE_KINDS).to_numpy()}

    @cached_property
    def step_spans(self) -> pd.DataFrame:
        """One row per step: ``step``, ``start_ms``, ``end_ms``, ``span_ms``."""
        a = self._arrays
        steps, inverse = np.unique(a["step"], return_inverse=True)
        start = np.full(len(steps), np.inf)
        end = np.full(len(steps), -np.inf)
        np.minimum.at(start, inverse, a["start"])
        np.maximum.at(end, inverse, a["end"])
        return pd.DataFrame({"step": steps, "start_ms": start, "end_ms": end, "span_ms": end - start})

    @property
    def step_ms(self) -> float:
        """Median over steps of each step's span (ms); a simulated timeline has one step."""
        return float(np.median(self.step_spans["span_ms"].to_numpy()))

    # ------------------------------------------------------------------ idle / bubble
    @cached_property
    def _busy(self) -> pd.DataFrame:
        """Busy ms per (step, replica, rank), overlapping compute rows merged."""
        a = self._arrays
        c = a["compute"]
        step, replica, rank, start, end = a["step"][c], a["replica"][c], a["rank"][c], a["start"][c], a["end"][c]
        order = np.lexsort((start, rank, replica, step))
        step, replica, rank, start, end = step[order], replica[order], rank[order], start[order], end[order]
        spans = self.step_spans
        step_ids = spans["step"].to_numpy()
        replicas = np.asarray(self.replicas, dtype=np.int64)
        ranks = np.asarray(self.ranks, dtype=np.int64)
        lanes = len(replicas) * len(ranks)
        busy = np.zeros((len(step_ids), lanes))
        if len(step):
            rank_pos = np.searchsorted(ranks, rank)
            if (rank_pos >= len(ranks)).any() or (ranks[np.minimum(rank_pos, len(ranks) - 1)] != rank).any():
                raise ValueError(
                    f"Timeline rows hold ranks {sorted(set(rank.tolist()))} outside meta P={self.meta.get('P')}"
                )
            group = np.searchsorted(step_ids, step) * lanes + self._lane(replica, rank)
            new_group = np.r_[True, group[1:] != group[:-1]]
            # a row overlaps an earlier one of its (step, rank) if it starts before their latest end
            if np.any(~new_group & (start < _group_running_max(end, new_group))):
                merged = _merged_lengths(group, start, end, busy.size)
            else:
                merged = np.bincount(group, weights=end - start, minlength=busy.size)
            busy = merged.reshape(busy.shape)
        span = spans["span_ms"].to_numpy()[:, None]
        idle = span - busy
        ratio = np.divide(idle, span, out=np.zeros_like(idle), where=span > 0)
        out = {"step": np.repeat(step_ids, lanes)}
        if len(replicas) > 1:
            out["replica"] = np.tile(np.repeat(replicas, len(ranks)), len(step_ids))
        out.update(
            {
                "rank": np.tile(ranks, len(step_ids) * len(replicas)),
                "busy_ms": busy.ravel(),
                "idle_ms": idle.ravel(),
                "idle_ratio": ratio.ravel(),
            }
        )
        return pd.DataFrame(out)

    @property
    def idle_by_rank(self) -> pd.DataFrame:
        """One row per rank (per replica and rank with several replicas): ``busy_ms``, ``idle_ms`` and ``idle_ratio``
        (idle share of the step), means over steps."""
        keys = ["replica", "rank"] if len(self.replicas) > 1 else "rank"
        return self._busy.groupby(keys, as_index=False)[["busy_ms", "idle_ms", "idle_ratio"]].mean()

    def bottleneck_rank(self, step: int | None = None) -> int | None:
        """The pipeline rank with the most busy time (the median over steps of its mean over replicas, so a step a
        shared machine stalled does not decide it; ``step`` alone when given), or None when every rank is equally
        busy (within 1e-9 relative) and there is no bottleneck to name. Of ranks tied at the most, the lowest."""
        busy = self._busy if step is None else self._busy[self._busy["step"] == step]
        if step is not None and busy.empty:
            raise ValueError(f"step={step!r} is not in this timeline; steps are {self.steps}")
        per_rank = busy.groupby(["rank", "step"])["busy_ms"].mean().groupby("rank").median()
        top, low = float(per_rank.max()), float(per_rank.min())
        if len(per_rank) < 2 or top - low <= 1e-9 * max(abs(top), 1e-12):
            return None
        return int(per_rank[per_rank >= top - 1e-9 * abs(top)].index.min())

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the step, averaged over ranks and steps (GPipe's convention)."""
        return float(self._busy["idle_ratio"].mean())

    @property
    def rank_span_bubble_rate(self) -> float:
        """The Zero Bubble paper's bubble rate ``(cost - ideal) / cost``, mean over steps (Qi et al., ICLR 2024,
        Section 5.3 and Appendix G, eq. 3; sail-sg's ``manual_order`` computes the same ``cost``).

        A rank's own span runs from its first compute action's start to its last one's end; ``cost`` is the longest
        over ranks (and replicas), ``ideal`` the most compute time of any rank (``m (T_F + T_B + T_W)`` for equal
        stages). Unlike :attr:`bubble_ratio`, which measures every rank's idle time over the whole step's span (any
        rank's first action to any rank's last) and averages over ranks, it leaves out each rank's wait before its
        first action and after its last, and only the longest span counts. 0 for a step with no compute.
        """
        a = self._arrays
        c = a["compute"]
        step_ids = self.step_spans["step"].to_numpy()
        lanes = len(self.replicas) * len(self.ranks)
        group = np.searchsorted(step_ids, a["step"][c]) * lanes + self._lane(a["replica"][c], a["rank"][c])
        first = np.full(len(step_ids) * lanes, np.inf)
        last = np.full(len(step_ids) * lanes, -np.inf)
        np.minimum.at(first, group, a["start"][c])
        np.maximum.at(last, group, a["end"][c])
        span = np.where(np.isfinite(first), last - first, 0.0).reshape(len(step_ids), lanes)
        cost = span.max(axis=1)
        ideal = self._busy["busy_ms"].to_numpy().reshape(len(step_ids), lanes).max(axis=1)
        rate = np.divide(cost - ideal, cost, out=np.zeros_like(cost), where=cost > 0)
        return float(rate.mean())

    # ------------------------------------------------------------------ in flight
    @cached_property
    def _held(self) -> dict[str, np.ndarray]:
        """Per held micro-batch chunk, numpy arrays ``step, rank, stage, acquire, release, replica``."""
        a = self._arrays
        c = a["compute"]
        step, rank, stage, mb = a["step"][c], a["rank"][c], a["stage"][c], a["mb"][c]
        start, end, kind, replica = a["start"][c], a["end"][c], a["kind"][c], a["replica"][c]
        if not len(step):  # transfers only: nothing is held
            empty = np.zeros(0)
            return {
                "step": empty.astype(np.int64),
                "rank": empty.astype(np.int64),
                "stage": empty.astype(np.int64),
                "acquire": empty,
                "release": empty,
                "replica": empty.astype(np.int64),
            }
        n_stages, n_mb, n_rep = int(stage.max()) + 1, int(mb.max()) + 1, int(replica.max()) + 1
        keys = ((step * n_rep + replica) * n_stages + stage) * n_mb + mb
        is_f = kind == "F"
        fkeys = keys[is_f]
        uniq, first, inverse = np.unique(fkeys, return_index=True, return_inverse=True)
        acquire = np.full(len(uniq), np.inf)
        np.minimum.at(acquire, inverse, start[is_f])
        release = np.full(len(uniq), -np.inf)
        bkeys = keys[~is_f]
        pos = np.searchsorted(uniq, bkeys)
        ok = pos < len(uniq)
        ok[ok] = uniq[pos[ok]] == bkeys[ok]
        np.maximum.at(release, pos[ok], end[~is_f][ok])
        held_step = step[is_f][first]
        missing = ~np.isfinite(release)
        if missing.any():  # a forward with no backward holds until its step ends
            ends = self.step_spans.set_index("step")["end_ms"]
            release[missing] = ends.reindex(held_step[missing]).to_numpy(float)
        return {
            "step": held_step,
            "rank": rank[is_f][first],
            "stage": stage[is_f][first],
            "acquire": acquire,
            "release": release,
            "replica": replica[is_f][first],
        }

    def _peak(self, stage_weight: np.ndarray) -> pd.Series:
        """Per rank, the peak over time, steps (and replicas) of the summed weights of held chunks.

        ``stage_weight`` is an array indexed by stage. Releases sort before acquisitions at
        equal times, so a chunk freed as another starts is not counted twice.
        """
        h = self._held
        w = np.asarray(stage_weight, dtype=float)[h["stage"].astype(np.int64)]
        lane = self._lane(h["replica"], h["rank"])  # each replica's rank is its own device
        rank = np.concatenate([lane, lane])
        step = np.concatenate([h["step"], h["step"]]).astype(np.int64)
        time = np.concatenate([h["acquire"], h["release"]]).astype(float)
        delta = np.concatenate([w, -w])
        order = np.lexsort((delta, time, step, rank))
        rank, step, delta = rank[order], step[order], delta[order]
        peaks = {r: 0.0 for r in self.ranks}
        if len(delta):
            level = np.cumsum(delta)
            new = np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])]
            starts = np.flatnonzero(new)
            lengths = np.diff(np.r_[starts, len(delta)])
            level = level - np.repeat(level[starts] - delta[starts], lengths)
            group_peak = np.maximum.reduceat(level, starts)
            ranks = self.ranks
            for lane, pk in zip(rank[starts].tolist(), group_peak.tolist()):
                r = ranks[lane % len(ranks)]
                peaks[r] = max(peaks.get(r, 0.0), pk)
        return pd.Series(peaks, dtype=float).rename_axis("rank")

    def _chunks_per_rank(self) -> dict[int, int]:
        if self.meta.get("v") is not None:
            return {r: int(self.meta["v"]) for r in self.ranks}
        a = self._arrays
        c = a["compute"]
        pairs = pd.DataFrame({"rank": a["rank"][c], "stage": a["stage"][c]}).drop_duplicates()
        counts = pairs.groupby("rank")["stage"].nunique()
        return {r: int(counts.get(r, 1)) for r in self.ranks}

    @cached_property
    def peak_inflight(self) -> pd.Series:
        """Per rank (Series indexed by rank): the peak number of micro-batches in flight, each stage's counted 1/v."""
        counts = self._peak(np.ones(int(self.df["stage"].max()) + 1))  # whole chunks: exact integers
        v = self._chunks_per_rank()
        return pd.Series({r: counts[r] / v[r] for r in counts.index}, dtype=float, name="peak_inflight").rename_axis(
            "rank"
        )

    @cached_property
    def peak_activation_bytes(self) -> pd.Series:
        """Per rank (Series indexed by rank): peak bytes of activations held, weighted by
        ``meta["stage_activation_bytes"]``."""
        stage_bytes = self.meta.get("stage_activation_bytes")
        n_stages = int(self.df["stage"].max()) + 1
        if (
            stage_bytes is None
            or len(stage_bytes) < n_stages
            or any(x is None or (isinstance(x, float) and math.isnan(x)) for x in stage_bytes)
        ):
            raise ValueError(
                "this Timeline's meta has no 'stage_activation_bytes' (one number per stage); simulate a Partition "
                "whose profile has activation_bytes, or pass meta={'stage_activation_bytes': [...]}"
            )
        return self._peak(np.asarray(stage_bytes, dtype=float)).rename("peak_activation_bytes")

    # ------------------------------------------------------------------ display
    def plot(
        self,
        ax: Axes | None = None,
        step: int | None = None,
        labels: bool = True,
        comms: bool = True,
        bottleneck: bool = True,
    ) -> Axes:
        """Gantt chart: one row per rank, compute bars colored by kind, idle time left empty.

        ``bottleneck`` shades the lane of :meth:`bottleneck_rank` (the busiest rank of the drawn steps; of every
        replica) and labels it "bottleneck"; nothing is marked when all ranks are equally busy.

        ``step`` picks one step of a multi-step timeline (times then start at that step's
        start); None draws all steps. Micro-batch numbers label bars wide enough to hold them;
        with several stages per rank, later chunks are drawn lighter. Transfers (``SEND_*``),
        the gradient reduction (``REDUCE_GRAD``) and ``UNSHARD`` show as thin bars under the rank's row
        when ``comms``, and tensor-parallel collectives (``TP_*``) as thin dark bars inside the actions
        that ran them. With several replicas every (replica, rank) gets a row. Returns the Axes
        (:func:`~pipeswift_lab.simulation.gantt.plot_timeline`).
        """
        from .gantt import plot_timeline

        return plot_timeline(self, ax, step=step, labels=labels, comms=comms, bottleneck=bottleneck)

    def _summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source}
        for k in ("schedule", "P", "m", "v"):
            if k in self.meta:
                out[k] = self.meta[k]
        if len(self.replicas) > 1:
            out["replicas"] = len(self.replicas)
        if "imported_from" in self.meta:
            out["imported_from"] = self.meta["imported_from"]
            out["time_source"] = ", ".join(f"{k} {v}" for k, v in self.meta.get("time_source", {}).items())
            out["clock_skew_ms"] = self.meta.get("clock_skew_ms")
        out.update(
            {
                "steps": len(self.steps),
                "actions": len(self.df),
                "step_ms": self.step_ms,
                "bubble_ratio": self.bubble_ratio,
            }
        )
        return out

    def _repr_html_(self) -> str:
        table = self.idle_by_rank.merge(self.peak_inflight.reset_index(), on="rank")
        return html_card(f"Timeline ({self.source}): step {self.step_ms:.4g} ms", self._summary(), table)

    def __repr__(self) -> str:
        return text_card("Timeline", self._summary())

    # ------------------------------------------------------------------ export
    def to_chrome_trace(self, path: str | PathLike[str]) -> str:
        """Write Chrome trace JSON (Perfetto, chrome://tracing) to ``path``; return the path.

        One process per rank (``pid`` = rank; ``replica * P + rank`` with several replicas) with
        a compute thread (``tid`` 0) and a transfer thread (``tid`` 1, the all-reduce too); every
        action is an ``"X"`` event (``ts``/``dur`` in µs).
        Flow events (``"s"`` → ``"f"``) join each ``SEND_*`` to its ``RECV_*``; without
        transfer rows they join each cross-rank dependency (``F`` to the next stage's ``F``,
        the backward to the previous stage's backward) (:mod:`~pipeswift_lab.simulation.chrome_trace`).
        """
        return write_chrome_trace(self, path)

    def to_csv(self, path: str | PathLike[str]) -> str:
        """Write the rows as CSV, with ``source`` and ``meta`` in a first comment line; return the path."""
        with open(path, "w", newline="") as fh:
            fh.write(_CSV_HEADER + json.dumps({"source": self.source, "meta": jsonable(self.meta)}) + "\n")
            self.df.to_csv(fh, index=False)
        return str(path)

    @classmethod
    def from_profiler(
        cls, path_or_paths: str | PathLike[str] | Sequence[str | PathLike[str]], schedule: str | None = None
    ) -> Timeline:
        """The measured Timeline of a real pipeline job from its ``torch.profiler`` traces, one per rank: a folder
        written by ``tensorboard_trace_handler``, or ``export_chrome_trace`` files (gzipped or not).

        One row per action (``PP:{stage}{kind}{mb}`` spans of torch's pipelining runtime, GPipe's ``Forward i`` /
        ``Backward i``), its ``step`` from ``ProfilerStep#N``, its time on the GPU kernels it launched
        (``time_source="device"``) or its CPU ops (``"host"``), ranks on one clock (``meta["clock_skew_ms"]``, the
        alignment's error bound). See :func:`~pipeswift_lab.simulation.trace_import.read_profiler_traces`.
        """
        from .trace_import import read_profiler_traces

        df, meta = read_profiler_traces(path_or_paths, schedule=schedule)
        return cls(df, source="measured", meta=meta)

    @classmethod
    def read_csv(cls, path: str | PathLike[str]) -> Timeline:
        """Read a Timeline written by :meth:`to_csv` (a plain CSV with the columns works too, as simulated)."""
        with open(path) as fh:
            first = fh.readline()
        source, meta, skip = "simulated", {}, 0
        if first.startswith(_CSV_HEADER):
            header = json.loads(first[len(_CSV_HEADER) :])
            source, meta, skip = header.get("source", "simulated"), header.get("meta", {}), 1
        df = pd.read_csv(path, skiprows=skip)
        return cls(df, source=source, meta=meta)


def _group_running_max(end: np.ndarray, new_group: np.ndarray) -> np.ndarray:
    """For each row, the largest ``end`` of the earlier rows of its group (-inf for a group's first row)."""
    out = np.empty_like(end)
    starts = np.flatnonzero(new_group)
    bounds = np.r_[starts, len(end)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a] = -np.inf
        if b - a > 1:
            out[a + 1 : b] = np.maximum.accumulate(end[a : b - 1])
    return out


def _merged_lengths(group: np.ndarray, start: np.ndarray, end: np.ndarray, size: int) -> np.ndarray:
    """Total length of the union of intervals per group (rows sorted by group, then start)."""
    total = np.zeros(size)
    i, n = 0, len(group)
    while i < n:
        g, cur_s, cur_e = group[i], start[i], end[i]
        j = i + 1
        while j < n and group[j] == g:
            if start[j] < cur_e:
                cur_e = max(cur_e, end[j])
            else:
                total[g] += cur_e - cur_s
                cur_s, cur_e = start[j], end[j]
            j += 1
        total[g] += cur_e - cur_s
        i = j
    return total


__all__ = ["OPTIONAL_COLUMNS", "COLUMNS", "COMPUTE_KINDS", "KINDS", "SOURCES", "Timeline"]
