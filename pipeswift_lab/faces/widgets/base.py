"""What every explorer shares: it shows as its ``widget``, redraws into an Output area and exposes its controls'
values as properties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Explorer", "value_property"]


def value_property(attribute: str, doc: str) -> property:
    """A property that reads and sets the ``value`` of the control stored at ``self.<attribute>``."""
    return property(
        lambda self: getattr(self, attribute).value,
        lambda self, value: setattr(getattr(self, attribute), "value", value),
        doc=doc,
    )


class Explorer:
    """What every explorer shares: it displays as its ``widget`` and redraws into an Output area."""

    widget: Any

    def _show(self, rows: list[Any]) -> None:
        """Lay out ``rows`` (controls and output areas) one under another as the ``widget``; then draw the first
        state."""
        import ipywidgets as w

        self.widget = w.VBox(rows)
        self._update()

    def _update(self) -> None:
        """Recompute from the controls' values and redraw (each explorer's own)."""
        raise NotImplementedError

    @staticmethod
    def _redraw(output: Any, draw: Callable[[], object]) -> None:
        """Clear ``output`` and show what ``draw()`` plots (and displays) there."""
        import matplotlib.pyplot as plt

        output.clear_output(wait=True)
        with output:
            draw()
            plt.show()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
