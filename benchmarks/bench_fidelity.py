"""How well the simulator predicts real runs, before and after calibration, on this machine's CPU.

The reference GPT (6 blocks, so 8 layers: P=4 with two chunks per rank fits) is profiled once,
one micro-batch of ``MICROBATCH`` sequences at the thread count each rank gets, and run for
real with ``psl.run`` (gloo, one process per rank) at P=2 for GPipe, 1F1B, Interleaved1F1B
and ZBVZeroBubble with m in {2, 4, 8}, and at P=4 where the schedule allows it (m >= P for
the single-chunk schedules here to keep the runs short; Interleaved1F1B needs m divisible by P).

* ``calibrate`` is fitted on the first round's runs of ``FIT`` (3 runs: one of each runtime at
  P=2 and one at P=4, the only one that tells the P=4 compute scale) and every other
  configuration is held out;
* for every run: the measured step (``RunResult.steady_step_ms``: the whole median step after
  the first, optimizer included), the prediction before calibration (the simulated step of
  the profile) and after (calibrated span plus the runtime's per-step overhead), and
  ``(predicted - measured) / measured``; the medians and maxima of ``|error|`` on the held-out
  runs, before and after;
* Spearman's rank correlation of predicted and measured step across the held-out runs,
  before and after;
* the noise floor: every configuration runs twice (``ROUNDS``, one round after the other), the
  measured step of a configuration is the mean of its runs' ``steady_step_ms``, and the median
  difference between a configuration's two runs is printed (no model predicts a run better
  than the runs repeat);
* the planner's pick: among all measured configurations, the one with the smallest calibrated
  predicted time per micro-batch (``step / m``: every micro-batch is the same size here, so this
  is throughput), measured, against the best measured time per micro-batch.

Run: ``python benchmarks/bench_fidelity.py`` (about two minutes on 2 cores). Figures are
reported, never asserted; on a shared machine they move by several percent run to run.

``--injected`` instead runs the sleeping-layer jobs of ``tests/fidelity/test_calibrator.py`` (every layer
sleeps 1.5x its profiled time, the first layer of a stage 4 ms more, the optimizer 60 ms) and prints what
``calibrate`` recovers against what was injected: the compute scale at P=2 and P=4, the fixed cost per action,
the step overhead with and without the optimizer's sleep (their difference against the 60 ms), the gap scale at
P=4, and the held-out GPipe run's error before and after calibration. The test asserts only what a loaded machine
cannot undo (fitted costs at least the injected ones); these are the figures it once held within 10-15%.
"""

from __future__ import annotations

import time
import warnings

import pandas as pd
import torch

MICROBATCH = 4
STEPS = 16
#: Every configuration is run this many times, in rounds; its measured step is the mean of the runs' steady_step_ms.
ROUNDS = 2
P2 = [
    (s, v, m) for s, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)) for m in (2, 4, 8)
]
P4 = [("GPipe", 1, 4), ("1F1B", 1, 4), ("1F1B", 1, 8), ("Interleaved1F1B", 2, 4), ("ZBVZeroBubble", 2, 4)]
CASES = [(2, *c) for c in P2] + [(4, *c) for c in P4]
#: the runs calibrate is fitted on: one single-chunk and one multi-chunk run at P=2, one run at P=4
FIT = [(2, "1F1B", 1, 4), (2, "Interleaved1F1B", 2, 4), (4, "1F1B", 1, 4)]


def main():
    import pipeswift_lab as psl
    from pipeswift_lab.fidelity.calibrator import CalibrationWarning
    from pipeswift_lab.runner.spec import available_cores

    setup = psl.models.reference(
        "gpt", batch_size=MICROBATCH * 8, vocab_size=4096, seq_len=32, d_model=64, n_layers=6, n_heads=4
    )
    x, y = setup.inputs, setup.targets
    threads = torch.get_num_threads()
    torch.set_num_threads(
        max(1, available_cores() // 2)
    )  # what each rank of a P=2 run gets (P=4 gets the same on 2 cores)
    try:
        prof = psl.profile(
            setup.model,
            x[:MICROBATCH],
            target=y[:MICROBATCH],
            loss_fn=setup.loss_fn,
            warmup=3,
            repeats=15,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    parts = {k: psl.partition(prof, k[0], v=k[2], schedule=k[1], m=k[3]) for k in CASES}
    runs = {}  # (configuration, round) -> RunResult; the rounds run one after the other, so slow spells hit both alike
    for r in range(ROUNDS):
        for i, k in enumerate(CASES):
            P, schedule, v, m = k
            print(f"[round {r + 1}/{ROUNDS}, {i + 1}/{len(CASES)}] P={P} {schedule} m={m}", flush=True)
            runs[(k, r)] = psl.run(
                setup.model,
                (x[: MICROBATCH * m], y[: MICROBATCH * m]),
                setup.loss_fn,
                parts[k],
                m,
                steps=STEPS,
                progress=False,
                launch=psl.Launch(timeout_s=300),
            )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        cal = psl.calibrate([runs[(k, 0)] for k in FIT], prof)  # fitted on the first round's runs of FIT only
    per_run = cal.error([runs[(k, r)] for r in range(ROUNDS) for k in CASES])
    per_run["config"] = [str(k) for r in range(ROUNDS) for k in CASES]
    per_run["round"] = [r for r in range(ROUNDS) for k in CASES]
    # one row per configuration: the measured step is the mean over rounds of each run's steady_step_ms
    table = (
        per_run.groupby("config", sort=False)
        .agg(
            schedule=("schedule", "first"),
            P=("P", "first"),
            v=("v", "first"),
            m=("m", "first"),
            measured_step_ms=("measured_step_ms", "mean"),
            predicted_before_ms=("predicted_before_ms", "first"),
            predicted_after_ms=("predicted_after_ms", "first"),
        )
        .reset_index(drop=True)
    )
    table.insert(4, "in_fit", [k in FIT for k in CASES])
    table.insert(5, "bounds", [str(list(parts[k].bounds)) for k in CASES])
    for when in ("before", "after"):
        table[f"rel_error_{when}"] = (table[f"predicted_{when}_ms"] - table["measured_step_ms"]) / table[
            "measured_step_ms"
        ]
    steps = per_run.pivot(index="config", columns="round", values="measured_step_ms")
    noise = (steps[1] / steps[0] - 1).abs() if ROUNDS > 1 else pd.Series(dtype=float)
    held = table[~table["in_fit"]]
    spearman_before = (
        held["predicted_before_ms"].rank().corr(held["measured_step_ms"].rank())
    )  # Spearman: Pearson of the ranks
    spearman_after = held["predicted_after_ms"].rank().corr(held["measured_step_ms"].rank())
    per_mb = table.assign(
        measured_per_mb=table["measured_step_ms"] / table["m"],
        predicted_per_mb=table["predicted_after_ms"] / table["m"],
    )
    pick = per_mb.loc[per_mb["predicted_per_mb"].idxmin()]
    best = per_mb.loc[per_mb["measured_per_mb"].idxmin()]
    # replay: how much of each held-out error is durations, how much schedule and communication model
    decomposition = []
    for k in CASES:
        if k in FIT:
            continue
        c = psl.compare(psl.simulate(parts[k], k[3], calibration=cal), runs[(k, 0)])
        d = c.decomposition.set_index("component")["share_of_measured"]
        decomposition.append({"durations": d["durations"], "model": d["schedule and communication model"]})
    decomposition = pd.DataFrame(decomposition)
    return (
        cal,
        table,
        held,
        (spearman_before, spearman_after),
        (pick, best),
        decomposition,
        noise,
        [str(w.message) for w in caught],
    )


def injected() -> None:
    """Print the fit of the test's sleeping-layer runs against the values injected into them."""
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests), str(tests / "fidelity")]
    from test_calibrator import ACTION_MS, PROFILE, SCALE, SPLIT2, SPLIT4, STEP_MS, sleepy_run

    import pipeswift_lab as psl
    from pipeswift_lab.fidelity.calibrator import CalibrationWarning

    runs = {
        "1F1B": sleepy_run("1F1B", 4, SPLIT2),
        "GPipe": sleepy_run("GPipe", 2, SPLIT2),
        "Interleaved1F1B": sleepy_run("Interleaved1F1B", 4, SPLIT4, v=2),
        "quick": sleepy_run("1F1B", 4, SPLIT2, step_ms=0.0),
        "P=4": sleepy_run("1F1B", 4, SPLIT4, steps=4),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        cal = psl.calibrate([runs["1F1B"], runs["Interleaved1F1B"]], PROFILE)
        slow = psl.calibrate([runs["1F1B"]], PROFILE)
        quick = psl.calibrate([runs["quick"]], PROFILE)
        p4 = psl.calibrate([runs["1F1B"], runs["P=4"]], PROFILE)
    held = cal.error([runs["GPipe"]]).iloc[0]
    overhead = slow.step_overhead["single-chunk"] - quick.step_overhead["single-chunk"]
    print(
        f"compute_scale[P=2] {cal.compute_scale[2]:.3f} (injected {SCALE}), "
        f"compute_scale[P=4] {p4.compute_scale[4]:.3f}, action_ms {cal.action_ms:.2f} (injected {ACTION_MS}), "
        f"gap_scale[P=4] {p4.gap_scale[4]:.2f}"
    )
    print(
        f"step overhead with the optimizer's sleep {slow.step_overhead['single-chunk']:.1f} ms, without "
        f"{quick.step_overhead['single-chunk']:.1f} ms: difference {overhead:.1f} ms (injected {STEP_MS})"
    )
    print(
        f"held-out GPipe: measured {held['measured_step_ms']:.1f} ms, error before {held['rel_error_before']:+.1%}, "
        f"after {held['rel_error_after']:+.1%}"
    )


if __name__ == "__main__":
    import sys

    if "--injected" in sys.argv[1:]:
        injected()
        sys.exit()
    start = time.time()
    cal, table, held, (rho_b, rho_a), (pick, best), decomposition, noise, notes = main()
    with pd.option_context(
        "display.width",
        220,
        "display.max_columns",
        20,
        "display.max_colwidth",
        60,
        "display.float_format",
        "{:.3g}".format,
    ):
        print(cal.df.to_string(index=False))
        print()
        print(table.to_string(index=False))
    for note in notes:
        print(f"note: {note}")
    b, a = held["rel_error_before"].abs(), held["rel_error_after"].abs()
    print(f"\nheld-out runs: {len(held)} (calibrated on {int(table['in_fit'].sum())})")
    print(
        f"median |rel error| before {b.median():.1%}, after {a.median():.1%}; "
        f"max before {b.max():.1%}, after {a.max():.1%}"
    )
    print(f"Spearman rank correlation predicted vs measured (held out): before {rho_b:.2f}, after {rho_a:.2f}")
    print(
        f"median share of the held-out error from durations {decomposition['durations'].abs().median():.1%}, "
        f"from the schedule/communication model {decomposition['model'].abs().median():.1%} (compare's replay)"
    )
    print(
        f"planner's pick (smallest calibrated step per micro-batch): P={pick.P} {pick.schedule} m={pick.m}, measured "
        f"{pick.measured_per_mb:.3g} ms per micro-batch; best measured P={best.P} {best.schedule} m={best.m} "
        f"{best.measured_per_mb:.3g} ms ({pick.measured_per_mb / best.measured_per_mb - 1:+.1%})"
    )
    if len(noise):
        print(
            f"noise floor: the same configuration's two runs differ by a median {noise.median():.1%} "
            f"(max {noise.max():.1%})"
        )
    print(f"{time.time() - start:.0f} s")
