"""``run(..., profiler_trace=DIR)``: every rank writes a torch.profiler trace of its steps, with torch's own spans.

Real runs (gloo, one CPU process per rank) of a tiny ``nn.Sequential``, two steps each.
"""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

N_LAYERS, WIDTH, BATCH = 4, 8, 4


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(N_LAYERS)])


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def two_ranks(schedule, v, m):
    profile = Profile.synthetic(fwd_ms=[1.0] * N_LAYERS, bwd_ms=[2.0] * N_LAYERS)
    return partition(profile, 2, method="uniform", v=v, schedule=schedule, m=m)


def go(schedule, v, m, **kw):
    part = two_ranks(schedule, v, m)
    kw.setdefault("steps", 2)
    return psl.run(
        model(), batch(), nn.functional.mse_loss, part, m, progress=False, launch=psl.Launch(timeout_s=120), **kw
    ), part


def traces(directory):
    """``{rank: [span names]}`` of the trace files in ``directory``, one file per rank, its rank checked."""
    files = sorted(Path(directory).glob("*.pt.trace.json"))
    by_rank = {}
    for file in files:
        trace = json.loads(file.read_text())
        rank = trace["distributedInfo"]["rank"]
        assert file.name.startswith(f"rank{rank}.") and rank not in by_rank, [f.name for f in files]
        assert trace["distributedInfo"]["world_size"] == 2
        by_rank[rank] = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert sorted(by_rank) == [0, 1], [f.name for f in files]
    return by_rank


def profiler_steps(names):
    return sorted(int(n.removeprefix("ProfilerStep#")) for n in names if n.startswith("ProfilerStep#"))


def test_interleaved_ranks_write_one_trace_each_with_a_span_per_step_and_per_action(tmp_path):
    where = tmp_path / "not" / "yet"  # made by the ranks
    m, steps = 4, 3
    result, part = go("Interleaved1F1B", 2, m, steps=steps, profiler_trace=where)
    assert result.meta["profiler_trace"] == str(where.resolve())
    by_rank = traces(where)
    forwards = Counter()
    for rank, names in by_rank.items():
        assert profiler_steps(names) == list(range(steps))
        mine = Counter(tuple(map(int, x.groups())) for n in names if (x := re.fullmatch(r"PP:(\d+)F(\d+)", n)))
        assert {s for s, _ in mine} == {s for s, r in enumerate(part.stage_to_rank) if r == rank}
        forwards += mine
    n_stages = 2 * 2
    assert sorted(forwards) == [(s, i) for s in range(n_stages) for i in range(m)]
    assert set(forwards.values()) == {steps} and sum(forwards.values()) == n_stages * m * steps
    assert any(re.fullmatch(r"PP:\d+B\d+", n) for n in by_rank[0])  # the backwards too

    # the importer reads the run's own traces: the same actions as the runner's recorder, in the same order on each
    # rank (how far the two clocks' readings of them differ is a timing against a timing, which a busy core moves:
    # benchmarks/bench_runner.py prints it)
    imported = psl.Timeline.from_profiler(where)
    key = ["step", "rank", "stage", "microbatch", "kind"]
    recorded = result.timeline.df
    recorded = recorded[recorded["kind"].isin(["F", "B"])]
    read = imported.df[imported.df["kind"].isin(["F", "B"])]
    both = recorded.merge(read, on=key, suffixes=("_run", "_trace"))
    assert len(both) == len(recorded) == len(read) == n_stages * m * steps * 2
    assert (both["end_ms_run"] >= both["start_ms_run"]).all() and (both["end_ms_trace"] >= both["start_ms_trace"]).all()
    for rank in (0, 1):
        orders = [
            list(df[df["rank"] == rank].sort_values("start_ms", kind="stable")[key].itertuples(index=False, name=None))
            for df in (recorded, read)
        ]
        assert orders[0] == orders[1], rank
    busy = result.timeline._busy.merge(imported._busy, on=["step", "rank"], suffixes=("_run", "_trace"))
    assert len(busy) == 2 * steps and (busy["busy_ms_trace"] > 0).all(), busy
    assert len(imported.meta["step_ms"]) == len(result.step_ms) == steps
    assert imported.meta["schedule"] == result.schedule


def test_gpipe_marks_forwards_and_a_resumed_run_numbers_its_steps_from_the_checkpoint(tmp_path):
    m = 2
    first, _ = go("GPipe", 1, m, steps=1, checkpoint=tmp_path / "ckpt")
    assert first.meta["profiler_trace"] is None and first.steps == 1
    where = tmp_path / "trace"
    where.mkdir()  # an existing directory is fine
    resumed, _ = go("GPipe", 1, m, steps=3, resume_from=tmp_path / "ckpt", profiler_trace=str(where))
    assert resumed.first_step == 1
    for names in traces(where).values():
        assert profiler_steps(names) == [1, 2]  # the run's own step numbers
        counts = Counter(n for n in names if re.fullmatch(r"(Forward|Backward) \d+", n))
        assert counts == {f"{kind} {i}": 2 for kind in ("Forward", "Backward") for i in range(m)}


def test_a_path_that_is_a_file_or_lies_under_one_is_refused_before_any_process_starts(tmp_path):
    file = tmp_path / "taken"
    file.write_text("")
    part = two_ranks("GPipe", 1, 2)
    for bad, says in ((file, "exists and is not a directory"), (file / "sub", "lies under")):
        with pytest.raises(ValueError, match=f"profiler_trace=.*{says}"):
            psl.run(model(), batch(), nn.functional.mse_loss, part, 2, steps=1, progress=False, profiler_trace=bad)
    with pytest.raises(TypeError, match="profiler_trace must be a directory"):
        psl.run(model(), batch(), nn.functional.mse_loss, part, 2, steps=1, progress=False, profiler_trace=3)
