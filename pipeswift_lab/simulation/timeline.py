"""The Timeline: one row per executed action, simulated or measured, and its metrics.

One schema serves :func:`pipeswift_lab.simulation.simulator` and the real runner, so predicted and
measured runs compare with plain pandas. Columns (exactly): ``step``, ``rank``, ``stage``,
``microbatch``, ``kind`` (``F``, ``B``, ``I``, ``W``, ``SEND_F``, ``RECV_F``, ``SEND_B``,
``RECV_B``, ``REDUCE_GRAD``), ``start_ms``, ``end_ms``, ``replica`` (the data-parallel replica,
0 in a simulation; ``rank`` is the pipeline rank within the replica) and, for a run that
changed configuration, ``segment``.

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
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from ..core.display import html_card, text_card
from ..core.vocabulary import COMPUTE_KINDS, KINDS
from .schema import COLUMNS, OPTIONAL_COLUMNS, normalize  # noqa: F401 - the schema, re-exported

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

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is not valid; use one of {list(SOURCES)}")
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

    def _lane(self, replica, rank) -> np.ndarray:
        """The device row of each (replica, rank): replica position * ranks + rank position (the rank's position without replicas)."""
        return np.searchsorted(self.replicas, replica) * len(self.ranks) + np.searchsorted(self.ranks, rank)

    @cached_property
    def _arrays(self):
        df = self.df
        return {
            "replica": df["replica"].to_numpy(np.int64),
            "step": df["step"].to_numpy(np.int64),
            "rank": df["rank"].to_numpy(np.int64),
            "stage": df["stage"].to_numpy(np.int64),
            "mb": df["microbatch"].to_numpy(np.int64),
            "kind": df["kind"].to_numpy(object),
            "start": df["start_ms"].to_numpy(float),
            "end": df["end_ms"].to_numpy(float),
            "compute": df["kind"].isin(COMPUTE_KINDS).to_numpy(),
        }

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

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the step, averaged over ranks and steps (GPipe's convention)."""
        return float(self._busy["idle_ratio"].mean())

    # ------------------------------------------------------------------ in flight
    @cached_property
    def _held(self):
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

    def _peak(self, stage_weight) -> pd.Series:
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
        """Per rank (Series indexed by rank): peak bytes of activations held, from ``meta["stage_activation_bytes"]``."""
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
    def plot(self, ax=None, step=None, labels=True, comms=True):
        """Gantt chart: one row per rank, compute bars colored by kind, idle time left empty.

        ``step`` picks one step of a multi-step timeline (times then start at that step's
        start); None draws all steps. Micro-batch numbers label bars wide enough to hold them;
        with several stages per rank, later chunks are drawn lighter. Transfers (``SEND_*``)
        and the gradient all-reduce (``REDUCE_GRAD``) show as thin bars under the rank's row
        when ``comms``. With several replicas every (replica, rank) gets a row. Returns the Axes.
        """
        from ..core.plot import KIND_COLORS, get_ax

        df = self.df
        offset = 0.0
        if step is not None:
            if step not in self.steps:
                raise ValueError(f"step={step!r} is not in this timeline; steps are {self.steps}")
            df = df[df["step"] == step]
            offset = float(df["start_ms"].min())
        ranks, replicas = self.ranks, self.replicas
        # one row per device: replica d's rank r at row d * P + r
        row_names = (
            [f"replica {d} rank {r}" for d in replicas for r in ranks]
            if len(replicas) > 1
            else [f"rank {r}" for r in ranks]
        )
        rank = self._lane(df["replica"].to_numpy(np.int64), df["rank"].to_numpy(np.int64))
        ax = get_ax(ax, figsize=(9.0, 0.45 * len(row_names) + 1.4))
        start = df["start_ms"].to_numpy(float) - offset
        end = df["end_ms"].to_numpy(float) - offset
        kind = df["kind"].to_numpy(object)
        stage = df["stage"].to_numpy(np.int64)
        mb = df["microbatch"].to_numpy(np.int64)
        lo, hi = (float(start.min()), float(end.max())) if len(df) else (0.0, 1.0)
        span = hi - lo if hi > lo else 1.0
        chunk = self._chunk_index()
        n_compute = int(np.isin(kind, COMPUTE_KINDS).sum())
        for k in COMPUTE_KINDS:
            sel = kind == k
            if not sel.any():
                continue
            alpha = np.where([chunk.get(int(s), 0) == 0 for s in stage[sel]], 1.0, 0.6)
            bars = ax.barh(
                rank[sel],
                end[sel] - start[sel],
                left=start[sel],
                height=0.8,
                color=KIND_COLORS[k],
                edgecolor="white",
                linewidth=0.4,
                label=k,
            )
            for bar, al in zip(bars, alpha):
                bar.set_alpha(al)
        if comms:
            for k in ("SEND_F", "SEND_B", "REDUCE_GRAD"):
                sel = kind == k
                if sel.any():
                    ax.barh(
                        rank[sel] + 0.47,
                        end[sel] - start[sel],
                        left=start[sel],
                        height=0.12,
                        color=KIND_COLORS[k],
                        label=k,
                    )
        if labels and 0 < n_compute <= 800:
            fig_width_px = ax.get_figure().get_size_inches()[0] * ax.get_figure().dpi * 0.8
            for i in np.flatnonzero(np.isin(kind, COMPUTE_KINDS)):
                text = str(mb[i])
                width_px = (end[i] - start[i]) / span * fig_width_px
                if width_px >= 7 * len(text) + 4:
                    ax.text((start[i] + end[i]) / 2, rank[i], text, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(row_names)), row_names)
        ax.set_ylim(len(row_names) - 0.2 if row_names else 1, -0.6)
        ax.set_xlim(lo, lo + span * 1.01)
        ax.set_xlabel("time since step start (ms)" if step is not None else "time (ms)")
        title = self.meta.get("schedule", "")
        details = ", ".join(
            f"{k}={self.meta[k]}" for k in ("P", "D", "m", "v") if k in self.meta and (k != "D" or self.meta[k] != 1)
        )
        step_text = f"{self.step_ms:,.0f}" if self.step_ms >= 100 else f"{self.step_ms:.3g}"
        ax.set_title(
            f"{self.source} {title} ({details}): step {step_text} ms, bubble {self.bubble_ratio:.1%}".replace("  ", " ")
        )
        if any(chunk.get(int(s), 0) > 0 for s in stage):
            from matplotlib.patches import Patch

            handles, names = ax.get_legend_handles_labels()
            handles.append(
                Patch(facecolor="grey", alpha=0.6, edgecolor="white", label="lighter: the rank's later chunk")
            )
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
        else:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
        ax.grid(axis="y", visible=False)
        return ax

    def _chunk_index(self) -> dict[int, int]:
        """Position of each stage among its rank's stages (0 for the first chunk)."""
        a = self._arrays
        pairs = sorted(set(zip(a["rank"].tolist(), a["stage"].tolist())))
        out, seen = {}, {}
        for r, s in pairs:
            out[s] = seen.get(r, 0)
            seen[r] = seen.get(r, 0) + 1
        return out

    def _summary(self) -> dict:
        out = {"source": self.source}
        for k in ("schedule", "P", "m", "v"):
            if k in self.meta:
                out[k] = self.meta[k]
        if len(self.replicas) > 1:
            out["replicas"] = len(self.replicas)
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
    def to_chrome_trace(self, path) -> str:
        """Write Chrome trace JSON (Perfetto, chrome://tracing) to ``path``; return the path.

        One process per rank (``pid`` = rank; ``replica * P + rank`` with several replicas) with
        a compute thread (``tid`` 0) and a transfer thread (``tid`` 1, the all-reduce too); every
        action is an ``"X"`` event (``ts``/``dur`` in µs).
        Flow events (``"s"`` → ``"f"``) join each ``SEND_*`` to its ``RECV_*``; without
        transfer rows they join each cross-rank dependency (``F`` to the next stage's ``F``,
        the backward to the previous stage's backward).
        """
        events = []
        names = self._process_names()
        for pid, name in names.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "transfer"}})
        a = self._arrays
        pids = self._pids()
        for i in range(len(self.df)):
            kind = a["kind"][i]
            tid = 0 if kind in COMPUTE_KINDS else 1
            events.append(
                {
                    "ph": "X",
                    "name": f"{kind}{a['mb'][i]} s{a['stage'][i]}",
                    "cat": kind,
                    "pid": int(pids[i]),
                    "tid": tid,
                    "ts": float(a["start"][i]) * 1e3,
                    "dur": float(a["end"][i] - a["start"][i]) * 1e3,
                    "args": {"step": int(a["step"][i]), "stage": int(a["stage"][i]), "microbatch": int(a["mb"][i])},
                }
            )
        for flow_id, (src, dst) in enumerate(self._flows()):
            events.append(
                {
                    "ph": "s",
                    "id": flow_id,
                    "name": "transfer",
                    "cat": "flow",
                    "pid": src[0],
                    "tid": src[1],
                    "ts": src[2],
                }
            )
            events.append(
                {
                    "ph": "f",
                    "bp": "e",
                    "id": flow_id,
                    "name": "transfer",
                    "cat": "flow",
                    "pid": dst[0],
                    "tid": dst[1],
                    "ts": dst[2],
                }
            )
        with open(path, "w") as fh:
            json.dump(
                {
                    "traceEvents": events,
                    "displayTimeUnit": "ms",
                    "otherData": {"source": self.source, **_jsonable(self.meta)},
                },
                fh,
            )
        return str(path)

    def _process_names(self) -> dict[int, str]:
        if len(self.replicas) == 1:
            return {r: f"rank {r}" for r in self.ranks}
        P = max(self.ranks) + 1
        return {d * P + r: f"replica {d} rank {r}" for d in self.replicas for r in self.ranks}

    def _pids(self) -> np.ndarray:
        a = self._arrays
        return a["rank"] if len(self.replicas) == 1 else a["replica"] * (max(self.ranks) + 1) + a["rank"]

    def _flows(self):
        """Pairs ``((pid, tid, ts_us), (pid, tid, ts_us))`` for the flow arrows."""
        a = self._arrays
        df = pd.DataFrame(
            {
                "step": a["step"],
                "rank": self._pids(),
                "replica": a["replica"],
                "stage": a["stage"],
                "mb": a["mb"],
                "kind": a["kind"],
                "start": a["start"],
                "end": a["end"],
            }
        )
        out = []
        sends = df[df["kind"].isin(["SEND_F", "SEND_B"])]
        if len(sends):
            recvs = df[df["kind"].isin(["RECV_F", "RECV_B"])].set_index(["step", "replica", "kind", "stage", "mb"])
            for row in sends.itertuples(index=False):
                target = ("RECV_F", row.stage + 1) if row.kind == "SEND_F" else ("RECV_B", row.stage - 1)
                key = (row.step, row.replica, target[0], target[1], row.mb)
                if key in recvs.index:
                    rec = recvs.loc[[key]].iloc[0]
                    out.append(((int(row.rank), 1, row.start * 1e3), (int(rec["rank"]), 1, float(rec["end"]) * 1e3)))
            return out
        comp = df[df["kind"].isin(COMPUTE_KINDS)]
        done = {}
        for row in comp.itertuples(index=False):
            done[(row.step, row.replica, "F" if row.kind == "F" else "G", row.stage, row.mb)] = row
        for row in comp.itertuples(index=False):
            if row.kind == "F":
                src = done.get((row.step, row.replica, "F", row.stage - 1, row.mb))
            elif row.kind in ("B", "I"):
                src = done.get((row.step, row.replica, "G", row.stage + 1, row.mb))
            else:
                src = None
            if src is not None and src.rank != row.rank:
                out.append(((int(src.rank), 0, src.end * 1e3), (int(row.rank), 0, row.start * 1e3)))
        return out

    def to_csv(self, path) -> str:
        """Write the rows as CSV, with ``source`` and ``meta`` in a first comment line; return the path."""
        with open(path, "w", newline="") as fh:
            fh.write(_CSV_HEADER + json.dumps({"source": self.source, "meta": _jsonable(self.meta)}) + "\n")
            self.df.to_csv(fh, index=False)
        return str(path)

    @classmethod
    def read_csv(cls, path) -> Timeline:
        """Read a Timeline written by :meth:`to_csv` (a plain CSV with the columns works too, as simulated)."""
        with open(path) as fh:
            first = fh.readline()
        source, meta, skip = "simulated", {}, 0
        if first.startswith(_CSV_HEADER):
            header = json.loads(first[len(_CSV_HEADER) :])
            source, meta, skip = header.get("source", "simulated"), header.get("meta", {}), 1
        df = pd.read_csv(path, skiprows=skip)
        return cls(df, source=source, meta=meta)


def _group_running_max(end, new_group):
    """For each row, the largest ``end`` of the earlier rows of its group (-inf for a group's first row)."""
    out = np.empty_like(end)
    starts = np.flatnonzero(new_group)
    bounds = np.r_[starts, len(end)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a] = -np.inf
        if b - a > 1:
            out[a + 1 : b] = np.maximum.accumulate(end[a : b - 1])
    return out


def _merged_lengths(group, start, end, size):
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


def _jsonable(meta: dict) -> dict:
    return json.loads(json.dumps(meta, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))


__all__ = ["OPTIONAL_COLUMNS", "COLUMNS", "COMPUTE_KINDS", "KINDS", "SOURCES", "Timeline"]
