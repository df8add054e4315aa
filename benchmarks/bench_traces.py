"""Importing ``torch.profiler`` traces: ``psl.Timeline.from_profiler(folder)`` against a plain ``json.load`` of the
same files, in time and in peak resident memory, for trace folders of growing size.

The traces are real: ``examples/torch_pipeline_job.py`` runs once under torch's launcher (2 ranks on gloo,
Interleaved1F1B, m=4, the last 4 of 6 steps profiled; ``OMP_NUM_THREADS=1``) and writes one
``rank{r}.*.pt.trace.json`` per rank. Bigger folders tile each rank's file over more steps, at the text level so the
bytes stay torch's (its layout, every field, the metadata events, ``distributedInfo``, ``baseTimeNanoseconds``): the
profiled window's events are copied ``k`` times, copy ``k`` shifted in ``ts`` by ``k`` times the window's length (the
same on every rank, so the ranks stay on one clock) and its ``ProfilerStep#N`` renamed ``N + k * steps``; flow ids,
``External id`` and the like are left as they are (the import reads none on a CPU trace). The metadata events are
written once, the profiler's ``Trace`` span and ``Record Window End`` stretched over the copies (one copy is byte
for byte the file torch wrote). Every size is checked: its events are ``k`` times the window's plus the metadata,
and its import has ``k`` times the rows and as many ``step_ms`` as steps (an ``AssertionError`` otherwise).

For each size, in a fresh interpreter each (so that the resident high-water is that measurement's):

* ``json.load`` — every file of the folder loaded with the standard library, one after another, nothing kept;
* ``import`` — ``psl.Timeline.from_profiler(folder)``.

Each interpreter first runs its own measurement once on the smallest folder (untimed: the import's one-time lazy
imports, torch's pipelining schedules through ``compute_orders``, are paid there), then collects garbage, trims
malloc and takes its resident size as the baseline; ``peak MB`` is ``ru_maxrss`` at the end minus that baseline
(the largest over the rounds; a few MB of allocator slack either way, so the 2 MB row's peaks are rough). For folders
under ``--single-above-mb`` (100 MB) there are ``--rounds`` (3) pairs of such interpreters, json and import in turn,
their order alternated, each timing ``--repeats`` (3) runs: the time is the median over the rounds of each one's
median. Above, one pair, one run each. The files were just written, so they are read from the page cache: disk speed
is not in these figures. Other processes' load moves every timing (the last line gives the load average); the ratio
is taken within one run of the script.

Printed: one row per size — folder MB, largest file MB, steps per rank, events, actions (the Timeline's rows),
``json.load`` s, import s, their ratio against the goal (import within 3x of ``json.load``: ``ok``), both peaks,
the import's peak over the largest file, and the import's MB/s. ``--big`` adds a folder of about ``--big-gb`` (1 GB)
when the memory its import would take (extrapolated from the largest default size) fits in 80% of the available
memory and the disk has room, else says what limits it. ``--cprofile`` profiles the import of the largest default
size once and prints its top functions by cumulative time.

Run: ``python benchmarks/bench_traces.py`` (sizes ``--steps 4,40,400``: 2, 24 and 238 MB), about 2 minutes on 2
cores at a load average of 3-6 (the torch job ~15 s of it); ``--big`` (1,680 steps per rank, 998 MB, its largest file
574 MB) adds about 2 minutes and needs ~3 GB of memory; ``--cprofile`` ~25 s; ``--trace-dir DIR`` reuses traces of
the same job instead of running it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "torch_pipeline_job.py"
#: The goal: the import takes at most this many times a plain json.load of the files.
GOAL_RATIO = 3.0
#: Values the tiling rewrites in each copy: every event's ``ts``, and the step numbers of ``ProfilerStep#N``.
_VALUES = re.compile(r'"ts":\s*(-?\d+(?:\.\d*)?)|"name":\s*"ProfilerStep#(\d+)"')
_EVENTS = re.compile(r'"traceEvents"\s*:\s*\[')
MB = 1e6


# ---------------------------------------------------------------------------------------------- real traces, tiling


def run_job(out: Path, microbatches: int, steps: int, active: int) -> list[Path]:
    """Run the plain torch pipeline job under torch's launcher; its per-rank trace files."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(JOB),
        "--schedule", "Interleaved1F1B", "--microbatches", str(microbatches), "--steps", str(steps),
        "--active", str(active), "--trace-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the torch job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return sorted(out.glob("*.pt.trace.json"))


def _ns(text: str) -> int:
    """A ``ts`` as written (µs, up to 3 decimals) in integer nanoseconds, so that shifting it is exact."""
    whole, _, frac = text.partition(".")
    sign = -1 if whole.startswith("-") else 1
    return int(whole) * 1000 + sign * int((frac + "000")[:3])


def _us(ns: int) -> str:
    return f"{ns // 1000}.{ns % 1000:03d}"


class TraceTemplate:
    """One rank's trace file split for tiling: the text around the events, the metadata events (written once) and
    the profiled window's events as literal pieces between the values each copy rewrites."""

    def __init__(self, path: Path) -> None:
        text = path.read_text()
        self.name = path.name
        opening = _EVENTS.search(text)
        assert opening, f"{path}: no traceEvents"
        decoder = json.JSONDecoder()
        pos, spans = opening.end(), []
        while True:
            while text[pos] in " \t\r\n,":
                pos += 1
            if text[pos] == "]":
                break
            event, end = decoder.raw_decode(text, pos)
            spans.append((pos, end, event))
            pos = end
        self.head, self.tail = text[: spans[0][0]], text[spans[-1][1] :]  # torch's whitespace around the events
        self.sep = text[spans[0][1] : spans[1][0]] if len(spans) > 1 else ",\n  "
        tiled = [s for s in spans if _tiled(s[2])]
        first = spans.index(tiled[0])
        self.before = [(text[a:b], e) for a, b, e in spans[:first] if not _tiled(e)]
        self.after = [(text[a:b], e) for a, b, e in spans[first:] if not _tiled(e)]
        window = self.sep.join(text[a:b] for a, b, _ in tiled)
        self.n_tiled, self.n_fixed = len(tiled), len(spans) - len(tiled)
        self.pieces, self.values, self.is_step = [], [], []
        last = 0
        for match in _VALUES.finditer(window):
            ts, step = match.groups()
            start = match.start(1) if ts is not None else match.start(2)
            self.pieces.append(window[last:start])
            self.values.append(_ns(ts) if ts is not None else int(step))
            self.is_step.append(ts is None)
            last = match.end(1) if ts is not None else match.end(2)
        self.pieces.append(window[last:])
        self.n_steps = sum(self.is_step)
        assert len(self.values) - self.n_steps == self.n_tiled, f"{path}: not one ts per event"
        ends = [round((e["ts"] + e.get("dur", 0)) * 1000) for _, _, e in tiled]
        self.lo_ns = min(round(e["ts"] * 1000) for _, _, e in tiled)
        self.hi_ns = max(ends)

    def write(self, dst: Path, copies: int, shift_ns: int) -> None:
        """The trace over ``copies`` windows, each ``shift_ns`` after the last."""
        stretch = (copies - 1) * shift_ns
        with open(dst, "w") as fh:
            fh.write(self.head)
            first = True

            def put(chunk: str) -> None:
                nonlocal first
                fh.write(chunk if first else self.sep + chunk)
                first = False

            for chunk, event in self.before:
                put(_stretched(chunk, event, stretch))
            pieces, values, is_step = self.pieces, self.values, self.is_step
            for k in range(copies):
                offset, renumber = k * shift_ns, k * self.n_steps
                out = [pieces[0]]
                for piece, value, step in zip(pieces[1:], values, is_step):
                    out.append(str(value + renumber) if step else _us(value + offset))
                    out.append(piece)
                put("".join(out))
            for chunk, event in self.after:
                put(_stretched(chunk, event, stretch))
            fh.write(self.tail)


def _tiled(event: dict[str, Any]) -> bool:
    """Events of the profiled window (copied per step block); metadata, instant markers and the profiler's own
    ``Trace`` span are written once."""
    return event.get("ph") not in ("M", "i") and event.get("cat") != "Trace"


def _stretched(chunk: str, event: dict[str, Any], stretch: int) -> str:
    """The profiler's ``Trace`` span and ``Record Window End`` marker moved to cover every copy."""
    if not stretch:
        return chunk
    if event.get("cat") == "Trace" and "dur" in event:
        return re.sub(r'("dur":\s*)(\d+(?:\.\d*)?)', lambda m: m.group(1) + _us(_ns(m.group(2)) + stretch), chunk)
    if event.get("ph") == "i" and event.get("name") == "Record Window End":
        return re.sub(r'("ts":\s*)(-?\d+(?:\.\d*)?)', lambda m: m.group(1) + _us(_ns(m.group(2)) + stretch), chunk)
    return chunk


def tile(templates: list[TraceTemplate], copies: int, dst: Path) -> None:
    dst.mkdir(parents=True)
    shift_ns = max(t.hi_ns for t in templates) - min(t.lo_ns for t in templates)
    for t in templates:
        t.write(dst / t.name, copies, shift_ns)


# ---------------------------------------------------------------------------------------------- measuring (workers)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _proc_bytes(path: str, key: str) -> int:
    """The ``key:`` line of a ``/proc`` status file (in kB) as bytes, 0 when absent."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return 0


def _json_load(folder: Path) -> dict[str, Any]:
    events = 0
    for path in sorted(folder.glob("*.pt.trace.json")):
        with open(path, "rb") as fh:
            events += len(json.load(fh)["traceEvents"])
    return {"events": events}


def _import(folder: Path) -> dict[str, Any]:
    import pipeswift_lab as psl

    tl = psl.Timeline.from_profiler(folder)
    meta = tl.meta
    return {"rows": len(tl.df), "steps": len(meta.get("step_ms", [])), "schedule": meta["schedule"]}


def worker(mode: str, folder: Path, warm: Path, repeats: int, memory_allowance: int) -> None:
    """One measurement in this fresh interpreter; prints ``RESULT {json}``."""
    op = _json_load if mode == "json" else _import
    if mode != "json":
        import pipeswift_lab  # noqa: F401 - imported before the baseline, as a user's session has it

    op(warm)  # untimed: lazy imports and first-call costs
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base = _rss()
    if memory_allowance:  # a MemoryError here rather than the machine swapping or the OOM killer
        limit = _proc_bytes("/proc/self/status", "VmData") + memory_allowance
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    if mode == "cprofile":
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.runcall(op, folder)
        took = time.perf_counter() - start
        print(f"import of {folder} under cProfile: {took:.1f} s (cProfile slows Python-level calls)")
        stats = pstats.Stats(profiler).strip_dirs()
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("tottime").print_stats(12)
        return
    times, out = [], {}
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            out = op(folder)
            times.append(time.perf_counter() - start)
            gc.collect()
    except MemoryError:
        print("RESULT " + json.dumps({"error": "MemoryError", "limit_mb": memory_allowance / MB}), flush=True)
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print("RESULT " + json.dumps({"s": statistics.median(times), "times": times, "peak": peak, **out}), flush=True)


def measure(mode: str, folder: Path, warm: Path, repeats: int, memory_allowance: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", mode, "--folder", str(folder), "--warm", str(warm)]
    cmd += ["--repeats", str(repeats), "--memory-allowance", str(memory_allowance)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if mode == "cprofile":
        print(done.stdout + done.stderr[-2000:])
        return {}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        why = "killed (out of memory?)" if done.returncode < 0 else f"exit {done.returncode}"
        return {"error": f"{mode} worker {why}: {done.stderr.strip()[-500:]}"}
    return json.loads(lines[-1][7:])


# ---------------------------------------------------------------------------------------------- main


def _size(folder: Path) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in folder.glob("*.pt.trace.json")]
    return sum(sizes), max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="4,40,400", help="steps per rank of each size (multiples of --active)")
    parser.add_argument("--big", action="store_true", help="add a folder of about --big-gb")
    parser.add_argument("--big-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="fresh json/import interpreter pairs per size")
    parser.add_argument("--repeats", type=int, default=3, help="runs in each interpreter")
    parser.add_argument("--single-above-mb", type=float, default=100.0, help="one run for folders above this")
    parser.add_argument("--cprofile", action="store_true", help="profile the largest default size's import once")
    parser.add_argument("--trace-dir", default=None, help="reuse this job's traces instead of running it")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--active", type=int, default=4, help="profiled steps of the job")
    parser.add_argument("--tmp", default=None, help="where the tiled folders go (default: the system's temp dir)")
    parser.add_argument("--worker", choices=["json", "import", "cprofile"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    parser.add_argument("--memory-allowance", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.folder), Path(args.warm), args.repeats, args.memory_allowance)
        return

    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_traces-", dir=args.tmp))
    try:
        if args.trace_dir:
            real = sorted(Path(args.trace_dir).glob("*.pt.trace.json"))
            job_s = 0.0
        else:
            start = time.perf_counter()
            real = run_job(work / "real", args.microbatches, args.active + 2, args.active)
            job_s = time.perf_counter() - start
        templates = [TraceTemplate(p) for p in real]
        window = {t.n_steps for t in templates}
        assert len(window) == 1, f"the ranks' traces profile different numbers of steps: {window}"
        per_copy = window.pop()
        steps = [int(s) for s in args.steps.split(",")]
        bad = [s for s in steps if s % per_copy]
        if bad:
            raise SystemExit(f"--steps {bad}: not multiples of the {per_copy} profiled steps")
        warm = work / f"steps-{min(steps)}"
        tile(templates, min(steps) // per_copy, warm)
        available_gib = _proc_bytes("/proc/meminfo", "MemAvailable") / 2**30
        print(
            f"real traces: {len(real)} ranks, {per_copy} steps, {sum(p.stat().st_size for p in real) / MB:.2f} MB "
            f"(job {job_s:.0f} s); memory available {available_gib:.1f} GiB; {os.cpu_count()} cores",
            flush=True,
        )

        rows: list[dict[str, Any]] = []
        per_step_rows = None
        cprofile_steps = max(steps) if args.cprofile else None
        sizes = [(s, False) for s in sorted(steps)]
        if args.big:
            one_copy = sum(p.stat().st_size for p in real)
            copies = max(1, round(args.big_gb * 1e9 / one_copy))
            sizes.append((copies * per_copy, True))
        for n_steps, big in sizes:
            copies = n_steps // per_copy
            folder = work / f"steps-{n_steps}"
            if big:
                why = _too_big(rows, templates, copies, work)
                if why:
                    print(f"--big: {n_steps} steps per rank skipped: {why}", flush=True)
                    break
            if not folder.exists():
                start = time.perf_counter()
                tile(templates, copies, folder)
                made = time.perf_counter() - start
            else:
                made = 0.0
            total, largest = _size(folder)
            single = total / MB > args.single_above_mb
            repeats, rounds = (1, 1) if single else (args.repeats, args.rounds)
            print(
                f"{n_steps} steps per rank: {total / MB:.0f} MB (tiled in {made:.1f} s), {rounds} round(s) of "
                f"{repeats} run(s) ...",
                flush=True,
            )
            allowance = int(0.8 * _proc_bytes("/proc/meminfo", "MemAvailable")) if big else 0
            found: dict[str, list[dict[str, Any]]] = {"json": [], "import": []}
            for r in range(rounds):  # fresh interpreters, json and import in turn, the order alternated
                for mode in ("json", "import") if r % 2 == 0 else ("import", "json"):
                    found[mode].append(measure(mode, folder, warm, repeats, allowance))
            failed = [m["error"] for ms in found.values() for m in ms if "error" in m]
            if failed:
                print(f"  failed: {'; '.join(failed)}", flush=True)
                break
            plain, imported = (
                {**ms[0], "s": statistics.median(m["s"] for m in ms), "peak": max(m["peak"] for m in ms)}
                for ms in (found["json"], found["import"])
            )
            expected_events = sum(t.n_fixed + copies * t.n_tiled for t in templates)
            assert plain["events"] == expected_events, (plain["events"], expected_events)
            if per_step_rows is None:
                per_step_rows = imported["rows"] / n_steps
            assert imported["rows"] == per_step_rows * n_steps, (imported["rows"], per_step_rows * n_steps)
            assert imported["steps"] == n_steps, (imported["steps"], n_steps)
            ratio = imported["s"] / plain["s"]
            rows.append(
                {
                    "folder MB": total / MB,
                    "largest file MB": largest / MB,
                    "steps/rank": n_steps,
                    "events": plain["events"],
                    "actions (rows)": imported["rows"],
                    "json.load s": plain["s"],
                    "import s": imported["s"],
                    "import/json": ratio,
                    f"<= {GOAL_RATIO:g}x": "ok" if ratio <= GOAL_RATIO else "MISSED",
                    "json peak MB": plain["peak"] / MB,
                    "import peak MB": imported["peak"] / MB,
                    "import peak / largest file": imported["peak"] / largest,
                    "import MB/s": total / MB / imported["s"],
                    "runs": rounds * repeats,
                    "schedule": imported["schedule"],
                }
            )
            print(
                f"  json.load {plain['s']:.2f} s, import {imported['s']:.2f} s (x{ratio:.2f}), "
                f"peaks {plain['peak'] / MB:.0f} / {imported['peak'] / MB:.0f} MB",
                flush=True,
            )
            if n_steps == cprofile_steps:
                measure("cprofile", folder, warm, 1)
            if folder != warm:
                shutil.rmtree(folder)

        table = pd.DataFrame(rows)
        pd.set_option("display.width", 250)
        print()
        print(table.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        if rows:
            last = rows[-1]
            print(
                f"\nMemory: each rank's file is json.load-ed whole and dropped before the next, so the import's peak "
                f"follows the largest file, not the folder: {last['import peak / largest file']:.1f}x it at "
                f"{last['steps/rank']} steps per rank ({last['largest file MB']:.0f} MB file, "
                f"{last['import peak MB']:.0f} MB peak, json.load alone {last['json peak MB']:.0f} MB)."
            )
        print(
            f"\nGoal: import within {GOAL_RATIO:g}x of json.load of the files. Times: medians (rounds of fresh "
            "interpreters), one-time imports excluded, files in the page cache. Peaks: ru_maxrss over the baseline "
            "after a warm-up.\n"
            f"Ran in {time.perf_counter() - began:.0f} s; load average {load}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _too_big(rows: list[dict[str, Any]], templates: list[TraceTemplate], copies: int, work: Path) -> str:
    """Why the big folder is not measured here (empty when it can be): its import's peak, extrapolated linearly from
    the largest size measured (per MB of the largest file), against 80% of the available memory; the disk."""
    if not rows:
        return "no smaller size measured to extrapolate its memory from"
    last = rows[-1]
    per_copy = [sum(len(p) for p in t.pieces) + len(t.values) * 17 for t in templates]  # ~17 bytes a value
    largest_mb, folder_mb = max(per_copy) * copies / MB, sum(per_copy) * copies / MB
    peak_mb = max(last["import peak / largest file"], last["json peak MB"] / last["largest file MB"]) * largest_mb
    available_mb = _proc_bytes("/proc/meminfo", "MemAvailable") / MB
    free_mb = shutil.disk_usage(work).free / MB
    if peak_mb > 0.8 * available_mb:
        return (
            f"its largest file (~{largest_mb:.0f} MB) would take ~{peak_mb:.0f} MB at peak ("
            f"{last['import peak / largest file']:.1f}x the file, as at {last['steps/rank']} steps), over 80% of "
            f"the {available_mb:.0f} MB available: each file is json.load-ed whole"
        )
    if folder_mb > 0.9 * free_mb:
        return f"~{folder_mb:.0f} MB to write, {free_mb:.0f} MB free on {work}"
    return ""


if __name__ == "__main__":
    main()
