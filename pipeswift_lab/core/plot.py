"""Shared drawing helpers: every plot takes ``ax=`` and returns the matplotlib Axes.

matplotlib and seaborn are imported here, inside functions, so that
``import pipeswift_lab`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Colors by action kind, shared by every Gantt chart and legend.
KIND_COLORS: dict[str, str] = {
    "F": "#4C72B0",  # forward
    "B": "#DD8452",  # full backward
    "I": "#C44E52",  # input-grad
    "W": "#55A868",  # weight-grad
    "SEND_F": "#8172B3",
    "RECV_F": "#8172B3",
    "SEND_B": "#937860",
    "RECV_B": "#937860",
    "REDUCE_GRAD": "#DA8BC3",  # gradient all-reduce across replicas
    "UNSHARD": "#8C8C8C",  # FSDP's all-gather of a stage's parameters
}


def get_ax(ax: Axes | None = None, figsize: tuple[float, float] = (7.0, 3.5)) -> Axes:
    """Return ``ax``, or a new Axes on a new figure in seaborn's style when ``ax`` is None."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    if ax is not None:
        return ax
    sns.set_theme(style="whitegrid", context="notebook")
    _, ax = plt.subplots(figsize=figsize)
    return ax


def figure_to_data_uri(fig: Figure) -> str:
    """Encode a matplotlib figure as an inline PNG ``data:`` URI (for the self-contained HTML report)."""
    import base64
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


__all__ = ["figure_to_data_uri", "get_ax", "KIND_COLORS"]
