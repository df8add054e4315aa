"""Fitting the simulator to measured runs, and publishing its error before and after.

A profile times each layer alone; inside a pipeline the same layer runs slower (ranks share
cores and memory bandwidth), torch's schedule runtime spends time outside the actions, and
transfers have latency. :func:`calibrate` fits a small model of these effects to the
measured Timelines of one or more :class:`~pipeswift_lab.runner.RunResult` of one model:

* ``compute_scale[P=k]`` — measured action time over profiled time when ``k`` ranks run
  at once; ``action_ms`` — a fixed cost inside every action (kernel launch, hooks,
  Python); ``loss_fwd_ms`` / ``loss_bwd_ms`` — the extra time of the last stage's forward
  and backward, the loss and its gradient, which a per-layer profile does not time: one
  least-squares fit ``measured = scale[P] * profiled + action_ms + loss terms`` over the
  median duration of every (run, stage, kind), costs kept non-negative;
* ``latency_ms`` and ``bandwidth_GBps`` — a transfer as seen by the runtime, from the gaps
  between a sender's action end and the receiver's action start, counted only where the
  receiver was already idle (so the gap is the transfer, not a queue): their median, or a
  least-squares line ``gap = latency + bytes / bandwidth`` when the boundaries carry
  different sizes (Hockney's alpha-beta model, as :class:`~pipeswift_lab.core.link.Link`);
* ``step_overhead_ms[single-chunk]`` / ``[multi-chunk]`` — the time a step spends outside
  its first-to-last action span (schedule runtime, optimizer step): the median over steps,
  per runtime (``ScheduleGPipe``/``Schedule1F1B`` against ``_PipelineScheduleRuntime``);
* ``gap_ms[single-chunk]`` / ``[multi-chunk]`` — the runtime's time between consecutive
  actions of a rank (posting and waiting on transfers, bookkeeping, descheduling), charged
  to the actions that communicate (``F``, ``B``, ``I``; a ``W`` follows its ``I`` locally), at the
  smallest P of the runs, and ``gap_scale[P=k]`` — how much longer it is when ``k`` ranks
  share the machine (Python work between actions is slowed by co-running ranks more than
  the kernels are): fitted last, jointly, by least squares of the relative error of the
  simulated against the measured action span over all runs (coordinate descent, each
  parameter by a bounded scalar search), with everything above fixed;
* ``step_cv`` — the step-time dispersion, the median over runs of the coefficient of
  variation of the steps after the warm-up; the planner's p95 uses it;
* ``links`` — apart from all of the above, the link of the backend that ran the runs' collectives (``REDUCE_GRAD``,
  ``UNSHARD``, the tensor-parallel ``TP_*``), fitted on their measured durations and bytes in that backend's shape
  (gloo's on CPU, whose reduce-scatter costs an all-reduce), per collective and over all of them
  (:mod:`pipeswift_lab.fidelity.collectives`): :meth:`Calibration.collective_ms` prices a collective of that
  backend with it, while NCCL's keep the ring formulas on the Topology's links.

A calibrated simulation runs each action for ``scale[P] * profiled + action_ms + gap_ms * gap_scale[P]``
(no gap for ``W``)
(plus the loss terms on the last stage) and adds ``step_overhead_ms`` of its runtime to the
span. :meth:`Calibration.error` gives
the error before and after on any runs (held out or not). A parameter the runs cannot
determine (no multi-chunk run, one boundary size, one profiled duration) is left at a
stated default with a warning naming it; the rest are fitted.

"The measured step" is everywhere :attr:`RunResult.steady_step_ms`:
:data:`pipeswift_lab.fidelity.comparison.MEASURED_STEP`.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.display import NOISE_CV, noise_note
from ..core.link import Link
from ..core.topology import Topology, collective_ms
from ..simulation.calibration import RUNTIMES, SimulatorCalibration, check_calibration, runtime_of, whole_step_ms
from .collectives import COLLECTIVE_KINDS, calibrate_links, collective_error, empty_links, link_of, links_ms
from .fitting import fit_compute, fit_gaps, fit_step_cv, fit_step_overhead, fit_transfer, minimize_scalar
from .measurements import Run, check_runs, measure_runs, model_of, partition_of, profile_table, run_key

if TYPE_CHECKING:
    from matplotlib.axes import Axes


class CalibrationWarning(UserWarning):
    """A calibration parameter could not be fitted from the runs given; the warning names it and its default."""


@dataclass(frozen=True, repr=False, kw_only=True)
class Calibration(SimulatorCalibration):
    """A :class:`~pipeswift_lab.simulation.calibration.SimulatorCalibration` fitted on measured runs, with its error
    on any runs (:meth:`error`, :meth:`plot`). ``df`` lists every parameter: ``parameter``, ``value``, ``unit``,
    ``how`` (how it was fitted, from how many samples, or why it kept its default). ``links`` is the link fitted on
    the runs' collectives, per backend and collective (:data:`~pipeswift_lab.fidelity.collectives.LINK_COLUMNS`;
    empty when the runs measured none with their bytes): :meth:`collective_ms` prices with it,
    :meth:`collective_error` checks it."""

    links: pd.DataFrame = field(default_factory=empty_links, compare=False)
    """The fitted links: ``backend``, ``dim`` (the mesh dimension: ``tp``, ``fsdp``, ``dp``; ``"all"``: over every
    one), ``collective`` (``"all"``: over every collective of the dim), ``latency_ms`` (per ring step),
    ``bandwidth_GBps``, ``samples``, ``sizes``, ``median_ratio`` (predicted / measured over its samples), ``how``."""

    def link(self, collective: str = "all", backend: str = "gloo", dim: str | None = None) -> Link | None:
        """The :class:`~pipeswift_lab.core.link.Link` fitted for ``backend``'s ``collective`` over mesh dimension
        ``dim`` (:func:`~pipeswift_lab.fidelity.collectives.links_ms` says which), or None when the runs fitted none
        for ``backend`` (or its latency alone)."""
        return link_of(self.links, collective, backend, dim)

    def collective_ms(
        self,
        collective: str,
        nbytes: float,
        n: int,
        backend: str = "gloo",
        link: Link | None = None,
        dim: str | None = None,
    ) -> float:
        """Milliseconds of ``collective`` (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) on a
        whole buffer of ``nbytes`` over ``n`` ranks of ``backend`` (over mesh dimension ``dim``: ``tp``, ``fsdp``,
        ``dp``): on the link fitted for ``backend``, in its shape, when there is one
        (:func:`~pipeswift_lab.fidelity.collectives.links_ms`); else NCCL's rings on ``link`` (a Topology's link;
        ``ValueError`` without one)."""
        fitted = links_ms(self.links, collective, nbytes, n, backend, dim)
        if not math.isnan(fitted):
            return fitted
        if link is None:
            raise ValueError(
                f"this calibration fitted no {backend} link (its runs measured no {backend} collective with bytes); "
                "give link= (a Topology's link) to price it with NCCL's ring formulas"
            )
        return collective_ms(collective, nbytes, n, link, "nccl")

    def collective_error(self, runs: Run | Sequence[Run], topology: Topology | None = None) -> pd.DataFrame:
        """Per run and measured collective size: measured median ms against NCCL's rings on ``topology``'s
        intra-node link (before) and the fitted link (after), with their ratios
        (:func:`~pipeswift_lab.fidelity.collectives.collective_error`)."""
        return collective_error(self.links, runs, topology)

    def save(self, path: str | PathLike[str]) -> str:
        """Write the calibration as JSON to ``path``, its links included; return the path."""
        super().save(path)
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["links"] = self.links.astype(object).where(self.links.notna(), None).to_dict(orient="records")
        Path(path).write_text(json.dumps(data, indent=1), encoding="utf-8")
        return str(path)

    @classmethod
    def load(cls, path: str | PathLike[str]) -> Calibration:
        """Read a calibration written by :meth:`save` (one written without links loads with none)."""
        loaded = super().load(path)
        rows = json.loads(Path(path).read_text(encoding="utf-8")).get("links") or []
        links = pd.DataFrame(rows, columns=list(empty_links().columns)) if rows else empty_links()
        for col in ("latency_ms", "bandwidth_GBps", "samples", "sizes", "median_ratio"):
            links[col] = pd.to_numeric(links[col], errors="coerce").astype(float)
        return replace(loaded, links=links)

    def _repr_html_(self) -> str:
        from ..core.display import html_card

        html = super()._repr_html_()
        if len(self.links):
            html += html_card("Collective links (fitted apart from compute)", {}, self.links)
        return html

    def error(self, runs: Run | Sequence[Run]) -> pd.DataFrame:
        """Per run: the measured step (:attr:`RunResult.steady_step_ms`), the prediction before and after
        calibration, both relative errors.

        Columns: ``run`` (index in ``runs``), ``schedule``, ``P``, ``v``, ``m``, ``in_fit``
        (whether the run was one this calibration was fitted on: ``False`` is the held-out
        check), ``measured_step_ms``, ``predicted_before_ms`` (the uncalibrated simulated
        step), ``predicted_after_ms`` (calibrated span plus the runtime's step overhead),
        ``rel_error_before``, ``rel_error_after`` (``(predicted - measured) / measured``).

        A calibration fitted on published runs takes published runs (:class:`~pipeswift_lab.fidelity.PublishedRun`):
        ``run`` is then the run's name, with ``model``, ``layout`` and ``gpus`` in place of the schedule's columns, and
        the steps are whole iterations (:func:`~pipeswift_lab.fidelity.published.predict_iteration`).
        """
        from ..simulation.simulator import simulate

        if self.meta.get("kind") == "published":
            return _published_error(self, runs)
        runs = check_runs(runs, self.meta.get("model"))
        fitted = set(self.meta.get("runs", ()))
        rows = []
        for i, run in enumerate(runs):
            part = partition_of(run, self.profile_table, self.profile_batch_size, i)
            measured = float(run.steady_step_ms)
            before = simulate(part, run.m, schedule=run.schedule).step_ms
            after = whole_step_ms(simulate(part, run.m, schedule=run.schedule, calibration=self))
            rows.append(
                {
                    "run": i,
                    "schedule": run.schedule,
                    "P": run.P,
                    "v": run.v,
                    "m": run.m,
                    "in_fit": run_key(run) in fitted,
                    "measured_step_ms": measured,
                    "predicted_before_ms": before,
                    "predicted_after_ms": after,
                    "rel_error_before": (before - measured) / measured,
                    "rel_error_after": (after - measured) / measured,
                }
            )
        return pd.DataFrame(rows)

    def plot(self, runs: Run | Sequence[Run], ax: Axes | None = None) -> Axes:
        """Predicted against measured step of ``runs``, before (hollow) and after (filled) calibration, with the
        y = x line. Returns the Axes."""
        from ..core.plot import get_ax

        table = self.error(runs)
        ax = get_ax(ax, figsize=(5.0, 4.6))
        hi = (
            float(np.nanmax(table[["measured_step_ms", "predicted_before_ms", "predicted_after_ms"]].to_numpy())) * 1.08
        )
        ax.plot([0, hi], [0, hi], color="#888888", linestyle="--", linewidth=1, label="y = x")
        held = ~table["in_fit"]
        for mask, marker, name in ((held, "o", "held out"), (~held, "s", "fitted on")):
            if mask.any():
                sub = table[mask]
                ax.scatter(
                    sub["measured_step_ms"],
                    sub["predicted_before_ms"],
                    marker=marker,
                    facecolors="none",
                    edgecolors="#d62728",
                    label=f"before ({name})",
                )
                ax.scatter(
                    sub["measured_step_ms"],
                    sub["predicted_after_ms"],
                    marker=marker,
                    color="#1f77b4",
                    label=f"after ({name})",
                )
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        published = self.meta.get("kind") == "published"
        ax.set_xlabel("measured iteration (ms, published)" if published else "measured step (ms, steady_step_ms)")
        ax.set_ylabel("predicted step (ms)")
        med_b, med_a = table["rel_error_before"].abs().median(), table["rel_error_after"].abs().median()
        ax.set_title(f"median |error| {med_b:.0%} before, {med_a:.0%} after")
        ax.legend(fontsize="small")
        return ax


# --------------------------------------------------------------------------- fitting
def calibrate(runs: Run | Sequence[Run], profile: Any = None) -> Calibration:
    """Fit the simulator to measured runs of one model; return a :class:`Calibration`.

    ``runs`` given as :class:`~pipeswift_lab.fidelity.PublishedRun` values (configurations with their published
    iteration time, at most a few: three is the intended) fit one compute scale of their analytic profiles instead
    (:func:`calibrate_published`; ``profile``: None, or an analytic Profile of theirs).

    ``runs`` is one or more :class:`~pipeswift_lab.runner.RunResult` of the same model (any
    P, m, schedule, partition), instrumented (the default of :func:`~pipeswift_lab.run`);
    ``profile`` the :class:`~pipeswift_lab.Profile` (or per-layer DataFrame) their partitions
    came from. With ``profile.meta["batch_size"]`` and the runs' micro-batch size both
    known and different, layer times are scaled in proportion. The parameters, their units
    and how each was fitted are in ``Calibration.df`` (the module docstring gives the model).
    A parameter the runs cannot determine keeps a stated default and a
    :class:`CalibrationWarning` names it.
    """
    from .published import PublishedRun

    listed = list(runs) if isinstance(runs, (list, tuple)) else [runs]
    if listed and all(isinstance(run, PublishedRun) for run in listed):
        return calibrate_published(listed, profile)
    if profile is None:
        raise TypeError("calibrate(runs, profile): measured runs need the Profile their partitions came from")
    runs = check_runs(runs)
    table, batch_size = profile_table(profile)
    parts = [partition_of(run, table, batch_size, i) for i, run in enumerate(runs)]
    how: dict[str, str] = {}
    missing: list[str] = []
    measured = measure_runs(runs, parts)
    scale, action_ms, loss_ms = fit_compute(measured.samples, how, missing)
    latency_ms, bandwidth = fit_transfer(measured.gaps, how, missing)
    closed_form = Calibration(
        compute_scale=scale,
        action_ms=action_ms,
        loss_ms=loss_ms,
        gap={},
        step_overhead=fit_step_overhead(measured.overheads, how, missing),
        latency_ms=latency_ms,
        bandwidth_GBps=bandwidth,
        step_cv=fit_step_cv(measured.cvs, how, missing),
        profile_table=table,
        profile_batch_size=batch_size,
        meta={"runs": tuple(run_key(r) for r in runs), "model": model_of(runs[0])},
    )
    cal = replace(fit_gaps(closed_form, runs, parts, measured.spans, how, missing), how=how, links=_links(runs))
    _warn_missing(missing)
    return cal


def calibrate_published(runs: Sequence[Any], profile: Any = None) -> Calibration:
    """One compute scale fitted on published runs (:class:`~pipeswift_lab.fidelity.PublishedRun`, each with its
    measurement), their iterations priced from analytic profiles (:func:`~pipeswift_lab.fidelity.predict_iteration`):
    the scale ``s`` on every simulated action that minimizes ``sum(log(predicted / measured)²)``
    (a bounded scalar search, :func:`~pipeswift_lab.fidelity.fitting.minimize_scalar`). The collectives beside the
    pipeline and the optimizer step keep their priced times. One scale because the runs that fit it are few
    (three): it carries what the roofline misses uniformly (the kernels' efficiency against the datasheet, clocks,
    the framework's overheads), and keeps the ranking of layouts the analytic model gives. ``profile``: None (each
    run's own analytic profile), or an analytic Profile whose spec and hardware every run shares. The Calibration
    holds it as ``compute_scale[P=1]``, applied at every P, and applies wherever ``calibration=`` is taken (simulate,
    sweep, plan); :meth:`Calibration.error` tables the runs before and after. Raises ``ValueError`` for a run
    without a measurement or one ``profile`` does not describe."""
    from .published import predict_iteration

    runs, profiles = _published_inputs(runs, profile)
    measured = np.array([run.measured_s * 1e3 for run in runs])

    def cal(scale: float) -> Calibration:
        return _scale_calibration(scale, runs, profile)

    def loss(scale: float) -> float:
        got = [predict_iteration(r, calibration=cal(scale), profile=p)["iteration_ms"] for r, p in zip(runs, profiles)]
        return float(np.sum(np.log(np.asarray(got) / measured) ** 2))

    before = np.array([predict_iteration(r, profile=p)["iteration_ms"] for r, p in zip(runs, profiles)])
    start = float(np.exp(np.mean(np.log(measured / before))))
    scale = minimize_scalar(loss, 0.5 * start, 2.0 * start, grid=12, iterations=16)
    return cal(scale)


def _published_inputs(runs: Sequence[Any], profile: Any) -> tuple[list[Any], list[Any]]:
    """The runs checked to carry a measurement, and the profile each is priced from (``profile`` where it describes
    the run at its micro-batch, else None: its own)."""
    from ..core.transformer_spec import TransformerSpec
    from ..profiling.table import Profile

    runs = list(runs)
    if not runs:
        raise ValueError("calibrate: no runs given")
    for i, run in enumerate(runs):
        if run.measured_s is None:
            raise ValueError(f"calibrate: published run {i} ({run.name!r}) has no measurement to fit on")
    if profile is None:
        return runs, [None] * len(runs)
    if not isinstance(profile, Profile) or profile.meta.get("source") != "analytic":
        raise TypeError(
            "calibrate(published_runs, profile): profile must be an analytic Profile (psl.analytic_profile)"
        )
    for run in runs:
        described = TransformerSpec(**profile.meta.get("spec", {})) == run.spec
        same_kernels = (profile.meta.get("attention"), profile.meta.get("dropout")) == (run.attention, run.dropout)
        if not described or not same_kernels or profile.meta.get("hardware") != run.hardware.name:
            raise ValueError(
                f"calibrate: the profile ({profile.meta.get('model')}) does not describe published run {run.name!r} "
                f"({run.spec.name or 'transformer'} on {run.hardware.name}, {run.attention} attention, "
                f"dropout={run.dropout})"
            )
    return runs, [profile if profile.meta.get("batch_size") == run.micro_batch else None for run in runs]


def _scale_calibration(scale: float, runs: Sequence[Any], profile: Any) -> Calibration:
    """The Calibration of one compute ``scale`` fitted on published ``runs``."""
    names = ", ".join(repr(run.name) for run in runs)
    return Calibration(
        compute_scale={1: float(scale)},
        action_ms=0.0,
        loss_ms=(0.0, 0.0),
        gap={},
        step_overhead={},
        latency_ms=0.0,
        bandwidth_GBps=math.inf,
        step_cv=math.nan,
        how={
            "compute_scale[P=1]": f"one scale for every P, fitted on {len(runs)} published runs ({names}): "
            "least squares of log(predicted / measured) iteration",
            "action_ms": "not fitted on published runs (0)",
        },
        profile_table=None if profile is None else profile.df,
        profile_batch_size=None if profile is None else profile.meta.get("batch_size"),
        meta={
            "kind": "published",
            "runs": tuple(run.name for run in runs),
            "hardware": tuple(sorted({run.hardware.name for run in runs})),
        },
    )


def _published_error(cal: Calibration, runs: Any) -> pd.DataFrame:
    """:meth:`Calibration.error` of published runs: per run its name (``run``), ``model``, ``layout``, ``gpus``,
    ``in_fit``, the measured and predicted iterations (ms, before and after) and the relative errors."""
    from .published import PublishedRun, predict_iteration

    runs = [runs] if isinstance(runs, PublishedRun) else list(runs)
    fitted, rows = set(cal.meta.get("runs", ())), []
    for run in runs:
        if not isinstance(run, PublishedRun) or run.measured_s is None:
            raise ValueError(
                f"error: this calibration was fitted on published runs; {run!r} is not one with a measurement"
            )
        measured = run.measured_s * 1e3
        before = predict_iteration(run)["iteration_ms"]
        after = predict_iteration(run, calibration=cal)["iteration_ms"]
        rows.append(
            {
                "run": run.name,
                "model": run.model,
                "layout": run.layout,
                "gpus": run.gpus,
                "in_fit": run.name in fitted,
                "measured_step_ms": measured,
                "predicted_before_ms": before,
                "predicted_after_ms": after,
                "rel_error_before": (before - measured) / measured,
                "rel_error_after": (after - measured) / measured,
            }
        )
    return pd.DataFrame(rows)


def _links(runs: Sequence[Run]) -> pd.DataFrame:
    """The collectives' links of ``runs`` (:func:`~pipeswift_lab.fidelity.collectives.calibrate_links`); warns when
    the runs measured collectives but their timelines carry no bytes to fit them on."""
    links = calibrate_links(runs)
    unsized = [
        i
        for i, run in enumerate(runs)
        if "bytes" not in run.timeline.df.columns and run.timeline.df["kind"].isin(COLLECTIVE_KINDS).any()
    ]
    if unsized:
        warnings.warn(
            f"calibrate: runs {unsized} measured collectives, but their timelines carry no bytes column, so their "
            "links are not fitted (Calibration.links has none of them)",
            CalibrationWarning,
            stacklevel=3,
        )
    return links


def _warn_missing(missing: list[str]) -> None:
    """One :class:`CalibrationWarning` naming every parameter the runs cannot determine."""
    if missing:
        warnings.warn(
            f"calibrate: the runs cannot determine {', '.join(missing)}; see Calibration.df 'how' for the default "
            "used. Add runs that vary what they need (e.g. a run of the other runtime, other stage sizes).",
            CalibrationWarning,
            stacklevel=3,
        )


__all__ = [
    "NOISE_CV",
    "Calibration",
    "CalibrationWarning",
    "RUNTIMES",
    "SimulatorCalibration",
    "calibrate",
    "calibrate_published",
    "check_calibration",
    "noise_note",
    "runtime_of",
    "whole_step_ms",
]
