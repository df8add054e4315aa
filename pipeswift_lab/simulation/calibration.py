"""The calibration the simulator applies: fitted costs of the runtime, the transfers and co-running ranks.

:func:`~pipeswift_lab.fidelity.calibrate` fits it on measured runs; :func:`~pipeswift_lab.simulation.simulate`,
:func:`~pipeswift_lab.simulation.sweep` and the planner take it as ``calibration=``. A calibrated simulation runs each
action for ``scale[P] * profiled + action_ms + gap_ms * gap_scale[P]`` (no gap for ``W``), adds the loss terms on the
last stage, and the runtime's ``step_overhead_ms`` to the span (:func:`whole_step_ms`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from ..core.display import html_card, text_card
from ..core.schedule import Schedule, ScheduleLike
from ..core.vocabulary import MULTI_CHUNK_SCHEDULES, canonical_schedule
from .schema import jsonable

if TYPE_CHECKING:
    from .timeline import Timeline


#: A subclass of SimulatorCalibration (what ``load`` returns when called on one).
C = TypeVar("C", bound="SimulatorCalibration")

#: Per-kind per-stage durations ``(fwd, bwd, igrad, wgrad)``, one sequence per kind with one entry per stage.
Durations = tuple[Sequence[float], ...]

#: Runtime kinds with a per-step overhead of their own.
RUNTIMES = ("single-chunk", "multi-chunk")
_FORMAT = "pipeswift_lab.calibration/1"


def runtime_of(schedule: ScheduleLike) -> str:
    """``"multi-chunk"`` for schedules torch runs with ``_PipelineScheduleRuntime``, ``"single-chunk"`` for GPipe and
    1F1B."""
    if isinstance(schedule, Schedule):  # a user's order runs on _PipelineScheduleRuntime
        return "multi-chunk"
    return "multi-chunk" if canonical_schedule(schedule) in MULTI_CHUNK_SCHEDULES else "single-chunk"


def whole_step_ms(timeline: Timeline) -> float:
    """A simulated Timeline's whole step (ms): its action span plus ``meta["step_overhead_ms"]`` (0 without a
    calibration)."""
    return float(timeline.step_ms) + float(timeline.meta.get("step_overhead_ms", 0.0) or 0.0)


def check_calibration(calibration: Any) -> SimulatorCalibration | None:
    """Return ``calibration`` if it is a :class:`Calibration` or None; raise ``TypeError`` otherwise."""
    if calibration is not None and not isinstance(calibration, SimulatorCalibration):
        raise TypeError(
            "calibration must be a Calibration (from psl.calibrate(runs, profile)) or None; "
            f"got {type(calibration).__name__}"
        )
    return calibration


@dataclass(frozen=True, repr=False, kw_only=True)
class SimulatorCalibration:
    """The fitted parameters (see :mod:`pipeswift_lab.fidelity.calibrator`) and the profile they apply to: what
    :func:`~pipeswift_lab.simulation.simulate` applies. :func:`~pipeswift_lab.fidelity.calibrate` returns the
    subclass :class:`~pipeswift_lab.fidelity.Calibration`, which adds the error tables.

    ``df`` lists every parameter: ``parameter``, ``value``, ``unit``, ``how`` (how it was
    fitted, from how many samples, or why it kept its default).
    """

    compute_scale: dict[int, float]
    """Number of co-running ranks P -> measured / profiled action time."""
    action_ms: float
    """Fixed cost inside every action, ms."""
    loss_ms: tuple[float, float]
    """(forward, backward) extra ms of the last stage: the loss, which the profile does not time."""
    gap: dict[str, float]
    """Runtime kind (:data:`RUNTIMES`) -> ms between consecutive actions of a rank."""
    step_overhead: dict[str, float]
    """Runtime kind -> ms a step spends outside its action span."""
    latency_ms: float
    """Per transfer, ms."""
    bandwidth_GBps: float
    """GB/s of a transfer; inf when not fitted (transfers take ``latency_ms`` only)."""
    step_cv: float
    """Coefficient of variation of the step after warm-up (nan when not fitted)."""
    how: dict[str, str] = field(default_factory=dict, compare=False)
    """Parameter -> how it was fitted (default: empty)."""
    profile_table: pd.DataFrame | None = field(default=None, compare=False)
    """Per-layer profile the runs were predicted from (default None)."""
    profile_batch_size: int | None = None
    """Micro-batch size of that profile (None: use it as is)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Runs fitted on (their keys, ``"runs"``), model fingerprint (``"model"``)."""
    gap_scale: dict[int, float] = field(default_factory=dict)
    """P -> factor on ``gap_ms`` (1 at the smallest fitted P; none given: 1)."""

    # ------------------------------------------------------------------ applying it
    def scale(self, P: int) -> float:
        """The compute scale for ``P`` co-running ranks: the fitted one, else that of the nearest fitted P (ties: the
        larger)."""
        return float(self.compute_scale[_nearest(self.compute_scale, P)])

    def gap_ms(self, schedule: ScheduleLike, P: int | None = None) -> float:
        """Calibrated ms between consecutive actions of a rank under ``schedule``'s runtime with ``P`` ranks (0 when
        not fitted).

        ``gap_ms[runtime] * gap_scale[P]``, the scale of the nearest fitted P (ties: the larger); 1 without ``P``.
        """
        value = self.gap.get(runtime_of(schedule), math.nan)
        if not math.isfinite(value):
            return 0.0
        if P is None or not self.gap_scale:
            return float(value)
        return float(value) * float(self.gap_scale[_nearest(self.gap_scale, P)])

    def action_durations(self, durations: Durations, P: int, schedule: ScheduleLike) -> tuple[list[float], ...]:
        """Per-kind per-stage durations ``(fwd, bwd, igrad, wgrad)`` as a calibrated run of ``P`` ranks under
        ``schedule`` takes them."""
        s, gap = self.scale(P), self.gap_ms(schedule, P)
        # the runtime's gap comes with the actions that communicate (F, B, I send or receive); a W follows its I locally
        out = [
            [s * d + self.action_ms + (gap if code < 3 else 0.0) for d in kind] for code, kind in enumerate(durations)
        ]
        loss_f, loss_b = self.loss_ms
        out[0][-1] += loss_f
        out[1][-1] += loss_b
        out[2][-1] += loss_b
        return tuple(out)

    def transfer_ms(self, nbytes: Sequence[float]) -> list[float]:
        """Calibrated ms of a transfer of each boundary's ``nbytes``: ``latency_ms + bytes / bandwidth``."""
        bw = self.bandwidth_GBps
        return [self.latency_ms + (0.0 if not math.isfinite(bw) else float(b) / (bw * 1e6)) for b in nbytes]

    def step_overhead_ms(self, schedule: ScheduleLike) -> float:
        """Calibrated per-step overhead of ``schedule``'s runtime (0 when that runtime was not fitted)."""
        value = self.step_overhead.get(runtime_of(schedule), math.nan)
        return 0.0 if not math.isfinite(value) else float(value)

    @property
    def label(self) -> str:
        """``calibrated on N runs``."""
        return f"calibrated on {len(self.meta.get('runs', ()))} runs"

    # ------------------------------------------------------------------ tables
    @property
    def df(self) -> pd.DataFrame:
        """Every parameter: ``parameter``, ``value``, ``unit``, ``how``."""
        rows = [(f"compute_scale[P={P}]", v, "x profiled") for P, v in sorted(self.compute_scale.items())]
        rows += [
            ("action_ms", self.action_ms, "ms per action"),
            ("loss_fwd_ms", self.loss_ms[0], "ms per last-stage F"),
            ("loss_bwd_ms", self.loss_ms[1], "ms per last-stage B or I"),
        ]
        rows += [(f"gap_ms[{k}]", self.gap.get(k, math.nan), "ms per action") for k in RUNTIMES]
        rows += [(f"gap_scale[P={P}]", v, "x gap_ms") for P, v in sorted(self.gap_scale.items())]
        rows += [(f"step_overhead_ms[{k}]", self.step_overhead.get(k, math.nan), "ms per step") for k in RUNTIMES]
        rows += [
            ("latency_ms", self.latency_ms, "ms per transfer"),
            ("bandwidth_GBps", self.bandwidth_GBps, "GB/s"),
            ("step_cv", self.step_cv, "std / mean of the step"),
        ]
        return pd.DataFrame(
            [{"parameter": p, "value": float(v), "unit": u, "how": self.how.get(p, "")} for p, v, u in rows]
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | PathLike[str]) -> str:
        """Write the calibration (parameters, how, the profile table) as JSON to ``path``; return the path."""
        data = {
            "format": _FORMAT,
            "compute_scale": {str(k): v for k, v in self.compute_scale.items()},
            "action_ms": self.action_ms,
            "loss_ms": list(self.loss_ms),
            "gap": dict(self.gap),
            "gap_scale": {str(k): v for k, v in self.gap_scale.items()},
            "step_overhead": dict(self.step_overhead),
            "latency_ms": self.latency_ms,
            "bandwidth_GBps": self.bandwidth_GBps,
            "step_cv": self.step_cv,
            "how": dict(self.how),
            "profile_table": None if self.profile_table is None else self.profile_table.to_dict(orient="list"),
            "profile_batch_size": self.profile_batch_size,
            "meta": jsonable(self.meta),
        }
        Path(path).write_text(json.dumps(data, indent=1), encoding="utf-8")
        return str(path)

    @classmethod
    def load(cls: type[C], path: str | PathLike[str]) -> C:
        """Read a calibration written by :meth:`save`."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{str(path)!r} is not a pipeswift_lab calibration (format {_FORMAT!r})")
        meta = dict(data["meta"])
        meta["runs"] = tuple(_tuples(k) for k in meta.get("runs", ()))
        if "model" in meta:
            meta["model"] = _tuples(meta["model"])
        table = None if data["profile_table"] is None else pd.DataFrame(data["profile_table"])
        loss_fwd, loss_bwd = (float(x) for x in data["loss_ms"])
        return cls(
            compute_scale={int(k): float(v) for k, v in data["compute_scale"].items()},
            action_ms=float(data["action_ms"]),
            loss_ms=(loss_fwd, loss_bwd),
            gap={k: float(v) for k, v in data["gap"].items()},
            step_overhead={k: float(v) for k, v in data["step_overhead"].items()},
            latency_ms=float(data["latency_ms"]),
            bandwidth_GBps=float(data["bandwidth_GBps"]),
            step_cv=float(data["step_cv"]),
            how=dict(data["how"]),
            profile_table=table,
            profile_batch_size=data["profile_batch_size"],
            meta=meta,
            gap_scale={int(k): float(v) for k, v in data.get("gap_scale", {}).items()},
        )

    # ------------------------------------------------------------------ display
    def _summary(self) -> dict[str, Any]:
        scales = ", ".join(f"P={P}: {v:.3g}x" for P, v in sorted(self.compute_scale.items()))
        return {
            "runs": len(self.meta.get("runs", ())),
            "compute_scale": scales,
            "action_ms": self.action_ms,
            "gap_ms": ", ".join(f"{k} {v:.3g}" for k, v in self.gap.items()),
            "gap_scale": ", ".join(f"P={P}: {v:.3g}x" for P, v in sorted(self.gap_scale.items())),
            "step_overhead_ms": ", ".join(f"{k} {v:.3g}" for k, v in self.step_overhead.items()),
            "latency_ms": self.latency_ms,
            "step_cv": self.step_cv,
        }

    def _repr_html_(self) -> str:
        return html_card(f"Calibration ({self.label})", self._summary(), self.df)

    def __str__(self) -> str:
        return text_card(f"Calibration ({self.label})", self._summary())

    __repr__ = __str__


def _nearest(fitted: dict[int, float], P: int) -> int:
    """``P`` when fitted, else the nearest fitted P (ties: the larger)."""
    return P if P in fitted else min(fitted, key=lambda k: (abs(k - P), -k))


def _tuples(value: Any) -> Any:
    """JSON lists back to (nested) tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


__all__ = ["RUNTIMES", "SimulatorCalibration", "check_calibration", "runtime_of", "whole_step_ms"]
