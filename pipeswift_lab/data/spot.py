"""A real spot-instance availability trace: how many of 16 requested AWS ``p2.xlarge`` spot instances (one NVIDIA
K80 each) were running, over 88.7 hours of 20–23 November 2020.

It was recorded and published by the Bamboo authors: Thorpe et al., *Bamboo: Making Preemptible Instances Resilient
for Affordable Training of Large DNNs*, NSDI 2023 (repository ``uclasystem/bamboo``, commit ``847083d``, file
``doc/data/aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv``, MIT licence). The shipped CSV is that file
byte for byte: no header, two columns (hours since the start, instances running), written with two points per
change, ``(t, old)`` then ``(t, new)``, which :func:`pipeswift_lab.cluster.read_capacity` reads as one instantaneous
change.
"""

from __future__ import annotations

import pandas as pd

from .files import data_path

#: File name of the spot trace inside this package.
SPOT_FILE: str = "aws_spot_p2_xlarge.csv"
#: The attribution any shipped copy of the spot trace must keep.
SPOT_ATTRIBUTION: str = (
    "AWS p2.xlarge spot availability, 16 instances requested, 2020-11-20 to 2020-11-23: Thorpe et al., 'Bamboo: "
    "Making Preemptible Instances Resilient for Affordable Training of Large DNNs', NSDI 2023 (uclasystem/bamboo, "
    "commit 847083d, doc/data/aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv, MIT licence)."
)
#: sha256 of the shipped CSV (the published file, unchanged).
SPOT_SHA256: str = "2fe17bc77cc1ad484362784f217304e7b21e987fc154c2f5d40f166214fb8726"
#: The spot instances the trace's owners asked for; the trace never exceeds it.
SPOT_REQUESTED: int = 16


def spot_instances() -> pd.DataFrame:
    """The spot trace as published, one row a point.

    Returns a DataFrame with columns ``hour`` (hours since the trace's start, non-decreasing; a change is two rows
    at the same hour, the old count then the new) and ``instances`` (spot instances running, 0…16).
    ``df.attrs["source"]`` holds the attribution. Turn it into cluster capacity with
    ``pipeswift_lab.cluster.read_capacity(df, time_column="hour", gpus_column="instances", time_unit="h", scale=8)``
    (``scale``: GPUs per instance of the cluster you study).
    """
    with data_path(SPOT_FILE).open("r", encoding="utf-8") as f:
        df = pd.read_csv(f, header=None, names=["hour", "instances"], dtype={"hour": float, "instances": "int64"})
    df.attrs["source"] = SPOT_ATTRIBUTION
    return df


__all__ = ["SPOT_ATTRIBUTION", "SPOT_FILE", "SPOT_REQUESTED", "SPOT_SHA256", "spot_instances"]
