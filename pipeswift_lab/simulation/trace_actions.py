"""One rank's pipeline actions, read from its ``torch.profiler`` trace (:func:`rank_actions`).

torch's pipelining runtime labels its actions with ``record_function``:

* ``_PipelineScheduleRuntime`` (Interleaved1F1B, LoopedBFS, the zero-bubble schedules, DualPipeV, and torchtitan's
  CSV schedules): ``PP:{stage}{kind}{microbatch}``, e.g. ``PP:0F1``, ``PP:1B3``, ``PP:2I0``, ``PP:2W0``,
  ``PP:0SEND_F1``, ``PP:1RECV_B3``, ``PP:0REDUCE_GRAD`` (``UNSHARD``/``RESHARD`` are dropped; an
  ``OVERLAP_F_B`` of DualPipeV gives each of its sub-actions the whole span);
* ``ScheduleGPipe``: ``Forward {i}`` and ``Backward {i}``, each around the receive, the compute and the send of
  micro-batch ``i``; the ``c10d::send``/``c10d::recv_`` ops inside become the ``SEND_*``/``RECV_*`` rows;
* ``Schedule1F1B`` in this torch version: no per-action spans (:func:`rank_actions` says so and how to get them).

A span is not all work. torch waits for an action's input inside its span (``_wait_batch_p2p`` before
``forward_one_chunk``; GPipe's ``Forward i`` also posts its receives and sends), and that wait is idle time, the
pipeline's bubble. On the host, a compute row therefore starts at the span's first compute op, moved back by the
shortest such lead of its (stage, kind) (the runtime's own preparation, which the runner's recorder counts too),
and ends with the span (or where GPipe's sends begin). The receive wait itself is not profiled on gloo, so the
shortest lead stands for the preparation. On GPU traces a row spans the kernels the span launched (device time: a
launch's ``correlation`` id joins its ``cuda_runtime``/``cuda_driver`` event to its ``kernel``/``gpu_memcpy``
event), where the wait is a stream wait and no kernel runs. Communication kernels (NCCL) launched inside an action
make its transfer rows' device time. Each row says which time it has in ``time_source``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from .trace_files import TraceError, TraceFile

_PP = re.compile(r"^PP:(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD)(\d*)$")
_PP_OVERLAP = re.compile(r"^PP:\((.*)\)OVERLAP_F_B$")
_SINGLE = re.compile(r"^(Forward|Backward) (\d+)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
#: Names of communication ops and annotations (torch's c10d, gloo and NCCL, and the functional collectives and their
#: waits that DTensor's tensor parallelism runs inside the actions): never an action's compute.
COMM_PREFIXES = (
    "c10d::",
    "_c10d_functional::",
    "_dtensor::",
    "gloo:",
    "nccl:",
    "nccl",
    "record_param_comms",
    "ProcessGroup",
)
_HOST_CATS = ("cpu_op", "user_annotation")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_DROPPED = ("UNSHARD", "RESHARD")
#: Columns of :func:`rank_actions`'s frame.
ACTION_COLUMNS = ("step", "stage", "microbatch", "kind", "start_us", "end_us", "time_source", "compute_us")


@dataclass(frozen=True)
class RankActions:
    """One rank's actions and step spans, as its trace's clock has them (µs)."""

    actions: pd.DataFrame
    """:data:`ACTION_COLUMNS`, one row per action."""
    steps: pd.DataFrame
    """``step``, ``start_us``, ``end_us`` of every ``ProfilerStep#N`` span (empty when the trace has none)."""
    labels: str
    """``"runtime"`` (``PP:`` labels) or ``"gpipe"`` (``Forward i``/``Backward i``)."""


class _Spans:
    """Start-sorted host ops of one thread, each with its communication code (``_WORK``, ``_SEND``, ``_RECV``,
    ``_OTHER_COMM``), for the ops inside an action's span."""

    def __init__(self, ts: list[float], end: list[float], comm: list[int]) -> None:
        order = np.argsort(np.asarray(ts), kind="stable")
        self.ts = np.asarray(ts, float)[order]
        self.end = np.asarray(end, float)[order]
        self.comm = np.asarray(comm, np.int8)[order]

    def inside(self, start: float, end: float) -> slice:
        return slice(int(np.searchsorted(self.ts, start, "left")), int(np.searchsorted(self.ts, end, "left")))


class _Kernels:
    """Device activity by correlation id, and the launches (any thread of the process) that name it."""

    def __init__(self, launch_ts: list[float], launch_corr: list[int], kernels: dict[int, tuple[float, float, bool]]):
        order = np.argsort(np.asarray(launch_ts), kind="stable")
        self.launch_ts = np.asarray(launch_ts, float)[order]
        self.launch_corr = np.asarray(launch_corr, np.int64)[order]
        self.kernels = kernels

    def span(self, start: float, end: float, comm: bool) -> tuple[float, float] | None:
        """The span of the (communication when ``comm``, else compute) device activity launched in [start, end)."""
        lo, hi = np.searchsorted(self.launch_ts, [start, end], "left")
        first, last = np.inf, -np.inf
        for corr in self.launch_corr[lo:hi].tolist():
            k = self.kernels.get(corr)
            if k is not None and k[2] == comm:
                first, last = min(first, k[0]), max(last, k[1])
        return (first, last) if first <= last else None


_WORK, _SEND, _RECV, _OTHER_COMM = range(4)


def _is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIXES)


@lru_cache(maxsize=4096)
def _comm_code(name: str) -> int:
    """``_WORK`` for compute, else which communication the op is."""
    if not _is_comm(name):
        return _WORK
    return _SEND if "send" in name else _RECV if "recv" in name else _OTHER_COMM


def rank_actions(trace: TraceFile) -> RankActions:
    """The pipeline actions of one rank's trace (see the module docstring), with their steps.

    Raises :class:`TraceError` naming the file when it holds no pipeline actions: with the way out when it looks
    like a pipeline job whose schedule emits no spans (``Schedule1F1B``), else saying it is not a pipeline job.
    """
    labels: list[tuple[str, float, float, int]] = []  # (name, ts, end, tid)
    steps: list[tuple[int, float, float]] = []
    host: dict[int, tuple[list[float], list[float], list[int]]] = {}
    launch_ts: list[float] = []
    launch_corr: list[int] = []
    kernels: dict[int, tuple[float, float, bool]] = {}
    p2p = 0
    for e in trace.events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name", "")
        ts = float(e.get("ts", 0.0))
        end = ts + float(e.get("dur", 0.0))
        if cat in _HOST_CATS:
            if name.startswith(("PP:", "Forward ", "Backward ")):
                labels.append((name, ts, end, e.get("tid", 0)))
                continue
            if name.startswith("ProfilerStep#"):
                match = _STEP.match(name)
                if match:
                    steps.append((int(match.group(1)), ts, end))
                continue
            comm = _comm_code(name)
            p2p += comm in (_SEND, _RECV)
            ts_list, end_list, comm_list = host.setdefault(e.get("tid", 0), ([], [], []))
            ts_list.append(ts)
            end_list.append(end)
            comm_list.append(comm)
        elif cat in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch_ts.append(ts)
                launch_corr.append(int(corr))
        elif cat in _DEVICE_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                kernels[int(corr)] = (ts, end, _is_comm(name))
    style = _label_style(trace, labels, p2p)
    spans = {tid: _Spans(*lists) for tid, lists in host.items()}
    device = _Kernels(launch_ts, launch_corr, kernels) if kernels else None
    rows = _rows(trace, labels, spans, device, style)
    step_df = pd.DataFrame(sorted(steps, key=lambda s: s[1]), columns=["step", "start_us", "end_us"])
    return RankActions(actions=_assign_steps(trace, rows, step_df), steps=step_df, labels=style)


def _label_style(trace: TraceFile, labels: list[tuple[str, float, float, int]], p2p: int) -> str:
    """``"runtime"`` or ``"gpipe"``; a clear error when the trace has neither kind of label."""
    if any(name.startswith("PP:") and (_PP.match(name) or _PP_OVERLAP.match(name)) for name, *_ in labels):
        return "runtime"
    if any(_SINGLE.match(name) for name, *_ in labels):
        return "gpipe"
    if p2p:
        raise TraceError(
            f"{trace.path}: rank {trace.rank} sends and receives tensors but the trace has no pipeline action spans "
            "(PP:{stage}{kind}{microbatch}, or GPipe's Forward i / Backward i). torch's Schedule1F1B emits none in "
            "this torch version: run the job through torch's _PipelineScheduleRuntime, as torchtitan does for a CSV "
            "schedule (--parallelism.pipeline_parallel_schedule_csv; in a script, _PipelineScheduleRuntime(stages, m, "
            "loss_fn=...) loaded with the schedule's per-rank order, as examples/torch_pipeline_job.py "
            "--through-runtime does), then profile again"
        )
    raise TraceError(
        f"{trace.path}: not a pipeline job's trace: rank {trace.rank} has no pipeline action spans "
        "(PP:{stage}{kind}{microbatch}, or GPipe's Forward i / Backward i) and no send/receive ops; profile a "
        "torch.distributed.pipelining schedule's steps"
    )


def _rows(
    trace: TraceFile,
    labels: list[tuple[str, float, float, int]],
    spans: dict[int, _Spans],
    device: _Kernels | None,
    style: str,
) -> list[tuple[int, int, str, float, float, str, float]]:
    """``(stage, microbatch, kind, start, end, time_source, label_start)`` of every action the labels name."""
    rows: list[tuple[int, int, str, float, float, str, float]] = []
    for name, ts, end, tid in labels:
        ops = spans.get(tid)
        if style == "runtime":
            for stage, kind, mb in _runtime_actions(name):
                comm = kind not in ("F", "B", "I", "W")
                rows.append((stage, mb, kind, *_timed(ts, end, ops, device, comm), ts))
            continue
        match = _SINGLE.match(name)
        if not match:
            continue
        forward, mb, stage = match.group(1) == "Forward", int(match.group(2)), trace.rank
        rows.append((stage, mb, "F" if forward else "B", *_timed(ts, end, ops, device, False), ts))
        for direction, code in (("SEND", _SEND), ("RECV", _RECV)):
            window = _comm_window(ops, ts, end, code)
            if window is not None:
                kind = f"{direction}_{'F' if forward else 'B'}"
                timed = device.span(*window, comm=True) if device is not None else None
                rows.append((stage, mb, kind, *(timed or window), "device" if timed else "host", ts))
    return rows


def _runtime_actions(name: str) -> list[tuple[int, str, int]]:
    """``(stage, kind, microbatch)`` of a ``PP:`` label (several for an ``OVERLAP_F_B``; none for UNSHARD/RESHARD)."""
    match = _PP.match(name)
    if match:
        stage, kind, mb = match.groups()
        return [] if kind in _DROPPED else [(int(stage), kind, int(mb) if mb else 0)]
    overlap = _PP_OVERLAP.match(name)
    if overlap:
        return [a for sub in overlap.group(1).split(";") for a in _runtime_actions(f"PP:{sub.strip()}")]
    return []


def _timed(ts: float, end: float, ops: _Spans | None, device: _Kernels | None, comm: bool) -> tuple[float, float, str]:
    """``(start, end, time_source)`` of the action labelled over [ts, end). A host-timed compute action starts at its
    first compute op (its lead, :func:`_without_waits`, is added back later) and ends where the span ends or, when
    the span posts sends after its compute (GPipe's), where the first of them starts."""
    if device is not None:
        span = device.span(ts, end, comm=comm)
        if span is not None:
            return span[0], span[1], "device"
    if comm or ops is None:
        return ts, end, "host"
    inside = ops.inside(ts, end)
    codes = ops.comm[inside]
    work = np.flatnonzero(codes == _WORK)
    if not len(work):
        return ts, end, "host"
    first = float(ops.ts[inside][work[0]])
    sends = np.flatnonzero(codes[work[0] :] == _SEND)
    stop = float(ops.ts[inside][work[0] + sends[0]]) if len(sends) else end
    return first, stop, "host"


def _without_waits(df: pd.DataFrame) -> pd.DataFrame:
    """Host-timed compute rows started back by their preparation: for every (stage, kind), the shortest lead from a
    span's start to its first compute op is the runtime's own work before the compute (taken as busy, as the
    runner's recorder does); whatever a span's lead has beyond it is the wait for its input (idle)."""
    df = df.assign(compute_us=df["start_us"])  # when the compute itself began: after the input arrived
    host = (df["time_source"] == "host") & df["kind"].isin(["F", "B", "I", "W"])
    if not host.any():
        return df
    lead = (df["start_us"] - df["label_us"]).where(host)
    shortest = lead.groupby([df["stage"], df["kind"]]).transform("min")
    return df.assign(start_us=np.where(host, df["start_us"] - shortest.fillna(0.0), df["start_us"]))


def _comm_window(ops: _Spans | None, ts: float, end: float, direction: int) -> tuple[float, float] | None:
    """The host span of the send (``_SEND``) or receive (``_RECV``) ops inside [ts, end), or None."""
    if ops is None:
        return None
    inside = ops.inside(ts, end)
    mine = ops.comm[inside] == direction
    if not mine.any():
        return None
    return float(ops.ts[inside][mine].min()), float(ops.end[inside][mine].max())


def _assign_steps(
    trace: TraceFile, rows: list[tuple[int, int, str, float, float, str, float]], steps: pd.DataFrame
) -> pd.DataFrame:
    """The rows as a frame with their ``step``: the ``ProfilerStep#N`` span holding the action's label start, or,
    in a trace without step spans, the action's occurrence count (the k-th ``1F0`` is step k). Actions outside every
    step span (profiling began mid-step) are dropped."""
    df = pd.DataFrame(rows, columns=["stage", "microbatch", "kind", "start_us", "end_us", "time_source", "label_us"])
    df = _without_waits(df)
    if df.empty:
        raise TraceError(f"{trace.path}: rank {trace.rank}'s pipeline spans name no actions")
    if len(steps):
        starts, ends = steps["start_us"].to_numpy(), steps["end_us"].to_numpy()
        pos = np.searchsorted(starts, df["label_us"].to_numpy(), "right") - 1
        ok = (pos >= 0) & (df["label_us"].to_numpy() < ends[np.maximum(pos, 0)])
        df = df[ok].assign(step=steps["step"].to_numpy()[pos[ok]])
        if df.empty:
            raise TraceError(
                f"{trace.path}: rank {trace.rank}'s pipeline actions all lie outside its ProfilerStep spans"
            )
    else:
        df = df.sort_values("label_us", kind="stable")
        df = df.assign(step=df.groupby(["stage", "kind", "microbatch"]).cumcount())
    return df[list(ACTION_COLUMNS)].reset_index(drop=True)


__all__ = ["ACTION_COLUMNS", "COMM_PREFIXES", "RankActions", "rank_actions"]
