"""Report sections measured on real runs: a pipeline run against its prediction, checkpoints and preemption."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from ...core.display import noise_warning
from ...core.jct import JCT
from .base import ReportContext, Section, reference_profile, reference_setup


def section_run(ctx: ReportContext) -> Section:
    """The reference GPT run for real at P=2 on CPU processes, the simulator calibrated on these runs, its error before and after."""
    import warnings

    import matplotlib.pyplot as plt
    import torch

    from ...fidelity import comparison as compare
    from ...fidelity.calibrator import CalibrationWarning, calibrate
    from ...partitioning.balance import partition
    from ...profiling.measure import profile
    from ...runner import run
    from ...runner.spec import available_cores
    from ...simulation.simulator import simulate
    from ...simulation.steady import MEASURED_STEP

    setup = reference_setup(ctx)
    P, m = 2, 2
    # profile one micro-batch with the threads each rank will have, so the prediction sees what a rank sees
    microbatch = setup.inputs.shape[0] // m
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores() // P))
    try:
        repeats, warmup = (3, 1) if ctx.quick else (10, 3)
        prof = profile(
            setup.model,
            setup.inputs[:microbatch],
            target=setup.targets[:microbatch],
            loss_fn=setup.loss_fn,
            warmup=warmup,
            repeats=repeats,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    # two runs to calibrate on (one per runtime: single-chunk 1F1B, multi-chunk Interleaved1F1B), one held out (GPipe)
    cases = (("1F1B", 1), ("Interleaved1F1B", 2), ("GPipe", 1))
    parts, runs = {}, {}
    for schedule, v in cases:
        parts[schedule] = partition(prof, P, v=v, schedule=schedule, m=m)
        runs[schedule] = run(
            setup.model,
            (setup.inputs, setup.targets),
            setup.loss_fn,
            parts[schedule],
            m,
            steps=3 if ctx.quick else 8,
            progress=False,
        )
    result = ctx.get("run", lambda: runs["1F1B"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], prof)
    errors = cal.error([runs[s] for s, _ in cases])
    comparison = compare(simulate(parts["1F1B"], m, calibration=cal), result)
    fig, axes = plt.subplot_mosaic(
        [["gantt", "gantt"], ["jct", "scatter"]], figsize=(11, 8.5), gridspec_kw={"height_ratios": [3, 2.6]}
    )
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
    tables = {
        "run_steps": result.df,
        "run_vs_simulation": comparison.df,
        "run_jct": JCT.table(jct),
        "calibration": cal.df,
        "calibration_error": errors,
        "run_step_stats": result.step_stats(),
    }
    return Section("Real pipeline runs, measured, and the simulator calibrated on them", intro, [fig], tables, summary)


def section_checkpoints(ctx: ReportContext) -> Section:
    """A job preempted at 70% of its steps, resumed from its checkpoint, against restarting it from zero."""
    import shutil
    import tempfile

    import matplotlib.pyplot as plt

    from ...core.costs import CheckpointModel
    from ...partitioning.balance import partition
    from ...runner import run, signal_at

    setup = reference_setup(ctx)
    P, m = 2, 2
    steps = 10 if ctx.quick else 20
    stop_at = int(0.7 * steps) - 1  # SIGTERM while this step's batch is fetched: this step finishes, then all save
    part = partition(reference_profile(ctx), P)
    batch = (setup.inputs, setup.targets)
    root = Path(tempfile.mkdtemp(prefix="pipeswift_report_ckpt_"))
    try:
        common = dict(steps=steps, progress=False)
        preempted = run(
            setup.model,
            signal_at(batch, stop_at, rank=0),
            setup.loss_fn,
            part,
            m,
            checkpoint_dir=root,
            checkpoint_every=max(1, steps // 4),
            **common,
        )
        resumed = run(
            setup.model, batch, setup.loss_fn, part, m, resume_from=root, checkpoint_dir=root / "resumed", **common
        )
        restarted = run(setup.model, batch, setup.loss_fn, part, m, **common)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = all(a.equal(b) for a, b in zip(resumed.state_dict().values(), restarted.state_dict().values()))
    lost = preempted.jct
    resume_jct = JCT(
        assembly_s=lost.assembly_s + resumed.jct.assembly_s,
        training_s=lost.training_s + resumed.jct.training_s,
        cleanup_s=lost.cleanup_s + resumed.jct.cleanup_s,
        preemption_loss_s=lost.preemption_loss_s + resumed.jct.preemption_loss_s,
        label="resume from the checkpoint",
    )
    restart_jct = JCT(
        assembly_s=lost.assembly_s + restarted.jct.assembly_s,
        training_s=restarted.jct.training_s,
        cleanup_s=lost.cleanup_s + restarted.jct.cleanup_s,
        preemption_loss_s=lost.preemption_loss_s + lost.training_s + restarted.jct.preemption_loss_s,
        label="restart from zero",
    )
    fig, ax = plt.subplots(figsize=(9, 3))
    resume_jct.plot(restart_jct, ax=ax, unit="s")
    fig.tight_layout()
    model = CheckpointModel.calibrate([preempted, resumed])
    table = pd.concat(
        [preempted.checkpoints.assign(run="preempted"), resumed.checkpoints.assign(run="resumed")], ignore_index=True
    )
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
    summary = [
        f"checkpoints: preempted at step {done}/{steps}, resumed {'bitwise equal' if same else 'NOT EQUAL'}; JCT "
        f"resume {resume_jct.total_s:.3g} s vs restart {restart_jct.total_s:.3g} s"
    ]
    costs = pd.DataFrame(
        [
            {"parameter": name, "value": getattr(model, name)}
            for name in ("save_latency_s", "write_GBps", "restore_latency_s", "read_GBps", "teardown_s")
        ]
    )
    return Section(
        "Checkpoints, preemption and resume",
        intro,
        [fig],
        {"checkpoints": table, "resume_vs_restart": JCT.table(resume_jct, restart_jct), "checkpoint_model": costs},
        summary,
    )


def section_elastic(ctx: ReportContext) -> Section:
    """The reference GPT resized P=2→4→2 within one job: what each change of configuration cost, measured."""
    import matplotlib.pyplot as plt

    from ...partitioning.balance import partition
    from ...runner import run

    setup = reference_setup(ctx)
    prof = reference_profile(ctx)
    m, steps = 4, (6 if ctx.quick else 12)
    third = steps // 3
    part = partition(prof, 2, m=m)
    result = run(
        setup.model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        m,
        steps=steps,
        progress=False,
        resize_at={third: 4, 2 * third: 2},
        profile=prof,
    )
    seg = result.segments
    fig, ax = plt.subplots(figsize=(9, 3))
    df = result.df.merge(pd.DataFrame({"step": range(steps)}), on="step")
    for row in seg.itertuples():
        part_df = df[(df["step"] >= row.first_step) & (df["step"] <= row.last_step)]
        ax.plot(part_df["step"], part_df["step_ms"], marker="o", label=f"segment {row.segment}: P={row.P}")
    ax.set_xlabel("step")
    ax.set_ylabel("measured step (ms)")
    ax.legend(frameon=False)
    fig.tight_layout()
    changes = [(seg.iloc[i - 1], seg.iloc[i]) for i in range(1, len(seg))]
    costs = pd.DataFrame(
        [
            {
                "change": f"P={a.P} -> P={b.P} at step {b.first_step}",
                "save_s": a.save_s,
                "teardown_s": a.teardown_s,
                "assembly_s": b.assembly_s,
                "restore_s": b.restore_s,
                "reconfiguration_s": a.save_s + a.teardown_s + b.assembly_s + b.restore_s,
            }
            for a, b in changes
        ]
    )
    intro = (
        f"<p>One job of {steps} steps that starts on 2 CPU ranks, moves to 4 at step {third} and back to 2 at step {2 * third} "
        "(<code>run(resize_at=...)</code>): at each change every rank checkpoints, the workers stop, the model is re-partitioned "
        "for the new P from the profile and new workers restore by name. Each change cost "
        + " and ".join(f"{c:.3g} s" for c in costs["reconfiguration_s"])
        + " (save, teardown, new workers, restore), against a first start of "
        f"{seg['assembly_s'].iloc[0]:.3g} s; the job's JCT counts them as cleanup and assembly, as they happened. On this 2-core "
        "machine 4 ranks share the cores, so their steps are no faster: the section shows the mechanics and their cost, "
        "not a speed-up.</p>"
    )
    summary = [
        "elastic: P 2->4->2 in one job, changes cost " + ", ".join(f"{c:.3g} s" for c in costs["reconfiguration_s"])
    ]
    return Section(
        "Elastic P within one job",
        intro,
        [fig],
        {"elastic_segments": seg.drop(columns=["bounds"]), "elastic_changes": costs},
        summary,
    )
