"""The bubble explorer: the closed-form bubble of a schedule against m, in either convention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core import analytic
from ...core.checks import check_choice
from ...core.vocabulary import SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, check_schedule_v
from .base import Explorer, value_property

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["BUBBLE_CONVENTIONS", "BubbleExplorer", "bubble_explorer", "plot_bubble_curve"]

#: The two bubble conventions :func:`plot_bubble_curve` draws, and what each measures.
BUBBLE_CONVENTIONS = {"ratio": "idle share of the step", "overhead": "bubble over compute"}


class BubbleExplorer(Explorer):
    """Sliders for P and m, a schedule dropdown and a v slider, redrawing the bubble curve.

    ``.result`` holds the numbers for the current setting: both bubble conventions and
    the in-flight micro-batches of the first rank (the activation-memory multiplier).
    """

    def __init__(
        self, P: int = 4, m: int = 8, schedule: str = "1F1B", v: int = 1, max_P: int = 32, max_m: int = 128
    ) -> None:
        import ipywidgets as w

        schedule, v = check_schedule_v(schedule, v)
        wide = {"description_width": "initial"}
        self._P = w.IntSlider(value=P, min=1, max=max_P, description="P (ranks)", continuous_update=False)
        self._m = w.IntSlider(
            value=m, min=1, max=max_m, description="m (micro-batches)", continuous_update=False, style=wide
        )
        self._schedule = w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
        self._v = w.IntSlider(value=v, min=1, max=8, description="v (chunks/rank)", continuous_update=False, style=wide)
        self._numbers = w.HTML()
        self._figure = w.Output()
        for control in (self._P, self._m, self._schedule, self._v):
            control.observe(self._on_change, names="value")
        self.result: dict[str, Any] = {}
        self._sync_v()
        self._show([w.HBox([self._P, self._m]), w.HBox([self._schedule, self._v]), self._numbers, self._figure])

    # Readable state: what the sliders say now.
    P = value_property("_P", "The number of ranks (pipeline stages) the slider shows.")
    m = value_property("_m", "The number of micro-batches per step the slider shows.")
    schedule = value_property("_schedule", "The schedule chosen in the dropdown.")
    v = value_property("_v", "The chunks per rank the slider shows (pinned by single-chunk and V-shape schedules).")

    def _sync_v(self) -> None:
        """Pin ``v`` where the schedule fixes it: 1 for single-stage schedules, 2 for V shapes."""
        if self.schedule in SINGLE_CHUNK_SCHEDULES:
            self._v.value, self._v.disabled = 1, True
        elif self.schedule in V_SHAPE_SCHEDULES:
            self._v.value, self._v.disabled = 2, True
        else:
            self._v.disabled = False

    def _on_change(self, change: dict[str, Any]) -> None:
        if change["owner"] is self._schedule:
            self._sync_v()
        self._update()

    def _update(self) -> None:
        P, m, schedule, v = self.P, self.m, self.schedule, self.v
        self.result = analytic.bubble_summary(P, m, schedule, v=v)
        r = self.result
        self._numbers.value = (
            f"<b>{schedule}</b>, P={P}, m={m}, v={v}: idle share of the step (bubble_ratio) "
            f"<b>{r['bubble_ratio']:.3f}</b>; bubble over compute (bubble_overhead) "
            f"<b>{r['bubble_overhead']:.3f}</b>; rank 0 holds <b>{r['inflight_rank0']:g}</b> micro-batches of "
            "activations."
        )
        self._draw()

    def _draw(self) -> None:
        def draw() -> None:
            ax = plot_bubble_curve([self.P], schedule=self.schedule, v=self.v, m_max=max(64, 2 * self.m))
            ax.scatter([self.m], [self.result["bubble_ratio"]], color="black", zorder=5, label=f"m={self.m}")
            ax.legend(fontsize="small")

        self._redraw(self._figure, draw)


def plot_bubble_curve(
    Ps: Sequence[int] = (2, 4, 8, 16),
    schedule: str = "1F1B",
    v: int = 1,
    m_max: int = 64,
    convention: str = "ratio",
    ax: Axes | None = None,
) -> Axes:
    """Bubble against m (1 … ``m_max``) for each P in ``Ps``; ``convention`` is "ratio" (the idle share of the step)
    or "overhead" (bubble over compute), see :data:`BUBBLE_CONVENTIONS`. Returns the Axes.

    Only the ``m`` torch's schedule accepts are drawn (1F1B needs ``m >= P``).
    """
    from ...core.plot import get_ax
    from ...core.vocabulary import accepts

    convention = check_choice("convention", convention, BUBBLE_CONVENTIONS)
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


def bubble_explorer(P: int = 4, m: int = 8, schedule: str = "1F1B", v: int = 1) -> BubbleExplorer:
    """Return a :class:`BubbleExplorer`; display it in a notebook cell to use the sliders."""
    return BubbleExplorer(P=P, m=m, schedule=schedule, v=v)
