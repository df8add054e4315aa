"""The pipeline explorer: a profile partitioned and simulated for the P, m, schedule and method chosen."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core.checks import check_choice
from ...core.vocabulary import SCHEDULES
from .base import Explorer, value_property

if TYPE_CHECKING:
    from ...partitioning.stages import Partition
    from ...profiling.table import Profile
    from ...simulation.calibration import SimulatorCalibration
    from ...simulation.timeline import Timeline

__all__ = ["M_MAX", "PipelineExplorer", "pipeline_explorer", "valid_microbatches"]

#: The largest micro-batch count the pipeline explorer offers (more when the schedule needs more).
M_MAX = 64


class PipelineExplorer(Explorer):
    """P and m sliders, schedule and partition dropdowns over a profile; shows the Gantt chart and metrics.

    Every change re-partitions and re-simulates (:func:`pipeswift_lab.simulation.sweeps.explore`);
    ``.partition``, ``.timeline`` and ``.result`` hold what is shown, and ``.error``
    the message when torch refuses the combination (e.g. 1F1B with m < P). ``result`` holds the busiest rank's
    ``bottleneck_rank_ms`` and ``rank_imbalance`` (a rank's ``v`` stages summed; the figures shown) beside the
    per-stage ``bottleneck_ms`` and ``imbalance`` (shown too when ``v > 1``).
    """

    def __init__(
        self,
        profile: Profile | None = None,
        P: int = 2,
        m: int = 4,
        schedule: str = "1F1B",
        method: str = "balanced",
        calibration: SimulatorCalibration | None = None,
    ) -> None:
        import ipywidgets as w

        from ...core.vocabulary import canonical_schedule
        from ...partitioning.balance import METHODS
        from ...simulation.calibration import check_calibration

        self.calibration = check_calibration(calibration)
        method = check_choice("method", method, METHODS)
        schedule = canonical_schedule(schedule)
        self.profile = profile if profile is not None else _reference_profile()
        self._P = w.IntSlider(
            value=P,
            min=1,
            max=len(self.profile.df),
            description="P (ranks)",
            continuous_update=False,
            layout=w.Layout(width="420px"),
        )
        self._schedule = w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
        # only the m torch's schedule accepts for this P, on a track long enough to drag
        valid = valid_microbatches(P, schedule)
        self.note = "" if m in valid else _snap_note(m, _nearest(valid, m), P, schedule)
        self._m = w.SelectionSlider(
            options=valid,
            value=_nearest(valid, m),
            description="m (micro-batches)",
            continuous_update=False,
            style={"description_width": "initial"},
            layout=w.Layout(width="520px"),
        )
        self._method = w.Dropdown(options=list(METHODS), value=method, description="partition")
        self._numbers = w.HTML()
        self._figure = w.Output()
        self._syncing = self._keep_note = False
        self._observe()
        self.partition: Partition | None = None
        self.timeline: Timeline | None = None
        self.result: dict[str, Any] = {}
        self.error: str | None = None
        self._show([w.HBox([self._P, self._m]), w.HBox([self._schedule, self._method]), self._numbers, self._figure])

    P = value_property("_P", "The number of ranks (pipeline stages) the slider shows.")
    schedule = value_property("_schedule", "The schedule chosen in the dropdown.")
    method = value_property("_method", "The partition method chosen in the dropdown.")

    @property
    def m(self) -> int:
        """The micro-batch count shown; setting one torch refuses for this P and schedule snaps to the nearest
        valid (see ``.note``)."""
        return self._m.value

    @m.setter
    def m(self, value: int) -> None:
        valid = list(self._m.options)
        self.note = "" if value in valid else _snap_note(value, _nearest(valid, value), self.P, self.schedule)
        if _nearest(valid, value) == self._m.value:
            self._update()  # same m: show the note
        else:
            self._keep_note = True
            self._m.value = _nearest(valid, value)

    def _observe(self) -> None:
        """Wire the controls: P or the schedule re-offer m; m and the method re-simulate."""
        self._P.observe(lambda change: self._on_shape(), names="value")
        self._schedule.observe(lambda change: self._on_shape(), names="value")
        self._m.observe(lambda change: None if self._syncing else self._on_m(), names="value")
        self._method.observe(lambda change: self._update(), names="value")

    def _on_m(self) -> None:
        if not self._keep_note:
            self.note = ""  # the user moved the slider: any earlier snap no longer applies
        self._keep_note = False
        self._update()

    def _on_shape(self) -> None:
        """P or the schedule changed: offer the m valid for them, keeping the current m or snapping to the nearest."""
        if self._syncing:
            return
        current, valid = self._m.value, valid_microbatches(self.P, self.schedule)
        self._syncing = True
        try:
            self._m.options = valid
            self._m.value = _nearest(valid, current)
        finally:
            self._syncing = False
        self.note = "" if current in valid else _snap_note(current, self._m.value, self.P, self.schedule)
        self._update()

    def _update(self) -> None:
        from ...simulation.calibration import whole_step_ms
        from ...simulation.sweeps import explore

        try:
            part, tl = explore(
                self.profile, self.P, self.m, self.schedule, method=self.method, calibration=self.calibration
            )
        except ValueError as error:
            self.partition = self.timeline = None
            self.error, self.result = str(error), {}
            self._numbers.value = f"<span style='color:#b00'>{html.escape(self.error)}</span>"
            self._figure.clear_output()
            return
        self.partition, self.timeline, self.error = part, tl, None
        self.result = {
            "P": self.P,
            "m": self.m,
            "schedule": self.schedule,
            "v": part.v,
            "method": self.method,
            "step_ms": whole_step_ms(tl),
            "bubble_ratio": tl.bubble_ratio,
            "bottleneck_ms": part.bottleneck_ms,
            "imbalance": part.imbalance,
            "bottleneck_rank_ms": part.bottleneck_rank_ms,
            "rank_imbalance": part.rank_imbalance,
        }
        r = self.result
        # a rank works through its v stages per micro-batch: the rank's figures pace the pipeline
        stages = (
            f" (slowest stage {r['bottleneck_ms']:.4g} ms, stage imbalance {r['imbalance']:.2f})" if r["v"] > 1 else ""
        )
        self._numbers.value = (
            (f"<i>{html.escape(self.note)}</i><br>" if self.note else "")
            + f"<b>{r['schedule']}</b> (v={r['v']}), {r['method']} split of P={r['P']}, m={r['m']}: "
            f"{'calibrated' if self.calibration is not None else 'simulated'} step "
            f"<b>{r['step_ms']:.4g} ms</b>, bubble_ratio <b>{r['bubble_ratio']:.3f}</b>, busiest rank "
            f"{r['bottleneck_rank_ms']:.4g} ms per micro-batch, rank imbalance {r['rank_imbalance']:.2f}{stages}"
        )
        self._redraw(self._figure, tl.plot)


def _reference_profile() -> Profile:
    """The reference GPT measured here as the quick report measures it (batch 4, 1 warm-up, 3 repeats)."""
    from ..report.base import ReportContext, reference_profile

    return reference_profile(ReportContext(quick=True, progress=False))


def valid_microbatches(P: int, schedule: str) -> list[int]:
    """The micro-batch counts ``m`` (1 … :data:`M_MAX`, or up to what the schedule needs) that torch's ``schedule``
    accepts with ``P`` ranks."""
    from ...core.vocabulary import accepts, default_v

    out = []
    for m in range(1, max(M_MAX, 4 * P) + 1):
        if not accepts(P, m, schedule, default_v(schedule)):
            continue
        out.append(m)
        if m >= M_MAX and len(out) >= 8:
            break
    return out


def _nearest(valid: Sequence[int], m: int) -> int:
    return min(valid, key=lambda k: (abs(k - m), k))


def _snap_note(asked: int, got: int, P: int, schedule: str) -> str:
    return f"m={asked} is not accepted by torch's {schedule} with P={P}; showing the nearest valid m={got}"


#: ``pipeline_explorer(profile=None, P=2, m=4, schedule="1F1B", method="balanced", calibration=None)`` returns a
#: :class:`PipelineExplorer` over ``profile`` (default: the reference GPT measured here); with a ``calibration`` every
#: configuration is simulated calibrated and ``step_ms`` is the whole predicted step (span plus the runtime's overhead).
pipeline_explorer = PipelineExplorer
