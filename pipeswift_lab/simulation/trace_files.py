"""Finding and reading ``torch.profiler`` traces: the files of a folder written by
``torch.profiler.tensorboard_trace_handler`` or given one by one (``export_chrome_trace``), gzipped or not, and each
file's rank, host and clock base.

The files are Kineto's Chrome trace JSON: ``traceEvents`` (the events), ``distributedInfo`` (``rank``,
``world_size``, ``backend``) when ``torch.distributed`` was initialized, ``baseTimeNanoseconds`` (event ``ts`` are
microseconds after it, so ``ts + base`` is the host's wall clock) and ``host_name``. Each file is read with the
standard library's ``json`` (through ``gzip`` for ``.gz``) and dropped once its events are extracted, so a folder's
peak memory is its largest file's, not the folder's.
"""

from __future__ import annotations

import gc
import gzip
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

#: File names a trace folder is searched for (the handler writes ``<worker>.<time_ns>.pt.trace.json[.gz]``).
TRACE_PATTERNS = ("*.pt.trace.json", "*.pt.trace.json.gz", "*.json", "*.json.gz")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


class TraceError(ValueError):
    """A trace that cannot be imported; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class TraceFile:
    """One rank's trace as read: its path, rank, world size, host, clock base and events."""

    path: Path
    rank: int
    world_size: int | None
    host: str | None
    base_ns: int
    """``baseTimeNanoseconds``: event ``ts`` (µs) count from it on the host's wall clock (0 when absent)."""
    events: list[dict[str, Any]]


def trace_paths(source: str | PathLike[str] | Sequence[str | PathLike[str]]) -> list[Path]:
    """The trace files of ``source``: a folder (its ``*.pt.trace.json[.gz]``, else any ``*.json[.gz]``), one file,
    or a list of files. Returns them sorted; ``FileNotFoundError`` names what is missing."""
    items = [source] if isinstance(source, (str, PathLike)) else list(source)
    if not items:
        raise ValueError("no trace given: pass a folder written by tensorboard_trace_handler, or trace files")
    out: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found: list[Path] = []
            for pattern in TRACE_PATTERNS:
                found = sorted(p for p in path.glob(pattern) if p.is_file())
                if found:
                    break
            if not found:
                raise FileNotFoundError(
                    f"{path} holds no profiler traces (*.pt.trace.json or *.json, gzipped or not); write them with "
                    "torch.profiler.profile(on_trace_ready=torch.profiler.tensorboard_trace_handler(dir)) or "
                    "prof.export_chrome_trace(path)"
                )
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"no such trace file or folder: {path}")
    return sorted(dict.fromkeys(out))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a trace's millions of small dicts are built: they hold no cycles,
    and its passes over them cost a third of the load."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_trace(path: Path, single: bool) -> TraceFile:
    """Read one trace file. ``single``: the only file given, so a trace without a rank is rank 0.

    Raises :class:`TraceError` naming the file when it is truncated, not JSON, or not a profiler trace.
    """
    try:
        with open(path, "rb") as fh:
            gzipped = fh.read(2) == b"\x1f\x8b"
        opener = gzip.open if gzipped else open
        with opener(path, "rb") as fh, _collector_paused():
            trace = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as err:
        raise TraceError(
            f"{path}: not a complete JSON profiler trace ({type(err).__name__}: {err}); the file is truncated or "
            "was not written by torch.profiler (was the job killed while it exported?)"
        ) from err
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(
            f"{path}: not a torch.profiler Chrome trace (no 'traceEvents' list); export one with "
            "tensorboard_trace_handler or prof.export_chrome_trace"
        )
    info = trace.get("distributedInfo") or {}
    rank = info.get("rank")
    if rank is None:
        match = _RANK_IN_NAME.search(path.name)
        if match:
            rank = int(match.group(1))
        elif single:
            rank = 0
        else:
            raise TraceError(
                f"{path}: the trace does not say its rank (no distributedInfo: was torch.distributed initialized "
                "before profiling?) and its name holds no 'rank<N>'; rename it rank<N>.pt.trace.json"
            )
    world = info.get("world_size")
    return TraceFile(
        path=path,
        rank=int(rank),
        world_size=int(world) if world is not None else None,
        host=trace.get("host_name"),
        base_ns=int(trace.get("baseTimeNanoseconds") or 0),
        events=trace["traceEvents"],
    )


__all__ = ["TRACE_PATTERNS", "TraceError", "TraceFile", "read_trace", "trace_paths"]
