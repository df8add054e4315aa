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

Run: ``python benchmarks/bench_runner.py`` (one to two minutes on 2 cores).
"""

from __future__ import annotations

import time

import pandas as pd
import torch

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
        kwargs = dict(steps=STEPS, progress=False, timeout_s=300)
        measured, bare = [], []
        for _ in range(2):
            measured.append(run(setup.model, batch, setup.loss_fn, part, m, **kwargs))
            bare.append(run(setup.model, batch, setup.loss_fn, part, m, instrument=False, **kwargs))
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


if __name__ == "__main__":
    start = time.time()
    table = main()
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3g}".format):
        print(table.to_string(index=False))
    print(
        f"\nmedian |rel_error| {table['rel_error'].abs().median():.1%}; "
        f"median overhead {table['overhead'].median():+.1%}; "
        f"{time.time() - start:.0f} s"
    )
