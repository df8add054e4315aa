"""Collectives calibrated apart from compute: the link of the backend that ran a run's collectives, fitted on its
measured collective actions (:func:`calibrate_links`; :func:`~pipeswift_lab.fidelity.calibrate` keeps it as
``Calibration.links``).

A CPU run's collectives ride gloo, whose algorithms are not NCCL's (gloo's reduce-scatter costs an all-reduce) and
whose costs on one machine's memory say nothing of a GPU network. So a CPU run's collectives are fitted on a link of
their own, in gloo's shape (:func:`~pipeswift_lab.core.topology.collective_shape`); a calibrated prediction for gloo
prices collectives with it (:func:`links_ms`), while predictions for NCCL keep the ring formulas on the Topology's
links.

Samples (:func:`collective_samples`): every collective action of the runs' steps after the first that carries its
bytes (the timeline's ``bytes`` column, the whole buffer the collective moved), with the run's ``backend`` and the
mesh dimension it ran over (``dim``, as :meth:`~pipeswift_lab.core.topology.Topology.link_of` names them):

* ``TP_ALL_REDUCE``, ``TP_ALL_GATHER``, ``TP_REDUCE_SCATTER``, ``TP_ALL_TO_ALL``: the collective it names, over the
  ``tp`` ranks;
* ``UNSHARD``: an all-gather over the ``fsdp`` ranks (FSDP2 gathers each of the stage's parameter groups, and copies
  them out, in the one action: its fitted latency is per action);
* ``REDUCE_GRAD``: FSDP's reduce-scatter over the ``fsdp`` ranks (``D == 1``), or DDP's all-reduce over the ``D``
  replicas (``dp``, ``fsdp == tp == 1``); HSDP's, a reduce-scatter and then an all-reduce in one action, is left out.

A collective's time runs from its issue on the process the timeline keeps (each pipeline rank's first tensor-parallel
and FSDP rank) to its completion, so it includes waiting for the group's last process to arrive, as that process's
runtime lives it.

Fit (:func:`fit_links`): per (backend, dim, collective), Hockney's alpha-beta model in the backend's shape,
``ms = steps · latency_ms + factor · bytes / bandwidth``, by least squares over the samples when the bytes each step
moves spread (the largest more than 10% above the smallest), kept physical (a negative latency is refitted through
the origin); where they do not spread, or the time does not grow with them (latency-bound collectives, noise), the
latency alone: the median of ``ms / steps``, with an infinite bandwidth. One more link is fitted over all the
collectives of each dim that ran several (``collective == "all"``) and over all of the backend's (``dim ==
collective == "all"``), which price a collective the runs did not measure (:func:`links_ms`). ``median_ratio`` is the
median predicted / measured over the row's samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..core.link import Link
from ..core.topology import DEFAULT_INTRA_NODE_LINK, Topology, collective_ms, collective_shape
from ..core.vocabulary import TP_COLLECTIVE
from .measurements import Run, steady_steps

__all__ = [
    "COLLECTIVE_KINDS",
    "LINK_COLUMNS",
    "SAMPLE_COLUMNS",
    "calibrate_links",
    "collective_error",
    "collective_samples",
    "empty_links",
    "fit_links",
    "link_of",
    "links_ms",
]

#: The timeline kinds measured as collectives.
COLLECTIVE_KINDS = (*TP_COLLECTIVE, "UNSHARD", "REDUCE_GRAD")
#: Columns of :func:`collective_samples`.
SAMPLE_COLUMNS = ("run", "backend", "kind", "dim", "collective", "n", "bytes", "ms")
#: Columns of the fitted links (:func:`fit_links`, ``Calibration.links``).
LINK_COLUMNS = (
    "backend",
    "dim",
    "collective",
    "latency_ms",
    "bandwidth_GBps",
    "samples",
    "sizes",
    "median_ratio",
    "how",
)
#: The text columns of the samples and the links.
_TEXT = ("backend", "kind", "dim", "collective", "how")
#: Least spread of the sizes (largest over smallest, less 1) that tells latency from bandwidth.
MIN_SPREAD = 0.1


def empty_links() -> pd.DataFrame:
    """A links table with no row (:data:`LINK_COLUMNS`)."""
    return pd.DataFrame({c: pd.Series(dtype=object if c in _TEXT else float) for c in LINK_COLUMNS})


def _collective(kind: str, meta: dict[str, Any], D: int) -> tuple[str, str, int] | None:
    """``(dim, collective, ranks)`` a ``kind`` row of a run laid out as ``meta`` says ran, or None when it mixes
    two."""
    tp, fsdp = int(meta.get("tp", 1) or 1), int(meta.get("fsdp", 1) or 1)
    if kind in TP_COLLECTIVE:
        return "tp", TP_COLLECTIVE[kind], tp
    if kind == "UNSHARD":
        return "fsdp", "all_gather", fsdp
    if kind == "REDUCE_GRAD" and fsdp > 1:
        return ("fsdp", "reduce_scatter", fsdp) if D == 1 else None
    if kind == "REDUCE_GRAD" and tp == 1:
        return "dp", "all_reduce", D
    return None


def collective_samples(runs: Run | Sequence[Run]) -> pd.DataFrame:
    """Every measured collective of ``runs``' steps after the first, with its bytes: one row per action
    (:data:`SAMPLE_COLUMNS`; ``run`` is the run's index, ``dim`` the mesh dimension and ``n`` the ranks of the
    collective). Runs whose timelines carry no ``bytes`` column give none."""
    runs = list(runs) if isinstance(runs, (list, tuple)) else [runs]
    frames = []
    for i, run in enumerate(runs):
        timeline = getattr(run, "timeline", None)
        if timeline is None or "bytes" not in timeline.df.columns:
            continue
        df = timeline.df
        df = df[df["step"].isin(steady_steps(run)) & df["kind"].isin(COLLECTIVE_KINDS) & (df["bytes"] > 0)]
        meta, D = getattr(run, "meta", {}) or {}, int(getattr(run, "D", 1) or 1)
        found = {k: _collective(k, meta, D) for k in df["kind"].unique()}
        which = {k: v for k, v in found.items() if v is not None and v[2] > 1}
        df = df[df["kind"].isin(list(which))]
        if df.empty:
            continue
        frames.append(
            pd.DataFrame(
                {
                    "run": i,
                    "backend": str(getattr(run, "backend", "gloo")),
                    "kind": df["kind"].to_numpy(object),
                    "dim": [which[k][0] for k in df["kind"]],
                    "collective": [which[k][1] for k in df["kind"]],
                    "n": [which[k][2] for k in df["kind"]],
                    "bytes": df["bytes"].to_numpy(float),
                    "ms": (df["end_ms"] - df["start_ms"]).to_numpy(float),
                }
            )
        )
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=object if c in _TEXT else float) for c in SAMPLE_COLUMNS})
    return pd.concat(frames, ignore_index=True)


def _shape(samples: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the latency steps and the bytes on the link (``factor · bytes``) in its backend's shape."""
    shapes = [
        collective_shape(c, int(n), b) for c, n, b in zip(samples["collective"], samples["n"], samples["backend"])
    ]
    steps = np.array([s for s, _ in shapes], float)
    moved = np.array([f for _, f in shapes], float) * samples["bytes"].to_numpy(float)
    return steps, moved


def _fit(samples: pd.DataFrame) -> tuple[float, float, str]:
    """``(latency_ms, bandwidth_GBps, how)`` of the samples (the module docs say how; bandwidth ``inf`` when only the
    latency could be fitted)."""
    steps, moved = _shape(samples)
    ms = samples["ms"].to_numpy(float)
    n = len(ms)
    per_step = moved / steps  # latency and bandwidth part where the bytes a step moves differ
    if n >= 2 and per_step.min() > 0 and per_step.max() > (1 + MIN_SPREAD) * per_step.min():
        (latency, per_byte), *_ = np.linalg.lstsq(np.column_stack([steps, moved]), ms, rcond=None)
        how = f"least squares of ms = steps·latency + bytes moved/bandwidth over {n} measured collectives"
        if latency < 0:
            latency, per_byte = 0.0, float(moved @ ms / (moved @ moved))
            how += " (the latency came out negative: 0, and the bandwidth refitted through the origin)"
        if per_byte > 0:
            return float(latency), float(1.0 / (per_byte * 1e6)), how
        why = "the time does not grow with the bytes"
    else:
        why = f"{int(samples['bytes'].nunique())} size(s) in these shapes do not tell latency from bandwidth"
    latency = float(np.median(ms / steps))
    return latency, math.inf, f"latency only ({why}): the median of ms / steps over {n} measured collectives"


def fit_links(samples: pd.DataFrame) -> pd.DataFrame:
    """The links fitted on ``samples`` (:func:`collective_samples`), :data:`LINK_COLUMNS`: one row per (backend, dim,
    collective), per dim of several collectives (``collective == "all"``) and per backend (``dim == collective ==
    "all"``), as the module docs say."""
    rows = []
    for backend, mine in samples.groupby("backend", sort=True):
        groups = []
        for dim, of_dim in mine.groupby("dim", sort=True):
            groups += [(dim, c, g) for c, g in of_dim.groupby("collective", sort=True)]
            if of_dim["collective"].nunique() > 1:
                groups.append((dim, "all", of_dim))
        for dim, collective, group in [*groups, ("all", "all", mine)]:
            latency, bandwidth, how = _fit(group)
            steps, moved = _shape(group)
            predicted = steps * latency + (moved / (bandwidth * 1e6) if math.isfinite(bandwidth) else 0.0)
            rows.append(
                {
                    "backend": backend,
                    "dim": dim,
                    "collective": collective,
                    "latency_ms": latency,
                    "bandwidth_GBps": bandwidth,
                    "samples": len(group),
                    "sizes": int(group["bytes"].nunique()),
                    "median_ratio": float(np.median(predicted / group["ms"].to_numpy(float))),
                    "how": how,
                }
            )
    return pd.DataFrame(rows, columns=list(LINK_COLUMNS)) if rows else empty_links()


def calibrate_links(runs: Run | Sequence[Run]) -> pd.DataFrame:
    """The links of the backends that ran ``runs``' collectives, fitted on their measured collective actions (the
    module docs): :func:`fit_links` of :func:`collective_samples`. Returns the links table."""
    return fit_links(collective_samples(runs))


def _row(links: pd.DataFrame, collective: str, backend: str, dim: str | None) -> pd.Series | None:
    """The links row pricing ``backend``'s ``collective`` over ``dim``: its own; else the dim's over all its
    collectives; else (``dim`` None) the collective's of the most samples over any dim; else the backend's over
    all. None when ``links`` has none of them."""
    mine = links[(links["backend"] == backend) & np.isfinite(links["latency_ms"].astype(float))]
    if dim is not None:
        choices = [mine[(mine["dim"] == dim) & (mine["collective"] == name)] for name in (collective, "all")]
    else:
        choices = [mine[(mine["dim"] != "all") & (mine["collective"] == collective)].sort_values("samples")[::-1]]
    choices.append(mine[(mine["dim"] == "all") & (mine["collective"] == "all")])
    return next((found.iloc[0] for found in choices if len(found)), None)


def link_of(links: pd.DataFrame, collective: str, backend: str, dim: str | None = None) -> Link | None:
    """The fitted :class:`~pipeswift_lab.core.link.Link` pricing ``backend``'s ``collective`` over mesh dimension
    ``dim`` (:func:`links_ms` says which row), or None when ``links`` has none or it fitted the latency alone (no
    finite bandwidth)."""
    row = _row(links, collective, backend, dim)
    if row is None or not 0 < row["bandwidth_GBps"] < math.inf:
        return None
    return Link(float(row["latency_ms"]), float(row["bandwidth_GBps"]))


def links_ms(
    links: pd.DataFrame, collective: str, nbytes: float, n: int, backend: str, dim: str | None = None
) -> float:
    """Milliseconds of ``collective`` on a whole buffer of ``nbytes`` over ``n`` ranks of ``backend``, in its shape, on
    the fitted link of ``dim``'s ``collective`` (``"tp"``, ``"fsdp"``, ``"dp"``), else of all of ``dim``'s collectives;
    without ``dim``, of the collective fitted on the most samples; else of all the backend's. NaN when ``links``
    fitted none for ``backend``."""
    row = _row(links, collective, backend, dim)
    if row is None:
        return math.nan
    steps, factor = collective_shape(collective, n, backend)
    bandwidth = float(row["bandwidth_GBps"])
    return steps * float(row["latency_ms"]) + (factor * nbytes / (bandwidth * 1e6) if bandwidth < math.inf else 0.0)


def collective_error(links: pd.DataFrame, runs: Run | Sequence[Run], topology: Topology | None = None) -> pd.DataFrame:
    """Per run and measured collective size: the measured median against the prediction before calibration (NCCL's
    rings on ``topology``'s intra-node link, where one machine's ranks meet; default
    :data:`~pipeswift_lab.core.topology.DEFAULT_INTRA_NODE_LINK`) and after (the fitted link of the run's backend,
    :func:`links_ms`).

    Columns: ``run``, ``backend``, ``kind``, ``dim``, ``collective``, ``n``, ``bytes``, ``samples``,
    ``measured_ms`` (median), ``predicted_before_ms``, ``predicted_after_ms``, ``ratio_before``, ``ratio_after``
    (predicted / measured).
    """
    samples = collective_samples(runs)
    rows = []
    for (run, backend, kind, dim, collective, n, nbytes), group in samples.groupby(
        ["run", "backend", "kind", "dim", "collective", "n", "bytes"], sort=True
    ):
        link = DEFAULT_INTRA_NODE_LINK if topology is None else topology.intra_node
        measured = float(group["ms"].median())
        before = collective_ms(collective, nbytes, int(n), link, "nccl")
        after = links_ms(links, collective, nbytes, int(n), backend, dim)
        rows.append(
            {
                "run": int(run),
                "backend": backend,
                "kind": kind,
                "dim": dim,
                "collective": collective,
                "n": int(n),
                "bytes": int(nbytes),
                "samples": len(group),
                "measured_ms": measured,
                "predicted_before_ms": before,
                "predicted_after_ms": after,
                "ratio_before": before / measured,
                "ratio_after": after / measured,
            }
        )
    return pd.DataFrame(rows)
