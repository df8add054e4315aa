"""The HTML report of ``pipeswift-lab report``: every capability of the lab on one default job.

The report is self-contained (plots embedded as PNG data URIs) and every table is also
written next to it as CSV. Each capability contributes one section function taking the
shared :class:`ReportContext` and returning a :class:`Section`; the context computes
shared inputs (the reference model, its profile) once, on first use.
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import analytic
from ._display import noise_warning
from .jct import JCT


@dataclass
class Section:
    """One report section: a title, explanatory HTML, figures and named tables."""

    title: str
    intro_html: str
    figures: list = field(default_factory=list)  # matplotlib Figures
    tables: dict = field(default_factory=dict)  # name -> DataFrame (also written as <name>.csv)
    summary: list = field(default_factory=list)  # short text lines for the terminal


@dataclass
class ReportContext:
    """Inputs shared by sections; ``quick`` shrinks work for tests and CI."""

    quick: bool = False
    progress: bool = True
    cache: dict = field(default_factory=dict)

    def get(self, key, build):
        """Return the cached value for ``key``, building it with ``build()`` the first time."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def section_bubbles(ctx: ReportContext) -> Section:
    """Bubble against m for several P, in both conventions, with the worked examples."""
    import matplotlib.pyplot as plt

    from .widgets import plot_bubble_curve

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    plot_bubble_curve((2, 4, 8, 16), schedule="1F1B", convention="ratio", ax=left)
    plot_bubble_curve((2, 4, 8, 16), schedule="1F1B", convention="overhead", ax=right)
    right.set_yscale("log")
    fig.tight_layout()
    rows = []
    for P, m in ((4, 16), (8, 16), (8, 64), (4, 8)):
        for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
            rows.append(analytic.bubble_summary(P, m, schedule, v))
    table = pd.DataFrame(rows)
    intro = (
        "<p>Two conventions of the pipeline bubble are in use. <code>bubble_ratio</code> is the share of a step a "
        "stage sits idle, (P−1)/(m+P−1) for GPipe and 1F1B (left). <code>bubble_overhead</code> is bubble time over "
        "ideal compute, (P−1)/m, and (P−1)/(v·m) for the interleaved schedule (right). A larger m shrinks both, "
        "but every extra micro-batch lengthens the step's compute and, for GPipe, the activations held.</p>"
    )
    worked = table[(table.schedule == "GPipe")].set_index(["P", "m"])["bubble_ratio"]
    summary = [f"bubble_ratio(P=8, m=16) = {worked[(8, 16)]:.3f}; bubble_ratio(P=4, m=16) = {worked[(4, 16)]:.3f}"]
    return Section("Pipeline bubbles", intro, [fig], {"bubbles": table}, summary)


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
        step = analytic.step_ms(P, m, "1F1B", fwd_ms=per_rank_ms / 3, bwd_ms=2 * per_rank_ms / 3)
        jct = JCT(queue_s=queue_s, assembly_s=assembly_s, training_s=steps * step / 1000, cleanup_s=120.0, label=label)
        jcts.append(jct)
        rows.append({"config": label, "P": P, "m": m, "step_ms": step, "bubble_ratio": analytic.bubble_ratio(P, m, "1F1B"), **jct.as_row()})
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
    return Section("Job completion time, not bubble", intro, [fig], {"jct_example": table, "jct_compare": JCT.compare(*jcts)}, summary)


def reference_setup(ctx: ReportContext):
    """The report's default job: the reference GPT on the CPU, micro-batch of 8 sequences."""
    from . import models

    return ctx.get("setup", lambda: models.reference("gpt", batch_size=4 if ctx.quick else 8))


def reference_profile(ctx: ReportContext):
    """The default job's measured per-layer profile (computed once per report)."""
    from .profile import profile

    def build():
        setup = reference_setup(ctx)
        repeats, warmup = (3, 1) if ctx.quick else (10, 3)
        return profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, warmup=warmup, repeats=repeats, progress=False)

    return ctx.get("profile", build)


def section_profile(ctx: ReportContext) -> Section:
    """The reference GPT measured layer by layer on this machine."""
    prof = reference_profile(ctx)
    ax = prof.plot()
    df = prof.df
    heaviest = df.loc[df["total_ms"].idxmax(), "name"]
    outside = (
        "the rest is the loss and the glue between layers"
        if prof.coverage <= 1
        else "over 100% means the layers' medians were taken in slower repeats than the step's median: the machine is busy"
    )
    intro = (
        f"<p>The reference GPT ({prof.n_layers} layers, batch shape {prof.meta.get('batch_shape')}) profiled in place "
        f"on {prof.meta.get('device')}: each layer's forward and backward timed during a real training step, "
        f"{prof.meta.get('repeats')} repeats. The layers cover {prof.coverage:.0%} of the measured step ({outside}); "
        f"the step varies by {prof.cv:.1%} run to run. The slowest layer is <code>{heaviest}</code>; the embedding and "
        f"the LM head hold the most parameters.</p>"
        + noise_warning(prof.cv, "the profiled step")
    )
    summary = [f"profile: {prof.n_layers} layers, step {prof.step_ms:.1f} ms, coverage {prof.coverage:.0%}, cv {prof.cv:.1%}, heaviest {heaviest}"]
    return Section("Per-layer profile", intro, [ax.figure], {"profile": df}, summary)


def section_partition(ctx: ReportContext) -> Section:
    """Uniform against time-balanced stages of the measured reference GPT."""
    import matplotlib.pyplot as plt

    from .partition import partition

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
        f"<p>P={P} stages of the profiled GPT. Equal layer counts ignore how long each layer takes; the balanced "
        f"split (exactly minimizing the slowest stage's forward+backward) {verdict}. Memory per stage counts "
        f"parameters, gradients, Adam state and activations of the micro-batches in flight.</p>"
    )
    table = pd.concat([uniform.df.assign(method="uniform"), balanced.df.assign(method="balanced")], ignore_index=True)
    summary = [f"partition P={P}: slowest stage uniform {uniform.bottleneck_ms:.4g} ms, balanced {balanced.bottleneck_ms:.4g} ms"]
    return Section("Stages: uniform vs balanced", intro, [fig], {"partition": table}, summary)


def section_timeline(ctx: ReportContext) -> Section:
    """Every schedule simulated on the balanced split, and the m sweep as training time."""
    import matplotlib.pyplot as plt

    from .partition import partition
    from .simulate import simulate
    from .sweep import sweep

    prof = reference_profile(ctx)
    P, m = 2, 4
    figs, rows = [], []
    schedules = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.6 * len(schedules) + 1), sharex=True)
    for ax, schedule in zip(axes, schedules):
        v = 1 if schedule in ("GPipe", "1F1B") else 2
        tl = simulate(partition(prof, P, v=v, schedule=schedule, m=m), m, schedule)
        tl.plot(ax=ax)
        ax.set_title(f"{schedule}: step {tl.step_ms:.3g} ms, bubble_ratio {tl.bubble_ratio:.3f}", fontsize="small")
        rows.append({"schedule": schedule, "v": v, "P": P, "m": m, "step_ms": tl.step_ms, "bubble_ratio": tl.bubble_ratio})
    fig.tight_layout()
    figs.append(fig)
    table = sweep(prof, P=[2, 3], m=[2, 4, 8, 16], schedules=["GPipe", "1F1B"], methods=["balanced"], steps=1000, progress=False)
    intro = (
        f"<p>The simulator replays the action order torch executes for each schedule with the measured stage times "
        f"(P={P}, m={m}, one micro-batch = the profiled batch). The sweep below gives each configuration's simulated "
        f"step and <code>training_s = steps × step_ms</code> for 1,000 steps. Here every micro-batch is the profiled "
        f"batch, so a larger m is a larger global batch: the bubble shrinks while each step does more work. "
        f"At a fixed global batch the planner section weighs m properly.</p>"
    )
    best = min(rows, key=lambda r: r["step_ms"])
    summary = [f"simulated P={P}, m={m}: fastest schedule {best['schedule']} at {best['step_ms']:.3g} ms per step"]
    return Section("Schedules simulated", intro, figs, {"schedules": pd.DataFrame(rows), "sweep": table}, summary)


def section_run(ctx: ReportContext) -> Section:
    """The reference GPT run for real at P=2 on CPU processes, the simulator calibrated on these runs, its error before and after."""
    import warnings

    import matplotlib.pyplot as plt
    import torch

    from .calibrate import CalibrationWarning, calibrate
    from .partition import partition
    from .profile import profile
    from .runner import compare, run
    from .runner.compare import MEASURED_STEP
    from .runner.spec import available_cores
    from .simulate import simulate

    setup = reference_setup(ctx)
    P, m = 2, 2
    # profile one micro-batch with the threads each rank will have, so the prediction sees what a rank sees
    microbatch = setup.inputs.shape[0] // m
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores() // P))
    try:
        repeats, warmup = (3, 1) if ctx.quick else (10, 3)
        prof = profile(setup.model, setup.inputs[:microbatch], target=setup.targets[:microbatch], loss_fn=setup.loss_fn, warmup=warmup, repeats=repeats, progress=False)
    finally:
        torch.set_num_threads(threads)
    # two runs to calibrate on (one per runtime: single-chunk 1F1B, multi-chunk Interleaved1F1B), one held out (GPipe)
    cases = (("1F1B", 1), ("Interleaved1F1B", 2), ("GPipe", 1))
    parts, runs = {}, {}
    for schedule, v in cases:
        parts[schedule] = partition(prof, P, v=v, schedule=schedule, m=m)
        runs[schedule] = run(setup.model, (setup.inputs, setup.targets), setup.loss_fn, parts[schedule], m, steps=3 if ctx.quick else 8, progress=False)
    result = ctx.get("run", lambda: runs["1F1B"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], prof)
    errors = cal.error([runs[s] for s, _ in cases])
    comparison = compare(simulate(parts["1F1B"], m, calibration=cal), result)
    fig, axes = plt.subplot_mosaic([["gantt", "gantt"], ["jct", "scatter"]], figsize=(11, 8.5), gridspec_kw={"height_ratios": [3, 2.6]})
    comparison.plot(ax=axes["gantt"])
    result.jct.plot(ax=axes["jct"], unit="s")
    cal.plot([runs[s] for s, _ in cases], ax=axes["scatter"])
    fig.tight_layout()
    jct = result.jct
    held = errors[~errors["in_fit"]].iloc[0]
    fitted = errors[errors["in_fit"]]
    parts_ms = comparison.decomposition.set_index("component")["ms"]
    step_cv = max(float(r.step_stats().iloc[-1]["cv"]) for r in runs.values())
    intro = (
        f"<p>The reference GPT cut in P={P} balanced stages, run for real with torch.distributed.pipelining on {P} CPU "
        f"processes (gloo), m={m} micro-batches of {microbatch} sequences, three times: 1F1B and Interleaved1F1B to "
        f"calibrate the simulator on, GPipe held out. The profile is one micro-batch taken with the threads each rank "
        f"gets. The measured step is, everywhere in this report, the {MEASURED_STEP}.</p>"
        f"<p>Before calibration the profile predicts the two fitted runs with errors of "
        f"{', '.join(f'{e:+.0%}' for e in fitted['rel_error_before'])} and the held-out GPipe run with "
        f"{held['rel_error_before']:+.0%}; after, {', '.join(f'{e:+.0%}' for e in fitted['rel_error_after'])} and "
        f"{held['rel_error_after']:+.0%} (held out). The calibration's parameters are in the table "
        f"<code>calibration</code>; <code>calibration_error</code> has every number. On the 1F1B run the calibrated "
        f"prediction is {comparison.step_ms[0]:.4g} ms against {comparison.step_ms[1]:.4g} ms measured; replaying the "
        f"measured action durations gives {comparison.replayed_step_ms:.4g} ms, so {parts_ms['durations']:+.3g} ms of the "
        f"error come from the predicted durations and {parts_ms['schedule and communication model']:+.3g} ms from the "
        f"schedule and communication model. The 1F1B run's JCT phases: assembly {jct.assembly_s:.3g} s (processes, "
        f"rendezvous, stages), training {jct.training_s:.3g} s, cleanup {jct.cleanup_s:.3g} s.</p>"
        + "".join(f"<p><em>{html.escape(str(w.message))}</em></p>" for w in caught)
        + noise_warning(prof.cv, "the profiled step")
        + noise_warning(step_cv, "the measured step after the warm-up (the noisiest of the three runs)")
    )
    summary = [
        f"measured runs P={P} m={m}: median |error| {errors['rel_error_before'].abs().median():.0%} before calibration, "
        f"{errors['rel_error_after'].abs().median():.0%} after; held-out GPipe {held['rel_error_before']:+.0%} -> {held['rel_error_after']:+.0%}; "
        f"assembly {jct.assembly_s:.3g} s"
    ]
    tables = {"run_steps": result.df, "run_vs_simulation": comparison.df, "run_jct": JCT.table(jct), "calibration": cal.df,
              "calibration_error": errors, "run_step_stats": result.step_stats()}
    return Section("Real pipeline runs, measured, and the simulator calibrated on them", intro, [fig], tables, summary)


def section_checkpoints(ctx: ReportContext) -> Section:
    """A job preempted at 70% of its steps, resumed from its checkpoint, against restarting it from zero."""
    import shutil
    import tempfile

    import matplotlib.pyplot as plt

    from .costs import CheckpointModel
    from .partition import partition
    from .runner import run, signal_at

    setup = reference_setup(ctx)
    P, m = 2, 2
    steps = 10 if ctx.quick else 20
    stop_at = int(0.7 * steps) - 1  # SIGTERM while this step's batch is fetched: this step finishes, then all save
    part = partition(reference_profile(ctx), P)
    batch = (setup.inputs, setup.targets)
    root = Path(tempfile.mkdtemp(prefix="pipeswift_report_ckpt_"))
    try:
        common = dict(steps=steps, progress=False)
        preempted = run(setup.model, signal_at(batch, stop_at, rank=0), setup.loss_fn, part, m, checkpoint_dir=root,
                        checkpoint_every=max(1, steps // 4), **common)
        resumed = run(setup.model, batch, setup.loss_fn, part, m, resume_from=root, checkpoint_dir=root / "resumed", **common)
        restarted = run(setup.model, batch, setup.loss_fn, part, m, **common)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = all(a.equal(b) for a, b in zip(resumed.state_dict().values(), restarted.state_dict().values()))
    lost = preempted.jct
    resume_jct = JCT(assembly_s=lost.assembly_s + resumed.jct.assembly_s, training_s=lost.training_s + resumed.jct.training_s,
                     cleanup_s=lost.cleanup_s + resumed.jct.cleanup_s,
                     preemption_loss_s=lost.preemption_loss_s + resumed.jct.preemption_loss_s, label="resume from the checkpoint")
    restart_jct = JCT(assembly_s=lost.assembly_s + restarted.jct.assembly_s, training_s=restarted.jct.training_s,
                      cleanup_s=lost.cleanup_s + restarted.jct.cleanup_s,
                      preemption_loss_s=lost.preemption_loss_s + lost.training_s + restarted.jct.preemption_loss_s,
                      label="restart from zero")
    fig, ax = plt.subplots(figsize=(9, 3))
    resume_jct.plot(restart_jct, ax=ax, unit="s")
    fig.tight_layout()
    model = CheckpointModel.calibrate([preempted, resumed])
    table = pd.concat([preempted.checkpoints.assign(run="preempted"), resumed.checkpoints.assign(run="resumed")], ignore_index=True)
    table = table[["run", "step", "kind", "bytes", "largest_rank_state_bytes", "save_ms", "blocking_ms"]]
    done = preempted.first_step + len(preempted.step_ms)
    intro = (
        f"<p>The reference GPT on P={P} CPU ranks, a job of {steps} steps with a checkpoint every {max(1, steps // 4)} steps "
        f"(torch.distributed.checkpoint, one file per rank, committed atomically with a checksummed manifest). A SIGTERM "
        f"(a cluster's preemption notice) reached rank 0 during step {stop_at}: every rank finished that step and all saved "
        f"at step {done}. Resuming there trained {resumed.steps - resumed.first_step} more steps and ended "
        f"{'bitwise equal to' if same else 'DIFFERENT from'} the job run without interruption. Against restarting from zero, "
        f"the measured JCT of the whole job was {resume_jct.total_s:.3g} s vs {restart_jct.total_s:.3g} s; the work the restart "
        f"throws away is the preempted run's {lost.training_s:.3g} s of training. Saves stalled the job a median "
        f"{table['blocking_ms'].median():.3g} ms and the restore took {resumed.restore_s * 1e3:.3g} ms; "
        "<code>CheckpointModel.calibrate</code> turns these into the planner's checkpoint costs (a fixed part plus bytes over "
        "a bandwidth).</p>"
    )
    summary = [f"checkpoints: preempted at step {done}/{steps}, resumed {'bitwise equal' if same else 'NOT EQUAL'}; JCT "
               f"resume {resume_jct.total_s:.3g} s vs restart {restart_jct.total_s:.3g} s"]
    costs = pd.DataFrame([{"parameter": name, "value": getattr(model, name)}
                          for name in ("save_latency_s", "write_GBps", "restore_latency_s", "read_GBps", "teardown_s")])
    return Section("Checkpoints, preemption and resume", intro, [fig],
                   {"checkpoints": table, "resume_vs_restart": JCT.table(resume_jct, restart_jct), "checkpoint_model": costs}, summary)


def section_plan(ctx: ReportContext) -> Section:
    """The JCT planner on the measured reference GPT: 8 devices like this one, half of them busy for 30 minutes."""
    from .planner import plan

    prof = reference_profile(ctx)
    calibration = [(2, ctx.cache["run"].jct.assembly_s)] if "run" in ctx.cache else None
    gpus, global_batch, steps, availability = 8, 64, 20_000, [(0, 4), (1800, 8)]
    result = plan(prof, gpus, global_batch, steps, availability=availability, assembly=calibration, progress=False)
    ax = result.plot(n=4)
    best = result.best
    intro = (
        f"<p>The planner weighs every configuration of the profiled GPT on {gpus} devices like this machine's CPU (a "
        f"what-if: the devices are hypothetical, the layer times measured) "
        f"(4 free now, 8 in 30 minutes), {steps:,} steps of {global_batch} sequences: P stages × D replicas, micro-batch "
        f"size and count, schedule, with queue, assembly"
        + (" (calibrated on the measured run above)" if calibration else "")
        + f", training, cleanup and the option to start small and grow. {result.explain()}</p>"
    )
    summary = [f"plan: best {best.label}, JCT {best.total_s / 3600:.2f} h; bubble-best {result.bubble_best.label} {result.bubble_best.total_s / 3600:.2f} h"]
    return Section("The JCT planner", intro, [ax.figure], {"plan_top": result.top(15)}, summary)


#: The cluster section's default window of the Philly trace (days since its first job) and cluster size.
CLUSTER_WINDOW_DAYS, CLUSTER_GPUS = (42, 44), 256


def section_cluster(ctx: ReportContext) -> Section:
    """Two busy days of the Philly trace on a shared cluster under the static, elastic and preemptive policies."""
    import warnings

    import matplotlib.pyplot as plt

    from . import cluster
    from .data import philly_jobs

    days = (42, 43) if ctx.quick else CLUSTER_WINDOW_DAYS
    jobs = philly_jobs(window=(days[0] * 86_400.0, days[1] * 86_400.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [cluster.simulate(jobs, CLUSTER_GPUS, policy=p, progress=False) for p in ("static", "elastic", "preemptive")]
    comparison = cluster.compare(*results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    comparison.plot(ax=left)
    comparison.plot_breakdown(ax=right)
    fig.tight_layout()
    table = comparison.table
    by = table.set_index("policy")
    unfinished = int(table["unfinished"].sum())
    intro = (
        f"<p>The Philly trace (Jeon et al., ATC 2019; as derived for Pollux, OSDI 2021), days {days[0]}–{days[1]}: "
        f"{len(jobs):,} jobs replayed on {CLUSTER_GPUS} GPUs by <code>psl.cluster.simulate</code>. <em>static</em> runs each "
        f"job on exactly the GPUs it asked for (FIFO with EASY backfilling); <em>elastic</em> shrinks and grows pipelines, "
        f"paying checkpoint, re-assembly and restore for each change; <em>preemptive</em> is Tiresias's two-queue "
        f"least-attained-service. Mean JCT: static {by.loc['static', 'mean_jct_s'] / 3600:.3g} h, elastic "
        f"{by.loc['elastic', 'mean_jct_s'] / 3600:.3g} h, preemptive {by.loc['preemptive', 'mean_jct_s'] / 3600:.3g} h; "
        f"median JCT {by.loc['static', 'p50_jct_s'] / 3600:.3g}, {by.loc['elastic', 'p50_jct_s'] / 3600:.3g} and "
        f"{by.loc['preemptive', 'p50_jct_s'] / 3600:.3g} h. "
        + (f"{unfinished} jobs did not finish ({len(caught)} warnings).</p>" if unfinished else "Every job finished.</p>")
    )
    columns = ["policy", "jobs", "finished", "mean_jct_s", "p50_jct_s", "p95_jct_s", "p99_jct_s", "mean_queue_s", "utilization", "restarts", "mean_jct_vs_first"]
    summary = [
        f"cluster days {days[0]}-{days[1]} on {CLUSTER_GPUS} GPUs: mean JCT "
        + ", ".join(f"{p} {by.loc[p, 'mean_jct_s'] / 3600:.2f} h" for p in by.index)
    ]
    return Section("A shared cluster: the Philly trace under three policies", intro, [fig], {"cluster_policies": table[columns], "cluster_breakdown": comparison.breakdown().reset_index(names="policy")}, summary)


#: Sections in report order. Later capabilities append theirs.
SECTIONS = [section_bubbles, section_jct_example, section_profile, section_partition, section_timeline, section_run, section_checkpoints,
            section_plan, section_cluster]


@dataclass(frozen=True)
class ReportResult:
    """Where the report was written, what it holds and how long it took."""

    path: Path
    csv_paths: tuple
    summary: tuple
    seconds: float

    def __str__(self) -> str:
        lines = [f"report: {self.path}", f"tables: {len(self.csv_paths)} CSV files in {self.path.parent}"]
        return "\n".join(lines + [f"  {line}" for line in self.summary] + [f"built in {self.seconds:.1f} s"])


def build_report(out="pipeswift-report", sections=None, quick=False, progress=True) -> ReportResult:
    """Build the HTML report under directory ``out``; return a :class:`ReportResult`.

    ``sections`` is a list of section functions (default :data:`SECTIONS`); ``quick``
    shrinks the measured work for tests and CI.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from tqdm.auto import tqdm

    from .plot import figure_to_data_uri

    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(quick=quick, progress=progress)
    parts, csv_paths, summary = [], [], []
    for make in tqdm(sections or SECTIONS, desc="report", disable=not progress):
        section = make(ctx)
        body = [f"<h2>{html.escape(section.title)}</h2>", section.intro_html]
        for fig in section.figures:
            body.append(f"<img alt='{html.escape(section.title)}' src='{figure_to_data_uri(fig)}'/>")
            plt.close(fig)
        for name, table in section.tables.items():
            path = out / f"{name}.csv"
            table.to_csv(path, index=False)
            csv_paths.append(path)
            body.append(f"<h3>{html.escape(name)} <small>(<a href='{path.name}'>{path.name}</a>)</small></h3>")
            body.append(table.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0))
        parts.append("<section>" + "\n".join(body) + "</section>")
        summary.extend(section.summary)
    page = _PAGE.format(body="\n".join(parts), generated=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return ReportResult(path.resolve(), tuple(csv_paths), tuple(summary), time.perf_counter() - start)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pipeswift_lab report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }}
td, th {{ padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }}
img {{ max-width: 100%; }}
section {{ margin-bottom: 2.5em; }}
</style></head><body>
<h1>pipeswift_lab report</h1>
<p>Job completion time for pipeline-parallel training: queue + assembly + training + cleanup (+ preemption loss).
Generated {generated}.</p>
{body}
</body></html>
"""
