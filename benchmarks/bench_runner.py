"""Real pipeline runs on this machine's CPU against the simulator, and what the instrumentation costs.

For several schedules and micro-batch counts at P=2 (gloo, one CPU process per rank), with
the micro-batch size fixed so one profile serves every row:

* ``predicted_ms`` — the simulated step (``simulate``) of a balanced partition of a profile
  of the reference GPT taken on this machine;
* ``measured_ms`` — the same span measured (first action start to last action end of the
  median step: ``compare``'s ``span_ms``), and ``rel_error = (predicted - measured) / measured``
  (``benchmarks/bench_fidelity.py`` compares whole steps, before and after calibration);
* ``step_ms`` / ``step_ms_bare`` — the whole measured step (optimizer included), median over
  the steps after the first of two runs each, with and without the action instrumentation
  (the runs alternate), and ``overhead`` = their relative difference. On a shared 2-core
  machine the noise between runs is several percent, so small overheads read as noise.

The profile is taken with the thread count each rank gets (cores // 2), so a layer's time in
the profile is its time in a rank when nothing else competes for the cores.

Because run-to-run noise hides a small overhead, the script also times the recorder itself:
``per_action_us`` is the extra cost of one wrapped stage call (two ``perf_counter_ns`` reads and
an append), measured on no-op stage methods over 200k calls; times the actions of a step it
bounds the overhead from above (``overhead_bound``).

Last, :func:`profiler_agreement` times one run's actions with both the recorder and ``torch.profiler``
(``profiler_trace=``) and prints how far the two readings of the same actions differ (durations, clock offset,
per-rank busy time, step time): figures a loaded machine moves, so printed here rather than asserted in a test.

Run: ``python benchmarks/bench_runner.py`` (one to two minutes on 2 cores).
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from pipeswift_lab import Launch

MICROBATCH = 4
STEPS = 8
CASES = [
    ("GPipe", 1, 4),
    ("1F1B", 1, 4),
    ("1F1B", 1, 8),
    ("Interleaved1F1B", 2, 4),
    ("Interleaved1F1B", 2, 8),
    ("ZBVZeroBubble", 2, 4),
    ("DualPipeV", 2, 4),
]


class _NoOpStage:
    stage_index, is_last = 0, False

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return None

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return None


def per_action_overhead_us(calls: int = 200_000) -> float:
    """Extra µs one instrumented stage call costs over the bare call (no-op methods, best of 5)."""
    from types import SimpleNamespace

    from pipeswift_lab.runner.rank.instrument import ActionRecorder

    def timed(stage):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(calls):
                stage.forward_one_chunk(i)
            best = min(best, time.perf_counter() - t0)
        return best / calls * 1e6

    bare = timed(_NoOpStage())
    stage = _NoOpStage()
    ActionRecorder([stage], SimpleNamespace(_maybe_compute_loss=lambda *a, **k: None), torch.device("cpu"))
    return timed(stage) - bare


def main() -> pd.DataFrame:
    from pipeswift_lab import compare, run
    from pipeswift_lab.models import reference
    from pipeswift_lab.partitioning.balance import partition
    from pipeswift_lab.profiling.measure import profile
    from pipeswift_lab.runner.spec import available_cores
    from pipeswift_lab.simulation.simulator import simulate

    setup = reference(
        "gpt",
        batch_size=MICROBATCH * max(m for _, _, m in CASES),
        vocab_size=4096,
        seq_len=32,
        d_model=64,
        n_layers=4,
        n_heads=4,
    )
    x, y = setup.inputs, setup.targets
    torch.set_num_threads(max(1, available_cores() // 2))  # what each of the 2 ranks uses
    prof = profile(
        setup.model, x[:MICROBATCH], target=y[:MICROBATCH], loss_fn=setup.loss_fn, warmup=3, repeats=15, progress=False
    )
    rows = []
    action_us = per_action_overhead_us()
    for schedule, v, m in CASES:
        part = partition(prof, 2, method="balanced", v=v, schedule=schedule, m=m)
        batch = (x[: MICROBATCH * m], y[: MICROBATCH * m])
        kwargs = dict(steps=STEPS, progress=False, launch=Launch(timeout_s=300))
        measured, bare = [], []
        for _ in range(2):
            measured.append(run(setup.model, batch, setup.loss_fn, part, m, **kwargs))
            bare.append(run(setup.model, batch, setup.loss_fn, part, m, launch=Launch(instrument=False), **kwargs))
        step_ms = float(pd.Series([t for r in measured for t in r.step_ms[1:]]).median())
        step_ms_bare = float(pd.Series([t for r in bare for t in r.step_ms[1:]]).median())
        c = compare(simulate(part, m), measured[-1])
        spans = c.df.set_index("metric").loc["span_ms"]  # the action span; c.step_ms is the whole step (steady_step_ms)
        predicted_ms, span_ms = float(spans["predicted"]), float(spans["measured"])
        rows.append(
            {
                "schedule": schedule,
                "v": v,
                "m": m,
                "bounds": str(list(part.bounds)),
                "predicted_ms": predicted_ms,
                "measured_ms": span_ms,
                "rel_error": float(spans["rel_error"]),
                "bubble_pred": c.bubble_ratio[0],
                "bubble_meas": c.bubble_ratio[1],
                "step_ms": step_ms,
                "step_ms_bare": step_ms_bare,
                "overhead": step_ms / step_ms_bare - 1,
                "per_action_us": action_us,
                "overhead_bound": action_us * 1e-3 * len(measured[-1].timeline.df) / STEPS / 2 / step_ms,
                "assembly_s": measured[-1].jct.assembly_s,
            }
        )
    return pd.DataFrame(rows)


def profiler_agreement(steps: int = 5, m: int = 4) -> dict:
    """The runner's recorder against torch.profiler's own spans of the same actions (``run(...,
    profiler_trace=DIR)`` read back with ``Timeline.from_profiler``): Interleaved1F1B at P=2, v=2, 8 blocks of width
    256 on 64 samples (each action about a millisecond, so runtime overheads do not dominate). Once asserted in
    ``tests/runner/test_profiler_trace_option.py`` (a busy core moved the busy ratio to 1.11); now printed: the
    median |duration gap| of an action between the two (ms, and over the median action), the spread of the two
    clocks' offset (median |offset - its median|, ms), each rank's median per-step busy-time ratio trace / recorder,
    and the largest step-time ratio trace / recorder."""
    import tempfile

    from torch import nn

    from pipeswift_lab import Profile, Timeline, run
    from pipeswift_lab.partitioning.balance import partition

    torch.manual_seed(0)
    wide = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    part = partition(
        Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8), 2, method="uniform", v=2, schedule="Interleaved1F1B", m=m
    )
    with tempfile.TemporaryDirectory() as where:
        result = run(wide, (x, y), nn.functional.mse_loss, part, m, steps=steps, progress=False, profiler_trace=where)
        imported = Timeline.from_profiler(where)
    key = ["step", "rank", "stage", "microbatch", "kind"]
    recorded = result.timeline.df[result.timeline.df["kind"].isin(["F", "B"])]
    read = imported.df[imported.df["kind"].isin(["F", "B"])]
    both = recorded.merge(read, on=key, suffixes=("_run", "_trace"))
    gap = (both["end_ms_trace"] - both["start_ms_trace"]) - (both["end_ms_run"] - both["start_ms_run"])
    typical = float((both["end_ms_run"] - both["start_ms_run"]).median())
    offset = both["start_ms_trace"] - both["start_ms_run"]
    busy = result.timeline._busy.merge(imported._busy, on=["step", "rank"], suffixes=("_run", "_trace"))
    ratio = (busy["busy_ms_trace"] / busy["busy_ms_run"]).groupby(busy["rank"]).median()
    step_ratio = pd.Series(imported.meta["step_ms"]) / pd.Series(list(result.step_ms))
    return {
        "actions": len(both),
        "median_action_ms": typical,
        "median_abs_duration_gap_ms": float(gap.abs().median()),
        "median_abs_duration_gap_rel": float(gap.abs().median()) / typical,
        "offset_spread_ms": float((offset - offset.median()).abs().median()),
        "busy_ratio_by_rank": [round(float(r), 3) for r in ratio],
        "max_step_ratio_off_1": float((step_ratio - 1).abs().max()),
    }


if __name__ == "__main__":
    start = time.time()
    table = main()
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3g}".format):
        print(table.to_string(index=False))
    agreement = profiler_agreement()
    print(
        "\nrecorder vs torch.profiler, the same actions (Interleaved1F1B, P=2, 5 steps): "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in agreement.items())
    )
    print(
        f"\nmedian |rel_error| {table['rel_error'].abs().median():.1%}; "
        f"median overhead {table['overhead'].median():+.1%}; "
        f"{time.time() - start:.0f} s"
    )
