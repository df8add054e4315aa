"""Loaders for the data shipped inside the package.

:func:`philly_jobs` reads the Philly trace: 82,247 jobs of Microsoft's multi-tenant GPU
cluster (Sept–Dec 2017), as derived and published with the Pollux artifact. Keep its
attribution with any copy (``README.md`` in this folder, also :data:`PHILLY_ATTRIBUTION`):

* Jeon et al., *Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training
  Workloads*, USENIX ATC 2019 (the Microsoft Philly trace, CC BY 4.0);
* Qiao et al., *Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
  Learning*, OSDI 2021 (the derived trace, ``petuum/adaptdl`` branch ``osdi21-artifact``,
  ``simulator/traces/philly.csv``, Apache-2.0).

:func:`spot_instances` reads a real spot-availability trace (16 AWS ``p2.xlarge`` spot instances over 88.7 hours,
November 2020, published with Bamboo, NSDI 2023; see :mod:`pipeswift_lab.data.spot`).

:func:`published_runs` reads training runs timed and published by their authors (Narayanan et al.'s SC'21 Table 1,
torchtitan's H100 benchmarks), each row with its source; :mod:`pipeswift_lab.data.published` also holds the
configurations and memory figures of Korthikanti et al. (2022).

The files are read with :mod:`importlib.resources`, so they load from an installed
wheel as well as from a source checkout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_int
from .files import PHILLY_FILE, data_path
from .published import PUBLISHED_FILE, published_runs
from .spot import SPOT_ATTRIBUTION, SPOT_FILE, SPOT_REQUESTED, SPOT_SHA256, spot_instances

#: The attribution any shipped copy of the trace must keep.
PHILLY_ATTRIBUTION: str = (
    "Philly trace: Jeon et al., 'Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads', "
    "USENIX ATC 2019 (Microsoft Philly trace, CC BY 4.0); derived trace from the Pollux artifact, Qiao et al., "
    "'Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning', OSDI 2021 "
    "(petuum/adaptdl, branch osdi21-artifact, simulator/traces/philly.csv, Apache-2.0)."
)
#: sha256 of the shipped CSV, as stated in the README next to it.
PHILLY_SHA256: str = "ebffb3dd1589bdf4e7bcd74496201c5ded1d557d498ee14f560463f37ec353da"


def _read_raw() -> pd.DataFrame:
    with data_path(PHILLY_FILE).open("r", encoding="utf-8") as f:
        return pd.read_csv(f, dtype={"cluster": str})


def philly_jobs(window: tuple[float, float] | None = None, sample: int | None = None, seed: int = 0) -> pd.DataFrame:
    """The Philly trace as a job table, one row per job in submission order.

    Returns a DataFrame with columns ``name`` (``philly-<row in the CSV>``), ``submit_s``
    (seconds since the trace's first submission, 2017-09-04 10:30:41), ``gpus`` (GPUs the
    job ran on, 1…128), ``duration_s`` (its run time on them, queueing excluded),
    ``gpu_s`` (``gpus * duration_s``), ``cluster`` (hashed virtual-cluster id) and
    ``timestamp`` (the original submission time). ``df.attrs["source"]`` holds the
    attribution. Ties in submission time keep the CSV's order.

    * ``window=(start_s, end_s)`` keeps jobs submitted in ``[start_s, end_s)`` (seconds
      since the first submission; ``submit_s`` is not shifted, so windows line up);
    * ``sample=n`` then keeps ``n`` jobs drawn at random without replacement with ``seed``.
    """
    raw = _read_raw()
    timestamp = pd.to_datetime(raw["timestamp"], format="%Y-%m-%d %H:%M:%S")
    submit_s = (timestamp - timestamp.min()).dt.total_seconds()
    df = pd.DataFrame(
        {
            "name": [f"philly-{i}" for i in range(len(raw))],
            "submit_s": submit_s.to_numpy(float),
            "gpus": raw["num_gpus"].to_numpy(np.int64),
            "duration_s": raw["duration"].to_numpy(float),
            "gpu_s": raw["gpu_time"].to_numpy(float),
            "cluster": raw["cluster"].to_numpy(),
            "timestamp": timestamp.to_numpy(),
        }
    )
    df = df.sort_values("submit_s", kind="stable").reset_index(drop=True)
    if window is not None:
        start, end = _check_window(window)
        df = df[(df["submit_s"] >= start) & (df["submit_s"] < end)].reset_index(drop=True)
    if sample is not None:
        df = _sample(df, _check_sample(sample, len(df), "trace window" if window is not None else "trace"), seed)
    df.attrs["source"] = PHILLY_ATTRIBUTION
    return df


def _check_window(window: Any) -> tuple[float, float]:
    try:
        start, end = window
        start, end = float(start), float(end)
    except (TypeError, ValueError):
        raise TypeError(
            f"window must be a (start_s, end_s) pair of seconds since the first submission; got {window!r}"
        ) from None
    if not (np.isfinite(start) and np.isfinite(end)) or start < 0 or end <= start:
        raise ValueError(f"window={window!r} is invalid; it must be (start_s, end_s) with 0 <= start_s < end_s, finite")
    return start, end


def _check_sample(sample: Any, available: int, where: str) -> int:
    """``sample`` as a number of jobs in ``[0, available]``."""
    count = check_int("sample", sample, minimum=0)
    if count > available:
        raise ValueError(f"sample={count} exceeds the {available} jobs in the {where}; give at most {available}")
    return count


def _sample(df: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    """``n`` rows of ``df`` drawn without replacement with ``seed``, in their order."""
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.choice(len(df), size=n, replace=False))
    return df.iloc[keep].reset_index(drop=True)


__all__ = [
    "PHILLY_ATTRIBUTION",
    "PHILLY_FILE",
    "PHILLY_SHA256",
    "PUBLISHED_FILE",
    "SPOT_ATTRIBUTION",
    "SPOT_FILE",
    "SPOT_REQUESTED",
    "SPOT_SHA256",
    "data_path",
    "philly_jobs",
    "published_runs",
    "spot_instances",
]
