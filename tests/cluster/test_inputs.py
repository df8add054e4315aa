"""Bad input to cluster.simulate: clear errors, or a stated and counted handling."""

import warnings

import numpy as np
import pandas as pd
import pytest

from pipeswift_lab import cluster
from pipeswift_lab.cluster.inputs import check_capacity, check_jobs


def table(**columns):
    base = {"submit_s": [0.0, 10.0], "gpus": [1, 2], "duration_s": [100.0, 200.0]}
    base.update(columns)
    return pd.DataFrame(base)


@pytest.mark.parametrize(
    "jobs, error, message",
    [
        ([1, 2], TypeError, "jobs must be a pandas DataFrame"),
        (table().drop(columns="gpus"), ValueError, r"missing the columns \['gpus'\]"),
        (table().iloc[:0], ValueError, "jobs has no rows"),
        (table(submit_s=["0", "x"]), TypeError, r"jobs\['submit_s'\] must be numeric; found '0'"),
        (table(submit_s=[-5.0, 1.0]), ValueError, r"jobs\['submit_s'\]=-5 at row 0 is invalid; it must be >= 0"),
        (table(duration_s=[100.0, 0.0]), ValueError, r"jobs\['duration_s'\]=0 at row 1 is invalid; it must be > 0"),
        (table(duration_s=[100.0, np.nan]), ValueError, r"non-finite value nan at row 1"),
        (table(gpus=[1, 0]), ValueError, r"jobs\['gpus'\]=0 at row 1 is invalid; it must be >= 1"),
        (table(gpus=[1.5, 2]), ValueError, "must be a whole number of GPUs"),
        (table(gpus=[True, False]), TypeError, r"jobs\['gpus'\] must be numeric"),
        (table(name=["a", "a"]), ValueError, "'a' appears more than once"),
        (table(min_gpus=[2, 1], max_gpus=[1, 2]), ValueError, "min_gpus=2 exceeds max_gpus=1"),
        (table(profile=[3, None]), TypeError, r"jobs\['profile'\] row 0 is float 3.0"),
    ],
)
def test_bad_jobs(jobs, error, message):
    with pytest.raises(error, match=message):
        check_jobs(jobs)


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="profile='gpt-9' is not in the library"):
        cluster.simulate(table(profile=["gpt-9", None]), 4, progress=False)


def test_unsorted_submissions_are_sorted_and_said_so():
    jobs = table(submit_s=[50.0, 10.0], name=["late", "early"])
    with pytest.warns(UserWarning, match="not sorted by submit_s; sorted them .stable., which moved 2 of 2 rows"):
        out = check_jobs(jobs)
    assert out["name"].tolist() == ["early", "late"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_jobs(table())  # sorted input: no warning


@pytest.mark.parametrize(
    "gpus, error, message",
    [
        (0, ValueError, "gpus=0 is invalid; a fixed capacity must be >= 1"),
        (True, TypeError, "got bool"),
        ("64", TypeError, "gpus must be an int or .* got str '64'"),
        ([], ValueError, "empty capacity series"),
        ([(0, 8), (10, -2)], ValueError, r"gpus\[1\] gpus=-2 is invalid; a capacity must be >= 0"),
        ([(0, 8), (10, 2.5)], TypeError, r"gpus\[1\] gpus=2.5 is invalid; it must be a whole number"),
        ([(0, 8), (-1, 4)], ValueError, r"gpus\[1\] time_s=-1.0 is invalid; it must be >= 0"),
        ([(0, 8), (0, 4)], ValueError, "strictly increasing"),
        ([(0, 8, 1)], ValueError, "is not a .time_s, gpus. pair"),
        ([(0, 0)], ValueError, "0 at every time"),
        (pd.DataFrame({"t": [0], "gpus": [4]}), ValueError, r"missing \['time_s'\]"),
    ],
)
def test_bad_capacity(gpus, error, message):
    with pytest.raises(error, match=message):
        check_capacity(gpus)


def test_capacity_forms_agree():
    frame = pd.DataFrame({"time_s": [0.0, 100.0], "gpus": [8, 4]})
    assert check_capacity(frame) == check_capacity([(0, 8), (100, 4)]) == ((0.0, 8), (100.0, 4))
    assert check_capacity(16) == ((0.0, 16),)
    assert check_capacity([(50, 4)]) == ((0.0, 4), (50.0, 4))  # the first count holds before its time


@pytest.mark.parametrize(
    "every, error, message",
    [
        (0, ValueError, "checkpoint_every_s=0.0 is invalid; it must be > 0"),
        (-5, ValueError, "checkpoint_every_s=-5.0 is invalid; it must be > 0"),
        (float("inf"), ValueError, "checkpoint_every_s=inf is invalid; it must be a finite number"),
        ("60", TypeError, "checkpoint_every_s must be a real number; got str '60'"),
    ],
)
def test_bad_checkpoint_interval(every, error, message):
    with pytest.raises(error, match=message):
        cluster.simulate(table(), 4, checkpoint_every_s=every, progress=False)


def test_bad_seed():
    with pytest.raises(TypeError, match="seed must be an integer"):
        cluster.simulate(table(), 4, seed=1.5, progress=False)
