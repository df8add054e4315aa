"""``Timeline.from_profiler``: real traces written by torch itself, of plain ``torch.distributed.pipelining`` jobs
(no pipeswift_lab in the workers) under ``torchrun`` on gloo, and what the toolkit does with them.

The GPU kernel-time path is tested on a trace the test builds in the Chrome trace format Kineto writes for CUDA
(``cuda_runtime`` launches and ``kernel`` events joined by ``correlation``), marked ``built_trace``: no GPU here.
"""

import gzip
import json
import re
import shutil
from collections import Counter

import numpy as np
import pytest

import pipeswift_lab as psl
from pipeswift_lab.simulation.trace_files import TraceError

pytestmark = pytest.mark.processes  # the fixtures launch torchrun jobs

M, STEPS, P = 4, 4, 2
_COMPUTE = re.compile(r"^(PP:\d+[FBIW]\d+|Forward \d+|Backward \d+)$")


def raw_trace(path):
    """The trace as the standard library reads it."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def trace_facts(folder):
    """Per rank, from the raw JSON: the summed duration of its compute spans (``PP:`` or GPipe's), the summed
    extent of the compute ops inside them (first op start to span end, the span's own waits left out), in µs."""
    facts = {}
    for path in sorted(folder.iterdir()):
        trace = raw_trace(path)
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        ops = sorted(
            (e["ts"], e["tid"])
            for e in events
            if e.get("cat") == "cpu_op" and not e["name"].startswith(("c10d::", "gloo:"))
        )
        starts = np.array([t for t, _ in ops])
        spans = [e for e in events if e.get("cat") == "user_annotation" and _COMPUTE.match(e["name"])]
        raw = sum(e["dur"] for e in spans)
        work = 0.0
        for e in spans:
            inside = starts[np.searchsorted(starts, e["ts"]) : np.searchsorted(starts, e["ts"] + e["dur"])]
            work += e["ts"] + e["dur"] - inside[0] if len(inside) else e["dur"]
        facts[trace["distributedInfo"]["rank"]] = {"raw_us": raw, "ops_us": work}
    return facts


# --------------------------------------------------------------------------- interleaved runtime
def test_the_interleaved_runtime_s_trace_becomes_one_row_per_action(interleaved_traces):
    tl = psl.Timeline.from_profiler(interleaved_traces)
    stages = P * 2
    counts = Counter(tl.df["kind"])
    assert counts["F"] == counts["B"] == stages * M * STEPS
    # every boundary but the last stage's sends forward and receives backward, once per micro-batch and step
    for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        assert counts[kind] == (stages - 1) * M * STEPS, kind
    assert counts["REDUCE_GRAD"] == stages * STEPS
    assert tl.source == "measured" and set(tl.df["time_source"]) == {"host"}
    meta = tl.meta
    assert (meta["schedule"], meta["P"], meta["v"], meta["m"], meta["D"]) == ("Interleaved1F1B", P, 2, M, 1)
    assert meta["schedule_order_matched"] is True
    assert meta["clock_skew_ms"] == 0.0 and "one host" in meta["clock_alignment"]
    assert len(meta["step_ms"]) == STEPS == len(tl.steps) and tl.steps[0] == meta["first_step"]
    # stage s on rank s % P (torch's loop placement), each step's micro-batches all there
    placed = tl.df[tl.df["kind"] == "F"].groupby("stage")["rank"].unique()
    assert {s: list(r) for s, r in placed.items()} == {s: [s % P] for s in range(stages)}
    per_step = tl.df[tl.df["kind"] == "B"].groupby("step")["microbatch"].nunique()
    assert (per_step == M).all()


def test_busy_time_lies_between_the_spans_compute_ops_and_the_whole_spans(interleaved_traces):
    """A span holds the wait for its input, which is idle: busy time is at most the spans' sum and at least the
    compute ops' extent inside them; the idle share is the rest of the step."""
    tl = psl.Timeline.from_profiler(interleaved_traces)
    facts = trace_facts(interleaved_traces)
    busy = tl._busy.groupby("rank")["busy_ms"].sum()
    for rank, f in facts.items():
        assert f["ops_us"] / 1e3 <= busy[rank] * (1 + 1e-9) <= f["raw_us"] / 1e3 * (1 + 1e-9), (rank, f, busy[rank])
    idle = tl.idle_by_rank.set_index("rank")
    spans = tl.step_spans["span_ms"].to_numpy()
    for rank in range(P):
        per_step = tl._busy[tl._busy["rank"] == rank]["busy_ms"].to_numpy()
        assert idle.loc[rank, "idle_ratio"] == pytest.approx(np.mean(1 - per_step / spans))
        assert 0 < idle.loc[rank, "idle_ratio"] < 1


def test_an_imported_timeline_works_as_any_measured_one(interleaved_traces, tmp_path):
    tl = psl.Timeline.from_profiler(interleaved_traces)
    stats = tl.step_spans
    assert len(stats) == STEPS and (stats["span_ms"] > 0).all()
    assert tl.plot().get_title() is not None
    out = json.loads(open(tl.to_chrome_trace(tmp_path / "t.json")).read())
    assert sum(e.get("ph") == "X" for e in out["traceEvents"]) == len(tl.df)
    again = psl.Timeline.read_csv(tl.to_csv(tmp_path / "t.csv"))
    assert again.df.equals(tl.df) and again.meta["clock_skew_ms"] == 0.0
    html = tl._repr_html_()
    assert "clock_skew_ms" in html and "torch.profiler" in html
    sim = psl.simulate(
        psl.Partition.from_bounds(
            psl.Profile.synthetic(fwd_ms=[0.3] * 9, bwd_ms=[0.6] * 9).df,
            [(0, 2), (2, 4), (4, 6), (6, 9)],
            v=2,
            schedule="Interleaved1F1B",
            m=M,
        ),
        m=M,
    )
    comparison = psl.compare(sim, tl)
    assert comparison.measured is tl and comparison.measured_step in tl.steps[1:]
    busy = comparison.df[comparison.df["metric"] == "busy_ms"].set_index("rank")["measured"]
    step_busy = tl._busy[tl._busy["step"] == comparison.measured_step].set_index("rank")["busy_ms"]
    assert busy.astype(float).to_dict() == pytest.approx(step_busy.to_dict())


# --------------------------------------------------------------------------- GPipe, chrome export, gzip
def test_gpipe_s_forward_and_backward_spans_import_from_exported_files_gzipped_or_not(gpipe_traces, tmp_path):
    files = sorted(gpipe_traces.iterdir())
    zipped = tmp_path / (files[1].name + ".gz")
    with open(files[1], "rb") as src, gzip.open(zipped, "wb") as dst:
        shutil.copyfileobj(src, dst)
    tl = psl.Timeline.from_profiler([files[0], zipped])
    counts = Counter(tl.df["kind"])
    assert counts["F"] == counts["B"] == P * M * STEPS
    assert counts["SEND_F"] == counts["RECV_F"] == counts["SEND_B"] == counts["RECV_B"] == (P - 1) * M * STEPS
    assert tl.meta["schedule"] == "GPipe" and (tl.meta["P"], tl.meta["v"], tl.meta["m"]) == (P, 1, M)
    assert psl.Timeline.from_profiler(gpipe_traces).df.equals(tl.df)
    facts = trace_facts(gpipe_traces)
    busy = tl._busy.groupby("rank")["busy_ms"].sum()
    for rank, f in facts.items():
        assert busy[rank] <= f["raw_us"] / 1e3 * (1 + 1e-9)
    # GPipe runs every forward before any backward on each rank, and rank 1 starts micro-batch i after rank 0
    first = tl.df[tl.df["step"] == tl.steps[0]]
    for rank in range(P):
        mine = first[(first["rank"] == rank) & first["kind"].isin(["F", "B"])].sort_values("start_ms")
        assert list(mine["kind"]) == ["F"] * M + ["B"] * M
    f0 = first[(first["kind"] == "F")].set_index(["rank", "microbatch"])["start_ms"]
    assert all(f0[(1, i)] > f0[(0, i)] for i in range(M))


# --------------------------------------------------------------------------- clear errors
def test_a_folder_missing_a_rank_is_named_with_what_was_found(interleaved_traces, tmp_path):
    one = sorted(interleaved_traces.iterdir())[0]
    shutil.copy(one, tmp_path / one.name)
    with pytest.raises(TraceError, match=r"miss rank\(s\) \[1\] of the job's 2") as err:
        psl.Timeline.from_profiler(tmp_path)
    assert str(tmp_path) in str(err.value) and one.name in str(err.value)


def test_a_truncated_file_is_named(interleaved_traces, tmp_path):
    files = sorted(interleaved_traces.iterdir())
    data = files[1].read_bytes()
    (tmp_path / files[0].name).write_bytes(files[0].read_bytes())
    (tmp_path / files[1].name).write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated") as err:
        psl.Timeline.from_profiler(tmp_path)
    assert files[1].name in str(err.value)
    with gzip.open(tmp_path / "cut.json.gz", "wb") as fh:
        fh.write(data)
    cut = (tmp_path / "cut.json.gz").read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(cut[: len(cut) // 2])
    with pytest.raises(TraceError, match="cut.json.gz"):
        psl.Timeline.from_profiler(tmp_path / "cut.json.gz")


def test_a_trace_of_a_job_that_is_not_a_pipeline_says_so(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "matmul.json"
    prof.export_chrome_trace(str(path))
    with pytest.raises(TraceError, match="not a pipeline job's trace") as err:
        psl.Timeline.from_profiler(path)
    assert "matmul.json" in str(err.value)
    (tmp_path / "not_a_trace.json").write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="not_a_trace.json.*no 'traceEvents'"):
        psl.Timeline.from_profiler(tmp_path / "not_a_trace.json")
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        psl.Timeline.from_profiler(tmp_path / "nothing_here")


def test_torch_s_schedule1f1b_emits_no_spans_and_the_error_gives_the_way_out(tmp_path):
    from torch_jobs import torch_job

    traces = torch_job(tmp_path / "one_f_one_b", "1F1B", "--microbatches", 4, "--steps", 3, "--active", 1)
    with pytest.raises(TraceError, match="Schedule1F1B emits none.*_PipelineScheduleRuntime") as err:
        psl.Timeline.from_profiler(traces)
    assert "rank0" in str(err.value)


def test_two_runs_of_one_rank_in_a_folder_are_refused(interleaved_traces, tmp_path):
    for path in interleaved_traces.iterdir():
        shutil.copy(path, tmp_path / path.name)
        shutil.copy(path, tmp_path / path.name.replace(".pt.trace", ".again.pt.trace"))
    with pytest.raises(TraceError, match="in two traces"):
        psl.Timeline.from_profiler(tmp_path)


# --------------------------------------------------------------------------- clocks of several hosts
SKEW_MS = 20


def test_ranks_on_other_hosts_are_aligned_from_the_hand_offs(interleaved_traces, tmp_path):
    """Rank 1's trace moved to another host whose clock runs 20 ms ahead: the import finds the offset within its
    stated error bound, which tells the skew apart (the bound is what the hand-offs allow: under load a hand-off
    takes longer, and a run with a core busy gave 4.3 ms)."""
    same = psl.Timeline.from_profiler(interleaved_traces)
    for path in sorted(interleaved_traces.iterdir()):
        trace = json.loads(path.read_text())
        if trace["distributedInfo"]["rank"] == 1:
            trace["host_name"] = "another-host"
            trace["baseTimeNanoseconds"] += SKEW_MS * 1_000_000
        (tmp_path / path.name).write_text(json.dumps(trace))
    moved = psl.Timeline.from_profiler(tmp_path)
    assert "several hosts" in moved.meta["clock_alignment"]
    bound = moved.meta["clock_skew_ms"]
    assert 0 < bound < SKEW_MS

    def rank1_lag(tl):
        f = tl.df[tl.df["kind"] == "F"].set_index(["step", "stage", "microbatch"])["start_ms"]
        return float(np.median([f[(s, 1, i)] - f[(s, 0, i)] for s in tl.steps for i in range(M)]))

    assert abs(rank1_lag(moved) - rank1_lag(same)) <= bound


# --------------------------------------------------------------------------- the GPU kernel path (built trace)
def _gpu_trace(rank, world=2):
    """A two-stage 1F1B-through-the-runtime trace of one rank as Kineto writes it for CUDA: host spans and ops,
    ``cuda_runtime`` launches, and later ``kernel`` events (NCCL for the transfers) joined by ``correlation``."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0.0, "dur": 10_000.0, "pid": 1, "tid": 1}
    ]
    corr = [100 * rank]

    def action(name, ts, dur, kernels, comm=False):
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1})
        for i, (k_start, k_dur) in enumerate(kernels):
            corr[0] += 1
            launch = ts + 5 + i
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "ts": launch,
                    "dur": 2,
                    "pid": 1,
                    "tid": 1,
                    "args": {"correlation": corr[0]},
                }
            )
            name_k = "ncclDevKernel_SendRecv" if comm else "ampere_sgemm_128x64_tn"
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": name_k,
                    "ts": k_start,
                    "dur": k_dur,
                    "pid": 0,
                    "tid": 7,
                    "args": {"correlation": corr[0]},
                }
            )

    if rank == 0:
        action("PP:0F0", 100, 50, [(200, 300), (520, 100)])  # device: 200..620
        action("PP:0SEND_F0", 160, 10, [(640, 40)], comm=True)
        action("PP:0RECV_B0", 180, 10, [(2000, 30)], comm=True)
        action("PP:0B0", 200, 30, [(2100, 400)])  # waits on the stream for rank 1's gradient
    else:
        action("PP:1RECV_F0", 100, 10, [(650, 40)], comm=True)
        action("PP:1F0", 120, 20, [(700, 500)])
        action("PP:1B0", 150, 20, [(1300, 600)])
        action("PP:1SEND_B0", 180, 10, [(1950, 60)], comm=True)
    info = {"backend": "nccl", "rank": rank, "world_size": world}
    return {"traceEvents": events, "distributedInfo": info, "baseTimeNanoseconds": 0, "host_name": "gpu-node"}


@pytest.mark.built_trace
def test_on_gpu_traces_an_action_spans_the_kernels_it_launched(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}.pt.trace.json").write_text(json.dumps(_gpu_trace(rank)))
    tl = psl.Timeline.from_profiler(tmp_path)
    assert set(tl.df["time_source"]) == {"device"}
    rows = {(r.stage, r.kind): (r.start_ms, r.end_ms) for r in tl.df.itertuples()}
    origin = 0.0  # the ProfilerStep span starts at 0 µs
    expect = {
        (0, "F"): (200, 620),
        (0, "SEND_F"): (640, 680),
        (1, "RECV_F"): (650, 690),
        (1, "F"): (700, 1200),
        (1, "B"): (1300, 1900),
        (1, "SEND_B"): (1950, 2010),
        (0, "RECV_B"): (2000, 2030),
        (0, "B"): (2100, 2500),
    }
    for key, (start, end) in expect.items():
        assert rows[key] == pytest.approx(((start - origin) / 1e3, (end - origin) / 1e3)), key
    assert tl.meta["schedule_order_matched"] and tl.meta["first_step"] == 7  # one micro-batch: GPipe = 1F1B
    # rank 0 is busy only while its kernels run: 420 + 400 µs of the 10 ms ProfilerStep-bounded step
    assert tl._busy.set_index("rank").loc[0, "busy_ms"] == pytest.approx(0.82)
