"""Report sections on the model alone: bubbles, JCT, the profile, partitions, simulated timelines and the plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from ...core import analytic
from ...core.costs import AssemblyModel
from ...core.display import noise_warning
from ...core.jct import JCT
from ...core.vocabulary import SINGLE_CHUNK_SCHEDULES, default_v
from .base import ReportContext, Section, figure_of, reference_profile

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ...profiling.table import Profile

__all__ = [
    "section_bubbles",
    "section_jct_example",
    "section_partition",
    "section_plan",
    "section_profile",
    "section_timeline",
]


def section_bubbles(ctx: ReportContext) -> Section:
    """Bubble against m for several P, in both conventions, with the worked examples."""
    import matplotlib.pyplot as plt

    from ..widgets import plot_bubble_curve

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    plot_bubble_curve((2, 4, 8, 16), schedule="1F1B", convention="ratio", ax=left)
    plot_bubble_curve((2, 4, 8, 16), schedule="Interleaved1F1B", v=2, convention="overhead", ax=right)
    left.set_title("GPipe and 1F1B: bubble_ratio, (P−1)/(m+P−1)")
    right.set_title("Interleaved1F1B, v=2: bubble_overhead, (P−1)/(v·m)")
    right.set_yscale("log")
    fig.tight_layout()
    rows = []
    for P, m in ((4, 16), (8, 16), (8, 64), (4, 8)):
        for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
            rows.append(analytic.bubble_summary(P, m, schedule, v=v))
    table = pd.DataFrame(rows)
    intro = (
        "<p>Two conventions of the pipeline bubble are in use. <code>bubble_ratio</code> is the share of a step a "
        "stage sits idle, (P−1)/(m+P−1) for GPipe and 1F1B (left). <code>bubble_overhead</code> is bubble time over "
        "ideal compute, (P−1)/m for GPipe and 1F1B and (P−1)/(v·m) for the interleaved schedule (right, v=2). "
        "A larger m shrinks both, but every extra micro-batch lengthens the step's compute and, for GPipe, "
        "the activations held.</p>"
    )
    worked = table[(table.schedule == "GPipe")].set_index(["P", "m"])["bubble_ratio"]
    summary = [f"bubble_ratio(P=8, m=16) = {worked[(8, 16)]:.3f}; bubble_ratio(P=4, m=16) = {worked[(4, 16)]:.3f}"]
    return Section(
        title="Pipeline bubbles", intro_html=intro, figures=[fig], tables={"bubbles": table}, summary=summary
    )


def section_jct_example(ctx: ReportContext) -> Section:
    """A JCT breakdown: many stages and micro-batches against fewer, on the closed-form step time."""
    import matplotlib.pyplot as plt

    # Inputs of the example, stated in the report: one sample's forward+backward through the whole
    # model takes 3 ms on one GPU; 512 samples a step; 20,000 steps; queue and start-up costs below.
    sample_ms, global_batch, steps = 3.0, 512, 20_000
    configs = [
        # label, P, m, queue_s, assembly_s
        ("8 stages, m=64", 8, 64, 2 * 3600.0, 600.0),
        ("4 stages, m=16", 4, 16, 0.0, 300.0),
    ]
    jcts, rows = [], []
    for label, P, m, queue_s, assembly_s in configs:
        per_rank_ms = sample_ms * global_batch / m / P  # one micro-batch through one rank's layers
        jct, row = _example_job(label, P, m, per_rank_ms, steps=steps, queue_s=queue_s, assembly_s=assembly_s)
        jcts.append(jct)
        rows.append(row)
    fig, ax = plt.subplots(figsize=(9, 2.6))
    JCT.plot_many(jcts, ax=ax)
    fig.tight_layout()
    intro = (
        f"<p>An illustrative job: {steps:,} steps of {global_batch} samples, 3 ms of forward+backward per sample on "
        "one GPU, 1F1B. Eight stages with 64 micro-batches have the smaller bubble and the faster step; the job "
        "that waits two hours for its 8 GPUs still finishes later than the one that starts now on 4. "
        "The planner section makes this choice on measured profiles.</p>"
    )
    table = pd.DataFrame(rows)
    a, b = jcts
    summary = [f"JCT {a.label}: {a.total_s / 3600:.2f} h vs {b.label}: {b.total_s / 3600:.2f} h"]
    return Section(
        title="Job completion time, not bubble",
        intro_html=intro,
        figures=[fig],
        tables={"jct_example": table, "jct_compare": JCT.compare(*jcts)},
        summary=summary,
    )


def _example_job(
    label: str, P: int, m: int, per_rank_ms: float, *, steps: int, queue_s: float, assembly_s: float
) -> tuple[JCT, dict[str, Any]]:
    """One configuration of the JCT example: its JCT (1F1B closed-form step, backward twice the forward, 120 s of
    cleanup) and its table row."""
    step = analytic.step_ms(P, m, "1F1B", fwd_ms=per_rank_ms / 3, bwd_ms=2 * per_rank_ms / 3)
    jct = JCT(queue_s=queue_s, assembly_s=assembly_s, training_s=steps * step / 1000, cleanup_s=120.0, label=label)
    row = {
        "label": label,
        "P": P,
        "m": m,
        "step_ms": step,
        "bubble_ratio": analytic.bubble_ratio(P, m, "1F1B"),
        **jct.as_row(),
    }
    return jct, row


def section_profile(ctx: ReportContext) -> Section:
    """The reference GPT measured layer by layer on this machine."""
    prof = reference_profile(ctx)
    ax = prof.plot()
    df = prof.df
    heaviest = df.loc[df["total_ms"].idxmax(), "name"]
    outside = (
        "the rest is the loss and the glue between layers"
        if prof.coverage <= 1
        else "over 100% means the layers' medians were taken in slower repeats than the step's median: "
        "the machine is busy"
    )
    intro = (
        f"<p>The reference GPT ({prof.n_layers} layers, batch shape {prof.meta.get('batch_shape')}) profiled in place "
        f"on {prof.meta.get('device')}: each layer's forward and backward timed during a real training step, "
        f"{prof.meta.get('repeats')} repeats. The layers cover {prof.coverage:.0%} of the measured step ({outside}); "
        f"the step varies by {prof.cv:.1%} run to run. The slowest layer is <code>{heaviest}</code>; the embedding and "
        f"the LM head hold the most parameters.</p>" + noise_warning(prof.cv, "the profiled step")
    )
    summary = [
        f"profile: {prof.n_layers} layers, step {prof.step_ms:.1f} ms, coverage {prof.coverage:.0%}, "
        f"cv {prof.cv:.1%}, heaviest {heaviest}"
    ]
    return Section(
        title="Per-layer profile", intro_html=intro, figures=[figure_of(ax)], tables={"profile": df}, summary=summary
    )


def section_partition(ctx: ReportContext) -> Section:
    """Uniform against time-balanced stages of the measured reference GPT."""
    import matplotlib.pyplot as plt

    from ...partitioning.balance import partition

    prof = reference_profile(ctx)
    P = 2 if prof.n_layers < 4 else 3
    uniform, balanced = partition(prof, P, method="uniform"), partition(prof, P, method="balanced")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    uniform.plot(ax=axes[0]).set_title(f"uniform: slowest stage {uniform.bottleneck_ms:.3g} ms")
    balanced.plot(ax=axes[1]).set_title(f"balanced: slowest stage {balanced.bottleneck_ms:.3g} ms")
    fig.tight_layout()
    if balanced.bottleneck_ms < uniform.bottleneck_ms * (1 - 1e-9):
        verdict = (
            f"cuts the slowest stage from {uniform.bottleneck_ms:.4g} ms to {balanced.bottleneck_ms:.4g} ms "
            f"(imbalance {uniform.imbalance:.2f} → {balanced.imbalance:.2f})"
        )
    else:
        verdict = f"finds the equal-count split already optimal here (slowest stage {balanced.bottleneck_ms:.4g} ms)"
    intro = (
        f"<p>P={P} ranks of the profiled GPT, v={balanced.v} stage each, so the slowest stage is the busiest rank. "
        "Equal layer counts ignore how long each layer takes; the balanced "
        f"split (exactly minimizing the slowest stage's forward+backward) {verdict}. Memory per stage counts "
        f"parameters, gradients, Adam state and activations of the micro-batches in flight.</p>"
    )
    table = pd.concat([uniform.df.assign(method="uniform"), balanced.df.assign(method="balanced")], ignore_index=True)
    summary = [
        f"partition P={P}: slowest stage uniform {uniform.bottleneck_ms:.4g} ms, "
        f"balanced {balanced.bottleneck_ms:.4g} ms"
    ]
    return Section(
        title="Stages: uniform vs balanced",
        intro_html=intro,
        figures=[fig],
        tables={"partition": table},
        summary=summary,
    )


def section_timeline(ctx: ReportContext) -> Section:
    """Every schedule simulated on the balanced split, and the m sweep as training time."""
    from ...simulation.sweeps import sweep

    prof = reference_profile(ctx)
    P, m = 2, 4
    fig, rows = _schedules_simulated(prof, P, m, ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"))
    table = sweep(
        prof,
        P=[2, 3],
        m=[2, 4, 8, 16],
        schedules=list(SINGLE_CHUNK_SCHEDULES),
        methods=["balanced"],
        steps=1000,
        progress=False,
    )
    intro = (
        f"<p>The simulator replays the action order torch executes for each schedule with the measured stage times "
        f"(P={P}, m={m}, one micro-batch = the profiled batch). The sweep below gives each configuration's simulated "
        f"step and <code>training_s = steps × step_ms</code> for 1,000 steps. Here every micro-batch is the profiled "
        f"batch, so a larger m is a larger global batch: the bubble shrinks while each step does more work. "
        f"At a fixed global batch the planner section weighs m properly.</p>"
    )
    best = min(rows, key=lambda r: r["step_ms"])
    summary = [f"simulated P={P}, m={m}: fastest schedule {best['schedule']} at {best['step_ms']:.3g} ms per step"]
    return Section(
        title="Schedules simulated",
        intro_html=intro,
        figures=[fig],
        tables={"schedules": pd.DataFrame(rows), "sweep": table.df},
        summary=summary,
    )


def _schedules_simulated(
    prof: Profile, P: int, m: int, schedules: tuple[str, ...]
) -> tuple[Figure, list[dict[str, Any]]]:
    """Each of ``schedules`` simulated on the balanced split of ``prof`` (``v`` as the schedule needs): a figure
    of their Gantt charts, one above the other, and one row per schedule."""
    import matplotlib.pyplot as plt

    from ...partitioning.balance import partition
    from ...simulation.simulator import simulate

    rows: list[dict[str, Any]] = []
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.6 * len(schedules) + 1), sharex=True)
    for ax, schedule in zip(axes, schedules):
        v = default_v(schedule)
        part = partition(prof, P, v=v, schedule=schedule, m=m)
        tl = simulate(part, m, schedule)
        tl.plot(ax=ax)
        ax.set_title(f"{schedule}: step {tl.step_ms:.3g} ms, bubble_ratio {tl.bubble_ratio:.3f}", fontsize="small")
        rows.append(
            {
                "schedule": schedule,
                "v": v,
                "P": P,
                "m": m,
                "step_ms": tl.step_ms,
                "bubble_ratio": tl.bubble_ratio,
                # per micro-batch: a rank works through its v stages, so with v > 1 the two differ
                "busiest_rank_ms": part.bottleneck_rank_ms,
                "slowest_stage_ms": part.bottleneck_ms,
            }
        )
    fig.tight_layout()
    return fig, rows


def section_plan(ctx: ReportContext) -> Section:
    """The JCT planner on the measured reference GPT: 8 devices like this one, half of them busy for 30 minutes."""
    from ...partitioning.balance import partition
    from ...planning.planner import plan

    prof = reference_profile(ctx)
    calibration = [(2, ctx.cache["run"].jct.assembly_s)] if "run" in ctx.cache else None
    gpus, global_batch, steps, availability = 8, 64, 20_000, [(0, 4), (1800, 8)]
    # a device that holds 85% of what the whole model needs on one (its replayed peak with one micro-batch), so
    # that the model must be pipelined (the head's rank alone needs most of it: the logits, their softmax and
    # gradients): the case the toolkit is for
    whole = max(partition(prof, 1, m=1).rank_mem_bytes)
    cap = 0.85 * whole
    result = plan(
        prof,
        gpus,
        global_batch,
        steps,
        availability=availability,
        costs=AssemblyModel.calibrate(calibration) if calibration else None,
        mem_per_gpu_bytes=cap,
        progress=False,
    )
    ax = result.plot(n=4)
    best = result.best
    intro = (
        f"<p>The planner weighs every configuration of the profiled GPT on {gpus} devices like this machine's CPU (a "
        f"what-if: the devices are hypothetical, the layer times measured; "
        f"4 free now, 8 in 30 minutes), each with room for 85% of the model "
        f"(<code>mem_per_gpu_bytes</code> = {cap / 2**20:.3g} MiB of the {whole / 2**20:.3g} MiB its peak takes on "
        f"one device with Adam and one micro-batch), so it must be pipelined; "
        f"{steps:,} steps of {global_batch} sequences: P ranks × D replicas, micro-batch "
        f"size and count, schedule, with queue, assembly"
        + (" (calibrated on the measured run above)" if calibration else "")
        + f", training, cleanup and the option to start small and grow. {result.explain()}</p>"
    )
    bubble_best = result.bubble_best
    summary = [
        f"plan: best {best.label}, JCT {best.total_s / 3600:.2f} h; "
        f"bubble-best {bubble_best.label} {bubble_best.total_s / 3600:.2f} h"
    ]
    return Section(
        title="The JCT planner",
        intro_html=intro,
        figures=[figure_of(ax)],
        tables={"plan_top": result.top(15)},
        summary=summary,
    )
