"""Rich notebook display shared by every result type: a short summary over a table."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd


def format_value(value: Any) -> str:
    """Human-readable form of a summary value (floats to 4 significant digits)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def html_card(title: str, summary: Mapping[str, Any], df: pd.DataFrame | None = None, max_rows: int = 20) -> str:
    """Return HTML with ``title``, the ``summary`` key/value pairs and the first ``max_rows`` rows of ``df``."""
    cell = "style='text-align:left'"
    items = "".join(
        f"<tr><th {cell}>{html.escape(str(k))}</th><td {cell}>{html.escape(format_value(v))}</td></tr>"
        for k, v in summary.items()
    )
    out = [f"<div class='pipeswift'><strong>{html.escape(title)}</strong>", f"<table>{items}</table>"]
    if df is not None:
        shown = df.head(max_rows)
        out.append(shown.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0))
        if len(df) > max_rows:
            out.append(f"<em>… {len(df) - max_rows} more rows; see <code>.df</code></em>")
    out.append("</div>")
    return "\n".join(out)


#: The one noise rule (profile card, report, notebooks): a step whose coefficient of variation
#: (std / mean over repeats or steps) exceeds this is too noisy to trust a prediction or an error to better than it.
NOISE_CV = 0.10


def noise_note(cv: float, what: str = "the step") -> str:
    """The noise warning as text when ``cv`` exceeds :data:`NOISE_CV` (else ``""``): what varied, by how much, and
    what to do."""
    if not (cv > NOISE_CV):  # NaN: nothing measured, nothing to warn about
        return ""
    return (
        f"Noisy machine: {what} varied by {cv:.0%} (std / mean; the rule is {NOISE_CV:.0%}), so predictions built "
        f"on it and their errors against measured runs are that uncertain. Run with nothing else on the machine, "
        f"pin threads (torch.set_num_threads), take more repeats or steps, and compare medians."
    )


def noise_warning(cv: float, what: str = "the step") -> str:
    """:func:`noise_note` as an HTML paragraph (``""`` when quiet)."""
    note = noise_note(cv, what)
    if not note:
        return ""
    head, rest = note.split(": ", 1)
    return f"<p><strong>{html.escape(head)}:</strong> {html.escape(rest)}</p>"


def text_card(title: str, summary: Mapping[str, Any]) -> str:
    """Plain-text form of :func:`html_card`'s summary, for ``__repr__`` and the CLI."""
    width = max((len(str(k)) for k in summary), default=0)
    lines = [title] + [f"  {str(k).ljust(width)}  {format_value(v)}" for k, v in summary.items()]
    return "\n".join(lines)


def hours(seconds: float) -> str:
    """A duration as people read it: ``1.67 h``, ``12.5 min``, ``42 s``, or ``never``."""
    if seconds == math.inf:
        return "never"
    if abs(seconds) >= 3600:
        return f"{seconds / 3600:.2f} h"
    if abs(seconds) >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def distinct_hours(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as :func:`hours` writes them, with more digits until two different values read differently."""
    text_a, text_b = hours(a), hours(b)
    if a == b or text_a != text_b or math.inf in (a, b):
        return text_a, text_b
    unit, scale = (" h", 3600) if abs(b) >= 3600 else (" min", 60) if abs(b) >= 60 else (" s", 1)
    for digits in range(3, 16):
        text_a, text_b = f"{a / scale:.{digits}f}{unit}", f"{b / scale:.{digits}f}{unit}"
        if text_a != text_b:
            break
    return text_a, text_b


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when the message is empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "distinct_hours",
    "first_line",
    "format_value",
    "hours",
    "html_card",
    "NOISE_CV",
    "noise_note",
    "noise_warning",
    "text_card",
]
