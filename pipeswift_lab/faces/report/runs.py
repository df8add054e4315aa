"""Report sections measured on real runs: a pipeline run against its prediction, checkpoints and preemption."""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ...core.display import noise_warning
from ...core.jct import JCT
from ...runner.options import Checkpointing, Elastic
from .base import ReportContext, Section, measure_setup, reference_profile, reference_setup

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ...fidelity.calibrator import Calibration
    from ...fidelity.comparison import Comparison
    from ...models import ReferenceSetup
    from ...partitioning.stages import Partition
    from ...profiling.table import Profile
    from ...runner.result import RunResult

__all__ = ["RUN_CASES", "CalibratedRuns", "section_checkpoints", "section_elastic", "section_run"]

#: The measured-run section's runs, as ``(schedule, v)``: the first two (one per runtime, single-chunk and
#: multi-chunk) are calibrated on, the last (GPipe) is held out.
RUN_CASES = (("1F1B", 1), ("Interleaved1F1B", 2), ("GPipe", 1))


@dataclass(frozen=True, kw_only=True)
class CalibratedRuns:
    """What the measured-run section measured and fitted: the runs, the calibration and its errors."""

    P: int
    """Ranks of every run."""
    m: int
    """Micro-batches per step of every run."""
    microbatch: int
    """Sequences per micro-batch (the profile is one micro-batch)."""
    profile: Profile
    """One micro-batch profiled with the threads each rank gets."""
    runs: dict[str, RunResult]
    """schedule -> its measured run, in :data:`RUN_CASES` order."""
    calibration: Calibration
    """The simulator calibrated on the 1F1B and Interleaved1F1B runs."""
    errors: pd.DataFrame
    """Every run's error before and after calibration (:meth:`Calibration.error`), with ``in_fit``."""
    comparison: Comparison
    """The calibrated prediction of the 1F1B run against its measurement."""
    caught: list[warnings.WarningMessage]
    """The calibration's warnings (a parameter kept its default), shown on the page."""

    @property
    def result(self) -> RunResult:
        """The 1F1B run: the one the page plots and the planner's assembly is calibrated on."""
        return self.runs["1F1B"]


def section_run(ctx: ReportContext) -> Section:
    """The reference GPT run for real at P=2 on CPU processes, the simulator calibrated on these runs, its error
    before and after."""
    measured = _calibrated_runs(ctx, P=2, m=2)
    result = ctx.get("run", lambda: measured.result)  # the planner section calibrates its assembly on this run
    tables = {
        "run_steps": result.df,
        "run_vs_simulation": measured.comparison.df,
        "run_jct": JCT.table(result.jct),
        "calibration": measured.calibration.df,
        "calibration_error": measured.errors,
        "run_step_stats": result.step_stats(),
        "run_memory": _memory_table(measured),
    }
    return Section(
        title="Real pipeline runs, measured, and the simulator calibrated on them",
        intro_html=_run_intro(measured),
        figures=[_run_figure(measured)],
        tables=tables,
        summary=[_run_summary(measured)],
    )


def _calibrated_runs(ctx: ReportContext, *, P: int, m: int) -> CalibratedRuns:
    """Profile one micro-batch as a rank sees it, run every case of :data:`RUN_CASES`, calibrate on the first two
    and compare the calibrated prediction of the 1F1B run with its measurement."""
    from ...fidelity.calibrator import CalibrationWarning, calibrate
    from ...fidelity.comparison import compare
    from ...partitioning.balance import partition
    from ...simulation.simulator import simulate

    setup = reference_setup(ctx)
    microbatch = setup.inputs.shape[0] // m
    prof = _rank_profile(setup, microbatch, P, quick=ctx.quick)
    parts = {schedule: partition(prof, P, v=v, schedule=schedule, m=m) for schedule, v in RUN_CASES}
    runs = {schedule: _run(setup, parts[schedule], m, steps=3 if ctx.quick else 8) for schedule, _ in RUN_CASES}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        cal = calibrate([runs["1F1B"], runs["Interleaved1F1B"]], prof)
    return CalibratedRuns(
        P=P,
        m=m,
        microbatch=microbatch,
        profile=prof,
        runs=runs,
        calibration=cal,
        errors=cal.error(list(runs.values())),
        comparison=compare(simulate(parts["1F1B"], m, calibration=cal), runs["1F1B"]),
        caught=caught,
    )


def _rank_profile(setup: ReferenceSetup, microbatch: int, P: int, *, quick: bool) -> Profile:
    """One micro-batch profiled with the threads each of ``P`` ranks will have, so the prediction sees what a rank
    sees."""
    import torch

    from ...runner.spec import available_cores

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores() // P))
    try:
        return measure_setup(setup, quick=quick, samples=microbatch)
    finally:
        torch.set_num_threads(threads)


def _run(setup: ReferenceSetup, part: Partition, m: int, *, steps: int) -> RunResult:
    """The reference job run for real on ``part`` (no progress bar)."""
    from ...runner import run

    return run(setup.model, (setup.inputs, setup.targets), setup.loss_fn, part, m, steps=steps, progress=False)


def _memory_table(measured: CalibratedRuns) -> pd.DataFrame:
    """Every run's peak memory per rank, measured (tensor level) beside predicted."""
    columns = ["rank", "measured_peak_bytes", "predicted_peak_bytes", "error", "resident_peak_bytes", "peak_at"]
    frames = [run.memory[columns].assign(schedule=name) for name, run in measured.runs.items()]
    return pd.concat(frames, ignore_index=True)[["schedule", *columns]]


def _memory_sentence(measured: CalibratedRuns) -> str:
    """What the memory table shows: the error of the memory model and where each run's peak is."""
    table = _memory_table(measured)
    if table["predicted_peak_bytes"].isna().all():
        return ""
    errors = table["error"].abs()
    fullest = table.loc[table.groupby("schedule")["measured_peak_bytes"].idxmax()]
    where = ", ".join(f"{row.schedule} rank {row.rank}" for row in fullest.itertuples())
    return (
        f"<p>Memory (table <code>run_memory</code>): each rank's tensor-level peak, measured in the run's second "
        f"step, against the memory model's prediction for that run: median |error| {errors.median():.1%}, largest "
        f"{errors.max():.1%}. The fullest ranks: {where}. The resident high-water of the processes is larger "
        f"(allocator and libraries): up to {table['resident_peak_bytes'].max() / 2**20:.0f} MiB above the start.</p>"
    )


def _run_figure(measured: CalibratedRuns) -> Figure:
    """The 1F1B run's Gantt chart against its prediction, its JCT, and every run predicted against measured."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplot_mosaic(
        [["gantt", "gantt"], ["jct", "scatter"]], figsize=(11, 8.5), gridspec_kw={"height_ratios": [3, 2.6]}
    )
    measured.comparison.plot(ax=axes["gantt"])
    measured.result.jct.plot(ax=axes["jct"], unit="s")
    measured.calibration.plot(list(measured.runs.values()), ax=axes["scatter"])
    fig.tight_layout()
    return fig


def _run_intro(measured: CalibratedRuns) -> str:
    """The measured-run section's text: the runs, the errors before and after calibration, where the error comes
    from, the JCT phases and any noise or calibration warning."""
    from ...simulation.steady import MEASURED_STEP

    P, m, errors, comparison = measured.P, measured.m, measured.errors, measured.comparison
    jct = measured.result.jct
    held = errors[~errors["in_fit"]].iloc[0]
    fitted = errors[errors["in_fit"]]
    parts_ms = comparison.decomposition.set_index("component")["ms"]
    step_cv = max(float(r.step_stats().iloc[-1]["cv"]) for r in measured.runs.values())
    return (
        f"<p>The reference GPT cut in P={P} balanced stages, run for real with torch.distributed.pipelining on {P} CPU "
        f"processes (gloo), m={m} micro-batches of {measured.microbatch} sequences, three times: 1F1B and "
        f"Interleaved1F1B to calibrate the simulator on, GPipe held out. The profile is one micro-batch taken with the "
        f"threads each rank gets. The measured step is, everywhere in this report, the {MEASURED_STEP}.</p>"
        f"<p>Before calibration the profile predicts the two fitted runs with errors of "
        f"{', '.join(f'{e:+.0%}' for e in fitted['rel_error_before'])} and the held-out GPipe run with "
        f"{held['rel_error_before']:+.0%}; after, {', '.join(f'{e:+.0%}' for e in fitted['rel_error_after'])} and "
        f"{held['rel_error_after']:+.0%} (held out). The calibration's parameters are in the table "
        f"<code>calibration</code>; <code>calibration_error</code> has every number. On the 1F1B run the calibrated "
        f"prediction is {comparison.step_ms[0]:.4g} ms against {comparison.step_ms[1]:.4g} ms measured; replaying the "
        f"measured action durations gives {comparison.replayed_step_ms:.4g} ms, so {parts_ms['durations']:+.3g} ms "
        f"of the error come from the predicted durations and {parts_ms['schedule and communication model']:+.3g} ms "
        f"from the schedule and communication model. The 1F1B run's JCT phases: assembly {jct.assembly_s:.3g} s "
        f"(processes, rendezvous, stages), training {jct.training_s:.3g} s, cleanup {jct.cleanup_s:.3g} s.</p>"
        + _memory_sentence(measured)
        + "".join(f"<p><em>{html.escape(str(w.message))}</em></p>" for w in measured.caught)
        + noise_warning(measured.profile.cv, "the profiled step")
        + noise_warning(step_cv, "the measured step after the warm-up (the noisiest of the three runs)")
    )


def _run_summary(measured: CalibratedRuns) -> str:
    """The measured-run section's line for the terminal."""
    errors = measured.errors
    held = errors[~errors["in_fit"]].iloc[0]
    return (
        f"measured runs P={measured.P} m={measured.m}: median |error| "
        f"{errors['rel_error_before'].abs().median():.0%} before calibration, "
        f"{errors['rel_error_after'].abs().median():.0%} after; "
        f"held-out GPipe {held['rel_error_before']:+.0%} -> {held['rel_error_after']:+.0%}; "
        f"assembly {measured.result.jct.assembly_s:.3g} s"
    )


def section_checkpoints(ctx: ReportContext) -> Section:
    """A job preempted at 70% of its steps, resumed from its checkpoint, against restarting it from zero."""
    from ...core.costs import CheckpointModel
    from ...partitioning.balance import partition

    P, m = 2, 2
    steps = 10 if ctx.quick else 20
    stop_at = int(0.7 * steps) - 1  # SIGTERM while this step's batch is fetched: this step finishes, then all save
    part = partition(reference_profile(ctx), P)
    preempted, resumed, restarted = _preempt_resume_restart(reference_setup(ctx), part, m, steps, stop_at)
    same = all(a.equal(b) for a, b in zip(resumed.state_dict().values(), restarted.state_dict().values()))
    resume_jct, restart_jct = _resume_vs_restart(preempted, resumed, restarted)
    model = CheckpointModel.calibrate([preempted, resumed])
    table = pd.concat(
        [preempted.checkpoints.assign(run="preempted"), resumed.checkpoints.assign(run="resumed")], ignore_index=True
    )
    table = table[
        ["run", "step", "kind", "status", "mode", "bytes", "largest_rank_bytes", "blocking_ms", "write_ms", "save_ms"]
    ]
    committed = table[table["status"] == "committed"]
    background = committed[committed["mode"] == "async"]
    stall_ms = float(background["blocking_ms"].median()) if len(background) else float("nan")
    write_MBps = float((committed["largest_rank_bytes"] / committed["write_ms"] / 1e3).median())
    done = preempted.first_step + len(preempted.step_ms)
    intro = (
        f"<p>The reference GPT on P={P} CPU ranks, a job of {steps} steps with a checkpoint every "
        f"{max(1, steps // 4)} steps (one packed file per rank, written in the background and committed atomically "
        f"with a checksummed manifest and DCP's metadata). A SIGTERM (a cluster's preemption notice) reached rank 0 "
        f"during step {stop_at}: every rank finished that step and all saved at step {done}. Resuming there trained "
        f"{resumed.steps - resumed.first_step} more steps and ended {'bitwise equal to' if same else 'DIFFERENT from'} "
        f"the job run without interruption. Against restarting from zero, the measured JCT of the whole job was "
        f"{resume_jct.total_s:.3g} s vs {restart_jct.total_s:.3g} s; the work the restart throws away is the "
        f"preempted run's {preempted.jct.training_s:.3g} s of training. A periodic save stalled the steps a median "
        f"{stall_ms:.3g} ms (the copy of each rank's state; the median step took {preempted.steady_step_ms:.3g} ms), "
        f"while its file was written in the background at a median {write_MBps:.3g} MB/s per rank; the stop's and "
        f"the end's saves wait for their writes. The restore took {resumed.restore_s * 1e3:.3g} ms (counted in "
        "the preemption loss); <code>CheckpointModel.calibrate</code> turns these into the planner's checkpoint "
        "costs (the stall, and the write and restore as a fixed part plus bytes over a bandwidth).</p>"
    )
    summary = [
        f"checkpoints: preempted at step {done}/{steps}, resumed {'bitwise equal' if same else 'NOT EQUAL'}; JCT "
        f"resume {resume_jct.total_s:.3g} s vs restart {restart_jct.total_s:.3g} s; save stall {stall_ms:.3g} ms, "
        f"background write {write_MBps:.3g} MB/s"
    ]
    costs = pd.DataFrame(
        [
            {"parameter": name, "value": getattr(model, name)}
            for name in (
                "asynchronous",
                "staging_latency_s",
                "staging_GBps",
                "save_latency_s",
                "write_GBps",
                "restore_latency_s",
                "read_GBps",
                "teardown_s",
            )
        ]
    )
    return Section(
        title="Checkpoints, preemption and resume",
        intro_html=intro,
        figures=[_jct_figure(resume_jct, restart_jct)],
        tables={
            "checkpoints": table,
            "resume_vs_restart": JCT.table(resume_jct, restart_jct),
            "checkpoint_model": costs,
        },
        summary=summary,
    )


def _preempt_resume_restart(
    setup: ReferenceSetup, part: Partition, m: int, steps: int, stop_at: int
) -> tuple[RunResult, RunResult, RunResult]:
    """Three real runs of ``steps`` steps: one preempted by a SIGTERM at step ``stop_at`` (checkpointing every
    quarter), one resumed from its checkpoint, and one run from zero without interruption."""
    import shutil
    import tempfile

    from ...runner import run, signal_at

    batch = (setup.inputs, setup.targets)
    root = Path(tempfile.mkdtemp(prefix="pipeswift_report_ckpt_"))
    try:
        preempted = run(
            setup.model,
            signal_at(batch, stop_at, rank=0),
            setup.loss_fn,
            part,
            m,
            checkpoint=Checkpointing(root, every=max(1, steps // 4)),
            steps=steps,
            progress=False,
        )
        resumed = run(
            setup.model,
            batch,
            setup.loss_fn,
            part,
            m,
            resume_from=root,
            checkpoint=root / "resumed",
            steps=steps,
            progress=False,
        )
        restarted = run(setup.model, batch, setup.loss_fn, part, m, steps=steps, progress=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return preempted, resumed, restarted


def _resume_vs_restart(preempted: RunResult, resumed: RunResult, restarted: RunResult) -> tuple[JCT, JCT]:
    """The whole job's JCT both ways: the preempted run plus its resumption, and the preempted run thrown away
    (its training counted as preemption loss) plus a run from zero."""
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
    return resume_jct, restart_jct


def _jct_figure(resume_jct: JCT, restart_jct: JCT) -> Figure:
    """The two ways' JCT breakdowns side by side, in seconds."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    resume_jct.plot(restart_jct, ax=ax, unit="s")
    fig.tight_layout()
    return fig


def section_elastic(ctx: ReportContext) -> Section:
    """The reference GPT resized P=2→4→2 within one job: what each change of configuration cost, measured."""
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
        elastic=Elastic(resize_at={third: 4, 2 * third: 2}, profile=prof),
    )
    seg = result.segments
    costs = _reconfiguration_costs(seg)
    changes = " and ".join(f"{c:.3g} s" for c in costs["reconfiguration_s"])
    intro = (
        f"<p>One job of {steps} steps that starts on 2 CPU ranks, moves to 4 at step {third} and back to 2 at step "
        f"{2 * third} (<code>run(elastic=Elastic(resize_at=...))</code>): at each change every rank checkpoints, the "
        "workers stop, the model is re-partitioned for the new P from the profile and new workers restore by name. "
        f"Each change cost {changes} (save, teardown, new workers, restore), against a first start of "
        f"{seg['assembly_s'].iloc[0]:.3g} s; the job's JCT counts them as cleanup and assembly, as they happened. "
        "On this 2-core machine 4 ranks share the cores, so their steps are no faster: the section shows the "
        "mechanics and their cost, not a speed-up.</p>"
    )
    summary = [
        "elastic: P 2->4->2 in one job, changes cost " + ", ".join(f"{c:.3g} s" for c in costs["reconfiguration_s"])
    ]
    return Section(
        title="Elastic P within one job",
        intro_html=intro,
        figures=[_segments_figure(result, steps)],
        tables={"elastic_segments": seg.drop(columns=["bounds"]), "elastic_changes": costs},
        summary=summary,
    )


def _segments_figure(result: RunResult, steps: int) -> Figure:
    """The measured step time of each of ``steps`` steps, one line per segment (configuration) of the job."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    df = result.df.merge(pd.DataFrame({"step": range(steps)}), on="step")
    for row in result.segments.itertuples():
        part_df = df[(df["step"] >= row.first_step) & (df["step"] <= row.last_step)]
        ax.plot(part_df["step"], part_df["step_ms"], marker="o", label=f"segment {row.segment}: P={row.P}")
    ax.set_xlabel("step")
    ax.set_ylabel("measured step (ms)")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def _reconfiguration_costs(seg: pd.DataFrame) -> pd.DataFrame:
    """One row per change of configuration between consecutive segments ``seg``: the old one's save and teardown,
    the new one's assembly and restore, and their sum ``reconfiguration_s``."""
    changes = [(seg.iloc[i - 1], seg.iloc[i]) for i in range(1, len(seg))]
    return pd.DataFrame(
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
