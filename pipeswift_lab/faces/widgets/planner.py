"""The planner explorer: the JCT plan of a profile, re-ranked as GPUs, batch, steps or availability change."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .base import Explorer, value_property

if TYPE_CHECKING:
    from ...planning.planner import Plan
    from ...profiling.table import Profile

__all__ = ["PlannerExplorer", "parse_availability", "planner_explorer"]


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


class PlannerExplorer(Explorer):
    """GPUs, global batch, steps and availability as controls; re-ranks the JCT plan on every change.

    ``.plan`` is the current :class:`~pipeswift_lab.planning.planner.Plan` (``None`` with ``.error``
    set when no configuration is feasible); other :func:`~pipeswift_lab.planning.planner.plan`
    arguments are fixed at construction through ``plan_kwargs``.
    """

    def __init__(
        self,
        profile: Profile,
        gpus: int = 16,
        global_batch: int = 64,
        steps: int = 10_000,
        availability: Sequence[tuple[float, int]] | None = None,
        **plan_kwargs: Any,
    ) -> None:
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
        self._following = False
        self._gpus.observe(self._on_gpus, names="value")
        for control in (self._batch, self._steps, self._availability):
            control.observe(self._on_change, names="value")
        self.plan: Plan | None = None
        self.error: str | None = None
        self._show([w.HBox([self._gpus, self._batch, self._steps]), self._availability, self._summary, self._output])

    gpus = value_property("_gpus", "The GPUs of the cluster, as the control shows.")
    global_batch = value_property("_batch", "The global batch (samples per step), as the control shows.")
    steps = value_property("_steps", "The training steps of the job, as the control shows.")

    @property
    def availability(self) -> list[tuple[float, int]]:
        """The availability the plan uses, parsed from the text box."""
        return parse_availability(self._availability.value)

    @availability.setter
    def availability(self, pairs: Sequence[tuple[float, int]]) -> None:
        self._availability.value = ", ".join(f"{t:g}:{n}" for t, n in pairs)

    def _on_gpus(self, change: dict[str, Any]) -> None:
        if self._availability_follows_gpus:
            self._following = True
            self._availability.value = f"0:{change['new']}"  # triggers the update
            self._following = False
            if self.plan is not None and self.plan.inputs["gpus"] == change["new"]:
                return
        self._update()

    def _on_change(self, change: dict[str, Any]) -> None:
        if change["owner"] is self._availability and not self._following:
            self._availability_follows_gpus = False
        self._update()

    def _update(self) -> None:
        from ...planning.planner import plan

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
        self._draw(self.plan)

    def _draw(self, shown: Plan) -> None:
        from IPython.display import display

        columns = [
            "strategy",
            "change",
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
        at = columns.index("total_s") + 1
        columns[at:at] = [c for c in shown.table.columns if c.startswith("total_s_p")]

        def draw() -> None:
            display(shown.top(5)[columns])
            shown.plot()

        self._redraw(self._output, draw)


#: ``planner_explorer(profile, gpus=16, global_batch=64, steps=10_000, availability=None, **plan_kwargs)`` returns a
#: :class:`PlannerExplorer`: the JCT plan of ``profile``, re-ranked live as GPUs, batch, steps or availability change;
#: ``plan_kwargs`` go to :func:`~pipeswift_lab.planning.planner.plan`, e.g. ``calibration=cal``, ``objective="p95"``.
planner_explorer = PlannerExplorer
