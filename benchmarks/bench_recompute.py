"""Recomputation and mixed precision: memory saved and time added per choice, measured against predicted.

Two models, each profiled once with ``recompute=True`` (what every layer costs and keeps recomputed), at the thread
count each of two ranks gets:

* the reference GPT (6 blocks of width 128, 64 tokens, vocabulary 4096: 8 layers), at P=2 under GPipe, 1F1B,
  Interleaved1F1B and ZBVZeroBubble (v=2 for the last two), m=4, micro-batches of 4 sequences;
* a Hugging Face Llama (4 decoder layers of width 64, built from a config: ``layers="auto"``), at P=2 under 1F1B
  and ZBVZeroBubble, m=4.

Every configuration runs for real (gloo, one CPU process per rank, Adam, ``STEPS`` steps) with ``recompute`` None,
``"selective"`` and ``"full"``. Per run:

* memory: every rank's measured tensor-level peak (``RunResult.memory``) against the prediction, which replays
  the layers as they cost recomputed; ``saved``: the busiest rank's peak below the same configuration's without
  recomputation, measured and predicted;
* step: the measured step (``RunResult.steady_step_ms``) against the calibrated prediction. ``calibrate`` is
  fitted per model on its runs *without* recomputation of ``FIT`` (one single-chunk and one multi-chunk run for
  the GPT, one of each for the Llama), so every recomputing run is held out, as are the GPT's GPipe and ZBV runs
  without recomputation: their error is the calibrated error of fp32 runs that the recomputing ones are judged by;
  ``added``: the step above the same configuration's without recomputation, measured and predicted.

Then bf16 autocast against fp32 on the GPT under 1F1B and ZBVZeroBubble (a profile taken with
``precision="bf16-mixed"``): step and peak, measured and predicted.

Run: ``python benchmarks/bench_recompute.py [--quick]`` (about 80 s on 2 cores; ``--quick``: the GPT under
1F1B and ZBVZeroBubble only, no bf16). Figures are reported, never asserted; on a shared machine steps move by
several percent run to run, peaks do not.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

import pipeswift_lab as psl
from pipeswift_lab.runner.spec import available_cores

sys.path.insert(0, str(Path(__file__).parent))
from memory_zoo import FAMILIES

MICRO, M, STEPS = 4, 4, 10
MODES = (None, "selective", "full")
V = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
FIT = {"gpt": ("1F1B", "Interleaved1F1B"), "hf-llama": ("1F1B", "ZBVZeroBubble")}


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def gpt_setup():
    setup = psl.models.reference(
        "gpt", batch_size=MICRO * M, vocab_size=4096, seq_len=64, d_model=128, n_layers=6, n_heads=4
    )
    return setup.model, setup.inputs, setup.targets, setup.loss_fn, None


def llama_setup():
    family = FAMILIES["hf-llama"]
    x, y = family.batch(MICRO * M)
    return family.build(4), x, y, family.loss, "auto"


def profiled(model, x, y, loss_fn, layers, **kwargs):
    """The model profiled on one micro-batch at the thread count each of two ranks gets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores() // 2))
    try:
        return psl.profile(
            model, x[:MICRO], target=y[:MICRO], loss_fn=loss_fn, layers=layers, warmup=2, repeats=7,
            progress=False, **kwargs,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def run_model(name, setup, schedules, precision_runs=False):
    """Every (schedule, recompute) run of one model: its rows, its runs, the profile."""
    model, x, y, loss_fn, layers = setup()
    prof = profiled(model, x, y, loss_fn, layers, recompute=True)
    runs = {}
    for schedule in schedules:
        part = psl.partition(prof, 2, v=V[schedule], schedule=schedule, m=M)
        for mode in MODES:
            print(f"[{name}] {schedule} recompute={mode}", flush=True)
            runs[(schedule, mode)] = psl.run(
                model, (x, y), loss_fn, part, M, steps=STEPS, optimizer=adam, progress=False,
                launch=psl.Launch(timeout_s=300), recompute=mode,
            )  # fmt: skip
    fit = [runs[(s, None)] for s in FIT[name] if (s, None) in runs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the parameters two runs cannot tell keep their stated defaults
        cal = psl.calibrate(fit, prof)
    keys = list(runs)
    steps = cal.error([runs[k] for k in keys])
    rows = []
    for i, (schedule, mode) in enumerate(keys):
        result = runs[(schedule, mode)]
        memory = result.memory
        busiest = memory["measured_peak_bytes"].idxmax()
        rows.append(
            {
                "model": name,
                "schedule": schedule,
                "recompute": mode or "none",
                "in_fit": schedule in FIT[name] and mode is None,
                "measured_step_ms": steps.loc[i, "measured_step_ms"],
                "predicted_step_ms": steps.loc[i, "predicted_after_ms"],
                "step_error": steps.loc[i, "rel_error_after"],
                "measured_peak_MiB": memory.loc[busiest, "measured_peak_bytes"] / 2**20,
                "predicted_peak_MiB": memory.loc[busiest, "predicted_peak_bytes"] / 2**20,
                "max_memory_error": memory["error"].abs().max(),
                "memory_errors": memory["error"].tolist(),
            }
        )
    table = pd.DataFrame(rows)
    base = table[table["recompute"] == "none"].set_index("schedule")
    for what, column in (("measured", "measured_peak_MiB"), ("predicted", "predicted_peak_MiB")):
        table[f"saved_{what}"] = 1 - table[column] / table["schedule"].map(base[column])
    for what, column in (("measured", "measured_step_ms"), ("predicted", "predicted_step_ms")):
        table[f"added_{what}"] = table[column] / table["schedule"].map(base[column]) - 1
    return table


def precision_table():
    """bf16 autocast against fp32, the GPT under 1F1B and ZBVZeroBubble: measured and predicted step and peak."""
    model, x, y, loss_fn, layers = gpt_setup()
    rows = []
    for precision in ("fp32", "bf16-mixed"):
        prof = profiled(model, x, y, loss_fn, layers, precision=precision)
        for schedule in ("1F1B", "ZBVZeroBubble"):
            print(f"[gpt] {schedule} precision={precision}", flush=True)
            part = psl.partition(prof, 2, v=V[schedule], schedule=schedule, m=M)
            result = psl.run(
                model, (x, y), loss_fn, part, M, steps=STEPS, optimizer=adam, progress=False,
                launch=psl.Launch(timeout_s=300), precision=precision,
            )  # fmt: skip
            memory = result.memory
            rows.append(
                {
                    "schedule": schedule,
                    "precision": precision,
                    "measured_step_ms": result.steady_step_ms,
                    "simulated_step_ms": psl.simulate(part, M).step_ms,
                    "measured_peak_MiB": memory["measured_peak_bytes"].max() / 2**20,
                    "predicted_peak_MiB": memory["predicted_peak_bytes"].max() / 2**20,
                    "max_memory_error": memory["error"].abs().max(),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the GPT under 1F1B and ZBVZeroBubble only, no bf16")
    args = parser.parse_args()
    start = time.time()
    schedules = ("1F1B", "ZBVZeroBubble") if args.quick else tuple(V)
    tables = [run_model("gpt", gpt_setup, schedules)]
    if not args.quick:
        tables.append(run_model("hf-llama", llama_setup, ("1F1B", "ZBVZeroBubble")))
    table = pd.concat(tables, ignore_index=True)
    shown = table.drop(columns=["memory_errors"])
    with pd.option_context("display.width", 240, "display.max_columns", 30, "display.float_format", "{:.3g}".format):
        print(shown.to_string(index=False))
        print()
        per_choice = (
            table[table["recompute"] != "none"]
            .groupby(["model", "recompute"])[["saved_measured", "saved_predicted", "added_measured", "added_predicted"]]
            .median()
        )
        print("memory saved and step added per choice (median over schedules):")
        print(per_choice.to_string())
    memory = pd.Series([e for errors in table["memory_errors"] for e in errors]).abs()
    recomputing = table[table["recompute"] != "none"]
    rc_memory = pd.Series([e for errors in recomputing["memory_errors"] for e in errors]).abs()
    print(
        f"\nmemory, every rank of every run ({len(memory)} ranks): median |error| {memory.median():.1%}, max "
        f"{memory.max():.1%}; the recomputing runs' ({len(rc_memory)} ranks): median {rc_memory.median():.1%}, max "
        f"{rc_memory.max():.1%}"
    )
    held_plain = table[(table["recompute"] == "none") & ~table["in_fit"]]["step_error"].abs()
    held_rc = recomputing["step_error"].abs()
    print(
        f"step, calibrated on {int(table['in_fit'].sum())} runs without recomputation: held-out runs without "
        f"recomputation ({len(held_plain)}) median |error| {held_plain.median():.1%}, max {held_plain.max():.1%}; "
        f"recomputing runs ({len(held_rc)}) median {held_rc.median():.1%}, max {held_rc.max():.1%}"
    )
    if not args.quick:
        precision = precision_table()
        with pd.option_context("display.width", 240, "display.float_format", "{:.3g}".format):
            print("\nbf16 autocast against fp32 (GPT, P=2, m=4):")
            print(precision.to_string(index=False))
        by = precision.set_index(["schedule", "precision"])
        for schedule in ("1F1B", "ZBVZeroBubble"):
            fp32, bf16 = by.loc[(schedule, "fp32")], by.loc[(schedule, "bf16-mixed")]
            print(
                f"{schedule}: bf16 step {bf16.measured_step_ms / fp32.measured_step_ms:.2f}x fp32's, peak "
                f"{bf16.measured_peak_MiB / fp32.measured_peak_MiB:.2f}x (predicted "
                f"{bf16.predicted_peak_MiB / fp32.predicted_peak_MiB:.2f}x)"
            )
        print(f"precision memory: max |error| {precision['max_memory_error'].max():.1%}")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
