"""A Timeline as Chrome trace JSON, for Perfetto or ``chrome://tracing`` (:meth:`Timeline.to_chrome_trace`).

One process per device (``pid`` = rank; ``replica * P + rank`` with several replicas) with a compute thread
(``tid`` 0) and a transfer thread (``tid`` 1, the all-reduce too); every action is an ``"X"`` event (``ts``/``dur`` in
µs). Flow events (``"s"`` → ``"f"``) join each ``SEND_*`` to its ``RECV_*``; without transfer rows they join each
cross-rank dependency (``F`` to the next stage's ``F``, the backward to the previous stage's backward).
"""

from __future__ import annotations

import json
from os import PathLike
from typing import Any

import numpy as np
import pandas as pd

from ..core.vocabulary import COMPUTE_KINDS
from .schema import jsonable, row_arrays
from .timeline_view import TimelineView

#: A flow arrow's end: ``(pid, tid, ts_us)``.
FlowEnd = tuple[int, int, float]


def write_chrome_trace(timeline: TimelineView, path: str | PathLike[str]) -> str:
    """Write ``timeline`` as Chrome trace JSON to ``path``; return the path (see the module docstring)."""
    events = _metadata_events(timeline) + _action_events(timeline) + _flow_events(timeline)
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": timeline.source, **jsonable(timeline.meta)},
    }
    with open(path, "w") as fh:
        json.dump(trace, fh)
    return str(path)


def _metadata_events(timeline: TimelineView) -> list[dict[str, Any]]:
    """The names of every process (device) and of its compute and transfer threads."""
    events: list[dict[str, Any]] = []
    for pid, name in _process_names(timeline).items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "transfer"}})
    return events


def _action_events(timeline: TimelineView) -> list[dict[str, Any]]:
    """One complete (``"X"``) event per row."""
    df = timeline.df
    pids = _pids(timeline)
    events = []
    for i, (kind, step, stage, mb, start, end) in enumerate(
        zip(df["kind"], df["step"], df["stage"], df["microbatch"], df["start_ms"], df["end_ms"])
    ):
        events.append(
            {
                "ph": "X",
                "name": f"{kind}{mb} s{stage}",
                "cat": kind,
                "pid": int(pids[i]),
                "tid": 0 if kind in COMPUTE_KINDS else 1,
                "ts": float(start) * 1e3,
                "dur": float(end - start) * 1e3,
                "args": {"step": int(step), "stage": int(stage), "microbatch": int(mb)},
            }
        )
    return events


def _flow_events(timeline: TimelineView) -> list[dict[str, Any]]:
    """A start (``"s"``) and a finish (``"f"``) event per flow arrow."""
    events: list[dict[str, Any]] = []
    for flow_id, (src, dst) in enumerate(_flows(timeline)):
        common = {"id": flow_id, "name": "transfer", "cat": "flow"}
        events.append({"ph": "s", **common, "pid": src[0], "tid": src[1], "ts": src[2]})
        events.append({"ph": "f", "bp": "e", **common, "pid": dst[0], "tid": dst[1], "ts": dst[2]})
    return events


def _process_names(timeline: TimelineView) -> dict[int, str]:
    if len(timeline.replicas) == 1:
        return {r: f"rank {r}" for r in timeline.ranks}
    P = max(timeline.ranks) + 1
    return {d * P + r: f"replica {d} rank {r}" for d in timeline.replicas for r in timeline.ranks}


def _pids(timeline: TimelineView) -> np.ndarray:
    rank = timeline.df["rank"].to_numpy(np.int64)
    if len(timeline.replicas) == 1:
        return rank
    return timeline.df["replica"].to_numpy(np.int64) * (max(timeline.ranks) + 1) + rank


def _flows(timeline: TimelineView) -> list[tuple[FlowEnd, FlowEnd]]:
    """Pairs ``((pid, tid, ts_us), (pid, tid, ts_us))`` for the flow arrows."""
    df = pd.DataFrame({**row_arrays(timeline.df), "rank": _pids(timeline)})
    sends = df[df["kind"].isin(["SEND_F", "SEND_B"])]
    if len(sends):
        return _transfer_flows(df, sends)
    return _dependency_flows(df[df["kind"].isin(COMPUTE_KINDS)])


def _transfer_flows(df: pd.DataFrame, sends: pd.DataFrame) -> list[tuple[FlowEnd, FlowEnd]]:
    """Each ``SEND_*`` joined to the ``RECV_*`` of the same micro-batch on the neighbouring stage."""
    out = []
    recvs = df[df["kind"].isin(["RECV_F", "RECV_B"])].set_index(["step", "replica", "kind", "stage", "mb"])
    for row in sends.itertuples(index=False):
        target = ("RECV_F", row.stage + 1) if row.kind == "SEND_F" else ("RECV_B", row.stage - 1)
        key = (row.step, row.replica, target[0], target[1], row.mb)
        if key in recvs.index:
            rec = recvs.loc[[key]].iloc[0]
            out.append(((int(row.rank), 1, row.start * 1e3), (int(rec["rank"]), 1, float(rec["end"]) * 1e3)))
    return out


def _dependency_flows(comp: pd.DataFrame) -> list[tuple[FlowEnd, FlowEnd]]:
    """Each compute action joined to the action on another rank whose output it needs."""
    out = []
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


__all__ = ["write_chrome_trace"]
