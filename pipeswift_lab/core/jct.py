"""Job completion time (JCT) and its terms.

JCT is what a training job is judged on: the time from submission until the job is
done, ``queue + assembly + training + cleanup + preemption loss``. Throughput and
bubble ratio only speak to the training term.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import pandas as pd

from .checks import check_choice, check_time
from .display import html_card, text_card

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: JCT terms in the order they happen, with their column names.
TERMS: tuple[str, ...] = ("queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s")


@dataclass(frozen=True)
class JCT:
    """One job's completion time, broken into terms, all in seconds.

    * ``queue_s`` — waiting for the GPUs;
    * ``assembly_s`` — from start to the first training step: processes, rendezvous,
      process groups, model and stage build (a checkpoint's restore is not in it);
    * ``training_s`` — the training steps;
    * ``cleanup_s`` — the final checkpoint and teardown;
    * ``preemption_loss_s`` — time lost to preemptions: the periodic checkpoints' stalls,
      work redone, recoveries, and every restore, a resumed job's first one included (it is
      paid only because the job was stopped). The runner, the planner and the cluster
      simulator all book a restore here.
    """

    queue_s: float = 0.0
    assembly_s: float = 0.0
    training_s: float = 0.0
    cleanup_s: float = 0.0
    preemption_loss_s: float = 0.0
    label: str = "job"

    def __post_init__(self) -> None:
        for term in TERMS:
            object.__setattr__(self, term, check_time(term, getattr(self, term)))
        if not isinstance(self.label, str):
            raise TypeError(f"label must be a str; got {type(self.label).__name__} {self.label!r}")

    @property
    def total_s(self) -> float:
        """Sum of all terms."""
        return sum(getattr(self, term) for term in TERMS)

    @property
    def fractions(self) -> dict[str, float]:
        """Each term's share of ``total_s`` (all zeros for an empty JCT)."""
        total = self.total_s
        return {term: (getattr(self, term) / total if total else 0.0) for term in TERMS}

    @property
    def df(self) -> pd.DataFrame:
        """One row per term: ``term``, ``seconds``, ``fraction``."""
        fractions = self.fractions
        return pd.DataFrame(
            {
                "term": list(TERMS),
                "seconds": [getattr(self, t) for t in TERMS],
                "fraction": [fractions[t] for t in TERMS],
            }
        )

    def as_row(self) -> dict[str, Any]:
        """The terms and ``total_s`` as a flat dict, with ``label``."""
        return {"label": self.label, **{t: getattr(self, t) for t in TERMS}, "total_s": self.total_s}

    def replace(self, **changes: Any) -> JCT:
        """A copy with some terms changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return JCT(**values)

    @staticmethod
    def table(*jcts: JCT) -> pd.DataFrame:
        """One row per JCT: ``label``, every term and ``total_s``."""
        if not jcts:
            raise ValueError("JCT.table needs at least one JCT")
        for j in jcts:
            if not isinstance(j, JCT):
                raise TypeError(f"JCT.table takes JCT objects; got {type(j).__name__}")
        return pd.DataFrame([j.as_row() for j in jcts])

    @staticmethod
    def compare(*jcts: JCT) -> pd.DataFrame:
        """Differences of each JCT from the first: one row per term plus ``total_s``.

        Columns: one per JCT label with its seconds, then ``<label> - <first label>``
        for each later JCT. Labels must be distinct.
        """
        if len(jcts) < 2:
            raise ValueError(f"JCT.compare needs at least two JCTs; got {len(jcts)}")
        table = JCT.table(*jcts)
        labels = list(table["label"])
        if len(set(labels)) != len(labels):
            raise ValueError(f"JCT labels must be distinct to compare them; got {labels}")
        out = table.set_index("label").T
        out.index.name = "term"
        base = labels[0]
        for label in labels[1:]:
            out[f"{label} - {base}"] = out[label] - out[base]
        out.columns.name = None
        return out.reset_index()

    @staticmethod
    def plot_many(jcts: Iterable[JCT], ax: Axes | None = None, unit: str = "h") -> Axes:
        """Stacked horizontal bars, one per JCT, one color per term. Returns the Axes."""
        from .plot import get_ax

        jcts = list(jcts)
        scale = {"s": 1.0, "min": 60.0, "h": 3600.0}
        unit = check_choice("unit", unit, scale)
        table = JCT.table(*jcts)
        ax = get_ax(ax, figsize=(7.0, 0.6 + 0.5 * len(jcts)))
        import seaborn as sns

        colors = sns.color_palette("deep", len(TERMS))
        left = [0.0] * len(jcts)
        for term, color in zip(TERMS, colors):
            widths = (table[term] / scale[unit]).tolist()
            ax.barh(table["label"], widths, left=left, color=color, label=term.removesuffix("_s"))
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel(f"job completion time ({unit})")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
        return ax

    def plot(self, *others: JCT, ax: Axes | None = None, unit: str = "h") -> Axes:
        """Stacked bar of this JCT's terms, with ``others`` side by side. Returns the Axes."""
        return JCT.plot_many((self, *others), ax=ax, unit=unit)

    def _summary(self) -> dict[str, float]:
        return {"total_s": self.total_s, **{t: getattr(self, t) for t in TERMS}}

    def _repr_html_(self) -> str:
        return html_card(f"JCT {self.label}: {self.total_s / 3600:.3g} h", self._summary(), self.df)

    def __str__(self) -> str:
        return text_card(f"JCT {self.label}", self._summary())


__all__ = ["JCT", "TERMS"]
