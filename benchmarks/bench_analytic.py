"""The analytic models against what was published: Korthikanti et al.'s memory figures, and the iteration times of
published multi-node runs (SC'21 Table 1, torchtitan's H100 benchmarks) predicted from analytic profiles.

1. Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (MLSys 2023): Figure 1 (per
   GPU, GB: parameters and optimizer state, activations of the tensor-parallel baseline, activations with sequence
   parallelism and selective recomputation) and Figure 7 (activation memory per layer as a % of the baseline) of
   their four models (Table 3), from :func:`pipeswift_lab.transformer_memory`, beside the paper's figures
   (:data:`pipeswift_lab.data.published.KORTHIKANTI_FIGURE_1` and ``_FIGURE_7``).
2. The published runs (:func:`pipeswift_lab.data.published_runs`): each predicted by
   :func:`pipeswift_lab.fidelity.predict_iteration` (analytic profile, tensor parallelism and recomputation, the
   simulated pipeline, the collectives beside it and the optimizer step), then calibrated with one compute scale on
   three held-in runs (:func:`pipeswift_lab.fidelity.published_check`), two ways: one scale for the whole dataset
   (held in: the three smallest runs by GPU count), and one scale per GPU type (held in: the three smallest of
   each). Printed: per run the measured and predicted iteration, before and after, and the error; the held-out
   MAPE; Spearman's rank correlation of the layouts within each model with three or more (by GPU-seconds per
   token, which ranks layouts across GPU counts); the pick's regret where a model has several layouts at one GPU
   count; and, beyond the issue's measures, Spearman of the achieved teraFLOP/s per GPU across the SC'21 table (does
   the model rank the configurations' efficiency), and what :func:`pipeswift_lab.plan` picks at the GPU count and
   batch of the five smallest SC'21 runs (the dataset has one layout per model and GPU count, so a pick that is not
   the published layout has no measured time to be compared with).
3. A scatter plot of predicted against measured iteration (log axes; hollow: uncalibrated, filled: calibrated;
   squares: held in), saved as ``bench_analytic_published.png`` under ``--out`` (default ``$PIPESWIFT_ARTIFACTS``,
   else ``artifacts/`` at the repository root, which git ignores).

Run: ``python benchmarks/bench_analytic.py`` (about half a minute on 2 cores). Nothing is asserted: the figures are
what they are (``tests/fidelity/test_published_runs.py`` checks the machinery).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pandas as pd

import pipeswift_lab as psl
from pipeswift_lab.core.transformer_memory import layer_activation_bytes
from pipeswift_lab.data.published import KORTHIKANTI_FIGURE_1, KORTHIKANTI_FIGURE_7, KORTHIKANTI_TABLE_3
from pipeswift_lab.fidelity import PublishedCheck, load_published, published_check, spearman

ROOT = Path(__file__).resolve().parent.parent
#: The SC'21 runs :func:`planner_picks` plans (the larger ones take minutes to plan).
PLANNED = ("sc21-gpt-1.7b", "sc21-gpt-3.6b", "sc21-gpt-7.5b", "sc21-gpt-18b", "sc21-gpt-39b")
S, V, GB = 2048, 51200, 1e9


def korthikanti() -> None:
    """Figures 1 and 7 of Korthikanti et al., computed beside the paper's."""
    print("== Korthikanti et al. 2022, Figure 1: GB per GPU (computed / paper)")
    print(f"{'model':>6} {'params+optimizer':>22} {'baseline activations':>24} {'SP + selective':>20}")
    for name, (a, h, L, t, p) in KORTHIKANTI_TABLE_3.items():
        spec = psl.TransformerSpec(L, h, a, S, V, tied=True)
        base = psl.transformer_memory(spec, 1, tp=t, pp=p)
        present = psl.transformer_memory(spec, 1, tp=t, pp=p, sequence_parallel=True, recompute="selective")
        paper = KORTHIKANTI_FIGURE_1[name]
        got = (base["model_states"] / GB, base["activations"] / GB, present["activations"] / GB)
        cells = [f"{g:8.2f} / {q:6.2f}" for g, q in zip(got, paper)]
        print(f"{name:>6} {cells[0]:>22} {cells[1]:>24} {cells[2]:>20}")
    print("\n== Korthikanti et al. 2022, Figure 7: activations per layer, % of the tensor-parallel baseline")
    print(f"{'model':>6} {'sequence parallel':>20} {'selective':>16} {'both':>16}")
    for name, (a, h, L, t, _) in KORTHIKANTI_TABLE_3.items():
        spec = psl.TransformerSpec(L, h, a, S, V, tied=True)
        base = layer_activation_bytes(spec, 1, tp=t)
        kinds = (
            {"sequence_parallel": True},
            {"recompute": "selective"},
            {"sequence_parallel": True, "recompute": "selective"},
        )
        got = [100 * layer_activation_bytes(spec, 1, tp=t, **kw) / base for kw in kinds]  # type: ignore[arg-type]
        cells = [f"{g:5.1f} / {q:5.1f}" for g, q in zip(got, KORTHIKANTI_FIGURE_7[name])]
        print(f"{name:>6} {cells[0]:>20} {cells[1]:>16} {cells[2]:>16}")


def report(check: PublishedCheck, title: str) -> None:
    """The per-run table and the summary of one check."""
    print(f"\n== {title}")
    table = check.table
    shown = pd.DataFrame(
        {
            "run": table["run"],
            "layout": table["layout"],
            "gpus": table["gpus"],
            "held in": table["in_fit"].map({True: "yes", False: ""}),
            "measured s": table["measured_step_ms"] / 1e3,
            "before s": table["predicted_before_ms"] / 1e3,
            "after s": table["predicted_after_ms"] / 1e3,
            "err before": table["rel_error_before"].map("{:+.1%}".format),
            "err after": table["rel_error_after"].map("{:+.1%}".format),
        }
    )
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for key, cal in check.calibrations.items():
        print(f"compute scale ({key}): {cal.compute_scale[1]:.3f} (calibrated on {', '.join(cal.meta['runs'])})")
    held_out = int((~table["in_fit"]).sum())
    print(
        f"held-out MAPE over {held_out} runs: {check.mape_before:.1%} uncalibrated -> {check.mape_after:.1%} calibrated"
    )
    for model, rho in check.spearman.items():
        n = int((table["model"] == model).sum())
        print(f"Spearman within {model} ({n} layouts, GPU-seconds per token): {rho:+.2f}")
    if check.picks.empty:
        print("pick within 5% of the measured best: not applicable (no model has two layouts at one GPU count)")
    else:
        print(check.picks.to_string(index=False))


def efficiency_ranking(check: PublishedCheck) -> None:
    """Spearman of predicted against achieved teraFLOP/s per GPU across the SC'21 table."""
    runs = {r.name: r for r in load_published()}
    sc21 = check.table[check.table["run"].str.startswith("sc21-")]
    measured = [runs[n].tflops_per_gpu for n in sc21["run"]]
    predicted = [
        runs[n].tflops_per_gpu * m / p
        for n, m, p in zip(sc21["run"], sc21["measured_step_ms"], sc21["predicted_after_ms"])
    ]
    rho = spearman(predicted, measured)
    print(f"\nSpearman of predicted against achieved TFLOP/s per GPU over the {len(sc21)} SC'21 runs: {rho:+.2f}")


def planner_picks(check: PublishedCheck, names: tuple[str, ...] | None = None) -> None:
    """``psl.plan`` at the GPU count, global batch and micro-batch of some SC'21 runs (default :data:`PLANNED`; full
    recomputation, no FSDP, calibrated per GPU type): its pick beside the published layout. Only a pick that is the
    published layout has a measured time; the others are what the planner would try instead."""
    from pipeswift_lab.fidelity import predict_iteration

    runs = {r.name: r for r in load_published()}
    print("\n== plan() at the published GPU counts (calibrated per GPU type; tp in 1, 2, 4, 8; no FSDP)")
    for name in names or PLANNED:
        r = runs[name]
        cal = check.calibrations[r.hardware.name if r.hardware.name in check.calibrations else "all"]
        prof = psl.analytic_profile(r.spec, r.hardware, r.micro_batch, attention=r.attention, dropout=r.dropout)
        best = psl.plan(
            prof,
            gpus=r.gpus,
            global_batch=r.global_batch,
            steps=10_000,
            topology=r.topology,
            precision="bf16-mixed",
            recompute="full",
            tp=[1, 2, 4, 8],
            fsdp=1,
            microbatch_sizes=[r.micro_batch],
            mem_per_gpu_bytes=r.hardware.hbm_bytes,
            schedules=["1F1B", "Interleaved1F1B"],
            calibration=cal,
            progress=False,
        ).best
        same = (best.tp, best.P, best.D, best.v if best.P > 1 else 1) == (r.tp, r.pp, r.dp, r.v)
        pipeline = f"pp{best.P}" + (f"(v{best.v})" if best.v > 1 else "") if best.P > 1 else ""
        pick = "×".join(x for x in (f"tp{best.tp}" if best.tp > 1 else "", pipeline, f"dp{best.D}") if x)
        published = predict_iteration(r, calibration=cal)["iteration_ms"] / 1e3
        print(
            f"{name:>14}: pick {pick} (step {best.step_ms / 1e3:.2f} s); published {r.layout} "
            f"(predicted {published:.2f} s, measured {r.measured_s:.2f} s): "
            + ("the published layout" if same else "another layout, not measured")
        )


def scatter(checks: dict[str, PublishedCheck], path: Path) -> None:
    """Predicted against measured iteration, log axes, one panel per check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(checks), figsize=(5.6 * len(checks), 5.2))
    for ax, (title, check) in zip(axes, checks.items()):
        table = check.table
        times = table[["measured_step_ms", "predicted_before_ms", "predicted_after_ms"]].to_numpy() / 1e3
        lo, hi = times.min() * 0.7, times.max() * 1.4
        ax.plot([lo, hi], [lo, hi], color="#888888", linestyle="--", linewidth=1, label="y = x")
        for framework, color in (("sc21-", "#1f77b4"), ("titan-", "#d62728")):
            for fitted, marker in ((False, "o"), (True, "s")):
                sub = table[table["run"].str.startswith(framework) & (table["in_fit"] == fitted)]
                if sub.empty:
                    continue
                name = ("SC'21 Table 1" if framework == "sc21-" else "torchtitan") + (" (held in)" if fitted else "")
                x = sub["measured_step_ms"] / 1e3
                ax.scatter(x, sub["predicted_before_ms"] / 1e3, marker=marker, facecolors="none", edgecolors=color)
                ax.scatter(x, sub["predicted_after_ms"] / 1e3, marker=marker, color=color, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured iteration (s, published)")
        ax.set_ylabel("predicted iteration (s)")
        ax.set_title(
            f"{title}\nheld-out MAPE {check.mape_before:.0%} hollow (uncalibrated), {check.mape_after:.0%} filled",
            fontsize=9,
        )
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    default = Path(os.environ.get("PIPESWIFT_ARTIFACTS", ROOT / "artifacts"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default, help="folder of the scatter plot")
    args = parser.parse_args()
    start = time.perf_counter()
    korthikanti()
    runs = load_published()
    pooled = published_check(runs, held_in=3)
    report(pooled, "Published runs: one compute scale for all, calibrated on the 3 smallest runs (by GPU count)")
    per_gpu = published_check(runs, held_in=3, group="hardware")
    report(per_gpu, "Published runs: one compute scale per GPU type, each calibrated on its 3 smallest runs")
    efficiency_ranking(per_gpu)
    planner_picks(per_gpu)
    path = args.out / "bench_analytic_published.png"
    scatter({"one scale, 3 smallest runs": pooled, "one scale per GPU type": per_gpu}, path)
    print(f"\nscatter plot: {path}  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
