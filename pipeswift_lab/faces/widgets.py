"""Interactive explorers for notebooks, built on ipywidgets.

Each explorer keeps its state readable (``.P``, ``.m``, ``.schedule``, ``.result``) so a
test drives it headlessly by setting slider values, exactly as a user drags them.
ipywidgets and matplotlib are imported when an explorer is built, not at package import.
"""

from __future__ import annotations

import html

from ..core import analytic
from ..core.vocabulary import SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, check_schedule_v


class _Explorer:
    """What every explorer shares: it displays as its ``widget`` and redraws into an Output area."""

    @staticmethod
    def _redraw(output, draw):
        """Clear ``output`` and show what ``draw()`` plots (and displays) there."""
        import matplotlib.pyplot as plt

        output.clear_output(wait=True)
        with output:
            draw()
            plt.show()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


class BubbleExplorer(_Explorer):
    """Sliders for P and m, a schedule dropdown and a v slider, redrawing the bubble curve.

    ``.result`` holds the numbers for the current setting: both bubble conventions and
    the in-flight micro-batches of the first rank (the activation-memory multiplier).
    """

    def __init__(self, P=4, m=8, schedule="1F1B", v=1, max_P=32, max_m=128):
        import ipywidgets as w

        schedule, v = check_schedule_v(schedule, v)
        self._P = w.IntSlider(value=P, min=1, max=max_P, description="P (ranks)", continuous_update=False)
        self._m = w.IntSlider(
            value=m,
            min=1,
            max=max_m,
            description="m (micro-batches)",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        self._schedule = w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
        self._v = w.IntSlider(
            value=v,
            min=1,
            max=8,
            description="v (chunks/rank)",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        self._numbers = w.HTML()
        self._figure = w.Output()
        for control in (self._P, self._m, self._schedule, self._v):
            control.observe(self._on_change, names="value")
        self.widget = w.VBox(
            [w.HBox([self._P, self._m]), w.HBox([self._schedule, self._v]), self._numbers, self._figure]
        )
        self.result: dict = {}
        self._sync_v()
        self._update()

    # Readable state: what the sliders say now.
    P = property(lambda self: self._P.value, lambda self, value: setattr(self._P, "value", value))
    m = property(lambda self: self._m.value, lambda self, value: setattr(self._m, "value", value))
    schedule = property(lambda self: self._schedule.value, lambda self, value: setattr(self._schedule, "value", value))
    v = property(lambda self: self._v.value, lambda self, value: setattr(self._v, "value", value))

    def _sync_v(self):
        """Pin ``v`` where the schedule fixes it: 1 for single-stage schedules, 2 for V shapes."""
        if self.schedule in SINGLE_CHUNK_SCHEDULES:
            self._v.value, self._v.disabled = 1, True
        elif self.schedule in V_SHAPE_SCHEDULES:
            self._v.value, self._v.disabled = 2, True
        else:
            self._v.disabled = False

    def _on_change(self, change):
        if change["owner"] is self._schedule:
            self._sync_v()
        self._update()

    def _update(self):
        P, m, schedule, v = self.P, self.m, self.schedule, self.v
        self.result = analytic.bubble_summary(P, m, schedule, v=v)
        r = self.result
        self._numbers.value = (
            f"<b>{schedule}</b>, P={P}, m={m}, v={v}: idle share of the step (bubble_ratio) "
            f"<b>{r['bubble_ratio']:.3f}</b>; bubble over compute (bubble_overhead) <b>{r['bubble_overhead']:.3f}</b>; "
            f"rank 0 holds <b>{r['inflight_rank0']:g}</b> micro-batches of activations."
        )
        self._draw()

    def _draw(self):
        def draw():
            ax = plot_bubble_curve([self.P], schedule=self.schedule, v=self.v, m_max=max(64, 2 * self.m))
            ax.scatter([self.m], [self.result["bubble_ratio"]], color="black", zorder=5, label=f"m={self.m}")
            ax.legend(fontsize="small")

        self._redraw(self._figure, draw)


def plot_bubble_curve(Ps=(2, 4, 8, 16), schedule="1F1B", v=1, m_max=64, convention="ratio", ax=None):
    """Bubble against m (1 … ``m_max``) for each P in ``Ps``; ``convention`` is "ratio" or "overhead". Returns the Axes.

    Only the ``m`` torch's schedule accepts are drawn (1F1B needs ``m >= P``).
    """
    from ..core.plot import get_ax
    from ..core.vocabulary import accepts

    if convention not in ("ratio", "overhead"):
        raise ValueError(
            f"convention={convention!r} is not valid; use 'ratio' (idle share of the step) or 'overhead' (bubble over compute)"
        )
    formula = analytic.bubble_ratio if convention == "ratio" else analytic.bubble_overhead
    ax = get_ax(ax)
    ms = list(range(1, m_max + 1))
    for P in Ps:
        valid = [m for m in ms if accepts(P, m, schedule, v)]
        ax.plot(valid, [formula(P, m, schedule, v=v) for m in valid], label=f"P={P}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble_ratio (idle share)" if convention == "ratio" else "bubble_overhead (bubble / compute)")
    ax.set_title(f"{schedule}" + (f", v={v}" if v > 1 else ""))
    ax.legend(fontsize="small")
    return ax


def bubble_explorer(P=4, m=8, schedule="1F1B", v=1) -> BubbleExplorer:
    """Return a :class:`BubbleExplorer`; display it in a notebook cell to use the sliders."""
    return BubbleExplorer(P=P, m=m, schedule=schedule, v=v)


class PipelineExplorer(_Explorer):
    """P and m sliders, schedule and partition dropdowns over a profile; shows the Gantt chart and metrics.

    Every change re-partitions and re-simulates (:func:`pipeswift_lab.simulation.sweeps.explore`);
    ``.partition``, ``.timeline`` and ``.result`` hold what is shown, and ``.error``
    the message when torch refuses the combination (e.g. 1F1B with m < P).
    """

    def __init__(self, profile=None, P=2, m=4, schedule="1F1B", method="balanced", calibration=None):
        import ipywidgets as w

        from ..partitioning.balance import METHODS
        from ..simulation.calibration import check_calibration

        self.calibration = check_calibration(calibration)

        if profile is None:
            from .. import models
            from ..profiling.measure import profile as measure

            setup = models.reference("gpt", batch_size=4)
            profile = measure(
                setup.model,
                setup.inputs,
                target=setup.targets,
                loss_fn=setup.loss_fn,
                warmup=1,
                repeats=3,
                progress=False,
            )
        self.profile = profile
        n_layers = len(profile.df)
        from ..core.vocabulary import canonical_schedule

        schedule = canonical_schedule(schedule)
        self._P = w.IntSlider(
            value=P,
            min=1,
            max=n_layers,
            description="P (ranks)",
            continuous_update=False,
            layout=w.Layout(width="420px"),
        )
        self._schedule = w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
        # only the m torch's schedule accepts for this P, on a track long enough to drag
        valid = valid_microbatches(P, schedule)
        self.note = "" if m in valid else _snap_note(m, _nearest(valid, m), P, schedule)
        self._m = w.SelectionSlider(options=valid, value=_nearest(valid, m), description="m (micro-batches)", continuous_update=False,
                                    style={"description_width": "initial"}, layout=w.Layout(width="520px"))  # fmt: skip
        self._method = w.Dropdown(options=list(METHODS), value=method, description="partition")
        self._numbers = w.HTML()
        self._figure = w.Output()
        self._syncing = False
        self._P.observe(lambda change: self._on_shape(), names="value")
        self._schedule.observe(lambda change: self._on_shape(), names="value")
        self._m.observe(lambda change: None if self._syncing else self._on_m(), names="value")
        self._method.observe(lambda change: self._update(), names="value")
        self.widget = w.VBox(
            [w.HBox([self._P, self._m]), w.HBox([self._schedule, self._method]), self._numbers, self._figure]
        )
        self.partition = self.timeline = None
        self.result: dict = {}
        self.error: str | None = None
        self._update()

    P = property(lambda self: self._P.value, lambda self, value: setattr(self._P, "value", value))
    schedule = property(lambda self: self._schedule.value, lambda self, value: setattr(self._schedule, "value", value))
    method = property(lambda self: self._method.value, lambda self, value: setattr(self._method, "value", value))

    @property
    def m(self) -> int:
        """The micro-batch count shown; setting one torch refuses for this P and schedule snaps to the nearest valid (see ``.note``)."""
        return self._m.value

    @m.setter
    def m(self, value):
        valid = list(self._m.options)
        self.note = "" if value in valid else _snap_note(value, _nearest(valid, value), self.P, self.schedule)
        if _nearest(valid, value) == self._m.value:
            self._update()  # same m: show the note
        else:
            self._keep_note = True
            self._m.value = _nearest(valid, value)

    def _on_m(self):
        if not getattr(self, "_keep_note", False):
            self.note = ""  # the user moved the slider: any earlier snap no longer applies
        self._keep_note = False
        self._update()

    def _on_shape(self):
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

    def _update(self):
        from ..simulation.calibration import whole_step_ms
        from ..simulation.sweeps import explore

        try:
            self.partition, self.timeline = explore(
                self.profile, self.P, self.m, self.schedule, method=self.method, calibration=self.calibration
            )
        except ValueError as error:
            self.partition = self.timeline = None
            self.error, self.result = str(error), {}
            self._numbers.value = f"<span style='color:#b00'>{html.escape(self.error)}</span>"
            self._figure.clear_output()
            return
        self.error = None
        tl, part = self.timeline, self.partition
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
        }
        r = self.result
        self._numbers.value = (
            (f"<i>{html.escape(self.note)}</i><br>" if self.note else "")
            + f"<b>{r['schedule']}</b> (v={r['v']}), {r['method']} split of P={r['P']}, m={r['m']}: "
            f"{'calibrated' if self.calibration is not None else 'simulated'} step "
            f"<b>{r['step_ms']:.4g} ms</b>, bubble_ratio <b>{r['bubble_ratio']:.3f}</b>, slowest stage "
            f"{r['bottleneck_ms']:.4g} ms, imbalance {r['imbalance']:.2f}"
        )
        self._draw()

    def _draw(self):
        self._redraw(self._figure, self.timeline.plot)


#: The largest micro-batch count the pipeline explorer offers (more when the schedule needs more).
M_MAX = 64


def valid_microbatches(P, schedule) -> list[int]:
    """The micro-batch counts ``m`` (1 … :data:`M_MAX`, or up to what the schedule needs) that torch's ``schedule`` accepts with ``P`` ranks."""
    from ..core.vocabulary import accepts, default_v

    out = []
    for m in range(1, max(M_MAX, 4 * P) + 1):
        if not accepts(P, m, schedule, default_v(schedule)):
            continue
        out.append(m)
        if m >= M_MAX and len(out) >= 8:
            break
    return out


def _nearest(valid, m) -> int:
    return min(valid, key=lambda k: (abs(k - m), k))


def _snap_note(asked, got, P, schedule) -> str:
    return f"m={asked} is not accepted by torch's {schedule} with P={P}; showing the nearest valid m={got}"


def pipeline_explorer(profile=None, P=2, m=4, schedule="1F1B", method="balanced", calibration=None) -> PipelineExplorer:
    """Return a :class:`PipelineExplorer` over ``profile`` (default: the reference GPT measured here).

    With a ``calibration`` (:func:`pipeswift_lab.fidelity.calibrator`) every configuration is simulated
    calibrated and ``step_ms`` is the whole predicted step (span plus the runtime's overhead).
    """
    return PipelineExplorer(profile, P=P, m=m, schedule=schedule, method=method, calibration=calibration)


def parse_availability(text: str) -> list[tuple[float, int]]:
    """Parse ``"0:16, 7200:32"`` into ``[(0.0, 16), (7200.0, 32)]`` (seconds from now : free GPUs)."""
    pairs = []
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        if ":" not in item:
            raise ValueError(f"availability item {item!r} is not 'seconds:gpus' (e.g. '0:16, 7200:32')")
        t, n = item.split(":", 1)
        try:
            pairs.append((float(t), int(n)))
        except ValueError:
            raise ValueError(
                f"availability item {item!r} is not 'seconds:gpus' with numbers (e.g. '0:16, 7200:32')"
            ) from None
    return pairs


class PlannerExplorer(_Explorer):
    """GPUs, global batch, steps and availability as controls; re-ranks the JCT plan on every change.

    ``.plan`` is the current :class:`~pipeswift_lab.planning.planner.Plan` (``None`` with ``.error``
    set when no configuration is feasible); other :func:`~pipeswift_lab.planning.planner.plan`
    arguments are fixed at construction through ``plan_kwargs``.
    """

    def __init__(self, profile, gpus=16, global_batch=64, steps=10_000, availability=None, **plan_kwargs):
        import ipywidgets as w

        self.profile, self.plan_kwargs = profile, {"progress": False, **plan_kwargs}
        text = ", ".join(f"{t:g}:{n}" for t, n in (availability or [(0, gpus)]))
        self._gpus = w.BoundedIntText(value=gpus, min=1, max=1_000_000, description="GPUs")
        self._batch = w.BoundedIntText(value=global_batch, min=1, max=10_000_000, description="global batch")
        self._steps = w.BoundedIntText(value=steps, min=1, max=10**9, description="steps")
        self._availability = w.Text(
            value=text, description="free GPUs", placeholder="seconds:gpus, e.g. 0:16, 7200:32", continuous_update=False
        )
        self._summary = w.HTML()
        self._output = w.Output()
        # with no availability given, "all GPUs free now" follows the GPUs control until the user edits it
        self._availability_follows_gpus = availability is None
        self._gpus.observe(self._on_gpus, names="value")
        for control in (self._batch, self._steps, self._availability):
            control.observe(self._on_change, names="value")
        self.widget = w.VBox(
            [w.HBox([self._gpus, self._batch, self._steps]), self._availability, self._summary, self._output]
        )
        self.plan = None
        self.error: str | None = None
        self._update()

    gpus = property(lambda self: self._gpus.value, lambda self, value: setattr(self._gpus, "value", value))
    global_batch = property(lambda self: self._batch.value, lambda self, value: setattr(self._batch, "value", value))
    steps = property(lambda self: self._steps.value, lambda self, value: setattr(self._steps, "value", value))

    @property
    def availability(self) -> list[tuple[float, int]]:
        """The availability the plan uses, parsed from the text box."""
        return parse_availability(self._availability.value)

    @availability.setter
    def availability(self, pairs):
        self._availability.value = ", ".join(f"{t:g}:{n}" for t, n in pairs)

    def _on_gpus(self, change):
        if self._availability_follows_gpus:
            self._following = True
            self._availability.value = f"0:{change['new']}"  # triggers the update
            self._following = False
            if self.plan is not None and self.plan.inputs["gpus"] == change["new"]:
                return
        self._update()

    def _on_change(self, change):
        if change["owner"] is self._availability and not getattr(self, "_following", False):
            self._availability_follows_gpus = False
        self._update()

    def _update(self):
        from ..planning.planner import plan

        try:
            self.plan = plan(
                self.profile,
                self.gpus,
                self.global_batch,
                self.steps,
                availability=self.availability,
                **self.plan_kwargs,
            )
            self.error = None
        except (ValueError, TypeError) as error:
            self.plan, self.error = None, str(error)
            self._summary.value = f"<pre style='color:#b00'>{html.escape(self.error)}</pre>"
            self._output.clear_output()
            return
        self._summary.value = f"<p>{html.escape(self.plan.explain())}</p>"
        self._draw()

    def _draw(self):
        from IPython.display import display

        columns = [
            "strategy",
            "P",
            "D",
            "m",
            "microbatch_size",
            "schedule",
            "v",
            "total_s",
            "queue_s",
            "training_s",
            "step_ms",
            "bubble_ratio",
        ]
        columns[8:8] = [c for c in self.plan.table.columns if c.startswith("total_s_p")]

        def draw():
            display(self.plan.top(5)[columns])
            self.plan.plot()

        self._redraw(self._output, draw)


def planner_explorer(
    profile, gpus=16, global_batch=64, steps=10_000, availability=None, **plan_kwargs
) -> PlannerExplorer:
    """Return a :class:`PlannerExplorer`: the JCT plan of ``profile``, re-ranked live as GPUs, batch, steps or availability change.

    ``plan_kwargs`` go to :func:`~pipeswift_lab.planning.planner.plan`, e.g. ``calibration=cal``,
    ``quantile=0.95`` or ``objective="p95"``.
    """
    return PlannerExplorer(
        profile, gpus=gpus, global_batch=global_batch, steps=steps, availability=availability, **plan_kwargs
    )
